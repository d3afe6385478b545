"""A layer call's misses read together: ExpertStore.acquire_many hands every miss that needs no waiting to
`source.read_many` in one call (their disk reads in flight at once, formats/diskio.py), then registers and pins
them as one-at-a-time loads would. With or without a DiskIO the experts hold the checkpoint's values, the counters
add up, and a failed read of one expert fails the call with its ExpertReadError while leaving no half-written slot
and the others registered (unpinned)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fault_inject import eio_on
from moetier.errors import ExpertReadError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.diskio import DiskIO
from moetier.formats.layout import ExpertLayout
from moetier.formats.safetensors import ExpertReader
from moetier.models.open import read_config
from moetier.store.source import FullSource
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey

CPU = torch.device("cpu")
K = ExpertKey


def make(path: Path, slots: int, direct: bool | None) -> ExpertStore:
    """An ExpertStore on the tiny qwen3_moe checkpoint (2 MoE layers x 6 experts), `slots` host slots; its reader
    reads through DiskIO(direct) (None: the plain one-at-a-time reader)."""
    config, family = read_config(path)
    layout = ExpertLayout(int(config.hidden_size), int(config.moe_intermediate_size), False)
    prefixes = {layer: f"model.layers.{layer}.mlp." for layer in (0, 1)}
    reader = ExpertReader(CheckpointIndex(path), family.sources, layout, prefixes, 6, torch.float32)
    if direct is not None:
        reader.set_io(DiskIO(direct=direct, depth=3))
    src = FullSource(reader, torch.float32)
    return ExpertStore(src, list(reader.plans), CPU, slots * src.slot_bytes + src.staging_bytes, None)


def spy(store: ExpertStore) -> list[list[ExpertKey]]:
    """The keys of every read_many call of the store's source, recorded."""
    calls: list[list[ExpertKey]] = []
    src: Any = store.source
    real = src.read_many

    def read_many(items: list[tuple[ExpertKey, Any]]) -> list[Any]:
        calls.append([k for k, _ in items])
        return real(items)

    src.read_many = read_many
    return calls


@pytest.mark.parametrize("direct", [None, True, False])
def test_misses_are_read_together_and_exact(
    tiny_ckpt: Callable[..., Path], canonical_experts: Callable[..., Any], direct: bool | None
) -> None:
    path = tiny_ckpt("qwen3_moe")
    want = canonical_experts("qwen3_moe")
    store = make(path, slots=4, direct=direct)
    calls = spy(store)
    try:
        store.acquire(K(0, 5))
        store.release(K(0, 5))
        keys = [K(1, 0), K(0, 5), K(1, 3), K(0, 2)]  # one hit, three misses
        views = store.acquire_many(keys)
        assert calls == [[K(1, 0), K(1, 3), K(0, 2)]]
        for key, v in zip(keys, views, strict=True):
            for piece, t in want[(key.layer, key.expert)].items():
                assert torch.equal(v.pieces[piece].float(), t), (key, piece)
        st = store.compute
        assert st.misses == 4 and st.hits == 1 and all(st.pins[k] == 1 for k in keys)
        store.release_many(keys)
        # a full pool: the next call's misses evict the unpinned ones and are read together again
        nxt = [K(1, 1), K(1, 2), K(0, 0)]
        views = store.acquire_many(nxt)
        assert calls[-1] == nxt and len(st.slots) == 4 and st.evictions == 3
        for key, v in zip(nxt, views, strict=True):
            assert torch.equal(v.pieces["down"].float(), want[(key.layer, key.expert)]["down"])
        store.release_many(nxt)
        assert store.stats()["disk_bytes"] == 7 * store.slot_bytes
    finally:
        store.close()


@pytest.mark.parametrize("direct", [None, True])
def test_a_failed_read_in_a_batch_fails_only_its_expert(tiny_ckpt: Callable[..., Path], direct: bool | None) -> None:
    path = tiny_ckpt("qwen3_moe")
    store = make(path, slots=4, direct=direct)
    try:
        bad, good = K(1, 4), [K(0, 1), K(1, 2)]
        with eio_on(store.source.reader, bad), pytest.raises(ExpertReadError) as err:
            store.acquire_many([good[0], bad, good[1]])
        assert err.value.key == bad and "model.safetensors" in str(err.value)
        assert f"expert {bad.expert} of layer {bad.layer}" in str(err.value)
        st = store.compute
        assert bad not in st.slots and not st.pins and set(good) <= set(st.slots)
        assert len(st.free) + len(st.slots) == st.pool.n_slots and store.faults.count == 1
        views = store.acquire_many([bad, *good])  # readable again: loads, the others hit
        assert len(views) == 3 and st.hits == 2
        store.release_many([bad, *good])
    finally:
        store.close()
