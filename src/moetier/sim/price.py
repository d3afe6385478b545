"""Memoised pricing of layer calls for the simulator.

`CostModel.work` prices each expert of a call independently, so the ExpertWork of one routed
expert depends only on (layer, expert, tokens, cached) and that of the shared experts only on
(layer, tokens). A replay of a thousand decode steps asks for the same few thousand items over
and over; `Pricer.work` builds each one once through CostModel.work and reuses the frozen
objects. Invariant: `Pricer.work(...)` == `CostModel.work(...)` for the same arguments.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from moetier.policies.costmodel import CostModel
from moetier.policies.schedule_base import ExpertWork
from moetier.types import ExpertKey


class Pricer:
    def __init__(self, cm: CostModel, fast: str, slow: str | None, link: str) -> None:
        self.cm, self.fast, self.slow, self.link = cm, fast, slow, link
        self._routed: dict[tuple[int, int, int, bool], ExpertWork] = {}
        self._shared: dict[tuple[int, int], list[ExpertWork]] = {}

    def work(
        self, layer: int, token_counts: Mapping[int, int], cached: Collection[ExpertKey], shared_tokens: int = 0
    ) -> list[ExpertWork]:
        out: list[ExpertWork] = []
        for e in sorted(token_counts):
            n = token_counts[e]
            if n == 0:
                continue
            hit = ExpertKey(layer, e) in cached
            w = self._routed.get((layer, e, n, hit))
            if w is None:
                w = self.cm.work(layer, {e: n}, {ExpertKey(layer, e)} if hit else (), self.fast, self.slow,
                                 self.link)[0]  # fmt: skip
                if len(self._routed) < 1_000_000:
                    self._routed[(layer, e, n, hit)] = w
            out.append(w)
        if shared_tokens > 0:
            sh = self._shared.get((layer, shared_tokens))
            if sh is None:
                sh = self.cm.work(layer, {}, (), self.fast, self.slow, self.link, shared_tokens=shared_tokens)
                self._shared[(layer, shared_tokens)] = sh
            out.extend(sh)
        return out
