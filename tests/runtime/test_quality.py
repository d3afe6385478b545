"""runtime/quality.py: per-token KL and top-1 agreement against hand-computed values, the summary statistics,
the compact reference record (round trip, file errors, mismatch errors), scoring over an engine's windows,
the reference engine's config and the default eval window."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import moetier
from moetier import EngineConfig, RuntimeConfig
from moetier.config import Budgets, PrecisionConfig, SparsityConfig
from moetier.errors import ConfigError
from moetier.runtime.quality import (
    TOP_K,
    RefLogprobs,
    collect,
    compare,
    declared_window,
    eval_window,
    kl_per_token,
    reference_config,
    summarize,
    tokens_digest,
    top1_agreement,
)

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"


# -- per-token math ------------------------------------------------------------------------
def test_kl_per_token_hand_computed() -> None:
    ref = torch.tensor([[0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)  # P = (1/2, 1/2); row 2 = the candidate's
    cand = torch.tensor([[math.log(0.25), math.log(0.75)], [1.0, 2.0]], dtype=torch.float64)  # Q = (1/4, 3/4)
    kl = kl_per_token(ref, cand)
    # 1/2 ln(0.5 / 0.25) + 1/2 ln(0.5 / 0.75) = 1/2 ln(4/3)
    assert kl.dtype == torch.float64 and kl.shape == (2,)
    assert kl[0].item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-12)


def test_kl_is_asymmetric_shift_invariant_and_nonnegative() -> None:
    ref = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)  # P = (1/4, 3/4)
    cand = torch.tensor([[5.0, 5.0]], dtype=torch.float64)  # Q = (1/2, 1/2), logits shifted by 5
    # KL(P||Q) = 1/4 ln(1/2) + 3/4 ln(3/2)
    assert kl_per_token(ref, cand).item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-12)
    assert kl_per_token(cand, ref).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    a, b = torch.randn(2, 64, 50, generator=torch.Generator().manual_seed(0))  # [64, 50] each
    assert kl_per_token(a, b).min().item() >= 0
    assert torch.allclose(kl_per_token(a, b + 100), kl_per_token(a, b), rtol=1e-4)


def test_kl_and_top1_refuse_mismatched_shapes() -> None:
    with pytest.raises(ConfigError, match=r"\[3, 5\] and \[3, 6\]"):
        kl_per_token(torch.zeros(3, 5), torch.zeros(3, 6))
    with pytest.raises(ConfigError, match="top-1"):
        top1_agreement(torch.zeros(5), torch.zeros(5))


def test_top1_agreement_hand_computed() -> None:
    ref = torch.tensor([[0.1, 0.9, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    cand = torch.tensor([[0.0, 5.0, 1.0], [0.0, 1.0, 0.5], [0.0, 0.0, 3.0]])
    assert top1_agreement(ref, cand).tolist() == [True, False, True]


def test_summarize_hand_computed() -> None:
    s = summarize(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([True, True, False, True]),
                  nll_sum=4 * math.log(10.0), ref_nll_sum=4 * math.log(8.0))  # fmt: skip
    assert s.tokens == 4 and s.kl_mean == pytest.approx(1.5)
    assert s.kl_stderr == pytest.approx(math.sqrt(5 / 3) / 2)  # sample std sqrt(5/3) over sqrt(4)
    assert s.kl_median == pytest.approx(1.5) and s.kl_p99 == pytest.approx(2.97) and s.kl_max == 3.0
    assert s.top1_pct == pytest.approx(75.0) and s.ppl == pytest.approx(10.0) and s.ref_ppl == pytest.approx(8.0)
    assert set(s.as_dict()) == {"kl_tokens", "kl_mean", "kl_stderr", "kl_median", "kl_p99", "kl_max", "top1_pct",
                                "ref_ppl"}  # fmt: skip
    one = summarize(torch.tensor([0.25]), torch.tensor([False]), 1.0, 1.0)
    assert one.kl_stderr == 0.0 and one.top1_pct == 0.0
    with pytest.raises(ConfigError, match="as many agreements"):
        summarize(torch.tensor([0.1, 0.2]), torch.tensor([True]), 1.0, 1.0)


# -- the reference record ------------------------------------------------------------------
class FakeEngine:
    """window_logits over fixed per-position logits [N, V] (a pure function of the position)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.table = logits  # [N, V]

    def window_logits(
        self, ids: list[int], window: int = 0, on_window: Callable[[int, int], None] | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        window = window or len(ids)
        starts = range(0, len(ids) - 1, window)
        for i, start in enumerate(starts):
            end = min(start + window, len(ids) - 1)
            yield start, self.table[start:end], torch.tensor(ids[start + 1 : end + 1])
            if on_window is not None:
                on_window(i + 1, len(starts))


def _table(n: int = 40, v: int = 100, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(n, v, generator=torch.Generator().manual_seed(seed))  # [N, V]


IDS = [i % 97 for i in range(0, 41 * 7, 7)]  # 41 token ids -> 40 scored


def test_record_keeps_top_k_exact_and_the_tail_within_half_a_step() -> None:
    logits = _table()
    rec = collect(FakeEngine(logits), IDS, 16, {"model": "m"})
    exact = torch.log_softmax(logits, dim=-1)  # [N, V]
    got = rec.rows(0, rec.tokens)
    assert rec.tokens == 40 and rec.vocab == 100 and rec.starts.tolist() == [0, 16, 32]
    assert rec.codes.dtype == torch.int16 and rec.top_ids.shape == (40, TOP_K)
    top = exact.topk(TOP_K, dim=-1)
    assert torch.equal(got.gather(1, top.indices), top.values)  # top K exact
    assert ((got - exact).abs() <= rec.step[:, None] / 2 + 1e-5).all()  # tail: half a 16-bit step
    assert torch.equal(rec.argmax(0, 40), exact.argmax(dim=-1))
    nll = -exact.gather(1, torch.tensor(IDS[1:])[:, None]).sum().item()
    assert rec.nll_sum == pytest.approx(nll, rel=1e-6)
    assert rec.meta["tokens_sha256"] == tokens_digest(IDS) and rec.meta["window"] == 16


def test_record_round_trips_through_a_file(tmp_path: Path) -> None:
    rec = collect(FakeEngine(_table()), IDS, 16, {"model": "m", "fingerprint": "abc"})
    rec.save(tmp_path / "ref.safetensors")
    back = RefLogprobs.load(tmp_path / "ref.safetensors")
    assert torch.equal(back.rows(0, 40), rec.rows(0, 40)) and torch.equal(back.starts, rec.starts)
    assert back.nll_sum == rec.nll_sum and back.meta == rec.meta
    with pytest.raises(ConfigError, match="is a directory"):
        rec.save(tmp_path)


def test_record_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.st: no such file"):
        RefLogprobs.load(tmp_path / "nope.st")
    (tmp_path / "junk.st").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ConfigError, match=r"junk\.st: not a safetensors file"):
        RefLogprobs.load(tmp_path / "junk.st")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.st"), metadata={"format": "something-else"})
    with pytest.raises(ConfigError, match=r"other\.st: not a moetier-ref-logprobs file"):
        RefLogprobs.load(tmp_path / "other.st")


def test_check_matches_refuses_another_model_or_text() -> None:
    rec = collect(FakeEngine(_table()), IDS, 16, {"model": "m", "fingerprint": "abc"})
    rec.check_matches("ref", 100, "abc", IDS)  # the same: no error
    with pytest.raises(ConfigError, match="vocabulary of 100 tokens, this model has 96"):
        rec.check_matches("ref", 96, "abc", IDS)
    with pytest.raises(ConfigError, match="another checkpoint"):
        rec.check_matches("ref", 100, "xyz", IDS)
    with pytest.raises(ConfigError, match="another text or --max-tokens"):
        rec.check_matches("ref", 100, "abc", [*IDS[:-1], 3])


def test_compare_against_itself_and_a_perturbed_candidate() -> None:
    logits = _table()
    rec = collect(FakeEngine(logits), IDS, 16, {})
    same = compare(FakeEngine(logits), IDS, 16, rec, "ref")
    assert same.summary.top1_pct == 100.0 and same.summary.kl_max < 1e-6
    assert same.summary.ppl == pytest.approx(same.summary.ref_ppl, rel=1e-6)
    noisy = logits + 0.5 * torch.randn(40, 100, generator=torch.Generator().manual_seed(1))
    got = compare(FakeEngine(noisy), IDS, 16, rec, "ref")
    want = kl_per_token(logits, noisy)  # from the exact reference logits
    assert torch.allclose(got.kl, want, rtol=1e-3, atol=1e-5)
    assert got.summary.kl_mean == pytest.approx(want.mean().item(), rel=1e-3)
    assert got.summary.top1_pct == pytest.approx(100 * top1_agreement(logits, noisy).double().mean().item())
    assert got.summary.top1_pct < 100.0


def test_compare_refuses_other_windows_or_tokens() -> None:
    rec = collect(FakeEngine(_table()), IDS, 16, {})
    with pytest.raises(ConfigError, match="other windows"):
        compare(FakeEngine(_table()), IDS, 8, rec, "ref")
    with pytest.raises(ConfigError, match="tokens differ in window 0"):
        compare(FakeEngine(_table()), [IDS[0], 5, *IDS[2:]], 16, rec, "ref")
    with pytest.raises(ConfigError, match="vocabulary of 100"):
        compare(FakeEngine(_table(v=90)), IDS, 16, rec, "ref")


# -- engine, reference config, window ------------------------------------------------------------
def test_window_logits_match_perplexity(tiny_ckpt) -> None:
    engine = moetier.load(tiny_ckpt("qwen3_moe"), EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32")))
    ids = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    seen: list[tuple[int, int]] = []
    rec = collect(engine, ids, 8, {}, lambda done, total: seen.append((done, total)))
    want = engine.perplexity(ids, window=8)
    engine.close()
    assert rec.starts.tolist() == [0, 8, 16, 24] and seen[-1] == (4, 4)
    assert rec.tokens == want.tokens == 29
    assert math.exp(rec.nll_sum / rec.tokens) == pytest.approx(want.ppl, rel=1e-6)


def test_reference_config_is_fp32_full_dense_all_resident() -> None:
    cand = EngineConfig(budgets=Budgets(host_expert_bytes=1 << 20), precision=PrecisionConfig(mode="int4"),
                        sparsity=SparsityConfig(target=0.5),
                        runtime=RuntimeConfig(device="cpu", dtype="bf16", max_seq_len=512))  # fmt: skip
    ref = reference_config(cand)
    assert ref.runtime.dtype == "fp32" and ref.runtime.device == "cpu" and ref.runtime.max_seq_len == 512
    assert ref.precision.mode == "full" and not ref.sparsity.enabled
    assert ref.budgets.host_expert_bytes is None and ref.budgets.accel_expert_bytes is None


def test_eval_window_order_and_limits() -> None:
    assert eval_window(64, 256, 1024, 4096) == (64, "--window")
    assert eval_window(0, 256, 1024, 4096) == (256, "train_window of moetier.json")
    assert eval_window(0, None, 2048, 4096) == (1024, "context length")
    assert eval_window(0, None, 2048, 300) == (300, "context length")
    with pytest.raises(ConfigError, match=r"256 tokens \(train_window of moetier\.json\) exceeds the KV cache"):
        eval_window(0, 256, 1024, 128)


def test_declared_window(tmp_path: Path) -> None:
    assert declared_window(BUNDLED) == 256  # the bundled model was trained on 256-token windows
    assert declared_window(tmp_path) is None
    (tmp_path / "moetier.json").write_text(json.dumps({"other": 1}))
    assert declared_window(tmp_path) is None
    for bad in ("{oops", json.dumps({"train_window": "256"}), json.dumps({"train_window": 1})):
        (tmp_path / "moetier.json").write_text(bad)
        with pytest.raises(ConfigError, match=r"moetier\.json"):
            declared_window(tmp_path)
