"""serve/metrics.py: each limit figure is read from the one store WORKER_FIGURES declares for it (the server
counters or the runner's stats), never searched for in other sections of a snapshot; the generation rate counts
the tokens of the last RATE_WINDOW_S seconds of its clock (a fake one here); no engine needed."""

from __future__ import annotations

from typing import Any

import pytest

from moetier.serve.metrics import RATE_WINDOW_S, WORKER_FIGURES, ServerMetrics, render, worker_figures
from serve.conftest import FakeClock

LIMIT_LINES = {  # figure -> its /metrics name
    "queue_timeouts": "moetier_queue_timeouts_total",
    "request_timeouts": "moetier_request_timeouts_total",
    "sequence_errors": "moetier_sequence_errors_total",
    "kv_waiting": "moetier_kv_waiting",
    "kv_reserved_bytes": "moetier_kv_reserved_bytes",
    "kv_budget_bytes": "moetier_kv_budget_bytes",
}


def _value(text: str, name: str) -> float:
    [line] = [ln for ln in text.splitlines() if ln.startswith(f"{name} ")]
    return float(line.split()[1])


def test_every_limit_figure_has_one_declared_store_and_a_line() -> None:
    assert set(WORKER_FIGURES) == set(LIMIT_LINES)
    assert set(WORKER_FIGURES.values()) == {"server", "runner"}
    text = render(ServerMetrics(), {}, 0, 0)
    for figure, name in LIMIT_LINES.items():
        assert _value(text, name) == 0, figure  # no snapshot yet, nothing counted: 0, not a missing line


def test_figures_come_from_their_store_only() -> None:
    metrics = ServerMetrics()
    metrics.count("queue_timeouts", 2)
    metrics.count("request_timeouts", 3)
    metrics.count("kv_waiting", 99)  # a server counter of a runner figure's name is not read
    runner = {"sequence_errors": 4, "kv_waiting": 1, "kv_reserved_bytes": 4096, "kv_budget_bytes": 8192,
              "queue_timeouts": 77}  # a runner figure of a server counter's name is not read  # fmt: skip
    decoy = dict.fromkeys(WORKER_FIGURES, 1000)  # neither the snapshot's worker section nor its top level
    snap: dict[str, Any] = {"runner": runner, "worker": decoy} | decoy
    want = {"queue_timeouts": 2, "request_timeouts": 3, "sequence_errors": 4, "kv_waiting": 1,
            "kv_reserved_bytes": 4096, "kv_budget_bytes": 8192}  # fmt: skip
    assert worker_figures(metrics.events_now(), runner) == want
    text = render(metrics, snap, 0, 0)
    for figure, name in LIMIT_LINES.items():
        assert _value(text, name) == want[figure], figure


def test_generation_rate_counts_the_last_window() -> None:
    clock = FakeClock()
    metrics = ServerMetrics(clock)
    assert metrics.tokens_per_s() == 0.0  # nothing yet, no time passed: no division by zero
    clock.advance(2.0)
    metrics.add_tokens(6)
    assert metrics.tokens_per_s() == pytest.approx(3.0)  # the server is 2 s old: 6 tokens over 2 s
    clock.advance(RATE_WINDOW_S)  # 12 s old: the window is the last 10 s, the 6 tokens are 10 s old (still in)
    metrics.add_tokens(4)
    assert metrics.tokens_per_s() == pytest.approx(10 / RATE_WINDOW_S)
    clock.advance(0.5)  # the first 6 are past the window now
    assert metrics.tokens_per_s() == pytest.approx(4 / RATE_WINDOW_S)
    assert _value(render(metrics, {}, 0, 0), "moetier_generation_tokens_per_second") == pytest.approx(0.4)
    clock.advance(RATE_WINDOW_S)
    assert metrics.tokens_per_s() == 0.0 and metrics.completion_tokens == 10  # the rate forgets, the counter does not
