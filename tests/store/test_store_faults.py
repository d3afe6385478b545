"""Failed expert reads in the stores: EIO injected into one expert's pread, a prefetch (background) read that
fails, the dynamic store's first touch and switch, a quantized tier's read.

Every failure must: raise (or record, in the background) ExpertReadError naming the file and the expert; leave
no half-written slot registered (the key neither resident nor in flight, the slot back on the free list, no
budget used); be counted in the store's `faults` and `stats()["read_errors"]`; leave later reads working, and
the expert itself loadable once its file reads again.
"""

from __future__ import annotations

import errno
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from fault_inject import eio_on
from moetier.errors import CheckpointError, ExpertReadError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.layout import ExpertLayout
from moetier.formats.safetensors import ExpertReader
from moetier.models.open import read_config
from moetier.store.dynamic import DynamicStore
from moetier.store.mover import Mover
from moetier.store.source import FullSource, QuantSource, as_read_error
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey, Move, MoveKind, Precision, Tier

CPU = torch.device("cpu")
K = ExpertKey


def make(path: Path, slots: int) -> ExpertStore:
    """An ExpertStore on the tiny qwen3_moe checkpoint (2 MoE layers x 6 experts) with `slots` host slots."""
    config, family = read_config(path)
    layout = ExpertLayout(int(config.hidden_size), int(config.moe_intermediate_size), False)
    prefixes = {layer: f"model.layers.{layer}.mlp." for layer in (0, 1)}
    reader = ExpertReader(CheckpointIndex(path), family.sources, layout, prefixes, 6, torch.float32)
    src = FullSource(reader, torch.float32)
    return ExpertStore(src, list(reader.plans), CPU, slots * src.slot_bytes + src.staging_bytes, None)


def eio(store: ExpertStore, key: ExpertKey) -> AbstractContextManager[None]:
    """os.preadv fails with EIO on expert `key`'s byte ranges only."""
    return eio_on(store.source.reader, key)


def assert_clean(store: ExpertStore, key: ExpertKey) -> None:
    st = store.compute
    assert key not in st.slots and key not in st.inflight and st.pins[key] == 0
    assert len(st.free) + len(st.slots) + len(st.inflight) == st.pool.n_slots
    assert len(set(st.free)) == len(st.free)


def assert_holds(store: ExpertStore, key: ExpertKey, expected: dict[str, torch.Tensor]) -> None:
    views = store.acquire(key)
    try:
        for piece, want in expected.items():
            assert torch.equal(views.pieces[piece].float(), want), (key, piece)
    finally:
        store.release(key)


def test_demand_read_eio_is_an_expert_read_error_and_registers_nothing(tiny_ckpt, canonical_experts):
    path = tiny_ckpt("qwen3_moe")
    store = make(path, slots=2)
    store.acquire(K(0, 0))
    store.release(K(0, 0))
    bad = K(1, 4)
    with eio(store, bad):
        for attempt in (1, 2):  # the second try reads again: no half-written slot to "hit"
            with pytest.raises(ExpertReadError) as err:
                store.acquire(bad)
            exc = err.value
            assert exc.key == bad and exc.path == str(path / "model.safetensors") and exc.rows == ()
            assert "expert 4 of layer 1" in str(exc) and "model.layers.1.mlp.experts.4." in str(exc)
            assert "Input/output error" in str(exc) and isinstance(exc.__cause__, OSError)
            assert_clean(store, bad)
            assert store.faults.count == attempt and store.stats()["read_errors"] == attempt
            assert store.compute.misses == 1  # a failed load is no miss
        assert_holds(store, K(0, 1), canonical_experts("qwen3_moe")[(0, 1)])  # other experts read fine
    assert_holds(store, bad, canonical_experts("qwen3_moe")[(1, 4)])  # the disk reads again: so does it
    store.close()


def test_failed_prefetch_is_recorded_not_fatal_and_the_key_loads_later(tiny_ckpt, canonical_experts):
    store = make(tiny_ckpt("qwen3_moe"), slots=3)
    bad = K(0, 3)
    with eio(store, bad):
        assert store.prefetch([bad, K(0, 4)]) == [bad, K(0, 4)]
        assert store.drain(5)
        stats = store.prefetch_stats()
        assert stats["failed"] == 1 and "expert 3 of layer 0" in stats["errors"][0]
        assert "model.safetensors" in stats["errors"][0] and "ExpertReadError" in stats["errors"][0]
        assert_clean(store, bad)
        assert store.resident() == {K(0, 4)}  # the other prefetch registered
        assert store.faults.count == 1 and store.faults.last is not None and "Input/output" in store.faults.last
        with pytest.raises(ExpertReadError):  # a forward that needs it tries again, and fails cleanly
            store.acquire(bad)
        assert_clean(store, bad)
        assert_holds(store, K(1, 2), canonical_experts("qwen3_moe")[(1, 2)])
    assert_holds(store, bad, canonical_experts("qwen3_moe")[(0, 3)])
    assert store.faults.count == 2
    store.close()


def test_truncated_file_names_file_expert_and_tensor(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    store = make(path, slots=1)
    file = path / "model.safetensors"
    reader = store.source.reader  # type: ignore[attr-defined]
    last = max(reader.plans, key=lambda k: reader.plans[k][0].offset)
    with open(file, "r+b") as f:
        f.truncate(reader.plans[last][0].offset + 8)
    with pytest.raises(ExpertReadError, match=r"end of file .*truncated") as err:
        store.acquire(last)
    assert err.value.key == last and err.value.path == str(file)
    assert isinstance(err.value, CheckpointError)  # callers catching CheckpointError still do
    assert_clean(store, last)
    store.close()


def test_as_read_error_wraps_read_failures_only():
    key = K(2, 5)
    exc = as_read_error(key, FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/model.safetensors"))
    assert isinstance(exc, ExpertReadError) and exc.path == "/x/model.safetensors" and exc.key == key
    assert str(exc).startswith("/x/model.safetensors: cannot read expert 5 of layer 2: No such file")
    same = ExpertReadError("m", key, "/f")
    assert as_read_error(key, same) is same
    assert as_read_error(key, ValueError("a bug")) is None and as_read_error(key, KeyboardInterrupt()) is None


def test_quant_source_read_error_names_tier_file_and_expert(tmp_path):
    """A quantized tier's failed read (EIO from its pread) is an ExpertReadError naming its layer file."""

    class Tier:
        spec = SimpleNamespace(precision=Precision.INT4)
        tensor_specs: ClassVar[dict[str, Any]] = {}
        path = tmp_path / "int4-g32"
        io = None  # plain pread (no formats/diskio.py DiskIO)

        def read_into(self, key: ExpertKey, dest: dict[str, torch.Tensor]) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        def close(self) -> None:
            pass

    fmt = SimpleNamespace(slot_bytes=64, pack_scratch_bytes=0, device=torch.device("cpu"))
    src = QuantSource(Tier(), fmt)  # type: ignore[arg-type]
    with pytest.raises(ExpertReadError) as err:
        src.read_into(K(3, 1), None)
    file = str(tmp_path / "int4-g32" / "layer-003.safetensors")
    assert err.value.path == file and str(err.value).startswith(f"{file}: cannot read expert 1 of layer 3 (int4")
    assert "Input/output error" in str(err.value)


# -- the dynamic store: first touch, switches ------------------------------------------------------------------


@dataclass
class _Views:
    row: torch.Tensor


class _Pool:
    def __init__(self, n_slots: int, numel: int) -> None:
        self.n_slots, self.slot_bytes, self.nbytes = n_slots, numel * 4, n_slots * numel * 4
        self.buf = torch.zeros(n_slots, numel)
        self.views = [_Views(self.buf[s]) for s in range(n_slots)]


class FlakySource:
    """Writes a per-expert value; keys in `failing` fail half way with EIO (a half-written slot)."""

    def __init__(self, precision: Precision, numel: int) -> None:
        self.precision, self.numel, self.slot_bytes, self.staging_bytes = precision, numel, numel * 4, 0
        self.failing: set[ExpertKey] = set()

    def read_into(self, key: ExpertKey, views: _Views) -> int:
        views.row[: self.numel // 2] = key.expert + 1
        if key in self.failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO), f"/disk/{self.precision.value}.safetensors")
        views.row[self.numel // 2 :] = key.expert + 1
        return self.slot_bytes

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> _Pool:
        return _Pool(n_slots, self.numel)

    def locate(self, key: ExpertKey, piece: str | None = None) -> str:
        return f"/disk/{self.precision.value}.safetensors: expert {key.expert}"

    def close(self) -> None:
        pass


def test_dynamic_store_first_touch_and_switch_failures():
    hi, lo = FlakySource(Precision.FULL, 64), FlakySource(Precision.INT4, 16)
    keys = [K(0, e) for e in range(4)]
    budget = 2 * hi.slot_bytes + 4 * lo.slot_bytes  # 1 hot + 1 transient high slot, 3 + 1 spare low slots
    store = DynamicStore(hi, lo, keys, 1, 1, CPU, budget, transient=1)
    lo.failing = {K(0, 2)}
    with pytest.raises(ExpertReadError) as err:  # first touch
        store.acquire(K(0, 2))
    assert err.value.key == K(0, 2) and err.value.path == "/disk/int4.safetensors"
    assert K(0, 2) not in store.index and store.faults.count == 1
    store.check()
    lo.failing = set()
    store.preload(hot=[K(0, 0)])
    hi.failing = {K(0, 1)}
    mover = Mover(lambda m: store.switch(m.key, m.precision))
    mover.submit([Move(MoveKind.PROMOTE, K(0, 1), Tier.DISK, Tier.HOST, Precision.FULL)])
    assert mover.drain(5)
    assert "promote (0, 1) to full" in mover.errors[0] and "Input/output error" in mover.errors[0]
    assert store.precision_of(K(0, 1)) == Precision.INT4 and store.faults.count == 2  # the old version stays
    store.check()
    views = store.acquire(K(0, 1))
    assert bool((views.row == 2).all())
    store.release(K(0, 1))
    assert store.stats()["read_errors"] == 2
    mover.close()
    store.close()
