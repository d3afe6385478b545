"""The experts seam: every transformers MoE family moetier runs without a row is exact against transformers.

Each family: a tiny random checkpoint built from its default config (models/tiny.py `tiny_config`), saved by
transformers (so in the family's own checkpoint naming: per-expert tensors or fused ones, renamed prefixes),
loaded by moetier through the seam (models/seam.py) at "all resident" and "one slot per MoE layer" budgets;
fp32 logits within 1e-4 of transformers' own model, and greedy decoding through the family's own cache
(hybrid linear-attention, MiniMax's own cache...) gives transformers' tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import moetier
from fault_inject import eio_on
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.config import PrefetchConfig
from moetier.errors import ExpertReadError, UnknownArchitectureError
from moetier.models import seam
from moetier.models.tiny import tiny_config
from moetier.runtime.observers import Tap
from moetier.types import ExpertKey

ATOL = 1e-4
RUNTIME = RuntimeConfig(device="cpu", dtype="fp32")

# transformers 5.24's causal-LM MoE text model types run through the seam and tested here (rows: models/families.py)
SEAM_FAMILIES = tuple(sorted(seam.VERIFIED))


@pytest.fixture(scope="module")
def family_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """family_ckpt(model_type) -> (folder, reference model), built once per module."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}
    root = tmp_path_factory.mktemp("seam")

    def get(model_type: str) -> tuple[Path, torch.nn.Module]:
        if model_type not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()
            with torch.no_grad():  # non-trivial expert-choice biases where a family has them
                for name, buf in model.named_buffers():
                    if name.endswith(("e_score_correction_bias", ".expert_bias")):
                        buf.uniform_(-0.5, 0.5)
            folder = root / model_type
            model.save_pretrained(folder)
            cache[model_type] = (folder, model)
        return cache[model_type]

    return get


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, T]


@pytest.mark.parametrize("model_type", SEAM_FAMILIES)
def test_seam_family_is_exact(family_ckpt, model_type):
    _check_exact(family_ckpt, model_type, family=model_type, seam=True)


# model types with a row (models/families.py) tested from their default config here too: the row's name
ROWS_FROM_DEFAULTS = {"llama4_text": "llama4"}


@pytest.mark.parametrize("model_type", sorted(ROWS_FROM_DEFAULTS))
def test_row_family_is_exact(family_ckpt, model_type):
    """Llama-4's row (`scaled_input`: each chosen expert runs on its router score times the input, outputs summed
    unweighted) with a dense layer, a NoPE layer and chunked attention: exact as the seam families are."""
    _check_exact(family_ckpt, model_type, family=ROWS_FROM_DEFAULTS[model_type], seam=False)


def test_scaled_input_read_fault_names_the_calls_rows(family_ckpt):
    """Llama-4's experts run on one row per (token, choice); a failed expert read still names the call's rows."""
    folder, _ = family_ckpt("llama4_text")
    probe = moetier.load(folder, EngineConfig(runtime=RUNTIME))
    budget = probe.store.slot_bytes + probe.store.staging_bytes  # one slot: every other expert is read from disk
    probe.close()
    engine = moetier.load(folder, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=RUNTIME))
    seen: dict[int, list[list[int]]] = {}
    engine.observers.add(Tap(lambda r: seen.__setitem__(r.layer, r.ids.tolist())))
    ids = _ids(1, 12)
    engine.logits(ids)
    routed = seen[2]  # the last MoE layer's ids [T][k]
    e = next(x for x in range(6) if 0 < sum(x in row for row in routed) < len(routed))
    with eio_on(engine.store.source.reader, ExpertKey(2, e)), pytest.raises(ExpertReadError) as err:
        engine.logits(ids)
    assert err.value.rows == tuple(t for t, row in enumerate(routed) if e in row)
    engine.close()


def _check_exact(family_ckpt, model_type: str, family: str, seam: bool) -> None:
    folder, ref = family_ckpt(model_type)
    ids = _ids(1, 12)
    with torch.no_grad():
        want = ref(ids).logits  # [1, T, V]
    probe = moetier.load(folder, EngineConfig(runtime=RUNTIME))
    assert probe.loaded.family.seam is seam and probe.info.family == family
    n_moe, slot, staging = len(probe.info.moe_layers), probe.store.slot_bytes, probe.store.staging_bytes
    assert (probe.logits(ids) - want).abs().max().item() <= ATOL  # all resident
    probe.close()
    engine = moetier.load(folder, EngineConfig(budgets=Budgets(host_expert_bytes=n_moe * slot + staging),
                                               runtime=RUNTIME))  # fmt: skip
    assert engine.store.host.pool.n_slots == n_moe  # one slot per MoE layer
    for prompt in (ids, _ids(2, 9), ids):
        with torch.no_grad():
            want = ref(prompt).logits
        assert (engine.logits(prompt) - want).abs().max().item() <= ATOL
    assert engine.store.host.evictions > 0
    # decoding through the family's own cache: transformers' greedy tokens fed one at a time, each step's logits
    # against transformers' own cached decoding of the same tokens (some families route over the whole sequence,
    # so a full-sequence forward is not the reference of a decode step)
    prompt = _ids(3, 6)
    with torch.no_grad():
        seq = ref.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # [1, 10]
        out = ref(input_ids=prompt, use_cache=True)
        want = [out.logits[0, -1]]
        for pos in range(6, seq.shape[1] - 1):
            out = ref(input_ids=seq[:, pos : pos + 1], past_key_values=out.past_key_values, use_cache=True)
            want.append(out.logits[0, -1])
    engine.decoder.reset()
    got = [engine.step(prompt)[-1]]
    for pos in range(6, seq.shape[1] - 1):
        got.append(engine.step(seq[:, pos : pos + 1])[-1])
    assert (torch.stack(got) - torch.stack(want)).abs().max().item() <= ATOL
    engine.close()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss", "sarvam_mla"])
def test_rows_through_the_seam(family_ckpt, model_type):
    """RuntimeConfig.seam runs a family that has a row through transformers' own block: also exact."""
    folder, ref = family_ckpt(model_type)
    ids = _ids(4, 10)
    with torch.no_grad():
        want = ref(ids).logits
    for through in (False, True):
        engine = moetier.load(folder, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32", seam=through)))
        assert engine.loaded.family.seam is through
        assert (engine.logits(ids) - want).abs().max().item() <= ATOL
        engine.close()


def test_seam_refuses_gate_prefetch(family_ckpt):
    """The default prefetch predictor applies the next layers' routers, which the seam leaves inside transformers'
    block: refused, naming the predictor that runs there (tests/runtime/test_prefetch_history.py runs it)."""
    folder, _ = family_ckpt("glm4_moe")
    with pytest.raises(moetier.ConfigError, match="use --prefetch-predictor history"):
        moetier.load(folder, EngineConfig(runtime=RUNTIME, prefetch=PrefetchConfig(enabled=True)))


@pytest.mark.parametrize(("model_type", "why"), [
    ("jetmoe", "attention is itself a mixture of experts"),
    ("longcat_flash", "zero-computation experts"),
    ("doge", "single-neuron product-key experts"),
    ("nemotron_h", r"experts are ungated \(up -> activation -> down"),
])  # fmt: skip
def test_refused_families_say_why(family_ckpt, model_type, why):
    """transformers 5.24's MoE families moetier cannot run are refused naming what it lacks, not for want of a row."""
    folder, _ = family_ckpt(model_type)
    with pytest.raises(UnknownArchitectureError, match=why) as err:
        moetier.load(folder, EngineConfig(runtime=RUNTIME))
    assert "no family row" not in str(err.value)


def test_llama4_composite_is_refused_naming_the_text_model(tmp_path):
    config = '{"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}'
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(UnknownArchitectureError, match=r"composite .* llama4_text"):
        moetier.load(tmp_path, EngineConfig(runtime=RUNTIME))




def test_tensors_transformers_skips_are_skipped(family_ckpt, tmp_path):
    """Qwen3-Next's published checkpoints carry a multi-token-prediction block (`mtp.*`, its experts per expert, which
    transformers would merge) that transformers skips at load (`_keys_to_ignore_on_load_unexpected`): moetier skips
    it too, with the logits of the checkpoint without it."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _ = family_ckpt("qwen3_next")
    out = tmp_path / "with_mtp"
    shutil.copytree(folder, out)
    sd = load_file(out / "model.safetensors")
    moe = next(k.split(".mlp.")[0] + "." for k in sd if ".mlp.experts.0." in k)  # "model.layers.N." of an MoE layer
    extra = {k.replace(moe, "mtp.layers.0.", 1): v.clone() for k, v in sd.items() if k.startswith(moe + "mlp.")}
    assert any(".experts.0." in k for k in extra)  # per-expert tensors transformers' MergeModulelist would take
    save_file({**sd, **extra, "mtp.fc.weight": torch.zeros(4, 4)}, out / "model.safetensors", metadata={"format": "pt"})
    ids = _ids(5, 10)
    with moetier.load(folder, EngineConfig(runtime=RUNTIME)) as a:
        want = a.logits(ids)
    with moetier.load(out, EngineConfig(runtime=RUNTIME)) as b:
        assert torch.equal(b.logits(ids), want)
