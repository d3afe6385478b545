"""The native step's wide mode (`RuntimeConfig.residual = "fp32"`, runtime/native_step.py over csrc/step.h
mt_step.xw) in the engine: closer to the fp32 model than the bf16 step on every family the lean decoder runs,
fp32 logits, fp16 caches, the batch runner's rows and echo on the same numerics, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moetier
from moetier.errors import ConfigError
from moetier.kernels import decode, native
from moetier.models.tiny import build_tiny_checkpoint
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest, StepEvent
from moetier.runtime.lean import LeanDecoder

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
NEVER: frozenset[int] = frozenset()

pytestmark = pytest.mark.skipif(
    decode.load(True, None) is None, reason=f"no native kernels here: {native.load_error(True, None)}"
)


def _engine(path: Path, dtype: str = "bf16", **runtime: object) -> moetier.Engine:
    rt = moetier.RuntimeConfig(dtype=dtype, **runtime)  # type: ignore[arg-type]
    return moetier.load(path, moetier.EngineConfig(runtime=rt))


def _forward(engine: moetier.Engine, ids: list[int], prompt: int) -> torch.Tensor:
    """Logits [T, V] fp32: the first `prompt` ids as one prefill (all positions), the rest one decode step each."""
    engine.decoder.reset()
    with torch.inference_mode():
        out = [engine.step(torch.tensor([ids[:prompt]]), all_logits=True).float()]
        out += [engine.step(torch.tensor([[t]]))[0:1].float() for t in ids[prompt:]]
    return torch.cat(out)


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Median over rows of logits [T, V] of KL(ref || got): robust to the odd router near-tie that a rounding
    flips on these random models (one such row moves a mean by 20x)."""
    lp, lq = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).median())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_checkpoint(f, root / f, seed=3, dtype=torch.bfloat16) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_wide_is_closer_to_fp32_than_the_bf16_step(tiny: dict[str, Path], family: str) -> None:
    """A prompt and decode steps: the wide step's median KL to the same checkpoint run in fp32 is under half the
    bf16 step's, its logits are fp32 and its caches fp16."""
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with _engine(tiny[family], dtype="fp32") as e:
        ref = _forward(e, ids, 24)
    with _engine(tiny[family]) as e:
        narrow = _forward(e, ids, 24)
    with _engine(tiny[family], residual="fp32") as e:
        lean = e.decoder
        assert isinstance(lean, LeanDecoder) and lean.k_cache.dtype == torch.float16
        assert e.stats()["native_step"]["torch_moe_calls"] == 0
        e.decoder.reset()
        with torch.inference_mode():
            assert e.step(torch.tensor([ids[:3]])).dtype == torch.float32
        wide = _forward(e, ids, 24)
    kl_wide, kl_narrow = _kl(ref, wide), _kl(ref, narrow)
    assert kl_wide <= 0.5 * kl_narrow, (kl_wide, kl_narrow)
    assert float((wide.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9  # near-ties of random logits


def test_the_bundled_model_is_closer_to_fp32_in_wide_mode() -> None:
    """The trained model over a prompt: median KL to fp32 under half the bf16 step's."""
    with _engine(MODEL, dtype="fp32") as e:
        ids = e.encode("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is "
                       "the sun. Arise, fair sun, and kill the envious moon, who is already sick and pale with "
                       "grief, that thou her maid art far more fair than she.")  # fmt: skip
        ref = e.logits(torch.tensor([ids]))[0].float()
    with _engine(MODEL) as e:
        narrow = e.logits(torch.tensor([ids]))[0].float()
    with _engine(MODEL, residual="fp32") as e:
        wide = e.logits(torch.tensor([ids]))[0]
        assert wide.dtype == torch.float32
    assert _kl(ref, wide) <= 0.5 * _kl(ref, narrow), (_kl(ref, wide), _kl(ref, narrow))


def _run(runner: BatchRunner, reqs: list[SeqRequest]) -> list[list[StepEvent]]:
    ids = [runner.add(r) for r in reqs]
    out: dict[int, list[StepEvent]] = {i: [] for i in ids}
    while not runner.idle():
        for ev in runner.step():
            out[ev.seq_id].append(ev)
    return [out[i] for i in ids]


def test_batched_rows_and_echo_take_the_wide_numerics() -> None:
    """The batch runner's rows decode as each sequence does alone, and echo's prompt logprobs (the prefill's
    fp32 residual rows through the native head) equal the eval logits of the same engine."""
    with _engine(MODEL, residual="fp32") as e:
        prompts = [e.encode(t) for t in ("ROMEO:", "JULIET: O", "Enter the KING", "What say you")]
        runner = BatchRunner(e, BatchConfig(max_batch=4))
        got = _run(runner, [SeqRequest(p, 10, stop_ids=NEVER) for p in prompts])
        assert runner.stats()["mean_batch"] > 1
        gen = [e.generate(p, 10, stop_at_eos=False).token_ids for p in prompts]
        toks = [[ev.token for ev in evs if ev.token is not None] for evs in got]
        same = sum(a == b for g, r in zip(toks, gen, strict=True) for a, b in zip(g, r, strict=True))
        assert same >= 0.9 * 40, (toks, gen)
        ids = e.encode("ROMEO: But soft, what light through yonder window breaks?")
        (_, logits, _), *_ = list(e.window_logits(ids, window=len(ids)))
        want = F.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        ev = _run(BatchRunner(e, BatchConfig(max_batch=2)), [SeqRequest(ids, 0, logprobs=1, echo=True)])[0][0]
        assert ev.prompt_logprobs is not None
        torch.testing.assert_close(torch.tensor(ev.prompt_logprobs[1:]), want, rtol=1e-5, atol=1e-5)


def test_wide_mode_refusals() -> None:
    """A bad value, a decoder without the native step, and a bf16 cache handed to the wide step are refused by
    name; an fp32 model (already wide) runs."""
    with pytest.raises(ConfigError, match="residual must be auto, bf16 or fp32"):
        moetier.RuntimeConfig(residual="fp16")
    with pytest.raises(ConfigError, match="--residual fp32 needs the native decode step"):
        _engine(MODEL, residual="fp32", native_step=False)
    with pytest.raises(ConfigError, match="--residual fp32 needs the native decode step"):
        _engine(MODEL, residual="fp32", lean=False)
    with _engine(MODEL, dtype="fp32", residual="fp32") as e:
        assert e.generate(e.encode("ROMEO:"), 3).token_ids
    with _engine(MODEL, residual="fp32") as e:
        lean = e.decoder
        assert isinstance(lean, LeanDecoder) and lean.fused is not None
        bf16 = torch.zeros(lean.k_cache.shape, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="float16 KV caches"):
            lean.fused.run_sequence(torch.tensor([5, 6]), 0, bf16, bf16, False, False)
