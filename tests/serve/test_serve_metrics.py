"""serve/metrics.py: each limit figure is read from the one store WORKER_FIGURES declares for it (the server
counters or the runner's stats), never searched for in other sections of a snapshot; no engine needed."""

from __future__ import annotations

from typing import Any

from moetier.serve.metrics import WORKER_FIGURES, ServerMetrics, render, worker_figures

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
