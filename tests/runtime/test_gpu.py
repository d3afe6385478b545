"""Exactness on a CUDA device with both tiers budgeted (host -> accelerator moves). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.models.tiny import TINY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
IDS = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(21))


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
@pytest.mark.parametrize("family", tuple(TINY))
def test_cuda_tiers_are_exact(tiny_ckpt, hf_model, family, lean):
    runtime = RuntimeConfig(device="cuda", dtype="fp32", lean=lean)
    path = tiny_ckpt(family)
    probe = moetier.load(path, EngineConfig(runtime=runtime))
    slot, staging, n_moe = probe.store.slot_bytes, probe.store.staging_bytes, len(probe.info.moe_layers)
    probe.close()
    budgets = Budgets(host_expert_bytes=n_moe * slot + staging, accel_expert_bytes=slot)
    engine = moetier.load(path, EngineConfig(budgets=budgets, runtime=runtime))
    assert engine.store.accel is not None and engine.store.accel.pool.n_slots == 1
    with torch.no_grad():
        ref = hf_model(family)(IDS).logits
    out = engine.logits(IDS)
    assert out.device.type == "cuda"
    assert (out.cpu() - ref).abs().max().item() <= 1e-4
    new = engine.generate(IDS[0, :7].tolist(), max_new_tokens=6, stop_at_eos=False).token_ids
    with torch.no_grad():
        seq = IDS[:, :7]
        for _ in range(6):
            seq = torch.cat([seq, hf_model(family)(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert new == seq[0, 7:].tolist()
    s = engine.stats()
    assert s["h2d_bytes"] == engine.store.accel.misses * slot
    assert s["peak_accel_expert_bytes"] <= slot
    assert s["peak_host_expert_bytes"] + staging <= budgets.host_expert_bytes
    engine.close()
