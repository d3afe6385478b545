"""moetier.studies.sweep with several [[grid]] blocks (their union, the block column, defaults filled in, plots per
block) and a study's own figures (`figures = "trimoe"`, studies/figures_tri.py) drawn from a small real sweep."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from moetier.errors import ConfigError
from moetier.sim.config import SimConfig
from moetier.sim.tri import TriSimConfig
from moetier.studies import sweep_simulate, sweep_tri
from moetier.studies.sweep import REQUIRED, Point, load_grid, parse_grid, point_key, register_point, run_sweep


def _echo(p: dict[str, Any]) -> dict[str, Any]:
    return {"y": p["x"] * 10 + p["z"]}


register_point("echo", Point(_echo, {"x": REQUIRED, "z": 0}, columns=("y",)))


def test_blocks_union_dedupe_block_column_and_defaults(tmp_path: Path) -> None:
    g = parse_grid({"point": "echo", "grid": [{"name": "a", "xs": [1, 2]}, {"name": "b", "xs": [2], "zs": [0, 5]}]})
    assert [b.name for b in g.blocks] == ["a", "b"] and g.varying == ("x", "z")
    assert dict(g.axes) == {"x": (1, 2), "z": (0, 5)}
    given = g.given()
    assert given == [{"x": 1}, {"x": 2}, {"x": 2, "z": 0}, {"x": 2, "z": 5}]
    rep = run_sweep(g, tmp_path, jobs=1)
    assert (rep.points, rep.ran, rep.errors) == (4, 4, 0)  # {"x": 2} and {"x": 2, "z": 0} are distinct keys
    rows = pq.read_table(rep.results).to_pylist()
    assert [(r["block"], r["x"], r["z"], r["y"]) for r in rows] == [("a", 1, 0, 10), ("a", 2, 0, 20), ("b", 2, 0, 20),
                                                                    ("b", 2, 5, 25)]  # fmt: skip
    assert {p.name for p in rep.plots} == {"a_y.png", "b_y.png"}  # one set of plots per block
    again = run_sweep(g, tmp_path, jobs=1)
    assert again.ran == 0 and again.done_before == 4
    assert point_key("echo", {"x": 2}) != point_key("echo", {"x": 2, "z": 0})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"grid": [{"name": "a", "xs": [1]}, {"name": "a", "xs": [2]}]}, "name must be a unique string"),
        ({"grid": [{"xs": [1]}, {"zs": [1]}]}, r"needs \['x'\] in \[params\] or in every \[grid\]"),
        ({"grid": [{"xs": [1]}, {"xs": [2], "ws": [1]}]}, r"no parameter\(s\) \['ws'\]"),
        ({"grid": [{"xs": [1]}, {"xs": [1], "x": [2]}]}, "x is given twice"),
        ({"grid": []}, r"\[grid\] a table or a non-empty \[\[grid\]\] list"),
        ({"grid": {"xs": [1]}, "figures": "nope"}, "unknown figures 'nope'"),
        ({"grid": {"xs": [1]}, "figures": 3}, "figures must be a string"),
    ],
)  # fmt: skip
def test_bad_block_grids(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_grid({"point": "echo", **data}, "g.toml")


def test_trimoe_figures_from_a_small_sweep(tmp_path: Path) -> None:
    """The study's blocks at small batches, one model, one step: every figure and the tables are written."""
    text = (Path(__file__).parents[2] / "sweeps" / "trimoe.toml").read_text()
    full = load_grid(Path(__file__).parents[2] / "sweeps" / "trimoe.toml")
    names = ["systems", "robustness", "systems-split", "ablation-base", "ablation", "variant-per-link",
             "variant-array", "variant-kv-hbm", "regimes", "regimes-norelayout", "variant-all-links", "ndp", "cpu",
             "drift", "drift-base"]  # fmt: skip
    assert [b.name for b in full.blocks] == names and full.figures == "trimoe"
    small = (
        text.replace('["deepseek-v2", "qwen3-235b-a22b", "glm-4.5-air"]', '["glm-4.5-air"]')
        .replace('["qwen3-235b-a22b"]', '["glm-4.5-air"]')
        .replace("[256, 512, 768]", "[64]")
        .replace("[32, 64, 128]", "[32]")
        .replace("batch_sizes = [512]", "batch_sizes = [64]")
        .replace("prefill_tokens = [512]", "prefill_tokens = [8]")
        .replace("output_lens = [512]", "output_lens = [8]")
        .replace("steps = 8", "steps = 1")
        .replace("warmup_steps = 16", "warmup_steps = 2")
        .replace("[4, 8, 16, 32]", "[8, 16]")
        .replace("[0.125, 0.5, 1.0, 2.0]", "[0.5, 1.0]")
        .replace("[0.0, 2.5, 8.0, 24.0]", "[0.0, 8.0]")
    )
    path = tmp_path / "small.toml"
    path.write_text(small)
    rep = run_sweep(load_grid(path), tmp_path / "out", jobs=1)
    assert rep.errors == 0
    names = {p.name for p in rep.plots}
    for fig in ("fig6_moe_speedup.png", "fig7_e2e_speedup.png", "robustness_batch.png", "fig8_ablation.png",
                "fig9a_ndp_count.png", "fig9b_cpu_tflops.png", "drift_relayout.png", "tables.md"):  # fmt: skip
        assert fig in names, fig
        assert (tmp_path / "out" / fig).stat().st_size > 500
    assert (tmp_path / "out" / "fig6_moe_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "out" / "tables.md").read_text()
    for title in ("over klotski", "ablation at batch 512", "Table 3", "NDP DIMMs", "popularity drift"):
        assert title in md, title



# The simulator points' parameters are their config dataclasses' fields; the configs check the values -------------
def test_point_parameters_are_the_config_fields() -> None:
    tri = {f.name: f.default for f in fields(TriSimConfig)}
    assert {"model": REQUIRED, **tri} == sweep_tri.DEFAULTS
    sim = {f.name for f in fields(SimConfig)} - {"prefetch_accuracy", "timeline_steps", "timeline_layers"}
    assert set(sweep_simulate.DEFAULTS) == sim | {"model", "profile", "stats", "cpu_tflops"}
    assert (sweep_simulate.DEFAULTS["steps"], sweep_simulate.DEFAULTS["batch_size"]) == (64, 1)
    assert sweep_simulate.DEFAULTS["prompt_len"] == 32 and sweep_simulate.DEFAULTS["cache_ratio"] == 0.25
    assert {"ndp_count", "hbm_ratio", "max_iters"} <= set(sweep_simulate.REFUSED)
    assert {"cache_ratio", "prefetch", "stats"} <= set(sweep_tri.REFUSED)


SIM = {"profile": "a6000-5220r", "model": "deepseek-v2-lite"}
TRI = {"model": "deepseek-v2-lite", "batch_size": 16, "steps": 1}


@pytest.mark.parametrize(
    ("point", "params", "grid", "match"),
    [
        ("simulate", SIM, {"prefetch_depths": [0]}, "prefetch_depth must be an integer >= 1, got 0"),
        ("simulate", SIM, {"steps": [0]}, "steps must be an integer >= 1, got 0"),
        ("simulate", SIM, {"batch_sizes": [0]}, "batch_size must be an integer >= 1, got 0"),
        ("simulate", SIM, {"prompt_lens": [-1]}, "prompt_len must be an integer >= 0, got -1"),
        ("simulate", SIM, {"warmup_steps": [-2]}, "warmup_steps must be an integer >= 0, got -2"),
        ("simulate", SIM, {"prefetch_maxs": [0]}, "prefetch_max must be an integer >= 1, got 0"),
        ("simulate", SIM, {"cache_ratios": [1.5]}, r"cache_ratio must be in \[0, 1\]"),
        ("simulate", SIM, {"schedulers": ["trimoe"]}, "'trimoe' is a three-domain .*simulate-tri"),
        ("simulate", SIM, {"max_iters": [3]}, "cannot use max_iters"),
        ("tri", TRI, {"max_iters": [-1]}, "max_iters must be an int >= 0, got -1"),
        ("tri", TRI, {"contexts": [-1]}, "context must be an int >= 0, got -1"),
        ("tri", TRI, {"ndp_counts": [0]}, "ndp_count must be an int >= 1, got 0"),
        ("tri", TRI, {"prefill_admit": [True]}, "cannot use prefill_admit"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(point: str, params: dict[str, Any], grid: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_grid({"point": point, "params": params, "grid": grid}, "g.toml")
