"""TriMoE's bottleneck-aware greedy makespan schedule of one MoE layer call (paper 4.2).

Three compute domains: the GPU (Domain.ACCEL), the AMX CPU (Domain.HOST) and the DIMM-NDP units
(Domain.NDP: one per DIMM, running in parallel). Every routed expert of the call is a `TriExpert`
whose parts the caller priced with its cost model / lookup tables; this module composes them:

- eq. 1  GPU hit (resident in HBM):  f_calc_gpu(L)
- eq. 2  GPU miss:                   max(f_calc_gpu(L), T_PCIe, T_DRAM(W, M))
- eq. 3  CPU:                        max(f_calc_cpu(L), T_DRAM(W, M))
- eq. 4  NDP:                        max(f_calc_ndp(L), T_Internal(W)); only for a LOCALISED expert,
                                     and only on its home DIMM
T_DRAM(W, M) is the host read of its weights under its layout M (`dram_read_s`): striped, W at the full
host bandwidth B; localised, W at one DIMM's share B / D.

Totals (eq. 5-7), `domain_totals`:
- GPU, CPU: serial sums of their experts' costs (eq. 5);
- DIMM d: T_DIMM(d) = sum of the eq. 4 costs of the experts on NDP d + T_contention^d (eq. 6);
- makespan = max(GPU, CPU, max_d T_DIMM(d)) (eq. 7; 0 for an empty call).
T_contention^d, our reading of eq. 6 ("the accumulated DRAM access latency caused by striped or localized
weight reads from the host processors targeting DIMM d"): every expert that a host processor reads from
DRAM (each expert on the CPU, and each non-resident expert on the GPU) keeps every DIMM it touches busy
for its `busy_s` (a striped expert touches all D DIMMs, a localised one only its home DIMM). The caller
prices busy_s (sim/ndp.py: the DRAM-array time of the bytes read from that DIMM, or, in its "channel"
mode, the whole channel transfer); left None it is T_DRAM, the "channel" reading. A resident GPU expert and
an NDP expert add nothing (NDP reads go through the internal bandwidth, already in eq. 4).

Phase 1, greedy start (paper: "estimate the execution cost of any expert E_i on all possible paths and
select the most suitable one"): each expert to its cheapest allowed, feasible domain by eq. 1-4 alone;
cost ties go ACCEL, then HOST, then NDP.
Phase 2, bottleneck-aware refinement (paper, word for word where it is explicit): the bottleneck device is
the one with the largest total (GPU, CPU or one DIMM; ties: GPU, CPU, then the lowest DIMM). Its costliest
expert (by its cost on that device; ties: first in input order) is the candidate; each move to one of the
other two domains (allowed and feasible) is priced by the exact new makespan (eq. 5-7, contention
included); the lowest wins, ties (within a relative 1e-12) go to the smallest increase of the receiving
device's total (the home DIMM's T_DIMM for NDP), then ACCEL, HOST, NDP. The move is made only if it lowers
the makespan (by more than a relative 1e-12); otherwise, when the bottleneck device has no expert (a DIMM
busy with contention only), or after `max_iters` moves, refinement stops. The paper names no further
candidate when the costliest expert cannot move, so neither do we.

Invariants (tests/policies/test_schedule_trimoe.py): every expert is assigned exactly once; NDP only
takes localised experts, on their home DIMM; the result's totals are recomputed from scratch (eq. 5-7)
and its makespan is their max; refinement never raises the makespan, so it is never above the greedy
start's; the result is a pure function of (experts, n_dimms, max_iters, domains).
Cost: O(n log n + moves * (log n + D)) -- heaps of candidates per device, totals updated per move.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from moetier.policies.schedule_base import finite_time
from moetier.types import Domain, ExpertKey, Layout

INF = math.inf
REL = 1e-12  # relative tolerance for "lower makespan" and "same makespan"
MAX_ITERS = 512
ALL_DOMAINS: frozenset[Domain] = frozenset((Domain.ACCEL, Domain.HOST, Domain.NDP))
_ORDER = {Domain.ACCEL: 0, Domain.HOST: 1, Domain.NDP: 2}


def dram_read_s(nbytes: int, layout: Layout, host_bw: float, n_dimms: int) -> float:
    """T_DRAM(W, M): host read time of `nbytes` weights: striped at the full host bandwidth, localised at one
    DIMM's share of it (host_bw / n_dimms)."""
    if not (finite_time(host_bw) and host_bw > 0) or n_dimms < 1 or nbytes < 0:
        raise ValueError(f"dram_read_s: need nbytes >= 0, host_bw > 0, n_dimms >= 1: {nbytes}, {host_bw}, {n_dimms}")
    return nbytes / host_bw if layout == Layout.STRIPED else nbytes * n_dimms / host_bw


@dataclass(frozen=True)
class TriExpert:
    """One routed (or shared: negative id, resident) expert of one layer call, its cost parts priced (seconds)."""

    key: ExpertKey
    tokens: int  # L_i, tokens routed to it in this call (> 0)
    resident: bool  # weights in GPU HBM: eq. 1, else eq. 2
    layout: Layout  # M_i
    dimm: int  # home DIMM of a localised expert (0 <= dimm < n_dimms); -1 for a striped one
    gpu_calc_s: float  # f_calc_gpu(L_i)
    cpu_calc_s: float  # f_calc_cpu(L_i)
    ndp_calc_s: float  # f_calc_ndp(L_i)
    pcie_s: float  # T_PCIe: its weights host -> GPU
    dram_s: float  # T_DRAM(W_i, M_i): host read of its weights under its layout (dram_read_s)
    internal_s: float  # T_Internal(W_i): its weights at its DIMM's internal bandwidth
    busy_s: float | None = None  # eq. 6: how long a host read of it keeps each DIMM it touches busy; None: dram_s

    def __post_init__(self) -> None:
        k = tuple(self.key)
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"TriExpert {k}: tokens must be an int > 0, got {self.tokens!r}")
        if not isinstance(self.resident, bool):
            raise ValueError(f"TriExpert {k}: resident must be a bool, got {self.resident!r}")
        if not isinstance(self.layout, Layout):
            raise ValueError(f"TriExpert {k}: layout must be a Layout, got {self.layout!r}")
        if isinstance(self.dimm, bool) or not isinstance(self.dimm, int):
            raise ValueError(f"TriExpert {k}: dimm must be an int, got {self.dimm!r}")
        if self.layout == Layout.STRIPED and self.dimm != -1:
            raise ValueError(f"TriExpert {k}: a striped expert has no home DIMM (dimm must be -1), got {self.dimm}")
        if self.layout == Layout.LOCALISED and self.dimm < 0:
            raise ValueError(f"TriExpert {k}: a localised expert needs a home DIMM >= 0, got {self.dimm}")
        for name in ("gpu_calc_s", "cpu_calc_s", "ndp_calc_s", "pcie_s", "dram_s", "internal_s", "busy_s"):
            if name == "busy_s" and self.busy_s is None:
                continue
            if not finite_time(getattr(self, name)):
                raise ValueError(f"TriExpert {k}: {name} must be finite and >= 0, got {getattr(self, name)!r}")

    def gpu_cost(self) -> float:
        """Eq. 1 when resident, else eq. 2."""
        if self.resident:
            return self.gpu_calc_s
        return max(self.gpu_calc_s, self.pcie_s, self.dram_s)

    def cpu_cost(self) -> float:
        """Eq. 3."""
        return max(self.cpu_calc_s, self.dram_s)

    def ndp_cost(self) -> float:
        """Eq. 4 on its home DIMM; inf for a striped expert (not executable on NDP)."""
        if self.layout != Layout.LOCALISED:
            return INF
        return max(self.ndp_calc_s, self.internal_s)


@dataclass(frozen=True)
class DomainTotals:
    """Eq. 5-7 for one assignment."""

    gpu_s: float  # T_total^GPU
    cpu_s: float  # T_total^CPU
    dimm_s: tuple[float, ...]  # T_DIMM(d), contention included
    contention_s: tuple[float, ...]  # T_contention^d
    makespan: float  # max(gpu_s, cpu_s, max(dimm_s))


@dataclass(frozen=True)
class TriSchedule:
    domains: Mapping[ExpertKey, Domain]  # ACCEL, HOST or NDP (on the expert's home DIMM) per expert
    totals: DomainTotals  # after refinement
    greedy: DomainTotals  # of the greedy start (the ablation's "+CPU" point)
    moves: int  # refinement moves made

    @property
    def makespan(self) -> float:
        return self.totals.makespan


# Internals work on domain codes (0 ACCEL, 1 HOST, 2 NDP) and plain lists: a 160-expert call stays well under 1 ms.
_DOMS = (Domain.ACCEL, Domain.HOST, Domain.NDP)
_CODE = {d: k for k, d in enumerate(_DOMS)}
_Prices = tuple[list[float], list[float], list[float], list[float], list[int], list[bool]]


def _prices(experts: Sequence[TriExpert], n_dimms: int, use: tuple[bool, bool, bool], who: str) -> _Prices:
    """Checks the call and prices every path: (gpu, cpu, ndp costs (inf where infeasible or not in `use`),
    T_DRAM, home DIMM (-1 striped), resident), one entry per expert."""
    if isinstance(n_dimms, bool) or not isinstance(n_dimms, int) or n_dimms < 0:
        raise ValueError(f"{who}: n_dimms must be an int >= 0, got {n_dimms!r}")
    g: list[float] = []
    c: list[float] = []
    nd: list[float] = []
    rd: list[float] = []
    home: list[int] = []
    res: list[bool] = []
    keys: set[ExpertKey] = set()
    for e in experts:
        if not isinstance(e, TriExpert):
            raise ValueError(f"{who}: experts must be TriExpert, got {type(e).__name__}")
        if e.key in keys:
            raise ValueError(f"{who}: expert {tuple(e.key)} appears twice in one layer call")
        keys.add(e.key)
        if e.dimm >= n_dimms:
            raise ValueError(f"{who}: expert {tuple(e.key)} lives on DIMM {e.dimm}, but there are {n_dimms}")
        d = e.dram_s
        g.append((e.gpu_calc_s if e.resident else max(e.gpu_calc_s, e.pcie_s, d)) if use[0] else INF)
        c.append(max(e.cpu_calc_s, d) if use[1] else INF)
        nd.append(max(e.ndp_calc_s, e.internal_s) if use[2] and e.dimm >= 0 else INF)
        rd.append(d if e.busy_s is None else e.busy_s)
        home.append(e.dimm)
        res.append(e.resident)
    return g, c, nd, rd, home, res


def _greedy(p: _Prices, experts: Sequence[TriExpert], who: str) -> list[int]:
    g, c, nd = p[0], p[1], p[2]
    out: list[int] = []
    for i in range(len(g)):
        gi, ci, ni = g[i], c[i], nd[i]
        k = (0 if gi <= ni else 2) if gi <= ci else (1 if ci <= ni else 2)
        if (gi, ci, ni)[k] == INF:
            raise ValueError(f"{who}: expert {tuple(experts[i].key)} has no allowed domain (NDP: localised only)")
        out.append(k)
    return out


def _totals(p: _Prices, assign: Sequence[int], n_dimms: int) -> DomainTotals:
    g, c, nd, rd, home, res = p
    gpu = cpu = striped = 0.0
    ndp = [0.0] * n_dimms
    local = [0.0] * n_dimms
    for i, k in enumerate(assign):
        if k == 0:
            gpu += g[i]
        elif k == 1:
            cpu += c[i]
        else:
            ndp[home[i]] += nd[i]
        if k == 1 or (k == 0 and not res[i]):  # a host processor reads its weights from DRAM
            if home[i] < 0:
                striped += rd[i]
            else:
                local[home[i]] += rd[i]
    cont = tuple([striped + x for x in local])
    dimm = tuple([a + x for a, x in zip(ndp, cont, strict=True)])
    return DomainTotals(gpu, cpu, dimm, cont, max(gpu, cpu, max(dimm, default=0.0)))


def domain_totals(experts: Sequence[TriExpert], assignment: Sequence[Domain], n_dimms: int) -> DomainTotals:
    """Eq. 5-7 of an assignment (one Domain per expert, in order), summed from scratch. ValueError when the
    lengths differ, a domain is unknown or an expert is on NDP without being localised."""
    who = "domain_totals"
    if len(assignment) != len(experts):
        raise ValueError(f"{who}: {len(assignment)} domains for {len(experts)} experts")
    p = _prices(experts, n_dimms, (True, True, True), who)
    codes = []
    for e, d in zip(experts, assignment, strict=True):
        if d not in _CODE:
            raise ValueError(f"{who}: unknown domain {d!r} for expert {tuple(e.key)}")
        if d == Domain.NDP and e.layout != Layout.LOCALISED:
            raise ValueError(f"{who}: expert {tuple(e.key)} on NDP needs a localised layout")
        codes.append(_CODE[d])
    return _totals(p, codes, n_dimms)


def _use(domains: Collection[Domain], who: str) -> tuple[bool, bool, bool]:
    bad = [d for d in domains if d not in _CODE]
    if bad:
        raise ValueError(f"{who}: unknown domain {bad[0]!r}; domains are accel, host, ndp")
    return Domain.ACCEL in domains, Domain.HOST in domains, Domain.NDP in domains


def greedy_assignment(experts: Sequence[TriExpert], domains: Collection[Domain] = ALL_DOMAINS) -> list[Domain]:
    """Phase 1: each expert to its cheapest allowed, feasible domain by eq. 1-4 (ties: ACCEL, HOST, NDP)."""
    who = "greedy_assignment"
    n_dimms = max((e.dimm for e in experts), default=-1) + 1
    p = _prices(experts, n_dimms, _use(domains, who), who)
    return [_DOMS[k] for k in _greedy(p, experts, who)]


def schedule_trimoe(
    experts: Sequence[TriExpert],
    n_dimms: int,
    *,
    max_iters: int = MAX_ITERS,
    domains: Collection[Domain] = ALL_DOMAINS,
) -> TriSchedule:
    """The two-phase schedule of the module docstring. `domains` restricts the domains in use (e.g. the
    GPU-NDP baseline: {ACCEL, NDP}); `max_iters` = 0 gives the greedy start alone."""
    # 1. Check, then per-expert costs on every path (inf where infeasible or not allowed)
    who = "trimoe schedule"
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 0:
        raise ValueError(f"{who}: max_iters must be an int >= 0, got {max_iters!r}")
    p = _prices(experts, n_dimms, _use(domains, who), who)
    g, c, nd, rd, home, res = p
    cost = (g, c, nd)

    # 2. Greedy start and its totals (from scratch)
    assign = _greedy(p, experts, who)
    greedy = _totals(p, assign, n_dimms)

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
            if best is None or ms2 < best[0] - REL * ms or (abs(ms2 - best[0]) <= REL * ms and inc < best[1]):
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
    totals = greedy if moves == 0 else _totals(p, assign, n_dimms)
    return TriSchedule({e.key: _DOMS[assign[i]] for i, e in enumerate(experts)}, totals, greedy, moves)


__all__ = [
    "ALL_DOMAINS",
    "MAX_ITERS",
    "DomainTotals",
    "Layout",
    "TriExpert",
    "TriSchedule",
    "domain_totals",
    "dram_read_s",
    "greedy_assignment",
    "schedule_trimoe",
]
