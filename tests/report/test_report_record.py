"""report/record.py and report/load.py without an engine: the recorder's sampling and no-op mode, the
run.json it writes, input detection, and the data of each figure (skips with their reasons)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.report import data
from moetier.report.load import default_out, load_input
from moetier.report.record import MAX_SAMPLES, RunRecorder, run_trace, sample, write_simulation
from moetier.sim.machine import TimelineOp
from moetier.traces import TraceRecorder


def fake_stats(calls: list[int]) -> Any:
    def stats() -> dict[str, Any]:
        calls.append(1)
        n = len(calls)
        return {"hits": 2 * n, "misses": n, "promotions": n, "demotions": n - 1,
                "precision": {"int4": {"experts": n, "bytes": 1}, "int2": {"experts": 10 - n, "bytes": 1}},
                "sparsity": {"target": 0.5, "layers": {"1": {"achieved": 0.4}, "2": {"achieved": 0.6}}}}  # fmt: skip

    return stats


def test_without_a_run_dir_everything_passes_through() -> None:
    calls: list[int] = []
    rec = RunRecorder(None, "generate", Path("m"), fake_stats(calls))
    inner = print
    assert rec.on_token(inner) is inner and rec.finish({"x": 1}) is None
    assert run_trace(None, Path("t.parquet")) == Path("t.parquet")
    assert calls == []


def test_samples_every_n_tokens_and_the_last(tmp_path: Path) -> None:
    calls: list[int] = []
    seen: list[int] = []
    rec = RunRecorder(tmp_path / "r", "generate", Path("m"), fake_stats(calls), {"precision": {"mode": "x"}}, 3)
    cb = rec.on_token(lambda tok, _text: seen.append(tok))
    for tok in range(7):
        cb(tok, "")
    rec.finish({"new_tokens": 7})
    assert seen == list(range(7))  # the wrapped callback still runs
    lines = [json.loads(x) for x in (tmp_path / "r" / "stats.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3, 6, 7]
    assert lines[0]["precision"] == {"int4": 1, "int2": 9} and lines[0]["sparsity"] == {"1": 0.4, "2": 0.6}
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["kind"] == "run" and run["stats_every"] == 3 and run["result"] == {"new_tokens": 7}


def test_generate_interval_bounds_the_lines() -> None:
    class Eng:
        config = None

        def stats(self) -> dict[str, Any]:
            return {}

    assert RunRecorder.for_generate(None, Eng(), Path("m"), 10).every == 1
    assert RunRecorder.for_generate(None, Eng(), Path("m"), 4 * MAX_SAMPLES + 1).every == 5


def test_run_dir_errors(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        run_trace(tmp_path / "f", None)
    assert run_trace(tmp_path / "new", None) == tmp_path / "new" / "trace.parquet"
    assert sample({}, 4) == {"step": 4, "hits": 0, "misses": 0, "promotions": 0, "demotions": 0, "precision": {}}


def _trace(path: Path) -> Path:
    rec = TraceRecorder({"model": "toy", "num_experts": 4, "top_k": 2, "hidden_size": 8,
                         "moe_intermediate_size": 8, "dtype": "float32", "moe_layers": [0, 1]})  # fmt: skip
    for step in range(3):
        rec.step = step
        for layer in (0, 1):
            rec.record(layer, [[0, 1 + layer]] * (2 if step == 0 else 1), [[0.6, 0.4]] * (2 if step == 0 else 1), None)
    return rec.save(path)


def test_activation_shares(tmp_path: Path) -> None:
    inp = load_input(_trace(tmp_path / "t.parquet"))
    act = data.activation(inp)
    assert isinstance(act, data.Activation) and act.layers == (0, 1)
    np.testing.assert_allclose(act.share, [[0.5, 0.5, 0, 0], [0.5, 0, 0.5, 0]])
    np.testing.assert_array_equal(act.tokens, [4, 4])
    assert default_out(inp) == Path.cwd() / "report-t"


def test_simulation_dir_and_skips(tmp_path: Path) -> None:
    op = TimelineOp("gpu", "dense", "L0", 0.0, 1e-3, 1, 0)
    write_simulation(tmp_path / "s", {"spec": "toy"}, "synthetic toy", None, [op])
    inp = load_input(tmp_path / "s")
    assert inp.kind == "simulation" and inp.timeline == (op,) and inp.trace is None
    assert default_out(inp) == tmp_path / "s" / "report"
    skip = data.activation(inp)
    assert isinstance(skip, data.Skip) and "synthetic trace" in skip.reason
    skip = data.precision_series(inp)
    assert isinstance(skip, data.Skip) and skip.reason.startswith("no precision data")
    (tmp_path / "s" / "timeline.jsonl").write_text('{"lane": "gpu"}\n')
    with pytest.raises(ConfigError, match="timeline op needs exactly the keys"):
        load_input(tmp_path / "s")
