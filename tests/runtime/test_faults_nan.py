"""NaN / Inf weights at run time: a checkpoint copy with one expert value (or one non-expert value) set to NaN or
Inf with the safetensors library.

What must hold (issue 18): greedy generate and perplexity do not print empty text or `nan` but raise
NumericalError naming the damaged expert (file, tensor, layer, expert) or non-expert weight; in a batched decode
the error's `rows` are the rows whose logits are not finite, it passes Engine.step unchanged, and its `logits`
(the step's output: the forward ran to its end) hold the other rows' clean logits; health() counts it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetier
from moetier import EngineConfig, RuntimeConfig
from moetier.errors import NumericalError
from moetier.runtime.batch import SlotDecoder
from moetier.runtime.engine import _all_finite
from moetier.runtime.observers import Tap

PROMPT = [int(t) for t in torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(3))]


def load(path: Path, dtype: str) -> moetier.Engine:
    return moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype=dtype)))  # type: ignore[arg-type]


def damage(path: Path, tensor: str, value: float) -> Path:
    """Set element [0, 0] (or [0]) of `tensor` in the checkpoint copy at `path` to `value`; returns the file."""
    file = path / "model.safetensors"
    sd = load_file(file)
    t = sd[tensor].clone()
    t.view(-1)[0] = value
    sd[tensor] = t
    save_file(sd, file, metadata={"format": "pt"})
    return file


def layer1_routing(engine: moetier.Engine, run: Callable[[], Any]) -> list[list[int]]:
    """ids [T][k] of the last MoE layer's call that `run` makes."""
    seen: list[list[list[int]]] = []
    engine.observers.add(Tap(lambda r: seen.append(r.ids.tolist()) if r.layer == 1 else None))
    run()
    return seen[-1]


@pytest.mark.parametrize(("variant", "value"), [("fp32", float("nan")), ("fp32", float("inf")), ("bf16", float("nan"))])
def test_damaged_expert_is_named_by_generate_and_perplexity(ckpt_copy, tiny_ckpt, variant, value):
    clean = load(tiny_ckpt("qwen3_moe", variant), "auto")
    e = layer1_routing(clean, lambda: clean.logits(torch.tensor([PROMPT])))[-1][0]  # the last row's first expert
    clean.close()
    path = ckpt_copy("qwen3_moe", variant)
    tensor = f"model.layers.1.mlp.experts.{e}.gate_proj.weight"
    file = damage(path, tensor, value)
    engine = load(path, "auto")
    with pytest.raises(NumericalError) as err:
        engine.generate(PROMPT, 4)
    msg = str(err.value)
    assert f"expert {e} of layer 1" in msg and str(file) in msg and repr(tensor) in msg and "gate" in msg
    assert err.value.rows == (0,)  # type: ignore[attr-defined]
    with pytest.raises(NumericalError, match=f"expert {e} of layer 1"):
        engine.perplexity(PROMPT)
    health = engine.health()
    assert health["status"] == "degraded" and health["numerical_errors"] == 2 and health["read_errors"] == 0
    assert f"expert {e} of layer 1" in health["last_error"] and engine.stats()["numerical_errors"] == 2
    engine.close()


def test_batched_decode_names_the_nan_row_and_keeps_the_others_logits(ckpt_copy, tiny_ckpt):
    """Sequence 0's decode row routes to the damaged expert, sequence 1's does not: rows == (0,), the error passes
    Engine.step unchanged, and its logits row 1 is sequence 1's clean logits (the forward ran to its end)."""
    prompts = [[5, 17, 33], [41, 8, 60, 12]]
    clean = load(tiny_ckpt("qwen3_moe"), "fp32")

    def fresh() -> SlotDecoder:
        slots = SlotDecoder(clean.decoder, 2)  # type: ignore[arg-type]
        for s, p in enumerate(prompts):
            slots.prefill(s, p)
        return slots

    prefill_last: set[int] = set()  # layer-1 experts of the prompts' last rows (the rows whose logits count)
    for p in prompts:
        prefill_last |= set(layer1_routing(clean, lambda p=p: SlotDecoder(clean.decoder, 1).prefill(0, p))[-1])
    found = None
    for a in range(3, 40):  # decode tokens whose layer-1 rows split an expert the prefills' last rows avoid
        tokens = [a, 50]
        rows = layer1_routing(clean, lambda tokens=tokens: fresh().decode([0, 1], tokens))
        only0 = [x for x in rows[0] if x not in rows[1] and x not in prefill_last]
        if only0:
            found = tokens, only0[0]
            break
    assert found is not None
    tokens, e = found
    ref = fresh().decode([0, 1], tokens)  # [2, V]
    clean.close()

    path = ckpt_copy("qwen3_moe")
    damage(path, f"model.layers.1.mlp.experts.{e}.down_proj.weight", float("nan"))
    engine = load(path, "fp32")
    slots = SlotDecoder(engine.decoder, 2)  # type: ignore[arg-type]
    for s, p in enumerate(prompts):
        engine.step(index=0, run=lambda s=s, p=p: slots.prefill(s, p))  # finite: no row routes to the expert
    with pytest.raises(NumericalError) as err:
        engine.step(index=1, run=lambda: slots.decode([0, 1], tokens))
    assert type(err.value) is NumericalError and err.value.rows == (0,)  # type: ignore[attr-defined]
    assert f"expert {e} of layer 1" in str(err.value) and "down_proj" in str(err.value)
    assert slots.pos == [4, 5]  # the forward ran: its finite rows are good, no retry needed
    logits = err.value.logits  # type: ignore[attr-defined]
    assert logits.shape == ref.shape and not torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[1], ref[1], rtol=0, atol=0)
    engine.close()


def test_damaged_non_expert_weight_is_named(ckpt_copy):
    path = ckpt_copy("qwen3_moe", "bf16")
    damage(path, "model.norm.weight", float("nan"))
    engine = load(path, "auto")
    with pytest.raises(NumericalError, match=r"non-expert weight model\.norm\.weight has 1 non-finite") as err:
        engine.generate(PROMPT, 2)
    assert err.value.rows == (0,)  # type: ignore[attr-defined]
    engine.close()


def test_all_finite_check():
    assert _all_finite(torch.randn(3, 7))
    assert _all_finite(torch.full((4, 8), 3e38))  # the sum overflows; every value is finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, 5).to(dtype)
            x[1, 3] = bad
            assert not _all_finite(x)
