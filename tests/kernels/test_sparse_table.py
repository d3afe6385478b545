"""ThresholdTable: JSON round trip, every load error as a ConfigError naming the problem, refusal of a
table calibrated on another model, and threshold lookups (grid, interpolation, missing layer/block)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from moetier.errors import ConfigError
from moetier.kernels.sparse import TABLE_FORMAT, TABLE_VERSION, ThresholdTable, default_table_path
from moetier.policies.sparsity import TARGETS

IDENTITY: dict[str, Any] = {
    "path": "/models/tiny", "family": "qwen3_moe", "hidden_size": 32, "moe_intermediate": 16, "num_experts": 6,
    "moe_layers": [0, 1], "fingerprint": "ab" * 32,
}  # fmt: skip


def row(scale: float) -> list[float]:
    return [0.0] + [scale * 1.2**i for i in range(1, len(TARGETS))]


def make_table() -> ThresholdTable:
    return ThresholdTable(
        model=dict(IDENTITY), activation="silu",
        calibration={"text": "t.txt", "sha256": "cd" * 32, "tokens": 512, "pairs": {"0": 1024, "1": 1024}},
        thresholds={0: {1: row(0.01), 4: row(0.02), 16: row(0.05)}, 1: {1: row(0.03), 4: row(0.04)}},
    )  # fmt: skip


def test_default_path() -> None:
    assert default_table_path("/m/x") == Path("/m/x/moetier-sparsity/thresholds.json")


def test_round_trip(tmp_path: Path) -> None:
    table = make_table()
    path = table.save(tmp_path / "deep" / "dir" / "thresholds.json")  # parents are made
    assert path == tmp_path / "deep" / "dir" / "thresholds.json" and path.is_file()
    assert not list(path.parent.glob("*.tmp"))
    raw = json.loads(path.read_text())
    assert raw["format"] == TABLE_FORMAT and raw["version"] == TABLE_VERSION
    assert raw["shared_experts"] == "dense" and raw["activation"] == "silu"
    assert set(raw["thresholds"]) == {"0", "1"} and set(raw["thresholds"]["0"]) == {"1", "4", "16"}
    back = ThresholdTable.load(path)
    assert back.thresholds == table.thresholds  # int keys again, floats exact
    assert back.targets == TARGETS
    assert back.model == table.model and back.calibration == table.calibration
    assert back.activation == "silu" and back.shared_dense
    assert back.to_json() == table.to_json()
    # saving again over it replaces it
    table.thresholds[1][1] = row(0.5)
    table.save(path)
    assert ThresholdTable.load(path).thresholds[1][1] == row(0.5)


def test_save_to_a_directory_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        make_table().save(tmp_path)


def test_threshold_lookup() -> None:
    table = make_table()
    assert table.threshold(0, 0.5) == row(0.01)[10]
    assert table.threshold(0, 0.5, block=4) == row(0.02)[10]
    assert table.threshold(1, 0.95, block=4) == row(0.04)[19]
    assert table.threshold(0, 0.0, block=16) == 0.0
    mid = table.threshold(1, 0.525)
    assert mid == pytest.approx(math.sqrt(row(0.03)[10] * row(0.03)[11]), rel=1e-12)


def test_threshold_missing_layer_or_block() -> None:
    table = make_table()
    with pytest.raises(ConfigError, match=r"no MoE layer 5 \(it has \[0, 1\]\)"):
        table.threshold(5, 0.5)
    with pytest.raises(ConfigError, match=r"blocks of 8 neurons \(it has \[1, 4, 16\]\)"):
        table.threshold(0, 0.5, block=8)
    with pytest.raises(ConfigError, match="blocks of 16 neurons"):
        table.threshold(1, 0.5, block=16)  # layer 1 has no 16


def test_threshold_above_the_tables_targets_is_a_config_error(tmp_path: Path) -> None:
    table = make_table()
    table.targets = (0.0, 0.25, 0.5)
    table.thresholds = {0: {1: [0.0, 0.1, 0.2]}}
    path = table.save(tmp_path / "short.json")
    loaded = ThresholdTable.load(path)  # a valid table by _check
    with pytest.raises(ConfigError):
        loaded.threshold(0, 0.7)


# --- load errors ---------------------------------------------------------------------------------


def write(tmp_path: Path, data: Any, name: str = "t.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def good() -> dict[str, Any]:
    return make_table().to_json()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no sparsity table at .*nope\.json.*moetier calibrate"):
        ThresholdTable.load(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="no sparsity table"):
        ThresholdTable.load(tmp_path)  # a directory is not a table file


def test_invalid_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"t\.json: not a sparsity table \(invalid JSON"):
        ThresholdTable.load(write(tmp_path, '{"format": "moetier-sparsity-table", '))
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ThresholdTable.load(path)


@pytest.mark.parametrize("data", [{**good(), "format": "something-else"}, [1, 2, 3], {"version": 1}])
def test_wrong_format(tmp_path: Path, data: Any) -> None:
    with pytest.raises(ConfigError, match="not a moetier sparsity table"):
        ThresholdTable.load(write(tmp_path, data))


def test_wrong_version(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"sparsity table version 2, this moetier reads {TABLE_VERSION}"):
        ThresholdTable.load(write(tmp_path, {**good(), "version": 2}))


def _with_row(layer: str, block: str, values: list[Any]) -> dict[str, Any]:
    data = good()
    data["thresholds"][layer][block] = values
    return data


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (_with_row("0", "1", row(0.01)[::-1]), "non-decreasing"),  # decreasing
        (_with_row("1", "4", [*row(0.01)[:-1], float("nan")]), "finite"),  # NaN (json writes NaN)
        (_with_row("1", "4", [*row(0.01)[:-1], float("inf")]), "finite"),
        (_with_row("0", "4", [-1.0, *row(0.01)[1:]]), "non-negative"),
        (_with_row("0", "1", row(0.01)[:-1]), f"thresholds must be {len(TARGETS)} finite"),  # wrong length
        (_with_row("0", "16", [*row(0.01), 9.0]), "layer 0 block 16"),  # too long
    ],
)
def test_bad_rows(tmp_path: Path, data: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        ThresholdTable.load(write(tmp_path, data))


def test_unknown_block(tmp_path: Path) -> None:
    data = good()
    data["thresholds"]["1"]["3"] = row(0.01)
    with pytest.raises(ConfigError, match=r"layer 1 has block size 3, not one of \(1, 4, 8, 16, 32\)"):
        ThresholdTable.load(write(tmp_path, data))


def test_bad_targets(tmp_path: Path) -> None:
    data = good()
    data["targets"] = [0.05, *TARGETS[1:]]
    with pytest.raises(ConfigError, match="targets must start at 0 and increase"):
        ThresholdTable.load(write(tmp_path, data))
    data["targets"] = list(TARGETS[::-1])
    with pytest.raises(ConfigError, match="targets must start at 0 and increase"):
        ThresholdTable.load(write(tmp_path, data))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("thresholds"),
        lambda d: d.pop("model"),
        lambda d: d.__setitem__("thresholds", {"layer0": {"1": row(0.01)}}),
        lambda d: d.__setitem__("thresholds", {"0": {"1": ["a"] * len(TARGETS)}}),
        lambda d: d.__setitem__("thresholds", [1, 2]),
        lambda d: d.__setitem__("targets", 5),
    ],
)
def test_malformed(tmp_path: Path, change: Any) -> None:
    data = good()
    change(data)
    with pytest.raises(ConfigError, match=r"t\.json: malformed sparsity table"):
        ThresholdTable.load(write(tmp_path, data))


# --- check_model ---------------------------------------------------------------------------------


def test_check_model_accepts_the_same_model() -> None:
    table = make_table()
    table.check_model(dict(IDENTITY), "t.json")
    table.check_model({**IDENTITY, "moe_layers": (0, 1), "path": "/elsewhere"}, "t.json")  # tuple; path not checked


@pytest.mark.parametrize(
    ("key", "value"),
    [("fingerprint", "00" * 32), ("hidden_size", 64), ("moe_intermediate", 32), ("num_experts", 8),
     ("moe_layers", [1, 2]), ("family", "mixtral")],
)  # fmt: skip
def test_check_model_refuses_another_model(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"t\.json: sparsity table was calibrated for another model \({key} is"):
        make_table().check_model({**IDENTITY, key: value}, "t.json")
