"""The Gantt chart of a simulated window (moetier.sim.timeline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier.errors import ConfigError
from moetier.policies.costmodel import load_profile
from moetier.sim import SimConfig, simulate
from moetier.sim.timeline import draw_timeline
from moetier.specs import load_spec
from moetier.studies.synthetic import generate, preset
from moetier.traces import iter_calls


def test_timeline_png_of_a_window(tmp_path: Path) -> None:
    spec = load_spec("qwen2-57b-a14b")
    calls = iter_calls(generate(preset(spec), 3, prompt_len=8))
    cfg = SimConfig(scheduler="hybrimoe", cache_ratio=0.25, prefetch=True, timeline_steps=(0, 2),
                    timeline_layers=(0, 2))  # fmt: skip
    r = simulate(spec, load_profile("a6000-5220r"), calls, cfg)
    ops = r.timeline
    assert ops and {op.step for op in ops} <= {0, 1, 2} and {op.layer for op in ops} <= {0, 1}
    assert {"dense", "expert", "shared"} <= {op.kind for op in ops}
    assert {op.lane for op in ops} <= {"gpu", "cpu", "pcie"}
    assert all(op.end >= op.start for op in ops)
    out = draw_timeline(ops, tmp_path / "sub" / "t.png", "test")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_empty_window_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="window"):
        draw_timeline([], tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
