"""The engine under an admitting cache policy (mrs-admit): the same logits as with every expert resident, bypasses
happen, the budget holds, and a batch of sequences hits more than under LRU at the same budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moetier
from moetier.kernels import decode, native
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest
from moetier.store.store import ExpertStore

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"

pytestmark = pytest.mark.skipif(
    decode.load(True, None) is None, reason=f"no native kernels here: {native.load_error(True, None)}"
)


def _engine(policy: str, slots: int | None) -> moetier.Engine:
    rt = moetier.RuntimeConfig(dtype="bf16", disk_io="buffered")
    budget = None
    if slots is not None:
        with moetier.load(MODEL, moetier.EngineConfig(runtime=rt)) as probe:
            store = probe.store
            assert isinstance(store, ExpertStore)
            budget = slots * store.slot_bytes + store.staging_bytes
    cfg = moetier.EngineConfig(budgets=moetier.Budgets(host_expert_bytes=budget), runtime=rt,
                               cache=moetier.CacheConfig(policy=policy))  # fmt: skip
    return moetier.load(MODEL, cfg)


def _forward(engine: moetier.Engine, ids: list[int], prompt: int) -> torch.Tensor:
    engine.decoder.reset()
    with torch.inference_mode():
        out = [engine.step(torch.tensor([ids[:prompt]]), all_logits=True).float()]
        out += [engine.step(torch.tensor([[t]]))[0:1].float() for t in ids[prompt:]]
    return torch.cat(out)


def test_logits_equal_all_resident_and_budget_holds() -> None:
    ids = torch.randint(3, 4000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    with _engine("lru", None) as e:
        ref = _forward(e, ids, 24)
    with _engine("mrs-admit", 32) as e:
        got = _forward(e, ids, 24)
        host = e.store.stats()["host"]
        assert host["transient_slots"] == 2 and e.store.pin_limit() == 2
        assert host["bypasses"] > 0 and host["peak_resident_bytes"] <= host["pool_bytes"] <= host["budget_bytes"]
    assert torch.equal(got, ref)  # pin groups are contiguous in expert id: the same bits as one call


def _batch_hit_rate(policy: str) -> float:
    with _engine(policy, 32) as e:
        runner = BatchRunner(e, BatchConfig(max_batch=8))
        for i in range(8):
            prompt = torch.randint(3, 4000, (6,), generator=torch.Generator().manual_seed(i)).tolist()
            runner.add(SeqRequest(prompt, 24, stop_ids=frozenset()))
        while not runner.idle():
            runner.step()
        host = e.store.stats()["host"]
        return host["hits"] / (host["hits"] + host["misses"])


def test_batched_decode_hits_more_than_lru() -> None:
    assert _batch_hit_rate("mrs-admit") > _batch_hit_rate("lru") + 0.1
