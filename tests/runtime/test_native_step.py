"""The native decode step (runtime/native_step.py over csrc/step.c) in the engine: bf16 CPU models of the four
families the lean decoder runs, against the same engine with the step off (torch attention and router, the
native executor for the experts), and its own invariants: batch invariance, chunked prompts, faults.

The step rounds where the bf16 reference rounds a tensor but computes everything in between in fp32, so it is
compared with the torch bf16 path by closeness of the logits and greedy agreement, and with itself where only the
kernels' path changes (a row in a batch or alone, a prompt in one call or in chunks). The wide step
(RuntimeConfig.residual "fp32") is compared with the same checkpoint in fp32, against the bf16 step's distance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moetier
from moetier.errors import ConfigError, ExpertReadError, NumericalError
from moetier.kernels import decode, native
from moetier.models.tiny import build_tiny_checkpoint
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest, StepEvent
from moetier.runtime.lean import LeanDecoder
from moetier.types import ExpertKey

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
NEVER: frozenset[int] = frozenset()

pytestmark = pytest.mark.skipif(
    decode.load(True, None) is None, reason=f"no native kernels here: {native.load_error(True, None)}"
)


def _engine(path: Path, step: bool = True, dtype: str = "bf16", **runtime: object) -> moetier.Engine:
    rt = moetier.RuntimeConfig(dtype=dtype, native_step=step, **runtime)  # type: ignore[arg-type]
    return moetier.load(path, moetier.EngineConfig(runtime=rt))


def _fused(engine: moetier.Engine) -> object:
    lean = engine.decoder
    assert isinstance(lean, LeanDecoder)
    return lean.fused


def _forward(engine: moetier.Engine, ids: list[int], prompt: int) -> torch.Tensor:
    """Logits [T, V] fp32: the first `prompt` ids as one prefill (all positions), the rest one decode step each."""
    engine.decoder.reset()
    with torch.inference_mode():
        out = [engine.step(torch.tensor([ids[:prompt]]), all_logits=True).float()]
        out += [engine.step(torch.tensor([[t]]))[0:1].float() for t in ids[prompt:]]
    return torch.cat(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_checkpoint(f, root / f, seed=3, dtype=torch.bfloat16) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_matches_the_torch_bf16_path(tiny: dict[str, Path], family: str) -> None:
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with _engine(tiny[family]) as e:
        st = e.stats()
        assert st["native_step"]["native_router"] and st["native_step"]["torch_moe_calls"] == 0
        got = _forward(e, ids, 24)
        assert e.stats()["native_step"]["calls"] == 1 + 16
        assert e.stats()["native"]["native_calls"] == 17 * len(e.info.moe_layers)
    with _engine(tiny[family], step=False) as e:
        assert "native_step" not in e.stats()
        ref = _forward(e, ids, 24)
    # bf16 rounding, a few roundings apart; on these tiny random models a rounding flips a near-tie in the top-k
    # now and then (seen: layer 1 of qwen2_moe at position 0, logits 0.938 / 0.922 against 0.922 / 0.941), which
    # moves a row by more: most rows, not all, are held to the rounding bound
    rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)  # [T]
    assert float((rel <= 0.03).float().mean()) >= 0.85, rel.tolist()
    assert float(rel.median()) <= 0.015, rel.tolist()
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_rows_of_a_batch_decode_as_they_do_alone() -> None:
    """A batched decode step's row is that sequence's decode alone up to the kernels' path for several rows (4-row
    blocks accumulate in another order): logits within bf16 rounding, the same greedy tokens nearly always."""
    with _engine(MODEL) as e:
        prompts = [e.encode(t) for t in ("ROMEO:", "JULIET: O", "Enter the KING", "What say you")]
        fused = _fused(e)
        caches = [(torch.zeros_like(e.decoder.k_cache), torch.zeros_like(e.decoder.v_cache)) for _ in prompts]
        alone = []
        for p, (kc, vc) in zip(prompts, caches, strict=True):
            fused.run_sequence(torch.tensor(p), 0, kc, vc, False, False)  # type: ignore[attr-defined]
            alone.append(fused.run_rows(torch.tensor([7]), [len(p)], [(kc, vc)])[0])  # type: ignore[attr-defined]
        batch = fused.run_rows(torch.tensor([7] * 4), [len(p) for p in prompts], caches)  # type: ignore[attr-defined]
        for row, ref in zip(batch, alone, strict=True):
            assert float((row.float() - ref.float()).abs().max()) <= 0.03 * float(ref.float().abs().max())
            assert int(row.argmax()) == int(ref.argmax())
        runner = BatchRunner(e, BatchConfig(max_batch=4))
        ids = [runner.add(SeqRequest(p, 12, stop_ids=frozenset())) for p in prompts]
        got: dict[int, list[int]] = {i: [] for i in ids}
        while runner.running or runner.pending:
            for ev in runner.step():
                if ev.token is not None:
                    got[ev.seq_id].append(ev.token)
        assert runner.stats()["mean_batch"] > 1
        gen = [e.generate(p, 12, stop_at_eos=False).token_ids for p in prompts]
    same = sum(a == b for g, r in zip((got[i] for i in ids), gen, strict=True) for a, b in zip(g, r, strict=True))
    assert same >= 0.9 * 48, (same, [got[i] for i in ids], gen)


def test_a_prompt_in_chunks_matches_one_call() -> None:
    """A prompt longer than step_rows runs in chunks that attend to the earlier ones through the cache."""
    ids = list(range(5, 45))
    with _engine(MODEL, step_rows=7) as small, _engine(MODEL) as whole:
        assert small.stats()["native_step"]["rows"] == 7
        a = small.logits(torch.tensor([ids])).float()
        b = whole.logits(torch.tensor([ids])).float()
    assert float((a - b).abs().max()) <= 0.03 * float(b.abs().max())
    assert bool((a.argmax(-1) == b.argmax(-1)).all())


def test_a_read_error_names_only_the_rows_that_routed_to_the_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    with _engine(MODEL) as e:
        fused = _fused(e)
        store = e.store
        orig = store.acquire_many
        failed: list[ExpertKey] = []

        def acquire_many(keys: list[ExpertKey]) -> list[object]:
            if keys[0].layer == 1 and not failed:
                failed.append(keys[-1])
                raise ExpertReadError("x.safetensors: EIO", keys[-1], "x.safetensors")
            return orig(keys)

        monkeypatch.setattr(store, "acquire_many", acquire_many)
        caches = [(torch.zeros_like(e.decoder.k_cache), torch.zeros_like(e.decoder.v_cache)) for _ in range(3)]
        with pytest.raises(ExpertReadError) as err:
            fused.run_rows(torch.tensor([5, 9, 40]), [0, 0, 0], caches)  # type: ignore[attr-defined]
        ids = fused.step.ids[1, :3]  # type: ignore[attr-defined]  # layer 1's routing of this call
        want = tuple(int(r) for r in (ids == failed[0].expert).any(-1).nonzero().flatten())
        assert err.value.rows == want and len(want) >= 1
        assert not any(store.compute.pins.values())  # nothing left pinned
        monkeypatch.setattr(store, "acquire_many", orig)
        assert torch.isfinite(fused.run_rows(torch.tensor([5, 9, 40]), [0, 0, 0], caches)).all()  # type: ignore[attr-defined]


def test_a_nan_expert_fails_the_step_naming_it() -> None:
    with _engine(MODEL) as e:
        e.logits(torch.tensor([[5, 6, 7]]))  # every routed expert of these tokens resident
        key = next(iter(e.store.compute.slots))
        views = e.store.views(key)
        views.w13.view(-1)[0] = float("nan")
        with pytest.raises(NumericalError, match=f"expert {key.expert} of layer {key.layer}"):
            for t in range(5, 60):
                e.logits(torch.tensor([[t, t + 1, t + 2]]))


def test_the_step_counts_its_scratch_and_refuses_bad_rows() -> None:
    with pytest.raises(moetier.ConfigError, match="step_rows"):
        moetier.RuntimeConfig(step_rows=0)
    with _engine(MODEL) as e:
        st = e.stats()["native_step"]
        assert st["scratch_bytes"] > 0 and st["unreadable_slots"] == 0
        assert e.stats()["kernels"].startswith("native (")


def test_a_seam_family_takes_the_same_routed_call(tiny: dict[str, Path]) -> None:
    """Through transformers' experts seam (its own attention and router), the MoE half is the same RoutedMoE call:
    no grouping, no plan object, one native call per layer call."""
    ids = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with _engine(tiny["qwen3_moe"], seam=True) as e:
        assert "native_step" not in e.stats() and e.stats()["executor"] == "native"
        got = _forward(e, ids, 20)
        st = e.stats()["native"]
        assert st["native_calls"] == 11 * len(e.info.moe_layers) and st["dense_calls"] == 0
        assert st["routed_scratch_bytes"] > 0
    with _engine(tiny["qwen3_moe"], seam=True, native_kernels=False) as e:
        ref = _forward(e, ids, 20)
    rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float(rel.median()) <= 0.015 and float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_group_calls_after_whole_ones_read_only_their_own_experts() -> None:
    """With fewer slots than a prompt's experts, the prompt's MoE calls run in groups; decode steps before them
    ran whole calls (fewer experts): the result is the prompt's alone, whatever ran before (a stale descriptor
    from a whole call must never join a group call)."""
    with _engine(MODEL) as probe:
        budget = 6 * probe.store.slot_bytes + probe.store.staging_bytes
    rt = moetier.RuntimeConfig(dtype="bf16")
    with moetier.load(MODEL, moetier.EngineConfig(budgets=moetier.Budgets(host_expert_bytes=budget), runtime=rt)) as e:
        assert e.store.pin_limit() == 6  # the bundled model routes 4 experts a token: a prompt needs groups
        prompt = torch.tensor([list(range(20, 44))])
        ref = e.logits(prompt)
        for t in (5, 9, 33, 70):
            e.step(torch.tensor([[t]]))
        assert torch.equal(e.logits(prompt), ref)

# --- the wide step (RuntimeConfig.residual "fp32": csrc/step.h mt_step.xw) -------------------------------------------
# closer to the fp32 model than the bf16 step on every family the lean decoder runs, fp32 logits, fp16 caches, the
# batch runner's rows and echo on the same numerics, and its refusals


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Median over rows of logits [T, V] of KL(ref || got): robust to the odd router near-tie that a rounding
    flips on these random models (one such row moves a mean by 20x)."""
    lp, lq = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).median())


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


def _run_all(runner: BatchRunner, reqs: list[SeqRequest]) -> list[list[StepEvent]]:
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
        got = _run_all(runner, [SeqRequest(p, 10, stop_ids=NEVER) for p in prompts])
        assert runner.stats()["mean_batch"] > 1
        gen = [e.generate(p, 10, stop_at_eos=False).token_ids for p in prompts]
        toks = [[ev.token for ev in evs if ev.token is not None] for evs in got]
        same = sum(a == b for g, r in zip(toks, gen, strict=True) for a, b in zip(g, r, strict=True))
        assert same >= 0.9 * 40, (toks, gen)
        ids = e.encode("ROMEO: But soft, what light through yonder window breaks?")
        (_, logits, _), *_ = list(e.window_logits(ids, window=len(ids)))
        want = F.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        ev = _run_all(BatchRunner(e, BatchConfig(max_batch=2)), [SeqRequest(ids, 0, logprobs=1, echo=True)])[0][0]
        assert ev.prompt_logprobs is not None
        torch.testing.assert_close(torch.tensor(ev.prompt_logprobs[1:]), want, rtol=1e-5, atol=1e-5)


def test_wide_mode_refusals() -> None:
    """A bad value, a decoder without the native step, and a bf16 cache handed to the wide step are refused by
    name; an fp32 model (already wide) runs."""
    with pytest.raises(ConfigError, match="residual must be auto, bf16 or fp32"):
        moetier.RuntimeConfig(residual="fp16")
    with pytest.raises(ConfigError, match="--residual fp32 needs the native decode step"):
        _engine(MODEL, residual="fp32", step=False)
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
