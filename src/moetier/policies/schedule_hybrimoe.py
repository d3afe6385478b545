"""HybriMoE's hybrid CPU-GPU schedule of one MoE layer call (paper IV-B).

Queues (the paper's three priority rules):
- GPU queue: cached experts, high load first; a moved expert joins it, in load order, when its
  transfer ends;
- CPU queue: uncached experts, low load first; when it is empty the CPU takes cached experts
  from the GPU queue, low load first ("steals");
- link: moves the highest-load uncached expert not yet taken (the back of the CPU queue).

Simulation: the three timelines are filled step by step; each step serves the lane that is free
earliest (ties: link, then GPU, then CPU, so a transfer is decided before the CPU could take the
same expert). The GPU computes the highest-load expert it holds (or idles until the next
arrival); the CPU and the link act under the decision rules below.

Decision rules (ours; the paper leaves them implicit in "a simulation ... to determine a
configuration that minimises overall latency", eq. 2: minimise max(CPU time, GPU time)).
`G` is the projected end of the GPU's work. The GPU never idles while it holds work, so G is exact
for the experts assigned so far: G = max(wrk, rel), wrk = GPU ready time + the GPU time of all its
experts, rel = max over moved experts m of (arrival(m) + GPU time of the experts moved from m on),
updated per move as rel <- max(rel, arrival) + fast_s. `C` is the CPU's end if it computes every
uncached expert left, and proj(G, C) the makespan after the CPU steals cached experts, low load
first, while that ends earlier than the GPU (C + slow_s < G; a steal lowers wrk, never rel).
1. Move: the link moves expert e iff proj(G', C - slow_s(e)) < proj(G, C), with G' the GPU end with
   e moved (arrival t_link + move_s(e)): moving must shorten the projected makespan. When it does
   not, the link stops for this call: C and G stay put until the CPU queue is empty (the CPU's
   progress moves t_cpu and C's remainder by the same amount), and lighter experts gain less.
2. CPU takes an uncached expert e (the lightest) unless it would end later on the CPU than a
   lower bound of moving everything left: t_cpu + slow_s(e) > max(G + their fast_s, t_link +
   their move_s + fast_s(e)) (a slow CPU at prefill). Then the CPU leaves all misses to the link.
   (Rule 1 only declines while the CPU takes misses and rule 2 only while the link moves them,
   so every expert is computed.)
3. Steal: with no uncached expert for it, the CPU takes the lowest-load cached expert j still
   queued iff t_cpu + slow_s(j) < G (G counting the misses still to move), else it stops.
Safety net (the paper's "testing different scheduling strategies"): the two extreme strategies,
every miss on the CPU (ktransformers' split) and every miss moved (gpu-lru's timeline), cost
O(n) to price; if one of them has a shorter makespan than the simulation (by more than 1e-9
relative), it is returned, so HybriMoE is never worse than either (a property test checks this).
On random instances the simulation alone is worse than the better extreme in about 0.1% of cases
(the projection lets the CPU steal an expert the GPU has by then started).

Without a slow domain (slow_s None: a CPU-only machine) every miss is moved (gpu-lru's timeline).
Ties in load are broken by position in `work`. Cost: O(n log n) plus the steal projections;
benchmarks/plan_speed.py measures it.

Invariants: those of schedule_base.Scheduler (tests/policies/test_schedulers.py); the schedule is a
pure function of (work, ready);
its makespan is never above both extremes' (the safety net).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from operator import attrgetter

from moetier.policies.schedule_base import ExpertWork, LayerScheduler, moved_timeline
from moetier.policies.schedule_ktransformers import split_timeline
from moetier.types import Domain, ExpertTask, Lane, Op, Plan

INF = float("inf")


def hybrid_timeline(work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
    """The simulation of the module docstring (needs slow_s on every expert), without the safety net."""
    # 1. Plain lists and the queues (ascending load; the GPU pops the end, the CPU reads the front)
    n = len(work)
    tok = [w.tokens for w in work]
    fast = [w.fast_s for w in work]
    slow = [float(w.slow_s) for w in work]  # type: ignore[arg-type]  # check_work: all given
    move = [w.move_s for w in work]
    cached = [w.cached for w in work]
    rank = sorted(range(n), key=lambda i: (tok[i], -i))
    pos = [0] * n
    for r, i in enumerate(rank):
        pos[i] = r
    gq = [i for i in rank if cached[i]]
    cq = [i for i in rank if not cached[i]]
    lo, hi = 0, len(cq) - 1  # CPU takes cq[lo], the link cq[hi]
    tg, tc, tl = ready
    # The GPU never idles while it holds work, so its end is max over release times r of (r + GPU time of the
    # experts released at or after r): wrk covers r = the lane's ready time (all its work), rel the moved experts.
    wrk = tg + sum(fast[i] for i in gq)
    rel = 0.0
    s_left = sum(slow[i] for i in cq)  # CPU time of the uncached experts left
    f_left = sum(fast[i] for i in cq)  # their GPU time
    m_left = sum(move[i] for i in cq)  # their transfer time
    link_open = cpu_open = steal_open = True
    pending: list[tuple[float, int]] = []  # (arrival, index) in link order
    ph = 0
    ops: list[tuple[Lane, int, float, float]] = []
    on_gpu = [False] * n
    done = 0

    def proj(a: float, b: float, c: float) -> float:
        """Makespan once the CPU (ending at c) steals cached experts, low load first, while that ends earlier."""
        for j in gq:
            if cached[j]:
                if c + slow[j] < max(a, b):
                    c += slow[j]
                    b -= fast[j]
                else:
                    break
        return max(a, b, c)

    # 2. Fill the timelines, always serving the lane free earliest (ties: link, GPU, CPU)
    while done < n:
        has_unc = lo <= hi
        a_link = tl if has_unc and link_open else INF
        if gq:
            a_gpu = tg
        elif ph < len(pending):
            a_gpu = pending[ph][0]
            if a_gpu < tg:
                a_gpu = tg
        else:
            a_gpu = INF
        a_cpu = tc if (has_unc and cpu_open) or steal_open else INF
        if a_link <= a_gpu and a_link <= a_cpu:
            if a_link == INF:
                raise RuntimeError("hybrimoe: no lane can make progress (internal error)")
            i = cq[hi]
            arr = tl + move[i]
            g_rel = (rel if rel > arr else arr) + fast[i]
            if cpu_open:  # rule 1
                c = tc + s_left
                if not proj(g_rel, wrk + fast[i], c - slow[i]) < proj(rel, wrk, c):
                    link_open = False
                    continue
            hi -= 1
            s_left -= slow[i]
            f_left -= fast[i]
            m_left -= move[i]
            ops.append(("link", i, tl, arr))
            tl = arr
            rel = g_rel
            wrk += fast[i]
            pending.append((arr, i))
        elif a_gpu <= a_cpu:
            tg = a_gpu
            while ph < len(pending) and pending[ph][0] <= tg:
                bisect.insort(gq, pending[ph][1], key=pos.__getitem__)
                ph += 1
            i = gq.pop()
            e = tg + fast[i]
            ops.append(("gpu", i, tg, e))
            tg = e
            on_gpu[i] = True
            done += 1
        elif has_unc and cpu_open:
            i = cq[lo]
            s = slow[i]
            if link_open:  # rule 2
                lb = tl + m_left + fast[i]
                if wrk + f_left > lb:
                    lb = wrk + f_left
                if tc + s > lb and tc + s > rel:
                    cpu_open = False
                    continue
            lo += 1
            s_left -= s
            f_left -= fast[i]
            m_left -= move[i]
            ops.append(("cpu", i, tc, tc + s))
            tc += s
            done += 1
        else:  # rule 3
            k = next((k for k, j in enumerate(gq) if cached[j]), -1)
            g_end = wrk if cpu_open else wrk + f_left
            if g_end < rel:
                g_end = rel
            if k < 0 or not tc + slow[gq[k]] < g_end:
                steal_open = False
                continue
            j = gq.pop(k)
            wrk -= fast[j]
            ops.append(("cpu", j, tc, tc + slow[j]))
            tc += slow[j]
            done += 1

    # 3. The Plan (makespan: the later of the two compute lanes' last op; 0 when a lane did nothing)
    keys = [w.key for w in work]
    accel, host = Domain.ACCEL, Domain.HOST
    end = max([0.0] + [e for lane, _, _, e in ops if lane != "link"])
    return Plan(
        tasks=tuple([ExpertTask(keys[i], work[i].tokens) for i in range(n)]),
        ops=tuple([Op(lane, keys[i], s, e) for lane, i, s, e in ops]),
        domains={keys[i]: accel if on_gpu[i] else host for i in range(n)},
        moved=tuple([keys[i] for _, i in pending]),
        makespan=end,
    )


def extremes_makespan(work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> tuple[float, float]:
    """Makespans of split_timeline (every miss on the CPU) and moved_timeline (every miss moved), in O(n)
    without building them (equal to the built ones up to rounding: sums may run in another order)."""
    tg, tc, tl = ready
    hits = [w.fast_s for w in work if w.cached]
    misses = sorted((w for w in work if not w.cached), key=attrgetter("tokens"), reverse=True)  # stable
    g = tg + sum(hits) if hits else 0.0
    split = max(g, tc + sum([w.slow_s for w in misses]) if misses else 0.0)  # type: ignore[misc]
    t = tg + sum(hits)
    for w in misses:
        tl += w.move_s
        t = (t if t > tl else tl) + w.fast_s
    return split, (t if misses else g)


class HybriMoEScheduler(LayerScheduler):
    name = "hybrimoe"
    admits = True
    placement = "frequency"
    cache_policy = "mrs"

    def plan(self, work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
        best = hybrid_timeline(work, ready)
        split, all_moved = extremes_makespan(work, ready)
        if min(split, all_moved) < best.makespan * (1 - 1e-9):  # 3. the safety net
            return split_timeline(work, ready) if split <= all_moved else moved_timeline(work, ready)
        return best
