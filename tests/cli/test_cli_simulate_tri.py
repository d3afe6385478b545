"""`moetier simulate-tri --scheduler trimoe|klotski|ktransformers-plus|monde|gpu-ndp` (cli/simulate_tri.py): the
three-domain machine's JSON line for each scheduler, its flags, one-line errors, and the two-domain machine's
flags refused by click as flags it does not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from moetier.cli.simulate_tri import register

app = typer.Typer()


@app.callback()
def _root() -> None:
    """Test app."""


register(app)
runner = CliRunner()
BASE = ["simulate-tri", "--spec", "deepseek-v2-lite", "--synthetic", "--steps", "1", "--batch-size", "16"]
SYSTEMS = ("trimoe", "klotski", "ktransformers-plus", "monde", "gpu-ndp")
DOMAINS = {"trimoe": {"gpu", "cpu", "ndp"}, "klotski": {"gpu"}, "ktransformers-plus": {"gpu", "cpu"},
           "monde": {"gpu", "ndp"}, "gpu-ndp": {"gpu", "ndp"}}  # fmt: skip


def _json(args: list[str]) -> dict[str, object]:
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    out: dict[str, object] = json.loads(lines[0])
    return out


@pytest.mark.parametrize("system", SYSTEMS)
def test_json_line_for_each_system(system: str) -> None:
    d = _json([*BASE, "--scheduler", system])
    for key in ("moe_s", "moe_step_s", "step_s", "throughput_tok_s", "greedy_moe_s", "dense_s", "busy", "flop_util",
                "experts", "predictor", "migration", "moves", "routed", "ndp_count", "profile", "source"):  # fmt: skip
        assert key in d, key
    assert d["scheduler"] == system and d["model"] == "deepseek-v2-lite" and d["steps"] == 1 and d["batch"] == 16
    assert d["profile"] == "h100-8470" and d["ndp_count"] == 16 and d["relayout"] is True
    busy, experts, pred, mig = d["busy"], d["experts"], d["predictor"], d["migration"]
    assert isinstance(busy, dict) and isinstance(experts, dict) and isinstance(pred, dict) and isinstance(mig, dict)
    assert set(busy) == {"gpu", "cpu", "ndp", "dimm"} and 0.0 <= pred["accuracy"] <= 1.0
    assert {k for k, v in experts.items() if v > 0} <= DOMAINS[system]  # a system only uses its domains
    assert {"prefetch", "relayout", "migrate", "link_frac"} <= set(mig)
    assert isinstance(d["moe_s"], float) and d["moe_step_s"] == pytest.approx(d["moe_s"])  # one step


def test_table_and_tri_flags() -> None:
    res = runner.invoke(app, [*BASE, "--scheduler", "trimoe"])
    assert res.exit_code == 0, res.output
    assert "MoE time per step" in res.stdout and "predictor class accuracy" in res.stdout
    d = _json([*BASE, "--scheduler", "gpu-ndp", "--ndp-count", "8", "--cpu-tflops-scale", "2", "--hbm-ratio", "0.2",
               "--no-refinement", "--no-relayout"])  # fmt: skip
    assert (d["ndp_count"], d["cpu_tflops_scale"], d["hbm_ratio"]) == (8, 2.0, 0.2)
    assert d["refinement"] is False and d["relayout"] is False and d["moves"] == 0
    mig = d["migration"]
    assert isinstance(mig, dict) and mig["relayout"] == mig["migrate"] == 0


def test_cpu_profile_flag() -> None:
    """--cpu-profile takes the CPU compute from another profile and says so in the table and the JSON."""
    d = _json([*BASE, "--scheduler", "ktransformers-plus", "--cpu-profile", "a6000-5220r"])
    extra = d["extra"]
    assert d["cpu_profile"] == "a6000-5220r" and isinstance(extra, dict)
    assert str(extra["cpu_source"]).startswith("a6000-5220r: ")
    base = _json([*BASE, "--scheduler", "ktransformers-plus"])
    assert d["moe_s"] != base["moe_s"]  # a 10-core Xeon instead of Table 1's AMX CPU
    res = runner.invoke(app, [*BASE, "--scheduler", "trimoe", "--cpu-profile", "a6000-5220r"])
    assert res.exit_code == 0 and "CPU compute from" in res.stdout


def test_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    cases = [
        ([*BASE, "--scheduler", "hybrimoe"], "unknown scheduler 'hybrimoe'; known: klotski"),
        ([*BASE, "--scheduler", "trimoe", "--hbm-ratio", "1.5"], "hbm_ratio must be in [0, 1]"),
        ([*BASE, "--scheduler", "monde", "--cpu-tflops-scale", "0"], "cpu_tflops_scale must be a number > 0"),
        ([*BASE, "--scheduler", "trimoe", "--profile", "nope"], "unknown hardware profile"),
        ([*BASE, "--scheduler", "trimoe", "--cpu-profile", "nope"], "unknown hardware profile 'nope'"),
        (["simulate-tri", "--spec", "deepseek-v2-lite", "--scheduler", "trimoe"], "exactly one of"),
        (["simulate-tri", "--synthetic", "--scheduler", "trimoe"], "--synthetic needs --spec"),
        (["simulate-tri", "--scheduler", "trimoe", "--trace", str(tmp_path / "missing.parquet")], "no such file"),
    ]  # fmt: skip
    for args, msg in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], (args, res.stderr)


def test_two_domain_flags_are_not_flags_of_simulate_tri(tmp_path: Path) -> None:
    for args in (["--cache-ratio", "0.25"], ["--precision", "int4"], ["--timeline", str(tmp_path / "t.png")],
                 ["--prefetch"], ["--prompt-len", "8"], ["--stats", "hybrimoe"]):  # fmt: skip
        res = runner.invoke(app, [*BASE, *args])
        assert res.exit_code == 2 and "No such option" in res.output and args[0] in res.output, (args, res.output)


def test_trace_replays_its_decode_steps(tmp_path: Path) -> None:
    from moetier.specs import load_spec
    from moetier.studies import synthetic

    spec = load_spec("deepseek-v2-lite")
    path = tmp_path / "t.parquet"
    synthetic.save(synthetic.generate(synthetic.preset(spec, batch_size=8, seed=1), 3, prompt_len=4), path)
    tri = ["simulate-tri", "--scheduler", "trimoe", "--trace", str(path)]
    d = _json([*tri, "--steps", "2", "--warmup-steps", "0"])
    assert d["steps"] == 2 and d["batch"] == 8 and d["calls"] == 2 * 26  # the prefill chunk (step 0) is not replayed
    w = _json([*tri, "--steps", "2", "--warmup-steps", "1"])  # decode step 1 the window, steps 2-3 replayed
    assert w["steps"] == 2 and w["warmup_steps"] == 1 and w["moe_s"] != d["moe_s"]
    assert _json([*tri, "--warmup-steps", "2"])["steps"] == 1  # without --steps: every step after the window
    res = runner.invoke(app, [*tri, "--batch-size", "4"])
    assert res.exit_code == 2 and "--batch-size applies to --synthetic only" in res.stderr
    res = runner.invoke(app, [*tri, "--steps", "9", "--warmup-steps", "0"])
    assert res.exit_code == 2 and "holds 3 decode steps" in res.stderr
    for args, msg in (([], "--warmup-steps 16 leaves none of its 3 decode steps to replay"),  # the default window
                      (["--steps", "2", "--warmup-steps", "2"], "--warmup-steps 2 + --steps 2 but the trace holds 3")):
        res = runner.invoke(app, [*tri, *args])
        err = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(err) == 1 and msg in err[0], res.stderr


def test_warmup_steps_flag() -> None:
    d = _json([*BASE, "--steps", "2"])
    assert d["warmup_steps"] == 16 and d["steps"] == 2  # the default window, never timed
    off = _json([*BASE, "--steps", "2", "--warmup-steps", "0"])
    assert off["warmup_steps"] == 0 and off["steps"] == 2 and off["moe_s"] != d["moe_s"]
    bad = runner.invoke(app, [*BASE, "--warmup-steps", "-1"])
    assert bad.exit_code == 2 and "--warmup-steps" in bad.output


def test_drift_and_contention_flags() -> None:
    base = _json([*BASE, "--scheduler", "trimoe"])
    moved = _json([*BASE, "--scheduler", "trimoe", "--drift", "20", "--contention", "array"])
    assert base["drift"] == 2.5 and base["contention"] == "channel"  # the paper regime's drift, eq. 6 per channel
    assert moved["drift"] == 20.0 and moved["contention"] == "array" and moved["moe_s"] != base["moe_s"]
    bad = runner.invoke(app, [*BASE, "--scheduler", "trimoe", "--contention", "bus"])
    assert bad.exit_code == 2 and "contention must be one of channel, array" in bad.output
    res = runner.invoke(app, ["simulate-tri", "--scheduler", "trimoe", "--drift", "1", "--trace", "t.parquet"])
    assert res.exit_code == 2 and "--drift applies to --synthetic traces only" in res.output


def test_step_noise_flag() -> None:
    base = _json([*BASE, "--scheduler", "trimoe", "--steps", "3", "--drift", "0"])
    noisy = _json([*BASE, "--scheduler", "trimoe", "--steps", "3", "--drift", "0", "--step-noise", "1.5"])
    assert base["step_noise"] == 0.0 and noisy["step_noise"] == 1.5 and noisy["moe_s"] != base["moe_s"]
    res = runner.invoke(app, ["simulate-tri", "--scheduler", "trimoe", "--step-noise", "1", "--trace", "t.parquet"])
    assert res.exit_code == 2 and "--step-noise applies to --synthetic traces only" in res.output
    bad = runner.invoke(app, [*BASE, "--step-noise", "-1"])
    assert bad.exit_code == 2 and "--step-noise" in bad.output


def test_prefill_output_len_and_dimm_link_flags() -> None:
    d = _json([*BASE, "--prefill-tokens", "8", "--output-len", "4", "--dimm-link", "all-links"])
    assert d["dimm_link"] == "all-links" and isinstance(d["prefill_s"], float) and d["prefill_s"] > 0
    step, pre = float(d["step_s"]), float(d["prefill_s"])  # type: ignore[arg-type]
    assert d["e2e_tok_s"] == pytest.approx(16 * 4 / (pre + 4 * step))
    util = d["step_util"]
    assert isinstance(util, dict) and set(util) == {"busy_gpu", "compute_gpu", "busy_cpu", "compute_cpu",
                                                     "compute_ndp"}  # fmt: skip
    off = _json(BASE)
    assert off["prefill_s"] == 0.0 and off["dimm_link"] == "calibrated"
    res = runner.invoke(app, [*BASE, "--dimm-link", "one"])
    assert res.exit_code == 2 and "dimm_link must be one of calibrated, per-link, all-links" in res.output


def test_defaults_are_the_paper_setting_and_variants_are_named() -> None:
    d = _json(BASE)
    assert d["regime"] == "paper" and d["kv_home"] == "host" and d["dimm_link"] == "calibrated"
    assert d["kv"]["bytes"] > 0 and "decision_accuracy" in d["predictor"]  # type: ignore[index,operator]
    calm = _json([*BASE, "--regime", "calm", "--kv-home", "hbm"])
    assert calm["drift"] is None and calm["kv"]["bytes"] == 0  # type: ignore[index]
    bad = runner.invoke(app, [*BASE, "--regime", "windy"])
    assert bad.exit_code == 2 and "regime must be one of paper, calm, drifting, stationary" in bad.output
