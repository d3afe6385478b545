"""Routing traces: recorded by the engine, saved as Parquet, loaded back; malformed files are refused."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import moetier
from moetier import EngineConfig, RuntimeConfig
from moetier.errors import TraceError
from moetier.traces import REQUIRED_META, SCHEMA, TraceRecorder, load

PROMPT = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(11)).tolist()
NEW = 5
META = dict(model="m", num_experts=4, top_k=2, hidden_size=8, moe_intermediate_size=4, dtype="float32")


def record(path, family, tmp_path, lean):
    engine = moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32", lean=lean)))
    out = tmp_path / "trace.parquet"
    engine.record_trace(out, with_scores=True)
    engine.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False)
    assert engine.save_trace() == out
    info = engine.info
    engine.close()
    return load(out), info


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v2", "gpt_oss"])
def test_recorded_trace(tiny_ckpt, tmp_path, family, lean):
    trace, info = record(tiny_ckpt(family), family, tmp_path, lean)
    n_moe, k, E = len(info.moe_layers), info.top_k, info.num_experts
    # prefill: one row per prompt token per MoE layer at step 0; then one row per layer for each of the
    # NEW - 1 decode forwards (the last sampled token is never fed back)
    assert len(trace) == (len(PROMPT) + NEW - 1) * n_moe
    rows = trace.table.to_pylist()
    assert trace.table.schema.names == SCHEMA.names
    prefill = [r for r in rows if r["step"] == 0]
    assert len(prefill) == len(PROMPT) * n_moe
    for layer in info.moe_layers:
        assert sorted(r["token"] for r in prefill if r["layer"] == layer) == list(range(len(PROMPT)))
    assert sorted({r["step"] for r in rows}) == list(range(NEW))
    for step in range(1, NEW):
        assert sorted(r["layer"] for r in rows if r["step"] == step) == sorted(info.moe_layers)
    assert {r["layer"] for r in rows} == set(info.moe_layers)
    for r in rows:
        assert len(r["experts"]) == k and len(set(r["experts"])) == k
        assert all(0 <= e < E for e in r["experts"])
        assert len(r["weights"]) == k and all(w >= 0 for w in r["weights"])
        assert len(r["scores"]) == E
        scores = torch.tensor(r["scores"])
        assert abs(scores.sum().item() - 1.0) < 1e-4  # softmax families: probabilities over all experts
        if family in ("qwen3_moe", "mixtral", "gpt_oss"):  # plain top-k of the scores
            top = torch.topk(scores, k).indices.tolist()
            assert sorted(top) == sorted(r["experts"])
        if family in ("qwen3_moe", "mixtral"):  # normalised top-k: weights = scores[ids] / sum
            picked = scores[r["experts"]]
            assert torch.allclose(torch.tensor(r["weights"]), picked / picked.sum(), atol=1e-5)
    meta = trace.metadata
    for key in REQUIRED_META:
        assert key in meta
    assert (meta["num_experts"], meta["top_k"]) == (E, k)
    assert (meta["hidden_size"], meta["moe_intermediate_size"]) == (32, info.expert_intermediate)
    assert meta["dtype"] == "float32"
    assert meta["model"] == str(tiny_ckpt(family))


def test_trace_routing_matches_the_decode(tiny_ckpt, hf_model, tmp_path):
    """The trace records what the model routed: replaying the prompt's routing through transformers'
    own router modules gives the same top-k ids at step 0."""
    path = tiny_ckpt("qwen3_moe")
    trace, info = record(path, "qwen3_moe", tmp_path, lean=False)
    model = hf_model("qwen3_moe")
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(i, out[2]))
        for i in info.moe_layers
    ]
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    for h in hooks:
        h.remove()
    rows = [r for r in trace.table.to_pylist() if r["step"] == 0]
    for layer in info.moe_layers:
        got = [sorted(r["experts"]) for r in sorted(rows, key=lambda r: r["token"]) if r["layer"] == layer]
        assert got == [sorted(x) for x in seen[layer].tolist()]


def test_sigmoid_family_scores(tiny_ckpt, tmp_path):
    trace, info = record(tiny_ckpt("deepseek_v3"), "deepseek_v3", tmp_path, lean=False)
    for r in trace.table.to_pylist():
        assert len(r["scores"]) == info.num_experts
        assert all(0.0 < s < 1.0 for s in r["scores"])  # independent sigmoids, not a distribution


def test_without_scores(tiny_ckpt, tmp_path):
    engine = moetier.load(tiny_ckpt("olmoe"), EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32")))
    out = tmp_path / "t.parquet"
    engine.record_trace(out)
    engine.generate(PROMPT[:4], max_new_tokens=2, stop_at_eos=False)
    engine.close()  # close() writes the trace
    trace = load(out)
    assert len(trace) == (4 + 2 - 1) * 2
    assert all(s is None for s in trace.table.column("scores").to_pylist())


def test_recorder_round_trip(tmp_path):
    rec = TraceRecorder(dict(META), with_scores=True)
    rec.record(3, [[0, 1], [2, 3]], [[0.75, 0.25], [0.5, 0.5]], [[0.4, 0.3, 0.2, 0.1]] * 2)
    rec.step = 1
    rec.record(3, [[1, 2]], [[0.6, 0.4]], [[0.1, 0.5, 0.3, 0.1]])
    trace = load(rec.save(tmp_path / "sub" / "r.parquet"))
    rows = trace.table.to_pylist()
    assert [(r["step"], r["token"], r["layer"]) for r in rows] == [(0, 0, 3), (0, 1, 3), (1, 0, 3)]
    assert rows[2]["experts"] == [1, 2]
    assert rows[0]["weights"] == pytest.approx([0.75, 0.25])
    assert trace.metadata["schema_version"] == 1 and trace.metadata["top_k"] == 2


def test_recorder_rollback_drops_the_failed_forward_only(tmp_path):
    """begin marks a forward's start; rollback drops its rows (all, or all but the tokens kept), never earlier
    forwards'; a retry then records its own rows for the same step."""
    rec = TraceRecorder(dict(META))
    rec.begin(0)
    rec.record(0, [[0, 1], [1, 2]], [[0.5, 0.5]] * 2, None)  # a forward that completed
    rec.begin(1)
    rec.record(0, [[2, 3], [3, 0], [0, 2]], [[0.5, 0.5]] * 3, None)
    rec.record(1, [[1, 3], [2, 0], [3, 1]], [[0.5, 0.5]] * 3, None)
    assert rec.rollback() == 6  # the failed forward: both of its layer calls
    rec.begin(1)  # the retry, with two of the rows
    rec.record(0, [[2, 3], [0, 2]], [[0.5, 0.5]] * 2, None)
    rec.begin(2)
    rec.record(0, [[1, 0], [3, 2]], [[0.5, 0.5]] * 2, None)
    assert rec.rollback(keep=[1]) == 1  # ran to its end: token 1's row stays, with its token number
    assert rec.rollback() == 0  # the kept row is final, the earlier forwards untouched
    rows = load(rec.save(tmp_path / "r.parquet")).table.to_pylist()
    assert [(r["step"], r["token"], r["layer"], r["experts"]) for r in rows] == [
        (0, 0, 0, [0, 1]), (0, 1, 0, [1, 2]), (1, 0, 0, [2, 3]), (1, 1, 0, [0, 2]), (2, 1, 0, [3, 2])
    ]  # fmt: skip


# -- malformed files ---------------------------------------------------------------------------


def test_random_bytes(tmp_path):
    bad = tmp_path / "noise.parquet"
    bad.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(TraceError, match=r"noise\.parquet"):
        load(bad)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match=r"absent\.parquet"):
        load(tmp_path / "absent.parquet")


def test_parquet_without_trace_metadata(tmp_path):
    bad = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1, 2, 3]}), bad)
    with pytest.raises(TraceError, match=r"plain\.parquet"):
        load(bad)


def _trace_like(tmp_path, meta: bytes, table: pa.Table | None = None):
    table = table if table is not None else pa.table({n: pa.array([], type=SCHEMA.field(n).type) for n in SCHEMA.names})
    path = tmp_path / "t.parquet"
    pq.write_table(table.replace_schema_metadata({b"moetier": meta}), path)
    return path


def test_metadata_lacking_keys(tmp_path):
    meta = {k: v for k, v in META.items() if k != "top_k"}
    with pytest.raises(TraceError, match="top_k"):
        load(_trace_like(tmp_path, json.dumps(meta).encode()))


def test_metadata_not_json(tmp_path):
    with pytest.raises(TraceError, match="JSON"):
        load(_trace_like(tmp_path, b"{oops"))


def test_missing_column(tmp_path):
    table = pa.table({n: pa.array([], type=SCHEMA.field(n).type) for n in SCHEMA.names if n != "weights"})
    with pytest.raises(TraceError, match="weights"):
        load(_trace_like(tmp_path, json.dumps(META).encode(), table))


def test_columns_of_wrong_type(tmp_path):
    table = pa.table({n: pa.array(["x"], type=pa.string()) for n in SCHEMA.names})
    with pytest.raises(TraceError, match=r"t\.parquet"):
        load(_trace_like(tmp_path, json.dumps(META).encode(), table))


def test_metadata_not_an_object(tmp_path):
    with pytest.raises(TraceError, match=r"t\.parquet"):
        load(_trace_like(tmp_path, b"5"))


def test_trace_path_that_is_a_directory_is_refused_before_running(tiny_ckpt, tmp_path):
    from moetier.errors import ConfigError

    engine = moetier.load(tiny_ckpt("qwen3_moe"), EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32")))
    with pytest.raises(ConfigError, match="is a directory"):
        engine.record_trace(tmp_path)
    assert engine.recorder is None
    engine.close()
