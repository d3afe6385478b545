"""Planning one MoE layer call: which experts, in which order, on which domain.

Pure function over plain data. Resident experts go first so that the misses' loads
(which may evict) never evict an expert this layer still needs before it runs; then
misses in expert order. With a single slot this still works: each miss is loaded,
computed and becomes evictable before the next one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from moetier.policies.sparsity import call_sparse
from moetier.types import Domain, ExpertKey, ExpertTask, Plan


def plan_layer(
    layer: int,
    token_counts: Mapping[int, int],
    resident: Collection[ExpertKey],
    domain: Domain = Domain.HOST,
    sparsity: float = 0.0,
    tipping: int = 0,
) -> Plan:
    """token_counts: expert id -> number of tokens routed to it in this call (> 0). With a
    sparsity target, every task carries it when the call's mean tokens per expert is below `tipping`
    (`call_sparse`: the whole call on the gather path, or none of it)."""
    keys = [ExpertKey(layer, e) for e in sorted(token_counts)]
    hits = [k for k in keys if k in resident]
    misses = [k for k in keys if k not in resident]
    target = sparsity if sparsity > 0 and call_sparse(token_counts.values(), tipping) else 0.0
    tasks = tuple(ExpertTask(key=k, tokens=token_counts[k.expert], sparsity=target) for k in hits + misses)
    return Plan(tasks, dict.fromkeys((t.key for t in tasks), domain))
