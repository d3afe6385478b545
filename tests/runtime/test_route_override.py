"""The routing override (runtime/route_override.py, RoutingConfig) in the engine: fewer experts per token on the
native step and the torch path, a followed trace replayed exactly, pruned experts never routed nor read, and
the errors for bad input. Traces are small synthetic ones written by the tests; the real traces in
../shared/data/traces are read (never copied) by one test that skips when they are absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import moetier
from moetier.cli.engine_flags import EngineFlags
from moetier.config import EngineConfig, RoutingConfig, RuntimeConfig
from moetier.errors import ConfigError
from moetier.kernels import decode
from moetier.policies.routing import reduce_routing
from moetier.runtime.observers import Route, Tap
from moetier.runtime.route_override import PRUNE_FORMAT, PruneFile
from moetier.traces import SCHEMA, write_table

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"
REAL_TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
NATIVE = decode.load(True, None) is not None
E, K, LAYERS = 32, 4, (0, 1, 2, 3)


def _load(routing: RoutingConfig, native: bool = True, dtype: str = "bf16") -> moetier.Engine:
    rt = RuntimeConfig(dtype=dtype, native_kernels=native)  # type: ignore[arg-type]
    return moetier.load(MODEL, EngineConfig(runtime=rt, routing=routing))


def _taps(e: moetier.Engine) -> dict[int, list[tuple[np.ndarray, np.ndarray]]]:
    seen: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def tap(r: Route) -> None:
        seen.setdefault(r.layer, []).append((r.ids.cpu().numpy().astype(np.int32),
                                             r.weights.float().cpu().numpy()))  # fmt: skip

    e.observers.add(Tap(tap))
    return seen


def _forward(e: moetier.Engine, ids: list[int], prompt: int) -> torch.Tensor:
    e.decoder.reset()
    with torch.inference_mode():
        out = [e.step(torch.tensor([ids[:prompt]]), all_logits=True).float()]
        out += [e.step(torch.tensor([[t]]))[0:1].float() for t in ids[prompt:]]
    return torch.cat(out)


IDS = torch.randint(3, 4000, (30,), generator=torch.Generator().manual_seed(5)).tolist()


def _stream(seen: dict[int, list[tuple[np.ndarray, np.ndarray]]], layer: int) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([a for a, _ in seen[layer]]), np.concatenate([w for _, w in seen[layer]])


@pytest.mark.skipif(not NATIVE, reason="no native kernels here")
def test_the_native_step_computes_the_reduced_routing_of_the_router() -> None:
    """Layer 0's input does not depend on any MoE layer: its routing under the cap is the router's, reduced."""
    with _load(RoutingConfig()) as e:
        full = _taps(e)
        _forward(e, IDS, 18)
    with _load(RoutingConfig(max_k=2, threshold=0.15)) as e:
        red = _taps(e)
        _forward(e, IDS, 18)
        st = e.stats()
        assert st["native_step"]["torch_moe_calls"] == 0  # the native MoE half took the -1 pairs
    ids, w = _stream(full, 0)
    want_ids, want_w = ids.copy(), w.copy()
    reduce_routing(want_ids, want_w, 0.15, 2, True)
    got_ids, got_w = _stream(red, 0)
    assert np.array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-2)  # the Route's weights are bf16 where the family's are
    assert (got_ids >= 0).sum(axis=1).max() <= 2 and (got_ids == -1).any()
    r = st["routing"]
    assert r["pairs_dropped"] > 0 and r["experts_per_token"] <= 2


@pytest.mark.skipif(not NATIVE, reason="no native kernels here")
def test_native_and_torch_paths_agree_under_the_reduction() -> None:
    routing = RoutingConfig(max_k=2)
    with _load(routing) as e:
        got = _forward(e, IDS, 18)
    with _load(routing, native=False) as e:
        assert "native_step" not in e.stats()
        ref = _forward(e, IDS, 18)
        assert e.stats()["routing"]["experts_per_token"] == 2
    rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)  # [T] bf16 rounding apart (test_native_step's bound)
    assert float(rel.median()) <= 0.015, rel.tolist()
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_no_reduction_is_the_plain_model() -> None:
    with _load(RoutingConfig(), dtype="fp32") as e:
        a = _forward(e, IDS[:12], 8)
    with _load(RoutingConfig(threshold=0.0, max_k=K), dtype="fp32") as e:
        b = _forward(e, IDS[:12], 8)
    assert torch.equal(a, b)


def _trace(path: Path, steps: int, layers: tuple[int, ...] = LAYERS, e: int = E, k: int = K, seed: int = 0) -> Path:
    """A synthetic batch-1 trace: one row per (step, layer), random distinct ids and Dirichlet weights."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {n: [] for n in SCHEMA.names}
    for s in range(steps):
        for layer in layers:
            cols["step"].append(s)
            cols["token"].append(0)
            cols["layer"].append(layer)
            cols["experts"].append(rng.permutation(e)[:k].tolist())
            cols["weights"].append(rng.dirichlet(np.ones(k)).astype(np.float32).tolist())
            cols["scores"].append(None)
    meta = {"model": "synthetic", "num_experts": e, "top_k": k, "hidden_size": 256, "moe_intermediate_size": 128,
            "dtype": "bfloat16", "schema_version": 1}  # fmt: skip
    return write_table(pa.table(cols, schema=SCHEMA), meta, path)


@pytest.mark.parametrize("native", [True, False])
def test_a_followed_trace_is_replayed_exactly(tmp_path: Path, native: bool) -> None:
    if native and not NATIVE:
        pytest.skip("no native kernels here")
    path = _trace(tmp_path / "t.parquet", steps=40)
    with _load(RoutingConfig(follow_trace=str(path)), native=native) as e:
        seen = _taps(e)
        _forward(e, IDS, 18)  # 18 prompt rows, then 12 decode steps
        st = e.stats()["routing"]
    rows = [r for r in zip(*(_read(path)), strict=True)]
    for layer in LAYERS:
        got_ids, got_w = _stream(seen, layer)
        want = [(i, w) for step, lay, i, w in rows if lay == layer][: len(got_ids)]
        assert len(got_ids) == 30
        assert got_ids.tolist() == [i for i, _ in want]
        np.testing.assert_allclose(got_w, np.array([w for _, w in want]), rtol=1e-2)  # bf16 where the family is
    assert st["trace_wraps"] == 0 and st["tokens"] == 30 * len(LAYERS)


def _read(path: Path) -> tuple[list[int], list[int], list[list[int]], list[list[float]]]:
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    return (t.column("step").to_pylist(), t.column("layer").to_pylist(), t.column("experts").to_pylist(),
            t.column("weights").to_pylist())  # fmt: skip


def test_a_short_trace_wraps_around(tmp_path: Path) -> None:
    path = _trace(tmp_path / "t.parquet", steps=7)
    with _load(RoutingConfig(follow_trace=str(path)), native=False) as e:
        _forward(e, IDS[:10], 4)
        assert e.stats()["routing"]["trace_wraps"] == len(LAYERS)


def test_a_trace_of_another_shape_is_refused_naming_both(tmp_path: Path) -> None:
    path = _trace(tmp_path / "t.parquet", steps=3, e=8, k=2)
    with pytest.raises(ConfigError, match=r"8 experts, top-2.*32 experts, top-4"):
        _load(RoutingConfig(follow_trace=str(path)))
    path = _trace(tmp_path / "t3.parquet", steps=3, layers=(0, 1, 2))
    with pytest.raises(ConfigError, match=r"3 MoE layers.*4 MoE layers"):
        _load(RoutingConfig(follow_trace=str(path)))
    with pytest.raises(ConfigError, match="no such file"):
        _load(RoutingConfig(follow_trace=str(tmp_path / "absent.parquet")))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"bad\.parquet"):
        _load(RoutingConfig(follow_trace=str(tmp_path / "bad.parquet")))


@pytest.mark.skipif(not REAL_TRACES.is_dir(), reason="../shared/data/traces is absent")
def test_a_real_trace_of_another_model_is_refused() -> None:
    path = REAL_TRACES / "mixtral-8x7b-instruct-specmoe" / "trace.parquet"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    with pytest.raises(ConfigError, match=r"32 MoE layers, 8 experts, top-2.*4 MoE layers, 32 experts, top-4"):
        _load(RoutingConfig(follow_trace=str(path)))


def _shape() -> dict[str, object]:
    return {"num_experts": E, "top_k": K, "moe_layers": list(LAYERS), "hidden_size": 256}


def test_pruned_experts_are_never_routed_nor_read(tmp_path: Path) -> None:
    pruned = {0: list(range(0, 16)), 2: [1, 5, 9]}
    path = PruneFile.write(tmp_path / "p.json", pruned, {"model": _shape(), "method": "test"})
    for native in [True, False] if NATIVE else [False]:
        with _load(RoutingConfig(prune=str(path)), native=native) as e:
            seen = _taps(e)
            _forward(e, IDS, 18)
            for layer, gone in pruned.items():
                ids, w = _stream(seen, layer)
                assert not np.isin(ids, gone).any()
                np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=2e-2)  # renormalised over the remaining
                assert (ids >= 0).all()
            resident = {(k.layer, k.expert) for k in e.store.cached_keys()}
            assert not any((layer, x) in resident for layer, gone in pruned.items() for x in gone)
            assert e.stats()["routing"]["pruned_experts"] == 19


def test_bad_pruning_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        _load(RoutingConfig(prune=str(tmp_path / "absent.json")))
    (tmp_path / "x.json").write_text('{"hello": 1}')
    with pytest.raises(ConfigError, match="not a pruning file"):
        _load(RoutingConfig(prune=str(tmp_path / "x.json")))
    other = dict(_shape(), num_experts=64)
    PruneFile.write(tmp_path / "o.json", {0: [1]}, {"model": other})
    with pytest.raises(ConfigError, match=r"64 experts.*32 experts"):
        _load(RoutingConfig(prune=str(tmp_path / "o.json")))
    PruneFile.write(tmp_path / "many.json", {1: list(range(29))}, {"model": _shape()})
    with pytest.raises(ConfigError, match="prunes 29 of 32"):
        _load(RoutingConfig(prune=str(tmp_path / "many.json")))
    assert PRUNE_FORMAT in (tmp_path / "many.json").read_text()


def test_bad_reduction_values_are_config_errors() -> None:
    for t in (1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="threshold"):
            RoutingConfig(threshold=t)
    with pytest.raises(ConfigError, match="at least 1"):
        RoutingConfig(max_k=-1)
    with pytest.raises(ConfigError, match="at least 1"):
        EngineFlags(max_experts_per_token=0).config()
    with pytest.raises(ConfigError, match="exceeds the model's top-k of 4"):
        _load(RoutingConfig(max_k=5), native=False)
    cfg = EngineFlags(expert_threshold=0.2, max_experts_per_token=3, expert_renorm=False).config()
    assert cfg.routing == RoutingConfig(threshold=0.2, max_k=3, renormalize=False)


@pytest.mark.parametrize("predictor", ["history", "gate"])
def test_the_reduction_runs_with_prefetch(predictor: str) -> None:
    from moetier.config import Budgets, PrefetchConfig

    cfg = EngineConfig(runtime=RuntimeConfig(dtype="bf16"), budgets=Budgets(host_expert_bytes=12 * 2**20),
                       prefetch=PrefetchConfig(enabled=True, predictor=predictor),
                       routing=RoutingConfig(max_k=2, threshold=0.1))  # fmt: skip
    with moetier.load(MODEL, cfg) as e:
        _forward(e, IDS, 18)
        st = e.stats()
        assert st["routing"]["pairs_dropped"] > 0 and "prefetch" in st


def test_route_probs_without_logits_skip_dropped_pairs() -> None:
    ids = torch.tensor([[2, -1, 0], [-1, 1, 3]])
    w = torch.tensor([[0.7, 0.0, 0.3], [0.0, 0.4, 0.6]])
    p = Route(0, torch.zeros(2, 4), ids, w, None, "softmax", 4).probs
    assert torch.allclose(p, torch.tensor([[0.3, 0.0, 0.7, 0.0], [0.0, 0.4, 0.0, 0.6]]))


def test_a_seam_model_takes_the_reduction_and_a_trace(tmp_path: Path) -> None:
    from moetier.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3_moe", tmp_path / "m", seed=3, dtype=torch.bfloat16)
    rt = RuntimeConfig(dtype="bf16", seam=True, native_kernels=False)
    with moetier.load(path, EngineConfig(runtime=rt, routing=RoutingConfig(max_k=1))) as e:
        seen = _taps(e)
        _forward(e, [5, 6, 7, 8, 9], 3)
        ids, _ = _stream(seen, e.info.moe_layers[0])
        assert ((ids >= 0).sum(axis=1) == 1).all()
    tr = _trace(tmp_path / "t.parquet", steps=8, layers=tuple(e.info.moe_layers), e=e.info.num_experts,
                k=e.info.top_k)  # fmt: skip
    with moetier.load(path, EngineConfig(runtime=rt, routing=RoutingConfig(follow_trace=str(tr)))) as e:
        seen = _taps(e)
        _forward(e, [5, 6, 7, 8, 9], 3)
        want = [r[2] for r in zip(*_read(tr), strict=True) if r[1] == e.info.moe_layers[0]][:5]
        assert _stream(seen, e.info.moe_layers[0])[0].tolist() == want
