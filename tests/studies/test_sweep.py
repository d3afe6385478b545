"""moetier.studies.sweep: grid files (expansion, plural keys, validation), point keys, the process-pool and
Ray runners, resume from points.jsonl, error rows, the Parquet schema and the plots."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetier.errors import ConfigError
from moetier.studies.sweep import REQUIRED, Point, load_grid, parse_grid, point_key, register_point, run_sweep
from moetier.studies.sweep_exec import RECORDS
from moetier.studies.sweep_simulate import simulate_point

SIM = {"profile": "a6000-5220r", "steps": 4, "prompt_len": 8}


def _count_point(p: dict[str, Any]) -> dict[str, Any]:
    """Appends x to the log file (one line per call, from any process); fails for x == 2 when asked."""
    with open(p["log"], "a") as f:
        f.write(f"{p['x']}\n")
    if p["fail"] and p["x"] == 2:
        raise RuntimeError("two is bad")
    return {"y": p["x"] * 10, "nested": {"a": 1.5}}


register_point("count", Point(_count_point, {"x": REQUIRED, "log": "", "fail": False}, columns=("y", "nested_a")))


def _count_grid(log: Path, fail: bool = False, xs: tuple[int, ...] = (1, 2, 3)) -> Any:
    return parse_grid({"point": "count", "params": {"log": str(log), "fail": fail}, "grid": {"xs": list(xs)}})


def _calls(log: Path) -> list[int]:
    return [int(x) for x in log.read_text().split()] if log.exists() else []


def test_expansion_order_plurals_and_types() -> None:
    g = parse_grid({"params": SIM, "grid": {"models": ["deepseek-v2-lite", "qwen3-30b-a3b"],
                    "cache_policies": ["lru", "lfu"], "cache_ratios": [0, 0.5, 1]}})  # fmt: skip
    pts = g.given()
    assert len(pts) == 12 and g.varying == ("model", "cache_policy", "cache_ratio")
    assert pts[0] == {**SIM, "model": "deepseek-v2-lite", "cache_policy": "lru", "cache_ratio": 0.0}
    assert pts[-1]["model"] == "qwen3-30b-a3b" and pts[1]["cache_ratio"] == 0.5  # first key outermost
    assert all(isinstance(p["cache_ratio"], float) for p in pts)  # ints and floats mixed -> floats
    assert g.metrics == ("tbt_s",)
    full = g.full(pts[0])
    assert full["scheduler"] == "hybrimoe" and full["warmup_steps"] == 0  # the point's defaults


def test_point_key_is_stable() -> None:
    a = point_key("simulate", {"model": "m", "cache_ratio": 0.5})
    assert a == point_key("simulate", {"cache_ratio": 0.5, "model": "m"})
    assert a != point_key("simulate", {"model": "m", "cache_ratio": 0.25}) != point_key("count", {"model": "m"})
    assert len(a) == 16


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite"], "bogus_keys": [1], "colour": [2]}},
         r"no parameter\(s\) \['bogus_keys', 'colour'\]"),
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite"], "ndp_counts": [8, 16]}}, "cannot use ndp_count"),
        ({"grid": {"models": ["deepseek-v2-lite"]}}, r"needs \['profile'\]"),
        ({"params": {**SIM, "model": "deepseek-v2-lite"}, "grid": {"models": ["qwen3-30b-a3b"]}}, "given twice"),
        ({"params": SIM, "grid": {"models": []}}, "non-empty list"),
        ({"params": SIM, "grid": {"models": "deepseek-v2-lite"}}, "non-empty list"),
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite"], "cache_ratios": ["a"]}}, "expected a float"),
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite"], "prefetch": [1]}}, "expected a bool"),
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite", "deepseek-v2-lite"]}}, "repeated"),
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite"], "schedulers": ["hybrimo"]}}, "unknown scheduler"),
        ({"params": SIM, "grid": {"models": ["no-such-model"]}}, "no-such-model"),
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite"], "cache_ratios": [1.5]}}, r"\[0, 1\]"),
        ({"point": "nope", "grid": {}}, "unknown point 'nope'"),
        ({"params": SIM, "grid": {"models": ["deepseek-v2-lite"]}, "metrics": ["tpot"]}, "unknown metric"),
        ({"params": SIM, "grd": {}}, "unknown top-level keys"),
        ({"params": {"profile": "this-machine", "precision": "int4", "steps": 4}, "grid": {
            "models": ["deepseek-v2-lite"], "cpu_tflops": [1.0]}}, "measured LUTs"),
    ],
)  # fmt: skip
def test_bad_grids_are_one_clear_error(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_grid(data, "g.toml")


def test_load_grid_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such grid file"):
        load_grid(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[grid\nmodels = 1\n")
    with pytest.raises(ConfigError, match="not a valid TOML"):
        load_grid(bad)


def test_cpu_tflops_scales_the_cpu() -> None:
    # llama.cpp at cache 0 computes every prefill expert on the CPU (kTransformers streams prefill misses to the GPU)
    base = {**SIM, "model": "deepseek-v2-lite", "scheduler": "llamacpp", "prompt_len": 64, "cache_ratio": 0.0}
    g = parse_grid({"params": base, "grid": {"cpu_tflops": [0.01, 100.0]}})
    slow, fast = (simulate_point(g.full(p)) for p in g.given())
    assert slow["ttft_s"] > fast["ttft_s"]


def test_process_pool_sweep_parquet_and_plot(tmp_path: Path) -> None:
    grid = tmp_path / "g.toml"
    grid.write_text('point = "simulate"\n[params]\nprofile = "a6000-5220r"\nsteps = 4\nprompt_len = 8\n'
                    '[grid]\nmodels = ["deepseek-v2-lite"]\nschedulers = ["hybrimoe", "ktransformers"]\n'
                    'cache_ratios = [0.25, 0.5]\n')  # fmt: skip
    started: list[int] = []
    rep = run_sweep(load_grid(grid), tmp_path / "out", jobs=2, on_start=started.append)
    assert (rep.points, rep.ran, rep.done_before, rep.errors, rep.runner) == (4, 4, 0, 0, "processes:2")
    assert started == [4]
    t = pq.read_table(rep.results)
    assert t.num_rows == 4
    names = t.column_names
    assert names[:4] == ["point_key", "profile", "steps", "prompt_len"]
    assert names[4:10] == ["model", "scheduler", "cache_ratio", "status", "error", "seconds"]
    s = t.schema
    assert s.field("cache_ratio").type == pa.float64() and s.field("steps").type == pa.int64()
    assert s.field("status").type == pa.string() and s.field("error").type == pa.string()
    for col in ("tbt_s", "ttft_s", "throughput_tok_s", "moe_layer_s", "hit_rate", "util_gpu", "util_cpu"):
        assert s.field(col).type == pa.float64(), col
    rows = t.to_pylist()
    assert [r["scheduler"] for r in rows] == ["hybrimoe", "hybrimoe", "ktransformers", "ktransformers"]
    assert all(r["status"] == "ok" and r["error"] is None and r["tbt_s"] > 0 for r in rows)
    assert json.loads(s.metadata[b"moetier.sweep"])["point"] == "simulate"
    png = tmp_path / "out" / "tbt_s_deepseek-v2-lite.png"
    assert rep.plots == (png,) and png.read_bytes()[:4] == b"\x89PNG"


def test_resume_runs_only_missing_points(tmp_path: Path) -> None:
    log, out = tmp_path / "calls.log", tmp_path / "out"
    rep = run_sweep(_count_grid(log), out, jobs=2)  # through the pool: the test's point pickles by reference
    assert rep.ran == 3 and sorted(_calls(log)) == [1, 2, 3]
    (out / "results.parquet").unlink()
    lines = (out / RECORDS).read_text().splitlines()
    dropped = next(ln for ln in lines if json.loads(ln)["params"]["x"] == 2)
    (out / RECORDS).write_text("".join(ln + "\n" for ln in lines if ln != dropped))
    rep = run_sweep(_count_grid(log), out, jobs=2)
    assert (rep.ran, rep.done_before) == (1, 2) and sorted(_calls(log)) == [1, 2, 2, 3]
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["x"] for r in rows] == [1, 2, 3] and [r["y"] for r in rows] == [10, 20, 30]
    assert rows[0]["nested_a"] == 1.5  # nested result dicts are flattened
    # a torn last line (a crash mid-write) is ignored, and the next record starts on a line of its own
    with (out / RECORDS).open("a") as f:
        f.write('{"key": "trunc')
    rep = run_sweep(_count_grid(log, xs=(1, 2, 3, 4)), out, jobs=1)
    assert rep.ran == 1 and _calls(log)[-1] == 4
    assert json.loads((out / RECORDS).read_text().splitlines()[-1])["params"]["x"] == 4


def test_error_rows_and_retry(tmp_path: Path) -> None:
    log, out = tmp_path / "calls.log", tmp_path / "out"
    rep = run_sweep(_count_grid(log, fail=True), out, jobs=1)
    assert (rep.ran, rep.errors) == (3, 1)
    rows = pq.read_table(out / "results.parquet").to_pylist()
    bad = rows[1]
    assert bad["status"] == "error" and bad["error"] == "RuntimeError: two is bad" and bad["y"] is None
    assert rows[2]["status"] == "ok" and rows[2]["y"] == 30  # the sweep went on
    assert run_sweep(_count_grid(log, fail=True), out, jobs=1).ran == 0  # an error is a finished point
    rep = run_sweep(_count_grid(log, fail=True), out, jobs=1, retry_errors=True)
    assert rep.ran == 1 and _calls(log) == [1, 2, 3, 2]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install moetier[sweep])")
def test_ray_local_instance(tmp_path: Path) -> None:
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        g = parse_grid(
            {"params": {**SIM, "model": "deepseek-v2-lite"}, "grid": {"schedulers": ["hybrimoe", "gpu-lru"]}}
        )
        rep = run_sweep(g, tmp_path / "out", ray="local")
        assert (rep.ran, rep.errors, rep.runner) == (2, 0, "ray:local")
        assert ray.is_initialized()  # an instance it did not start is left running
        rows = pq.read_table(rep.results).to_pylist()
        assert [r["scheduler"] for r in rows] == ["hybrimoe", "gpu-lru"] and all(r["tbt_s"] > 0 for r in rows)
    finally:
        ray.shutdown()


# The "tri" point (studies/sweep_tri.py): the three-domain TriMoE machine ---------------------------------------------
TRI = {"model": "deepseek-v2-lite", "batch_size": 16, "steps": 1}


@pytest.mark.parametrize(
    ("grid", "match"),
    [
        ({"cache_ratios": [0.25]}, "cannot use cache_ratio: .*hbm_ratio"),
        ({"cpu_tflops": [10.0]}, "cannot use cpu_tflops: .*cpu_tflops_scale"),
        ({"prefetch": [True]}, "cannot use prefetch"),
        ({"precisions": ["int4"]}, "cannot use precision"),
        ({"schedulers": ["hybrimoe"]}, "unknown scheduler 'hybrimoe'"),
        ({"ndp_counts": [0]}, "ndp_count must be an int >= 1"),
        ({"hbm_ratios": [1.5]}, r"hbm_ratio must be in \[0, 1\]"),
        ({"cpu_tflops_scales": [0.0]}, "cpu_tflops_scale must be a number > 0"),
        ({"refinements": [1]}, "expected a bool"),
        ({"drifts": ["fast"]}, "drift must be a number >= 0"),
        ({"drifts": [-1.0]}, "drift must be a number >= 0"),
        ({"contentions": ["bus"]}, "contention must be one of channel, array"),
        ({"profiles": ["nope"]}, "unknown hardware profile 'nope'"),
        ({"models": ["no-such-model"]}, "no-such-model"),
    ],
)  # fmt: skip
def test_tri_point_refuses_what_it_cannot_use(grid: dict[str, Any], match: str) -> None:
    params = {k: v for k, v in TRI.items() if k != "model" or "models" not in grid}
    with pytest.raises(ConfigError, match=match):
        parse_grid({"point": "tri", "params": params, "grid": grid}, "g.toml")


def test_tri_point_sweep_columns(tmp_path: Path) -> None:
    g = parse_grid({"point": "tri", "params": TRI, "grid": {"schedulers": ["klotski", "trimoe"]},
                    "metrics": ["moe_step_s"]})  # fmt: skip
    assert g.full(g.given()[0])["ndp_count"] == 16 and g.full(g.given()[0])["relayout"] is True
    rep = run_sweep(g, tmp_path / "out", jobs=1)
    assert (rep.points, rep.ran, rep.errors) == (2, 2, 0)
    t = pq.read_table(rep.results)
    from moetier.studies.sweep_tri import COLUMNS

    assert set(COLUMNS) <= set(t.column_names)
    for col in ("moe_step_s", "throughput_tok_s", "busy_gpu", "predictor_accuracy", "migration_link_frac"):
        assert t.schema.field(col).type == pa.float64(), col
    klotski, trimoe = t.to_pylist()
    assert klotski["scheduler"] == "klotski" and klotski["status"] == "ok" and trimoe["status"] == "ok"
    assert klotski["busy_gpu"] == pytest.approx(1.0) and klotski["experts_cpu"] == klotski["experts_ndp"] == 0
    assert trimoe["moe_step_s"] < klotski["moe_step_s"] and trimoe["throughput_tok_s"] > klotski["throughput_tok_s"]
    assert 0.0 <= trimoe["predictor_accuracy"] <= 1.0
