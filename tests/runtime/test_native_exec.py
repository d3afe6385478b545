"""The native executor and the native dense projections in the engine (runtime/executors/native.py,
runtime/lean.py with kernels/decode.py), on the bundled model in bf16.

The native path rounds once per output where torch rounds per expert and per add, so it is compared with
torch's own bf16 path by what a user sees: greedy top-1 agreement token by token (the issue asks >= 99%)
and the logits' closeness; fp32 models never take it (exactness is the dense executor's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import moetier
from moetier.errors import ConfigError
from moetier.kernels import decode, ggml, native

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"
HELDOUT = Path(__file__).resolve().parents[2] / "data" / "shakespeare_heldout.txt"

pytestmark = pytest.mark.skipif(
    decode.load(True, None) is None, reason=f"no native kernels here: {native.load_error(True, None)}"
)


def _engine(native_on: bool, **runtime: object) -> moetier.Engine:
    rt = moetier.RuntimeConfig(dtype="bf16", native_kernels=native_on, **runtime)  # type: ignore[arg-type]
    return moetier.load(MODEL, moetier.EngineConfig(runtime=rt))


def _decode_logits(engine: moetier.Engine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] (fp32) of feeding ids one token at a time (decode steps: the native path's regime)."""
    engine.decoder.reset()
    out = []
    with torch.inference_mode():
        for t in ids:
            out.append(engine.step(torch.tensor([[t]]))[0].float())
    return torch.stack(out)


def _ids(n: int) -> list[int]:
    with _engine(False) as e:
        return e.encode(HELDOUT.read_text()[:20000])[:n]  # held-out text: the model was not trained on it


def test_native_executor_is_chosen_and_reports() -> None:
    with _engine(True) as e:
        e.generate("ROMEO:", max_new_tokens=4, stop_at_eos=False)
        st = e.stats()
    assert st["executor"] == "native"
    assert st["native"]["native_calls"] > 0 and st["native"]["isa"] in ("avx512-bf16-vnni", "avx2+vnni", "avx2", "c")
    with _engine(False) as e:
        assert e.stats()["executor"] == "dense" and "native" not in e.stats()


def test_native_decode_is_as_close_to_fp32_as_torch_bf16() -> None:
    """benchmarks/native_quality.py over 2000 held-out decode steps (windows of 256): torch bf16 and native bf16
    both agree with fp32 on 98.45% of top-1 tokens (KL 1.6e-4 and 2.4e-4 nats), native with torch bf16 on
    99.25%. The two bf16 paths round differently and this small model has near-ties, so native is held to
    fp32 (KL within 2x torch bf16's, top-1 >= 97%) and to torch bf16 (top-1 >= 97%) over 300 steps."""
    ids = _ids(300)
    rt = moetier.RuntimeConfig(dtype="fp32")
    with moetier.load(MODEL, moetier.EngineConfig(runtime=rt)) as ref_engine:
        ref = _decode_logits(ref_engine, ids).log_softmax(-1)
    got = {}
    for native_on in (True, False):
        with _engine(native_on) as e:
            got[native_on] = _decode_logits(e, ids)
            if native_on:
                assert e.stats()["native"]["native_calls"] >= len(ids)

    def kl(logits: torch.Tensor) -> float:
        return float((ref.exp() * (ref - logits.log_softmax(-1))).sum(-1).mean())

    assert kl(got[True]) <= 2 * kl(got[False]) + 1e-5, (kl(got[True]), kl(got[False]))
    top1 = float((got[True].argmax(-1) == ref.argmax(-1)).float().mean())
    assert top1 >= 0.97, top1
    assert float((got[True].argmax(-1) == got[False].argmax(-1)).float().mean()) >= 0.97


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_dense_precision_quantises_projections(dense: str) -> None:
    ids = _ids(120)
    with _engine(True, dense_precision=dense) as q, _engine(True) as full:
        layer0 = q.decoder.layers[0]
        assert isinstance(layer0.wqkv, decode.QDense) and layer0.wqkv.bits == decode.DENSE_BITS[dense]
        head = q.decoder.lm_head
        assert isinstance(head, decode.QDense)
        # int8: Q8_0; int4: Q6_K by ggml (as llama.cpp's Q4_0 files keep the head), Q8_0 without ggml
        q6k = ggml.KIND_BASE + GGMLQuantizationType.Q6_K.value
        assert head.bits == (q6k if dense == "int4" and ggml.available() else 8)
        if head.bits == q6k:  # ggml's quantiser: its blocks decode (numpy reference) to the bf16 head within 6 bits
            deq = torch.from_numpy(dequantize(head.q.numpy(), GGMLQuantizationType.Q6_K))  # [V, H] fp32
            w = q.loaded.model.get_output_embeddings().weight.float()  # the bf16 copy stays in the model
            assert deq.shape == w.shape and (deq - w).abs().max() <= 0.03 * w.abs().max()
        lq, lf = _decode_logits(q, ids), _decode_logits(full, ids)
    agree = float((lq.argmax(-1) == lf.argmax(-1)).float().mean())
    assert agree >= (0.97 if dense == "int8" else 0.75), agree


def test_dense_precision_refusals() -> None:
    with pytest.raises(ConfigError, match="needs the native CPU kernels"):
        _engine(False, dense_precision="int4")
    with pytest.raises(ConfigError, match="dense_precision must be one of"):
        moetier.RuntimeConfig(dense_precision="int3")
    with pytest.raises(ConfigError, match="needs the lean decoder"):
        _engine(True, dense_precision="int8", lean=False)


def test_fp32_model_keeps_the_exact_dense_path() -> None:
    rt = moetier.RuntimeConfig(dtype="fp32")
    with moetier.load(MODEL, moetier.EngineConfig(runtime=rt)) as e:
        assert e.stats()["executor"] == "dense"
