"""TriMoE's bottleneck-aware greedy makespan schedule of one MoE layer call (paper 4.2), and the
schedulers that run it: `trimoe` (all three domains) here, `gpu-ndp` and `monde` in their own files.

Costs and totals (eq. 1-7) are schedule_tri_base's. Two phases:
Phase 1, greedy start (paper: "estimate the execution cost of any expert E_i on all possible paths and
select the most suitable one"): each expert to its cheapest allowed, feasible domain by eq. 1-4 alone;
cost ties go ACCEL, then HOST, then NDP.
Phase 2, bottleneck-aware refinement (paper, word for word where it is explicit): the bottleneck device is
the one with the largest total (GPU, CPU or one DIMM; ties: GPU, CPU, then the lowest DIMM). Its costliest
expert (by its cost on that device; ties: first in input order) is the candidate; each move to one of the
other two domains (allowed and feasible) is priced by the exact new makespan (eq. 5-7, contention
included); the lowest wins, ties (within a relative 1e-12) go to the smallest increase of the receiving
device's total (the home DIMM's T_DIMM for NDP; increases within the same relative 1e-12 are equal), then ACCEL,
HOST, NDP. The move is made only if it lowers
the makespan (by more than a relative 1e-12); otherwise, when the bottleneck device has no expert (a DIMM
busy with contention only), or after `max_iters` moves, refinement stops. The paper names no further
candidate when the costliest expert cannot move, so neither do we.

`TriMoEScheduler` ("trimoe"): all three domains, refinement, hot prefetch, relayout and cold rebalancing over
the DIMM-Link (the simulator's settings may turn the last three off).

Invariants (tests/policies/test_schedule_trimoe.py): every expert is assigned exactly once; NDP only
takes localised experts, on their home DIMM; the result's totals are recomputed from scratch (eq. 5-7)
and its makespan is their max; refinement never raises the makespan, so it is never above the greedy
start's; the result is a pure function of (experts, n_dimms, max_iters, domains).
Cost: O(n log n + moves * (log n + D)) -- heaps of candidates per device, totals updated per move.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence

from moetier.policies.schedule_tri_base import (
    ALL_DOMAINS,
    DOMAINS,
    INF,
    TriExpert,
    TriOutcome,
    domain_use,
    greedy_codes,
    price_paths,
    sum_totals,
    tri_plan,
)
from moetier.types import Domain

REL = 1e-12  # relative tolerance for "lower makespan" and "same makespan"
MAX_ITERS = 512


def schedule_trimoe(
    experts: Sequence[TriExpert],
    n_dimms: int,
    *,
    max_iters: int = MAX_ITERS,
    domains: Collection[Domain] = ALL_DOMAINS,
) -> TriOutcome:
    """The two-phase schedule of the module docstring. `domains` restricts the domains in use (e.g. the
    GPU-NDP baseline: {ACCEL, NDP}); `max_iters` = 0 gives the greedy start alone."""
    # 1. Check, then per-expert costs on every path (inf where infeasible or not allowed)
    who = "trimoe schedule"
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 0:
        raise ValueError(f"{who}: max_iters must be an int >= 0, got {max_iters!r}")
    p = price_paths(experts, n_dimms, domain_use(domains, who), who)
    g, c, nd, rd, home, res = p
    cost = (g, c, nd)

    # 2. Greedy start and its totals (from scratch)
    assign = greedy_codes(p, experts, who)
    greedy = sum_totals(p, assign, n_dimms)

    # 3. Running state: G, C, S (striped contention, on every DIMM), loc[d] (NDP + localised contention);
    #    a max-heap of (-cost there, index) per device (0 GPU, 1 CPU, 2 + d DIMM d), stale entries popped lazily
    G, C = greedy.gpu_s, greedy.cpu_s
    S = 0.0
    loc = [0.0] * n_dimms
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(2 + n_dimms)]
    for i, k in enumerate(assign):
        h = home[i]
        if k == 2:
            loc[h] += nd[i]
        elif k == 1 or not res[i]:
            if h < 0:
                S += rd[i]
            else:
                loc[h] += rd[i]
        heaps[2 + h if k == 2 else k].append((-cost[k][i], i))
    for hp in heaps:
        heapq.heapify(hp)

    # 4. Refinement
    moves = 0
    while moves < max_iters:
        # 4a. the bottleneck device: GPU, CPU, or the busiest DIMM (top1 index, top1 and top2 of loc)
        t1 = t2 = -INF
        d1 = -1
        for d, v in enumerate(loc):
            if v > t1:
                t1, t2, d1 = v, t1, d
            elif v > t2:
                t2 = v
        dmax = t1 + S if n_dimms else 0.0
        ms = max(G, C, dmax)
        dev = 0 if dmax <= G >= C else 1 if dmax <= C else 2 + d1
        hp = heaps[dev]
        want = 2 if dev >= 2 else dev
        while hp and assign[hp[0][1]] != want:
            heapq.heappop(hp)
        if not hp:
            break
        i = hp[0][1]
        src, h = assign[i], home[i]
        r_src = src == 1 or (src == 0 and not res[i])
        # 4b. price each move of i to another allowed, feasible domain: (new makespan, receiver increase, code)
        best: tuple[float, float, int] | None = None
        for dst in (0, 1, 2):
            ci = cost[dst][i]
            if dst == src or ci == INF:
                continue
            dr = rd[i] * ((dst == 1 or (dst == 0 and not res[i])) - r_src)  # change of its DRAM reads
            g2 = G + (ci if dst == 0 else 0.0) - (g[i] if src == 0 else 0.0)
            c2 = C + (ci if dst == 1 else 0.0) - (c[i] if src == 1 else 0.0)
            if h < 0:  # striped: its reads touch every DIMM
                s2, dl = S + dr, 0.0
                dm2 = (t1 + s2) if n_dimms else 0.0
            else:
                s2, dl = S, dr + (ci if dst == 2 else 0.0) - (nd[i] if src == 2 else 0.0)
                dm2 = max(t2 if h == d1 else t1, loc[h] + dl) + s2
            ms2 = max(g2, c2, dm2)
            inc = g2 - G if dst == 0 else c2 - C if dst == 1 else dl
            # ties within REL: the smaller receiver increase, then the lower code (ACCEL, HOST, NDP); the increases
            # are compared within REL too, so equal ones that round apart do not decide (a GPU and a CPU cost equal)
            tol = REL * ms
            if best is None or ms2 < best[0] - tol or (abs(ms2 - best[0]) <= tol and inc < best[1] - tol):
                best = (ms2, inc, dst)
        if best is None or not best[0] < ms - REL * ms:
            break
        # 4c. make the move
        dst = best[2]
        G += (g[i] if dst == 0 else 0.0) - (g[i] if src == 0 else 0.0)
        C += (c[i] if dst == 1 else 0.0) - (c[i] if src == 1 else 0.0)
        dr = rd[i] * ((dst == 1 or (dst == 0 and not res[i])) - r_src)
        if h < 0:
            S += dr
        else:
            loc[h] += dr + (nd[i] if dst == 2 else 0.0) - (nd[i] if src == 2 else 0.0)
        assign[i] = dst
        heapq.heappush(heaps[2 + h if dst == 2 else dst], (-cost[dst][i], i))
        moves += 1

    # 5. The result, totals summed from scratch
    totals = greedy if moves == 0 else sum_totals(p, assign, n_dimms)
    return TriOutcome(tri_plan(experts, [DOMAINS[k] for k in assign], totals.makespan), totals, greedy, moves)


class TriMoEScheduler:
    """TriMoE: all three domains, the two-phase schedule, every background action."""

    name = "trimoe"
    domains: frozenset[Domain] = ALL_DOMAINS
    prefetches = True
    relayouts = True
    rebalances = True
    refines = True

    def schedule(self, experts: Sequence[TriExpert], n_dimms: int, hot: frozenset[int], max_iters: int) -> TriOutcome:
        return schedule_trimoe(experts, n_dimms, max_iters=max_iters if self.refines else 0, domains=self.domains)


__all__ = ["MAX_ITERS", "TriMoEScheduler", "schedule_trimoe"]
