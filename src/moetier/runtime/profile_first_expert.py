"""HybriMoE Fig. 3(e) on this CPU: is the first expert of a layer call slower than the ones after it?

HybriMoE III: "the first expert computation on the CPU is slower, but subsequent tasks are processed faster with
better cache utilization". The cost model's `cpu.first_expert_s` (policies/hwprofile.py; the simulator adds it to
the CPU lane's ready time) is that extra time. `moetier profile` (runtime/profile.py) and
benchmarks/cpu_first_expert.py both measure it here:

1. `position_times`: a layer call computes n experts one after the other (distinct weights, the same tokens each,
   as decode does) through the engine's expert function (kernels/experts.SwiGLU); before each call a buffer
   larger than the last-level cache is read, standing in for the attention and dense work between MoE layers.
   Each expert's wall time is taken separately, per position in the call, over `rounds` calls (after `warmup`
   calls that are not kept); rounds of several token counts are interleaved.
2. `first_expert_estimate` (pure, no clock) turns one token count's timings into the figure and decides whether
   it is recorded. med_j = median over rounds of position j; later = median(med_1 .. med_{n-1});
   diff = med_0 - later (the benchmark's first_expert_s); noise = max_j>=1 |med_j - later|, how far positions
   that should cost the same differ from each other. The rule: first_expert_s = diff when diff > noise (the first
   position's median lies beyond the spread of every later position's), else 0, with the reason (not slower, or
   within noise). With more rounds the medians settle and the noise shrinks, so a real effect is recorded.

Invariants: timings are CPU wall times (no device sync: CPU experts only); nothing process-wide is changed (the
caller sets torch's thread count); at least 3 experts per call, so that later positions have a spread.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moetier.errors import ConfigError
from moetier.kernels.experts import SwiGLU

MIN_EXPERTS = 3  # position 0 and at least two later positions (one later position has no spread)


@dataclass(frozen=True)
class FirstExpert:
    """One token count's timings reduced by the rule in the module docstring (seconds)."""

    medians_s: tuple[float, ...]  # median time of the expert at each position of the call
    later_s: float  # median of positions 1..n-1's medians
    diff_s: float  # medians_s[0] - later_s; may be <= 0
    noise_s: float  # largest |median_j - later_s| over the later positions
    first_expert_s: float  # diff_s when it is beyond the noise, else 0.0
    reason: str  # why first_expert_s is what it is, one sentence

    @property
    def recorded(self) -> bool:
        return self.first_expert_s > 0


def first_expert_estimate(times: Sequence[Sequence[float]]) -> FirstExpert:
    """times[position][round] in seconds -> the FirstExpert figure and decision (see the module docstring)."""
    # 1. check the input: >= MIN_EXPERTS positions, each with >= 1 finite time >= 0
    if len(times) < MIN_EXPERTS:
        raise ConfigError(f"first expert: need timings of >= {MIN_EXPERTS} positions per call, got {len(times)}")
    for j, ts in enumerate(times):
        if not ts:
            raise ConfigError(f"first expert: position {j} has no timings")
        if any(not math.isfinite(t) or t < 0 for t in ts):
            raise ConfigError(f"first expert: position {j} has a time that is not a finite number >= 0: {list(ts)}")
    # 2. medians per position, the later positions' common median and their spread around it
    med = tuple(float(statistics.median(ts)) for ts in times)
    later = float(statistics.median(med[1:]))
    diff = med[0] - later
    noise = max(abs(m - later) for m in med[1:])
    # 3. the rule: recorded only when positive and beyond the spread of the later positions
    us = f"first {med[0] * 1e6:.1f} us, later {later * 1e6:.1f} us, spread +-{noise * 1e6:.1f} us"
    extra = f"the first expert's extra {diff * 1e6:+.1f} us"
    if diff <= 0:
        value, reason = 0.0, f"0: the first expert is not slower ({us})"
    elif diff <= noise:
        value, reason = 0.0, f"0: {extra} is within the later positions' spread ({us})"
    else:
        value, reason = diff, f"recorded: {extra} is beyond the later positions' spread ({us})"
    return FirstExpert(medians_s=med, later_s=later, diff_s=diff, noise_s=noise, first_expert_s=value,
                       reason=reason)  # fmt: skip


def position_times(
    experts: Sequence[Any], hidden: int, counts: Sequence[int], rounds: int, flush_bytes: int, warmup: int = 2
) -> dict[int, list[list[float]]]:  # fmt: skip
    """{tokens: times[position][round]} of each expert of a layer call on the CPU (see the module docstring).
    `experts` are slot views the engine's SwiGLU takes (w13 [2I, H], w2 [H, I], any precision), one per position;
    `counts` the tokens per expert, interleaved round by round; `flush_bytes` the buffer read before each call."""
    # 1. check, then the inputs: bf16 tokens [t, H] per count, the flush buffer
    if len(experts) < MIN_EXPERTS:
        raise ConfigError(f"first expert: need >= {MIN_EXPERTS} experts per call, got {len(experts)}")
    if rounds < 1 or warmup < 0 or flush_bytes < 0 or not counts or min(counts) < 1:
        raise ConfigError(
            f"first expert: need rounds >= 1, warmup >= 0, flush_bytes >= 0 and token counts >= 1, got "
            f"rounds={rounds}, warmup={warmup}, flush_bytes={flush_bytes}, counts={list(counts)}"
        )
    gen = torch.Generator().manual_seed(3)
    xs: Mapping[int, torch.Tensor] = {t: torch.randn(t, hidden, generator=gen).to(torch.bfloat16) for t in counts}
    flush = torch.ones(max(1, flush_bytes // 4), dtype=torch.float32)  # [flush_bytes / 4]
    fn = SwiGLU(F.silu)
    times: dict[int, list[list[float]]] = {t: [[] for _ in experts] for t in counts}
    # 2. interleaved rounds: flush, then the experts one by one, each timed; the first `warmup` rounds dropped
    with torch.inference_mode():
        for r in range(rounds + warmup):
            for t in counts:
                float(flush.sum())
                for j, ex in enumerate(experts):
                    t0 = time.perf_counter()
                    fn(xs[t], ex)
                    dt = time.perf_counter() - t0
                    if r >= warmup:
                        times[t][j].append(dt)
    return times
