"""Expert prediction for prefetching in the simulator: which predictor (`PREDICTORS`) and the oracle's noise.

The engine predicts the next layers' experts either by applying their routers to the current hidden
state (HybriMoE IV-C; `--prefetch-predictor gate`, its default, on a family row's own blocks only) or
with the simulator's default predictor below (`--prefetch-predictor history`; the only one on
transformers' own MoE blocks, the experts seam, whose routers stay in transformers' code). The
simulator has no hidden states. Its default predictor, "history"
(policies/route_history.py), learns online from the routing replayed so far (the warm-up window
first) and is scored per distance. The "oracle" predictor, kept as an explicit option for
sensitivity studies, takes the trace's actual future routing and degrades it to a configured
accuracy per distance: each actually routed expert is
kept with probability `accuracy[d-1]` (d = 1..3 MoE layers ahead), else replaced by an expert that
was not routed (carrying the same token count). Precision of the prediction is therefore
`accuracy` in expectation.

Invariants: deterministic for a given numpy Generator; a prediction never holds more experts than
the actual routing, and a swapped-in expert is one the call did not route (same token count).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from moetier.errors import ConfigError

PREDICTORS = ("history", "oracle")

# Assumed router-reuse accuracy at 1, 2, 3 MoE layers ahead. The HybriMoE paper reports none;
# this is an assumption in the range other predictors report (TriMoE's load predictor: > 78%).
DEFAULT_ACCURACY: tuple[float, ...] = (0.85, 0.75, 0.65)


def check_accuracy(accuracy: tuple[float, ...], depth: int) -> None:
    if not 0 <= depth <= 3:
        raise ConfigError(f"prefetch depth must be in 0..3 MoE layers, got {depth}")
    if len(accuracy) < depth:
        raise ConfigError(f"prefetch accuracy needs a value per distance 1..{depth}, got {list(accuracy)}")
    bad = [a for a in accuracy if not 0.0 <= a <= 1.0]
    if bad:
        raise ConfigError(f"prefetch accuracy values must be in [0, 1], got {bad}")


def degrade(
    actual: Mapping[int, int],
    accuracy: float,
    num_experts: int,
    rng: np.random.Generator,
    scores: np.ndarray | None = None,
) -> dict[int, int]:
    """A predicted {expert: tokens} from the actual one: each kept with probability `accuracy`,
    else swapped for a not-routed expert (dropped when every expert was routed). With the call's
    router scores [E] a swap-in is drawn in proportion to its score (a predictor's errors are the
    near-misses just below the top-k), else uniformly."""
    if accuracy >= 1.0 or not actual:
        return dict(actual)
    ids = list(actual)
    keep = (rng.random(len(ids)) < accuracy).tolist()  # [n]
    if all(keep):
        return dict(actual)
    pred = {e: actual[e] for e, k in zip(ids, keep, strict=True) if k}
    lost = [e for e, k in zip(ids, keep, strict=True) if not k]
    free = num_experts - len(actual)
    if free <= 0:
        return pred
    # Gumbel top-m: sampling without replacement in proportion to exp(key) = score (uniform without scores)
    w = np.zeros(num_experts) if scores is None else np.asarray(scores, dtype=np.float64)  # [E]
    key = np.log(np.maximum(w, 1e-12)) + rng.gumbel(size=num_experts)  # [E]
    key[ids] = -np.inf
    m = min(len(lost), free)  # 1 <= m <= free < num_experts
    repl = np.argpartition(-key, m - 1)[:m]  # [m]
    for e_new, e_old in zip(repl.tolist(), lost, strict=False):
        pred[int(e_new)] = actual[e_old]
    return pred
