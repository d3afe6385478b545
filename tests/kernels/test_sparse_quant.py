"""The native sparse kernel on quantized experts in the rows layout: against the same math on the
dequantized weights (float64), for int8, int4 and int2, bf16 and fp32 activations, several experts
with different token sets, and thresholds 0 and a quantile. int4's gate and up rows take integer dot
products against bf16 x quantised to int8 per block of 32 (the dense int4 experts' activation form), so
its reference quantises x the same way; every kernel path (AVX-512, AVX2 with and without VNNI, plain C)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetier.formats.quant import QuantSpec, dequantize_into, quantize_matrix
from moetier.kernels import native
from moetier.kernels.sparse import NativeSparseQuant
from moetier.types import Precision

H, I = 128, 64  # noqa: E741


@pytest.fixture(scope="module")
def lib() -> object:
    got = native.load()
    if got is None:
        pytest.skip(f"native sparse kernel unavailable: {native.load_error()}")
    return got


@pytest.fixture(scope="module", params=("native", "avx2", "avx2-novnni", "c"))
def path_lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    """The library built for each kernel path this CPU can run (tests/kernels/test_mm_paths.py)."""
    isa = str(request.param)
    if isa.startswith("avx2") and not {"avx2", "fma"} <= set(native.cpu_info()[1]):
        pytest.skip(f"this CPU cannot run the {isa} path")
    root = tmp_path_factory.getbasetemp() / "kernel-cache"
    got = native.load(True, root, isa)
    if got is None:
        pytest.skip(f"no native kernels here: {native.load_error(True, root, isa)}")
    return got


def _expert(spec: QuantSpec, seed: int, H: int = H) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for m, rows in (("w13", 2 * I), ("w2", I)):  # w2: down rows [I, H], quantised along H
        w = torch.randn(rows, H, generator=g) * H**-0.5
        qm = quantize_matrix(w, spec, method="rtn")
        out[f"{m}.q"], out[f"{m}.scale"], out[f"{m}.zero"] = qm.q, qm.scale, qm.zero
        deq = torch.empty(rows, H, dtype=torch.float64)
        dequantize_into(qm.q, qm.scale, qm.zero, spec.bits, deq)
        out[f"{m}.deq"] = deq
    return out


def _q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] as the int4 integer path reads it: int8 per block of 32 (scale max|x| / 127, round to nearest
    even), computed in fp32 as the kernel computes it, returned as float64 values."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.round(xb * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [0.0, 0.8])
def test_quant_kernel_matches_dequantized_reference(lib: object, precision: str, dtype: torch.dtype, q: float) -> None:
    _check_against_reference(lib, precision, dtype, q, H, 32)


@pytest.mark.parametrize(("hidden", "group"), [(128, 32), (1024, 128), (544, 32), (1056, 96)])
@pytest.mark.parametrize("q", [0.0, 0.8])
@pytest.mark.parametrize(("n_tok", "block"), [(5, 1), (1, 1), (3, 4)])
def test_int4_integer_path_on_every_kernel_path(
    path_lib: object, hidden: int, group: int, q: float, n_tok: int, block: int
) -> None:
    """bf16 int4: the gate and up rows through mm.c's kind-4 rows (short rows, long rows 4 at a time at one
    token, 4x4 blocks from 3), groups wider than a block and of 3 blocks (96), the down rows by
    column tiles (5 tokens) or each neuron's up and down rows together (up to 4 tokens: decode), masks per
    neuron and per block of 4, written and accumulated, on each ISA path."""
    _check_against_reference(path_lib, "int4", torch.bfloat16, q, hidden, group, n_tok, block)


def _check_against_reference(
    lib: object, precision: str, dtype: torch.dtype, q: float, H: int, group: int, n_tok: int = 5,
    block: int = 1,
) -> None:  # fmt: skip
    spec = QuantSpec(Precision(precision), group)
    experts = [_expert(spec, s, H) for s in range(3)]
    x = (torch.randn(n_tok, H, generator=torch.Generator().manual_seed(9))).to(dtype)
    tokens = [[t for t in ts if t < n_tok] or [n_tok - 1] for ts in ([0, 2, 4], [1], [0, 1, 2, 3])]
    weights = [[0.5, 0.25, 1.0][: len(tokens[0])], [0.75], [0.1, 0.2, 0.3, 0.4][: len(tokens[2])]]
    int_path = spec.bits == 4 and dtype == torch.bfloat16  # gate and up rows by integer dot products
    xd = _q8_blocks(x) if int_path else x.double()
    acts = [F.silu(xd[t] @ e["w13.deq"][:I].T) for e, t in zip(experts, tokens, strict=True)]
    thr = float(torch.quantile(torch.cat([a.flatten() for a in acts]).abs(), q)) if q else 0.0
    ref = torch.zeros(n_tok, H, dtype=torch.float64)
    want_pairs = 0
    for e, t, w, a in zip(experts, tokens, weights, acts, strict=True):
        m = (a.abs() >= thr).reshape(len(t), -1, block).any(-1, keepdim=True).expand(-1, -1, block).reshape(a.shape)
        want_pairs += int(m.sum())
        h = a * m * (xd[t] @ e["w13.deq"][I:].T)
        ref.index_add_(0, torch.tensor(t), (h @ e["w2.deq"]) * torch.tensor(w, dtype=torch.float64)[:, None])
    kernel = NativeSparseQuant(lib, H, I, dtype, spec.bits, group)  # type: ignore[arg-type]
    addrs = [tuple(e[f"{m}.{p}"].data_ptr() for m in ("w13", "w2") for p in ("q", "scale", "zero")) for e in experts]
    starts = [0, *itertools.accumulate(len(t) for t in tokens)]
    out = torch.full((n_tok, H), 7.0, dtype=dtype)
    flat_t, flat_w = [t for ts in tokens for t in ts], [w for ws in weights for w in ws]
    pairs = kernel(x, addrs, flat_t, flat_w, starts, out, thr, block)
    assert abs(pairs - want_pairs) <= 2 * block  # only ties at the threshold may differ (fp32 vs float64 gate)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    kernel(x, addrs, flat_t, flat_w, starts, out, thr, block, accumulate=True)
    torch.testing.assert_close(out.double(), 2 * ref, rtol=2 * tol, atol=2 * tol)
    assert bool((out[0] != 7.0).any())  # overwritten, token 0 has experts


def test_quant_kernel_refuses_bad_shapes(lib: object) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        NativeSparseQuant(lib, H, I, torch.float32, 4, 48)  # type: ignore[arg-type]  # 128 % 48
    with pytest.raises(ValueError, match="do not fit"):
        NativeSparseQuant(lib, H, I, torch.float32, 3, 32)  # type: ignore[arg-type]
    k = NativeSparseQuant(lib, H, I, torch.float32, 4, 32)  # type: ignore[arg-type]
    x, out = torch.zeros(2, H), torch.zeros(2, H)
    with pytest.raises(ValueError, match="6 addresses"):
        k(x, [(1, 2, 3)], [0], [1.0], [0, 1], out, 0.1, 1)


def test_engine_with_quantized_rows_tier(tmp_path: Path) -> None:
    """End to end: `quantize --for-sparsity` writes the rows tier; the engine at int4 + sparsity gives the
    same logits on the gather path and the masked dense path, skips the target's share of neurons, and
    differs from int4 without sparsity; a model without the rows tier names the command to write it."""
    import moetier
    from moetier.config import EngineConfig, PrecisionConfig, SparsityConfig
    from moetier.errors import CheckpointError, ConfigError
    from moetier.formats.checkpoint import CheckpointIndex
    from moetier.formats.qtier import source_fingerprint
    from moetier.formats.quantize import quantize_model
    from moetier.kernels.sparse import default_table_path
    from moetier.models.tiny import build_tiny_checkpoint
    from moetier.runtime.calibrate import calibrate, model_identity

    path = build_tiny_checkpoint("qwen3_moe", tmp_path / "m", seed=2, moe_intermediate_size=64)  # fp32: exact paths
    ids = torch.randint(3, 96, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    with moetier.load(path) as eng:
        ident = model_identity(eng.info, source_fingerprint(CheckpointIndex(path))["fingerprint"])
        calibrate(eng, ids, 64, ident, "silu", {"text": "ids"}).save(default_table_path(path))
    pcfg = PrecisionConfig(mode="int4", groups=(("int4", 32),))
    with pytest.raises(CheckpointError, match="--for-sparsity"):
        moetier.load(path, EngineConfig(precision=pcfg, sparsity=SparsityConfig(target=0.5)))
    with pytest.raises(ConfigError, match="dynamic"):
        moetier.load(path, EngineConfig(precision=PrecisionConfig(mode="dynamic", hi="int4", lo="int2"),
                                        sparsity=SparsityConfig(target=0.5)))  # fmt: skip
    (rows,) = quantize_model(path, ["int4"], group_sizes={"int4": 32}, method="rtn", down_rows=True)
    assert rows.name == "int4-g32-rows"
    quantize_model(path, ["int4"], group_sizes={"int4": 32}, method="rtn")
    x = torch.tensor([ids[:40]])
    got = {}
    for name, tipping in (("gather", 1000), ("dense", 0)):
        cfg = EngineConfig(precision=pcfg, sparsity=SparsityConfig(target=0.6, tipping=tipping, dense="masked"))
        with moetier.load(path, cfg) as eng:
            got[name] = eng.logits(x).float()
            sp = eng.stats()["sparsity"]
            assert abs(sp["achieved"] - 0.6) < 0.1, sp
            assert sp["kernel"] == "native" or native.load() is None
    torch.testing.assert_close(got["gather"], got["dense"], rtol=1e-3, atol=1e-3)
    with moetier.load(path, EngineConfig(precision=pcfg)) as eng:
        plain = eng.logits(x).float()
    assert (plain - got["dense"]).abs().max() > 1e-3  # sparsity did skip neurons
    # the default dense path on quantized rows is the unmasked expert (the native kernel at threshold 0): no
    # neuron skipped, the same function as the gather path with every neuron active
    with moetier.load(path, EngineConfig(precision=pcfg, sparsity=SparsityConfig(target=0.6, tipping=0))) as eng:
        original = eng.logits(x).float()
        assert eng.stats()["sparsity"]["achieved"] == 0.0
        for b in eng.loaded.blocks:
            b.pipeline.executor.threshold = 0.0  # type: ignore[union-attr]
            b.pipeline.scheduler.tipping = 1000  # type: ignore[union-attr]
        every_neuron = eng.logits(x).float()
    torch.testing.assert_close(original, every_neuron, rtol=1e-3, atol=1e-3)
    assert (original - got["dense"]).abs().max() > 1e-3
    from moetier.formats.qtier import list_tiers

    layouts = sorted((t["path"].rsplit("/", 1)[-1], t["layout"]) for t in list_tiers(path))
    assert layouts == [("int4-g32", "packed"), ("int4-g32-rows", "rows")]


def test_for_sparsity_refuses_families_without_sparse_execution(tmp_path: Path) -> None:
    from moetier.errors import ConfigError
    from moetier.formats.quantize import quantize_model
    from moetier.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("gpt_oss", tmp_path / "g")
    with pytest.raises(ConfigError, match="gpt_oss experts do not support"):
        quantize_model(path, ["int8"], method="rtn", down_rows=True)
    assert not (path / "moetier-quant").exists()
