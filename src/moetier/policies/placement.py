"""Initial fast-tier placements: which experts the fast tier holds before the first layer call.

A scheduler names its placement (`Scheduler.placement`); the simulator and the engine look it up
in PLACEMENTS and warm their cache with the returned keys, in order, up to its capacity:
- "frequency": the experts with the most tokens in a warm-up window (kTransformers, Fiddler; also
  the start of the dynamic caches), hottest first across all layers; ties, and experts never seen,
  in (expert, layer) order so that a partly filled remainder spreads over the layers;
- "layers": whole MoE layers (llama.cpp's -ngl): as many complete layers as fit, the LAST layers
  first, as llama.cpp does (src/llama-model.cpp: layers il >= n_layer + 1 - n_gpu_layers go to the
  GPU); `from_end=False` takes the first layers. Capacity left over by a partial layer stays unused.

Invariants: the result has no duplicates, at most `capacity` keys, only keys of `layers` x
[0, num_experts); bad arguments raise ConfigError naming them. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from moetier.errors import ConfigError
from moetier.types import ExpertKey


def _check(layers: Sequence[int], num_experts: int, capacity: int) -> None:
    if num_experts <= 0:
        raise ConfigError(f"placement: num_experts must be > 0, got {num_experts}")
    if capacity < 0:
        raise ConfigError(f"placement: capacity must be >= 0 experts, got {capacity}")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"placement: layers must be distinct, got {list(layers)}")


def count_tokens(calls: Iterable[Any]) -> dict[ExpertKey, int]:
    """Tokens per expert over a warm-up window: `calls` are objects with `.layer` and `.ids` [T, k]
    (traces.iter_calls' Call, or anything shaped like it)."""
    out: dict[ExpertKey, int] = {}
    for call in calls:
        ids = np.asarray(call.ids)  # [T, k]
        if ids.ndim != 2:
            raise ConfigError(f"placement: call of layer {call.layer} has ids of shape {ids.shape}, expected [T, k]")
        experts, counts = np.unique(ids, return_counts=True)  # [U], [U]
        for e, c in zip(experts.tolist(), counts.tolist(), strict=True):
            key = ExpertKey(int(call.layer), int(e))
            out[key] = out.get(key, 0) + int(c)
    return out


def by_frequency(
    layers: Sequence[int], num_experts: int, capacity: int, counts: Mapping[ExpertKey, int] | None = None
) -> list[ExpertKey]:
    """The `capacity` experts with the most tokens in `counts`, hottest first (see the module docstring)."""
    _check(layers, num_experts, capacity)
    counts = counts or {}
    keys = [ExpertKey(lay, e) for lay in layers for e in range(num_experts)]
    keys.sort(key=lambda k: (-counts.get(k, 0), k.expert, k.layer))
    return keys[:capacity]


def by_layers(
    layers: Sequence[int],
    num_experts: int,
    capacity: int,
    counts: Mapping[ExpertKey, int] | None = None,
    from_end: bool = True,
) -> list[ExpertKey]:
    """Whole layers, llama.cpp style: floor(capacity / num_experts) layers, the last ones first (`counts` unused)."""
    _check(layers, num_experts, capacity)
    n = min(len(layers), capacity // num_experts)
    chosen = sorted(layers, reverse=from_end)[:n]
    return [ExpertKey(lay, e) for lay in chosen for e in range(num_experts)]


PLACEMENTS: dict[str, Callable[..., list[ExpertKey]]] = {
    "frequency": by_frequency,
    "layers": by_layers,
}


def initial_placement(
    name: str, layers: Sequence[int], num_experts: int, capacity: int, counts: Mapping[ExpertKey, int] | None = None
) -> list[ExpertKey]:
    """The placement `name` (a Scheduler's `placement`), preferred keys first."""
    try:
        fn = PLACEMENTS[name]
    except KeyError:
        raise ConfigError(f"unknown placement {name!r}; known: {', '.join(PLACEMENTS)}") from None
    return fn(layers, num_experts, capacity, counts)
