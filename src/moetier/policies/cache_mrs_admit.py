"""MRS with admission control: score-ranked eviction that keeps a stable set under batched decode.

Why (issue 29): with B sequences decoding together, one layer call routes to the union of B tokens' top-k
experts (8 clients, top-4 of 32 on the bundled model: about 16 of the layer's 32). A recency policy evicts
the previous layers' experts to make room for them, so with a cache of 25% of all experts every expert is
gone before the next step comes back to its layer: LRU hits 0.0% on 8-client replays of the bundled traces
(0.39% in the serving soak) against 46-48% for one sequence. A popularity ranking alone (LFU 26%, MRS 27-29%)
keeps more, but every miss still takes a cached slot: the call's misses push out the stable experts.

What this policy adds to MRS (cache_mrs.py, unchanged ranking: S <- alpha * TopP(s) + (1 - alpha) * S):
- **admission**: a demand miss is loaded into one of `transient_slots` reserved slots of the pool; once it
  is written the store asks `admit(key, victim)`: with S(key) >= S(victim) (the victim being the lowest
  ranked evictable resident) the victim is evicted and its slot becomes the transient one (the miss is now
  cached); otherwise the miss is computed from the transient slot and dropped when its last pin goes (a
  bypass), and nothing resident is evicted for it;
- **small pin groups**: the store lets one `acquire_many` pin at most `transient_slots` experts
  (`ExpertStore.pin_limit`), so a call's experts are computed in groups whose misses always fit the
  transient slots (the native executor sums groups in fp32: the same bits).

The budget is unchanged: the transient slots are slots of the same pool (`ExpertStore` invariants).

Measured (scratch replays that model the store exactly: pin groups, transient slots; 199-step bundled traces
with router scores; 8 clients = 8 offsets of one trace decoding together; cache of 25% of the experts, of
which `transient_slots` = 2 transient; hit rates in %):

    trace            1 seq: LRU  MRS   mrs-admit     8 clients: LRU  LFU   MRS   mrs-admit
    macbeth-ross            48.3 56.1  55.7                     0.0  25.9  28.9  44.0
    twelfth-night           47.7 56.5  56.2                     0.0  26.9  28.3  43.1

transient_slots 1 / 2 / 4 / 8 at 8 clients (macbeth-ross): 45.5 / 44.0 / 41.3 / 35.8: every reserved slot is one
fewer cached; 2 is the default because each pin group is one native call (1 would be one call per expert).

Invariants: the ranking and the victim are MRS's (the victim is always a candidate); `admit` is a pure
comparison of two S values (True on a tie: the newer expert wins, as in LRU); `transient_slots` >= 1.
No torch.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from moetier.errors import ConfigError
from moetier.policies.cache_mrs import MRSPolicy

TRANSIENT_SLOTS_DEFAULT = 2


class MRSAdmitPolicy(MRSPolicy):
    def __init__(
        self,
        top_k: int | None = None,
        alpha: float | None = None,
        top_p: int | None = None,
        normalize: bool = False,
        transient_slots: int = TRANSIENT_SLOTS_DEFAULT,
    ) -> None:
        super().__init__(top_k=top_k, alpha=alpha, top_p=top_p, normalize=normalize)
        if isinstance(transient_slots, bool) or not isinstance(transient_slots, int) or transient_slots < 1:
            raise ConfigError(f"mrs-admit transient_slots must be an int >= 1, got {transient_slots!r}")
        self.transient_slots = transient_slots  # declared: the store reserves this many bypass slots

    @property
    def options(self) -> dict[str, Any]:
        return super().options | {"transient_slots": self.transient_slots}

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        """Whether the freshly loaded `key` may take `victim`'s place in the cache (else it is bypassed)."""
        return self.score(key) >= self.score(victim)
