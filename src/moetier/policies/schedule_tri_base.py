"""The three-domain scheduler protocol (TriMoE paper 4.2, eq. 1-7): which domain computes each routed expert
of one MoE layer call on a GPU + AMX CPU + DIMM-NDP machine, and the cost model every such scheduler shares.

Three compute domains: the GPU (Domain.ACCEL), the AMX CPU (Domain.HOST) and the DIMM-NDP units
(Domain.NDP: one per DIMM, running in parallel). Every routed expert of the call is a `TriExpert`
whose parts the caller priced with its cost model (sim/ndp.py); this module composes them:

- eq. 1  GPU hit (resident in HBM):  f_calc_gpu(L)
- eq. 2  GPU miss:                   max(f_calc_gpu(L), T_PCIe, T_DRAM(W, M))
- eq. 3  CPU:                        max(f_calc_cpu(L), T_DRAM(W, M))
- eq. 4  NDP:                        max(f_calc_ndp(L), T_Internal(W)); only for a LOCALISED expert,
                                     and only on its home DIMM
T_DRAM(W, M) is the host read of its weights under its layout M (`dram_read_s`): striped, W at the full
host bandwidth B; localised, W at "single-DIMM bandwidth": the DIMM's channel, B / channels (sim/ndp.py passes
Table 1's 8 channels: 38.4 GB/s, not B / D = 19.2 GB/s, since a DIMM read alone has its channel).

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

The protocol (`TriScheduler`): one file per scheduler (policies/schedule_*.py), looked up by name in
policies.schedulers.TRI_SCHEDULERS. A scheduler declares its capabilities as data, which the simulator
(sim/tri.py) reads instead of asking which scheduler it is:
- `domains`: the compute domains it uses (with NDP the machine starts from an offline layout that
  localises cold experts on single DIMMs; without it every expert stays striped);
- `prefetches`: hot experts are prefetched into HBM over PCIe, hidden by the attention/dense window;
- `relayouts` / `rebalances`: layout changes (striped <-> localised) / cold-expert migrations between
  DIMMs over the DIMM-Link (both switched off by the simulator's `relayout` setting);
- `pipelines` (optional, False when absent): its schedule takes `window_s`, the PCIe time left free in the
  layer's attention/dense window, to stream weights under it (klotski);
- `refines`: its schedule takes the bottleneck-aware refinement's iteration budget (`max_iters`; the
  simulator passes 0, the greedy start alone, when its `refinement` setting is off).
`schedule(experts, n_dimms, hot, max_iters)` returns a `TriOutcome`: the one `Plan` type every scheduler
returns (tasks in input order, the domain of each, the experts whose weights cross PCIe for this call,
the makespan; no timeline: the three domains run concurrently), with the eq. 5-7 totals of that plan and
of the greedy start, and the refinement moves beside it.

Invariants every three-domain scheduler keeps (tests/policies/test_schedule_tri.py): every expert is
assigned exactly once, to a domain in `domains`; NDP only takes localised experts, on their home DIMM;
plan.makespan == totals.makespan; the outcome is a pure function of (experts, n_dimms, hot, max_iters).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from moetier.policies.schedule_base import finite_time
from moetier.types import Domain, ExpertKey, ExpertTask, Layout, Plan

INF = math.inf
ALL_DOMAINS: frozenset[Domain] = frozenset((Domain.ACCEL, Domain.HOST, Domain.NDP))


def dram_read_s(nbytes: int, layout: Layout, host_bw: float, n_dimms: int, channels: int | None = None) -> float:
    """T_DRAM(W, M): host read time of `nbytes` weights: striped at the full host bandwidth; localised at "single-DIMM
    bandwidth", its channel's rate host_bw / channels (a DIMM read alone has its channel to itself, and never more;
    channels None: one DIMM's share host_bw / n_dimms, as if every DIMM of its channel were read at once)."""
    bad_channels = channels is not None and channels < 1
    if not (finite_time(host_bw) and host_bw > 0) or n_dimms < 1 or nbytes < 0 or bad_channels:
        raise ValueError(f"dram_read_s: need nbytes >= 0, host_bw > 0, n_dimms >= 1, channels >= 1: {nbytes}, "
                         f"{host_bw}, {n_dimms}, {channels}")  # fmt: skip
    ways = n_dimms if channels is None else channels
    return nbytes / host_bw if layout == Layout.STRIPED else nbytes * ways / host_bw


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
class TriOutcome:
    """What a three-domain scheduler returns for one call: the Plan, and the totals the simulator reports."""

    plan: Plan
    totals: DomainTotals  # eq. 5-7 of plan.domains (after any refinement); plan.makespan == totals.makespan
    greedy: DomainTotals  # of the greedy start (the ablation's "+CPU" point); = totals without refinement
    moves: int = 0  # refinement moves made

    @property
    def makespan(self) -> float:
        return self.totals.makespan


class TriScheduler(Protocol):
    """One file per three-domain scheduler, looked up by name in policies.schedulers.TRI_SCHEDULERS; the
    capabilities are read by the simulator (see the module docstring)."""

    name: str
    domains: frozenset[Domain]
    prefetches: bool
    relayouts: bool
    rebalances: bool
    refines: bool

    def schedule(
        self, experts: Sequence[TriExpert], n_dimms: int, hot: frozenset[int], max_iters: int
    ) -> TriOutcome:
        """`hot`: expert ids the load predictor calls hot for this call; `max_iters`: refinement budget (0: none).
        A scheduler that also declares `pipelines = True` takes a keyword `window_s`: the PCIe time free during the
        layer's attention/dense work before this call (Klotski's multi-batch pipeline)."""
        ...


def tri_plan(experts: Sequence[TriExpert], assignment: Sequence[Domain], makespan: float) -> Plan:
    """The Plan of an assignment (one Domain per expert, in order): tasks in input order; `moved`: the
    non-resident experts on the GPU (their weights cross PCIe for this call), in input order."""
    return Plan(
        tasks=tuple([ExpertTask(e.key, e.tokens) for e in experts]),
        domains={e.key: d for e, d in zip(experts, assignment, strict=True)},
        moved=tuple([e.key for e, d in zip(experts, assignment, strict=True) if d is Domain.ACCEL and not e.resident]),
        makespan=makespan,
    )


# Pricing shared by the schedulers: domain codes (0 ACCEL, 1 HOST, 2 NDP) and plain lists, so a 160-expert call
# stays well under 1 ms.
DOMAINS = (Domain.ACCEL, Domain.HOST, Domain.NDP)  # by code
CODE = {d: k for k, d in enumerate(DOMAINS)}
Prices = tuple[list[float], list[float], list[float], list[float], list[int], list[bool]]


def price_paths(experts: Sequence[TriExpert], n_dimms: int, use: tuple[bool, bool, bool], who: str) -> Prices:
    """Checks the call and prices every path: (gpu, cpu, ndp costs (inf where infeasible or not in `use`),
    eq. 6 busy time, home DIMM (-1 striped), resident), one entry per expert."""
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


def greedy_codes(p: Prices, experts: Sequence[TriExpert], who: str) -> list[int]:
    """Each expert to its cheapest priced domain (ties: ACCEL, HOST, NDP); ValueError when none is allowed."""
    g, c, nd = p[0], p[1], p[2]
    out: list[int] = []
    for i in range(len(g)):
        gi, ci, ni = g[i], c[i], nd[i]
        k = (0 if gi <= ni else 2) if gi <= ci else (1 if ci <= ni else 2)
        if (gi, ci, ni)[k] == INF:
            raise ValueError(f"{who}: expert {tuple(experts[i].key)} has no allowed domain (NDP: localised only)")
        out.append(k)
    return out


def sum_totals(p: Prices, assign: Sequence[int], n_dimms: int) -> DomainTotals:
    """Eq. 5-7 of an assignment given as domain codes, summed from scratch."""
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
    p = price_paths(experts, n_dimms, (True, True, True), who)
    codes = []
    for e, d in zip(experts, assignment, strict=True):
        if d not in CODE:
            raise ValueError(f"{who}: unknown domain {d!r} for expert {tuple(e.key)}")
        if d == Domain.NDP and e.layout != Layout.LOCALISED:
            raise ValueError(f"{who}: expert {tuple(e.key)} on NDP needs a localised layout")
        codes.append(CODE[d])
    return sum_totals(p, codes, n_dimms)


def domain_use(domains: Collection[Domain], who: str) -> tuple[bool, bool, bool]:
    """(ACCEL, HOST, NDP) allowed; ValueError naming an unknown domain."""
    bad = [d for d in domains if d not in CODE]
    if bad:
        raise ValueError(f"{who}: unknown domain {bad[0]!r}; domains are accel, host, ndp")
    return Domain.ACCEL in domains, Domain.HOST in domains, Domain.NDP in domains


def greedy_assignment(experts: Sequence[TriExpert], domains: Collection[Domain] = ALL_DOMAINS) -> list[Domain]:
    """Each expert to its cheapest allowed, feasible domain by eq. 1-4 (ties: ACCEL, HOST, NDP)."""
    who = "greedy_assignment"
    n_dimms = max((e.dimm for e in experts), default=-1) + 1
    p = price_paths(experts, n_dimms, domain_use(domains, who), who)
    return [DOMAINS[k] for k in greedy_codes(p, experts, who)]


def hot_order(experts: Sequence[TriExpert], idx: Sequence[int]) -> list[int]:
    """Indices `idx` hottest first: by tokens in this call descending, ties to the input order."""
    return sorted(idx, key=lambda i: (-experts[i].tokens, i))


def hot_split(experts: Sequence[TriExpert], n_dimms: int, other: int, who: str) -> tuple[list[int], DomainTotals]:
    """The "hot experts on the GPU, the rest elsewhere" split that the two-domain baselines share (En-KTransformers:
    `other` = 1, the CPU; MoNDE: `other` = 2, NDP). Shared and resident experts compute on the GPU (eq. 1). Of the
    others, those the other domain cannot take (NDP: striped ones) are loaded on demand to the GPU (eq. 2); the rest,
    hottest first (tokens in this call), are cut at the prefix length k that minimises the eq. 7 makespan: the k
    hottest go to the GPU (on-demand PCIe loads, eq. 2), the others to `other` (eq. 3 or eq. 4). Ties go to the
    smallest k (the least PCIe traffic). O(n log n + n * D). Returns the domain codes and the eq. 5-7 totals."""
    use = (True, other == 1, other == 2)
    p = price_paths(experts, n_dimms, use, who)
    g, c, nd, rd, home, res = p
    alt = c if other == 1 else nd
    assign = [0] * len(experts)
    movable = [i for i in range(len(experts)) if not res[i] and alt[i] < INF]
    for i in movable:
        assign[i] = other
    # start: k = 0 (every movable expert on `other`); then move them to the GPU hottest first
    base = sum_totals(p, assign, n_dimms)
    G, C, loc, S = base.gpu_s, base.cpu_s, list(base.dimm_s), 0.0
    best_k, best_ms = 0, base.makespan
    order = hot_order(experts, movable)
    for k, i in enumerate(order, start=1):
        G += g[i]
        if other == 1:
            C -= c[i]  # its DRAM read stays (GPU miss or CPU): contention unchanged
        else:  # off its home DIMM's NDP, and its home now serves the GPU's host read (eq. 6)
            loc[home[i]] += rd[i] - nd[i]
        ms = max(G, C, max(loc, default=0.0) + S)
        if ms < best_ms * (1 - 1e-12):
            best_k, best_ms = k, ms
    for i in order[:best_k]:
        assign[i] = 0
    return assign, sum_totals(p, assign, n_dimms)


__all__ = [
    "ALL_DOMAINS", "CODE", "DOMAINS", "INF", "DomainTotals", "Prices", "TriExpert", "TriOutcome", "TriScheduler",
    "domain_totals", "domain_use", "dram_read_s", "greedy_assignment", "greedy_codes", "hot_order", "hot_split",
    "price_paths", "sum_totals",
    "tri_plan",
]  # fmt: skip
