"""`moetier replay`: human table, --json line, one-line errors (in-process via typer's CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from moetier import traces
from moetier.cli.app import app
from moetier.cli.replay import register
from moetier.sim.cache_replay import replay_trace
from moetier.traces import TraceRecorder

runner = CliRunner()
E, K, LAYERS = 8, 2, (1, 2)


def write_trace(path: Path, scores: bool = True, steps: int = 30) -> Path:
    meta = {"model": "toy", "num_experts": E, "top_k": K, "hidden_size": 8, "moe_intermediate_size": 8,
            "dtype": "float32", "moe_layers": list(LAYERS)}  # fmt: skip
    rec = TraceRecorder(meta, with_scores=scores)
    rng = np.random.default_rng(0)
    for step in range(steps):
        rec.step = step
        tokens = 5 if step == 0 else 1
        for layer in LAYERS:
            p = rng.dirichlet(np.full(E, 0.4), size=tokens)  # [T, E]
            ids = np.argsort(-p, axis=1)[:, :K]  # [T, k]
            rec.record(layer, ids.tolist(), np.take_along_axis(p, ids, 1).tolist(), p.tolist())
    return rec.save(path)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("replay") / "t.parquet")


def test_command_registered_once() -> None:
    one = typer.Typer()
    register(one)
    register(one)
    assert [c.name for c in one.registered_commands].count("replay") == 1


def test_human_table(trace_file: Path) -> None:
    result = runner.invoke(app, ["replay", str(trace_file), "--cache-policy", "all", "--cache-ratio", "0.5"])
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    out = result.stdout
    assert "8 of 16 experts cached" in out
    for needle in ("lru", "lfu", "mrs", "belady", "all", "decode"):
        assert needle in out
    lru = replay_trace(traces.load(trace_file), "lru", 0.5)
    assert f"{100 * lru.hit_rate:.1f}%" in out
    assert f"{100 * lru.layers[0].hit_rate:.1f}%" in out


def test_json_line(trace_file: Path) -> None:
    result = runner.invoke(
        app, ["replay", str(trace_file), "--cache-policy", "lru,mrs", "--alpha", "0.3", "--top-p", "3", "--json"]
    )
    assert result.exit_code == 0, (result.stderr, result.exception)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["policies"] == ["lru", "mrs"] and data["slots"] == 4 and data["total_experts"] == 16
    assert data["scores"] == "router" and data["calls"] == 60
    mrs = replay_trace(traces.load(trace_file), "mrs", 0.25, alpha=0.3, top_p=3)
    assert data["hit_rate"]["mrs"] == pytest.approx(mrs.hit_rate)
    assert data["results"]["mrs"]["options"] == {"alpha": 0.3, "top_p": 3, "normalize": False}
    assert data["results"]["lru"]["options"] == {}
    res = data["results"]["lru"]
    assert res["hits"] + res["misses"] == res["accesses"]
    assert set(res["per_layer"]) == {"1", "2"}
    assert "cache hit rate" in result.stderr  # the table goes to stderr with --json


def test_trace_without_scores_says_so(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "bare.parquet", scores=False, steps=5)
    result = runner.invoke(app, ["replay", str(path), "--cache-policy", "mrs", "--json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert json.loads(result.stdout)["scores"] == "weights"
    assert "no router scores" in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cache-ratio", "0"], "cache ratio must lie in (0, 1]"),
        (["--cache-ratio", "1.5"], "cache ratio must lie in (0, 1]"),
        (["--cache-policy", "fifo"], "unknown cache policy 'fifo'"),
        (["--alpha", "0.2"], "only mrs takes --alpha"),
        (["--cache-policy", "mrs", "--alpha", "2"], "alpha must lie in (0, 1]"),
    ],
)
def test_bad_flags(trace_file: Path, args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["replay", str(trace_file), *args])
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert needle in result.stderr and "Traceback" not in result.output


def test_bad_files(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a trace")
    for path, needle in ((tmp_path / "missing.parquet", "no such file"), (text, "cannot read as a Parquet trace")):
        result = runner.invoke(app, ["replay", str(path)])
        assert result.exit_code == 2, (result.stdout, result.stderr)
        assert result.stderr.startswith("error: ") and needle in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_per_layer_flag(trace_file: Path) -> None:
    result = runner.invoke(app, ["replay", str(trace_file), "--cache-policy", "lru,belady", "--per-layer",
                                 "--cache-ratio", "0.25", "--json"])  # fmt: skip
    assert result.exit_code == 0, (result.stderr, result.exception)
    data = json.loads(result.stdout)
    assert data["per_layer"] is True and data["slots"] == 2 * 2  # floor(0.25 * 8) per layer, 2 layers
    want = replay_trace(traces.load(trace_file), "belady", 0.25, per_layer=True)
    assert data["hit_rate"]["belady"] == pytest.approx(want.hit_rate)
    assert data["results"]["lru"]["per_layer_caches"] is True
    assert "per-layer caches" in result.stderr
