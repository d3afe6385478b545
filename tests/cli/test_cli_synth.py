"""`moetier synth`: writes a loadable synthetic trace from a preset or a fit; bad input is one line, exit 2."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

import moetier.cli.synth as cli_synth
from moetier import traces
from moetier.errors import ConfigError
from moetier.studies.synthetic import SynthParams, generate, save

runner = CliRunner()


@dataclass(frozen=True)
class StandInSpec:
    name: str = "stand-in"
    moe_layers: tuple[int, ...] = (1, 2, 3)
    num_experts: int = 32
    top_k: int = 4
    hidden: int = 512
    moe_inter: int = 256


@pytest.fixture
def app(monkeypatch):
    def load_spec(name: str) -> StandInSpec:
        if name != "stand-in":
            raise ConfigError(f"unknown model spec {name!r}")
        return StandInSpec()

    monkeypatch.setattr(cli_synth, "_load_spec", load_spec)
    a = typer.Typer()
    a.command(name="noop")(lambda: None)
    cli_synth.register(a)
    cli_synth.register(a)  # idempotent
    assert [c.name for c in a.registered_commands].count("synth") == 1
    return a


def test_spec_preset_json(app, tmp_path):
    out = tmp_path / "t.parquet"
    args = ["synth", "--spec", "stand-in", "--steps", "7", "--batch-size", "3", "--prompt-len", "2", "--seed", "4"]
    res = runner.invoke(app, [*args, "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    payload = json.loads(lines[0])
    t = traces.load(out)
    assert payload["rows"] == len(t) == 3 * 3 * 2 + 7 * 3 * 3
    assert payload["params"]["seed"] == 4 and payload["params"]["batch_size"] == 3
    assert payload["stats"]["decode_steps"] == 7 and payload["stats"]["batch"] == 3
    assert t.metadata["model"] == "stand-in" and t.metadata["moe_layers"] == [1, 2, 3]
    assert traces.iter_calls(t)[0].scores.shape == (6, 32)


def test_fit_then_generate(app, tmp_path):
    src = save(generate(SynthParams(num_layers=2, num_experts=16, top_k=2, hot_frac=1 / 16, warm_frac=4 / 16), 20, 3),
               tmp_path / "rec.parquet")  # fmt: skip
    out = tmp_path / "syn.parquet"
    res = runner.invoke(app, ["synth", "--fit", str(src), "--steps", "9", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "share of tokens on the top 10%" in res.stdout
    t = traces.load(out)
    assert len(t) == 2 * 9 and t.metadata["num_experts"] == 16


def test_params_out_then_params(app, tmp_path):
    knobs = tmp_path / "fits" / "stand-in.json"
    first = tmp_path / "a.parquet"
    res = runner.invoke(app, ["synth", "--spec", "stand-in", "--steps", "6", "--seed", "3", "--out", str(first),
                              "--params-out", str(knobs), "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["params_out"] == str(knobs) and knobs.exists()
    second = tmp_path / "b.parquet"
    res = runner.invoke(app, ["synth", "--params", str(knobs), "--steps", "6", "--seed", "3", "--out", str(second),
                              "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["source"] == f"params:{knobs}"
    a, b = traces.load(first), traces.load(second)
    assert a.table.equals(b.table)  # the same knobs and seed give the same trace


def test_bad_params_file(app, tmp_path):
    bad = tmp_path / "knobs.json"
    bad.write_text('{"num_experts": 8, "colour": 1}')
    res = runner.invoke(app, ["synth", "--params", str(bad), "--steps", "3", "--out", str(tmp_path / "o.parquet")])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and "unknown synthetic parameter(s) colour" in res.stderr
    both = ["synth", "--params", str(bad), "--spec", "stand-in", "--steps", "3", "--out", str(tmp_path / "o.parquet")]
    res = runner.invoke(app, both)
    assert res.exit_code == 2 and "exactly one of --spec NAME, --fit TRACE or --params" in res.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "5"], "exactly one of --spec"),
        (["--spec", "stand-in", "--fit", "x.parquet", "--steps", "5"], "exactly one of --spec"),
        (["--spec", "nope", "--steps", "5"], "unknown model spec 'nope'"),
        (["--spec", "stand-in", "--steps", "0"], "--steps must be at least 1"),
        (["--spec", "stand-in", "--steps", "3", "--prompt-len", "-1"], "--prompt-len"),
        (["--spec", "stand-in", "--steps", "3", "--batch-size", "0"], "--batch-size"),
        (["--fit", "missing.parquet", "--steps", "3"], "missing.parquet: no such file"),
    ],
)
def test_bad_input_is_one_line_exit_2(app, tmp_path, args, message):
    res = runner.invoke(app, ["synth", *args, "--out", str(tmp_path / "o.parquet")])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_fit_of_a_non_trace_file(app, tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    res = runner.invoke(app, ["synth", "--fit", str(bad), "--steps", "3", "--out", str(tmp_path / "o.parquet")])
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and "Parquet" in res.stderr
