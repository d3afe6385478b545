"""Output quality against a reference model: per-token KL divergence of the next-token distribution, top-1
agreement, their summary (as llama.cpp's `llama-perplexity --kl-divergence` reports them), and the reference's
log-probabilities, kept in memory or saved to a file (`moetier eval --save-logits FILE` / `--kl-ref FILE`).

Math (float64 throughout): for a scored token t with reference distribution P_t and candidate Q_t over the
vocabulary, KL_t = sum_v P_t(v) (log P_t(v) - log Q_t(v)) in nats, both sides renormalised with log_softmax;
top-1 agreement is argmax P_t == argmax Q_t. The summary gives the mean KL with its standard error
(sample std / sqrt(n)), the median and 99th percentile (linear interpolation), the maximum, the top-1 share
and both perplexities.

The reference record (`RefLogprobs`) is compact: per scored token the log-probabilities of the whole vocabulary
quantized to 16 bits between that token's lowest log-probability and 0 (a step of at most 100/65535 nats), plus
the `TOP_K` largest log-probabilities exact in float32 with their ids; dequantizing writes the exact values over
the 16-bit ones. So the reference's argmax, its top mass and its perplexity (its summed NLL is stored exactly)
are exact, and only tail probabilities carry a rounding of at most half a step in log space. `--kl-ref full`
keeps the same record in memory, so a saved file and `full` give the same numbers.

Non-finite logits (NaN / Inf from a damaged weight) never become a figure: `collect` and `compare` raise
NumericalError naming the window; a perplexity that overflows a float is inf (`safe_exp`), not an exception.

Invariants: reference and candidate are scored over the same tokens and the same windows (`starts` and `targets`
are compared, so a record of another text, another --max-tokens or another --window is refused with an error
naming the difference); a record of another model (other vocabulary or checkpoint fingerprint) is refused;
KL is never computed from logits of different lengths or vocabularies.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from moetier.config import EngineConfig, PrecisionConfig, RuntimeConfig
from moetier.errors import ConfigError, NumericalError
from moetier.formats.qtier import source_fingerprint
from moetier.models.open import open_index

FORMAT = "moetier-ref-logprobs"
FORMAT_VERSION = 1
TOP_K = 32  # reference log-probabilities kept exact per token
LOGPROB_FLOOR = -100.0  # log-probabilities below this are stored as this (p < 4e-44)
TRAIN_WINDOW_FILE = "moetier.json"  # a model folder's moetier notes; `train_window` is read by declared_window


class WindowScorer(Protocol):
    """What scoring needs of an engine (runtime/engine.Engine.window_logits)."""

    def window_logits(
        self, ids: list[int], window: int = 0, on_window: Callable[[int, int], None] | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]: ...


# -- per-token math ---------------------------------------------------------------------
def safe_exp(x: float) -> float:
    """exp(x), inf where it overflows a float (a perplexity from a huge NLL), nan for nan."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def check_finite(logits: torch.Tensor, what: str) -> None:
    """NumericalError naming `what` unless every logit ([T, V], any float dtype) is finite."""
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).any(dim=-1).sum())
        raise NumericalError(
            f"{what}: {bad} of {logits.shape[0]} positions have NaN / Inf logits: a damaged weight (NaN / Inf in the "
            "checkpoint) or an overflow; no figure is computed from them"
        )


def kl_per_token(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || Q_cand) in nats per token: ref_logits [T, V], cand_logits [T, V] (logits or log-probs, any
    float dtype; each row is renormalised) -> [T] float64, >= 0 up to rounding."""
    if ref_logits.dim() != 2 or ref_logits.shape != cand_logits.shape:
        raise ConfigError(
            f"KL needs two [T, V] logit tensors of one shape, got {list(ref_logits.shape)} and "
            f"{list(cand_logits.shape)}"
        )
    ref = torch.log_softmax(ref_logits.double(), dim=-1)  # [T, V]
    cand = torch.log_softmax(cand_logits.to(ref.device).double(), dim=-1)  # [T, V]
    return (ref.exp() * (ref - cand)).sum(dim=-1)  # [T]


def top1_agreement(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """ref_logits [T, V], cand_logits [T, V] -> [T] bool: the two argmax tokens are the same."""
    if ref_logits.dim() != 2 or ref_logits.shape != cand_logits.shape:
        raise ConfigError(
            f"top-1 needs two [T, V] logit tensors of one shape, got {list(ref_logits.shape)} and "
            f"{list(cand_logits.shape)}"
        )
    return ref_logits.argmax(dim=-1) == cand_logits.to(ref_logits.device).argmax(dim=-1)  # [T]


@dataclass(frozen=True)
class QualitySummary:
    """KL and top-1 agreement of a candidate against a reference over the same scored tokens."""

    tokens: int
    kl_mean: float  # nats/token
    kl_stderr: float  # standard error of kl_mean: sample std (n - 1) / sqrt(n); 0 for one token
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_pct: float  # % of tokens whose argmax agrees
    ppl: float  # the candidate's perplexity over these tokens
    ref_ppl: float  # the reference's

    def as_dict(self) -> dict[str, float | int]:
        return {"kl_tokens": self.tokens, "kl_mean": self.kl_mean, "kl_stderr": self.kl_stderr,
                "kl_median": self.kl_median, "kl_p99": self.kl_p99, "kl_max": self.kl_max,
                "top1_pct": self.top1_pct, "ref_ppl": self.ref_ppl}  # fmt: skip


def summarize(kl: torch.Tensor, agree: torch.Tensor, nll_sum: float, ref_nll_sum: float) -> QualitySummary:
    """kl [N] (per-token KL), agree [N] bool, and the two NLLs summed over the same N tokens -> the summary."""
    n = int(kl.numel())
    if n == 0 or agree.numel() != n:
        raise ConfigError(f"quality summary needs as many agreements as KL values (> 0), got {n} and {agree.numel()}")
    kl = kl.double().cpu()  # [N]
    stderr = kl.std(unbiased=True).item() / math.sqrt(n) if n > 1 else 0.0
    q = torch.quantile(kl, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return QualitySummary(
        tokens=n, kl_mean=kl.mean().item(), kl_stderr=stderr, kl_median=q[0], kl_p99=q[1], kl_max=kl.max().item(),
        top1_pct=100.0 * agree.double().mean().item(), ppl=safe_exp(nll_sum / n), ref_ppl=safe_exp(ref_nll_sum / n),
    )  # fmt: skip


# -- the reference record -----------------------------------------------------------------
def tokens_digest(ids: list[int]) -> str:
    """sha256 of a token id sequence (int64 little-endian)."""
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class RefLogprobs:
    """The reference's next-token log-probabilities over scored tokens, compact (see the module docstring).

    N scored tokens, V vocabulary, W windows, K = min(TOP_K, V)."""

    starts: torch.Tensor  # [W] int64: each window's first position in the token ids
    targets: torch.Tensor  # [N] int64: the scored tokens, windows concatenated
    lo: torch.Tensor  # [N] float32: log-probability of code 0
    step: torch.Tensor  # [N] float32: log-probability per code
    codes: torch.Tensor  # [N, V] int16: round((logprob - lo) / step) - 32768
    top_ids: torch.Tensor  # [N, K] int64: the K most likely tokens, most likely first
    top_logprobs: torch.Tensor  # [N, K] float32: their exact log-probabilities
    nll_sum: float  # the reference's NLL summed over the N tokens (exact, from float32 logits)
    meta: dict[str, Any] = field(default_factory=dict)  # model, fingerprint, window, description, ...

    @property
    def tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def vocab(self) -> int:
        return int(self.codes.shape[1])

    @classmethod
    def encode(cls, windows: Iterable[tuple[int, torch.Tensor, torch.Tensor]], meta: dict[str, Any]) -> RefLogprobs:
        """windows: (start, logits [T, V], targets [T]) per window, consumed one at a time -> the compact record."""
        starts, targets, lo, step, codes, top_ids, top_lp, nll = [], [], [], [], [], [], [], 0.0
        for start, logits, tgt in windows:
            check_finite(logits, f"the reference's window at token {start}")
            lp = torch.log_softmax(logits.float(), dim=-1).clamp_min(LOGPROB_FLOOR).cpu()  # [T, V]
            low = lp.min(dim=-1).values  # [T]
            stp = (-low).clamp_min(1e-30) / 65535  # [T]; log-probs lie in [low, 0]
            q = torch.round((lp - low[:, None]) / stp[:, None]).clamp(0, 65535) - 32768  # [T, V]
            k = min(TOP_K, lp.shape[1])
            vals, idx = lp.topk(k, dim=-1)  # [T, K]
            starts.append(start)
            targets.append(tgt.cpu().long())
            lo.append(low)
            step.append(stp)
            codes.append(q.to(torch.int16))
            top_ids.append(idx)
            top_lp.append(vals)
            nll -= lp.gather(1, tgt.cpu().long()[:, None]).double().sum().item()
        if not starts:
            raise ConfigError("no windows to record")
        return cls(torch.tensor(starts, dtype=torch.int64), torch.cat(targets), torch.cat(lo), torch.cat(step),
                   torch.cat(codes), torch.cat(top_ids), torch.cat(top_lp), nll, dict(meta))  # fmt: skip

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Log-probabilities of scored tokens a..b-1 -> [b - a, V] float32 (exact top K, 16-bit tail)."""
        codes = self.codes[a:b].float() + 32768  # [T, V]
        lp = self.lo[a:b, None] + codes * self.step[a:b, None]  # [T, V]
        return lp.scatter(1, self.top_ids[a:b], self.top_logprobs[a:b])  # [T, V]

    def argmax(self, a: int, b: int) -> torch.Tensor:
        """The reference's most likely token for scored tokens a..b-1 -> [b - a] int64 (exact)."""
        return self.top_ids[a:b, 0]

    # -- the file ------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write the record as one safetensors file (tensors above; `meta` as JSON in its metadata)."""
        if path.is_dir():
            raise ConfigError(f"--save-logits {path} is a directory; give a file name, e.g. {path / 'ref.safetensors'}")
        tensors = {"starts": self.starts, "targets": self.targets, "lo": self.lo, "step": self.step,
                   "codes": self.codes, "top_ids": self.top_ids, "top_logprobs": self.top_logprobs}  # fmt: skip
        head = {"format": FORMAT, "version": str(FORMAT_VERSION), "nll_sum": repr(self.nll_sum),
                "meta": json.dumps(self.meta, sort_keys=True)}  # fmt: skip
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=head)

    @classmethod
    def load(cls, path: Path) -> RefLogprobs:
        """Read a record written by `save`; ConfigError names the file and what is wrong with it."""
        if not path.is_file():
            raise ConfigError(f"reference logits file {path}: no such file")
        try:
            with safe_open(str(path), framework="pt") as f:
                head = f.metadata() or {}
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(f"reference logits file {path}: not a safetensors file ({exc})") from exc
        if head.get("format") != FORMAT:
            raise ConfigError(f"reference logits file {path}: not a {FORMAT} file (write one with --save-logits)")
        if head.get("version") != str(FORMAT_VERSION):
            raise ConfigError(f"reference logits file {path}: version {head.get('version')!r}, this moetier reads "
                              f"{FORMAT_VERSION}")  # fmt: skip
        names = ("starts", "targets", "lo", "step", "codes", "top_ids", "top_logprobs")
        if missing := [n for n in names if n not in tensors]:
            raise ConfigError(f"reference logits file {path}: missing tensors {', '.join(missing)}")
        t = tensors
        rec = cls(t["starts"], t["targets"], t["lo"], t["step"], t["codes"], t["top_ids"], t["top_logprobs"],
                  nll_sum=float(head.get("nll_sum", "nan")), meta=json.loads(head.get("meta", "{}")))  # fmt: skip
        n = rec.tokens
        shapes_ok = (rec.codes.dim() == 2 and rec.codes.shape[0] == n and rec.lo.shape == rec.step.shape == (n,)
                     and rec.top_ids.shape == rec.top_logprobs.shape and rec.top_ids.shape[0] == n)  # fmt: skip
        if not shapes_ok or not math.isfinite(rec.nll_sum):
            raise ConfigError(f"reference logits file {path}: inconsistent tensor shapes or header")
        return rec

    # -- matching a run --------------------------------------------------------------
    def check_matches(self, source: str, vocab: int, fingerprint: str | None, ids: list[int]) -> None:
        """ConfigError unless this record was made for the same model (vocabulary, checkpoint fingerprint) and
        the same token ids; the windows are checked as they are scored (`compare`)."""
        if self.vocab != vocab:
            raise ConfigError(f"{source} holds a vocabulary of {self.vocab} tokens, this model has {vocab}: "
                              f"it was saved for another model ({self.meta.get('model', '?')})")  # fmt: skip
        theirs = self.meta.get("fingerprint")
        if fingerprint is not None and theirs is not None and theirs != fingerprint:
            raise ConfigError(f"{source} was saved for another checkpoint ({self.meta.get('model', '?')}): its "
                              "weights or config.json differ from this model's")  # fmt: skip
        if self.meta.get("tokens_sha256") not in (None, tokens_digest(ids)):
            raise ConfigError(f"{source} was saved for another text or --max-tokens ({self.meta.get('text', '?')}, "
                              f"{len(ids)} tokens now, {self.meta.get('token_ids', '?')} then)")  # fmt: skip


def collect(engine: WindowScorer, ids: list[int], window: int, meta: dict[str, Any],
            on_window: Callable[[int, int], None] | None = None) -> RefLogprobs:  # fmt: skip
    """Score `ids` with `engine` over its perplexity windows and keep the compact record of its log-probs."""
    meta = {**meta, "tokens_sha256": tokens_digest(ids), "token_ids": len(ids), "window": window}
    return RefLogprobs.encode(engine.window_logits(ids, window, on_window), meta)


@dataclass(frozen=True)
class Comparison:
    summary: QualitySummary
    kl: torch.Tensor  # [N] float64 per-token KL
    agree: torch.Tensor  # [N] bool


def compare(engine: WindowScorer, ids: list[int], window: int, ref: RefLogprobs, source: str,
            on_window: Callable[[int, int], None] | None = None, first: int = 0) -> Comparison:  # fmt: skip
    """Score `ids` with `engine` over its perplexity windows against `ref` (made over the same windows). `first` > 0:
    the figures (KL, top-1, both perplexities) over each window's scored positions from `first` on, as
    llama-perplexity's --kl-divergence scores the second half of each of its windows."""
    if first < 0:
        raise ConfigError(f"the first scored position of a window must be >= 0, got {first}")
    kls, agrees, nll, ref_nll, done = [], [], 0.0, 0.0, 0
    starts = ref.starts.tolist()
    for i, (start, logits, tgt) in enumerate(engine.window_logits(ids, window, on_window)):
        t = int(tgt.numel())
        if i >= len(starts) or starts[i] != start or done + t > ref.tokens:
            raise ConfigError(f"{source} was scored over other windows (its windows start at {starts[:3]}..., "
                              f"this run's window {i} at {start}): use the same --window and --max-tokens")  # fmt: skip
        if not torch.equal(ref.targets[done : done + t], tgt.cpu().long()):
            raise ConfigError(f"{source} was saved for another text: its tokens differ in window {i}")
        check_finite(logits, f"window {i} (at token {start})")
        cand = logits.double()  # [T, V]
        if cand.shape[1] != ref.vocab:
            raise ConfigError(f"{source} holds a vocabulary of {ref.vocab} tokens, this model's logits {cand.shape[1]}")
        rows = ref.rows(done, done + t)  # [T, V] the reference's log-probabilities
        kls.append(kl_per_token(rows, cand.cpu())[first:])  # [T - first]
        agrees.append((ref.argmax(done, done + t) == cand.argmax(dim=-1).cpu())[first:])
        tl = tgt.cpu().long()
        nll += torch.nn.functional.cross_entropy(cand[first:], tgt.to(cand.device)[first:], reduction="sum").item()
        if first:  # the reference's NLL over the same positions, from its kept log-probabilities
            ref_nll -= rows[first:].double().gather(1, tl[first:, None]).sum().item()
        done += t
    if done != ref.tokens:
        raise ConfigError(
            f"{source} scored {ref.tokens} tokens, this run {done}: use the same --window and --max-tokens"
        )
    kl, agree = torch.cat(kls), torch.cat(agrees)  # [N], [N]
    if kl.numel() == 0:
        raise ConfigError(f"no position of any window is at or past {first}: lower the first scored position")
    return Comparison(summarize(kl, agree, nll, ref_nll if first else ref.nll_sum), kl, agree)


# -- the reference engine and the default window --------------------------------------------
def reference_config(candidate: EngineConfig) -> EngineConfig:
    """`--kl-ref full`: the same checkpoint in fp32, every expert resident at full precision, sparsity off,
    on the candidate's device with its KV-cache length (so the same windows fit) and kernel settings."""
    rt = candidate.runtime
    runtime = RuntimeConfig(device=rt.device, dtype="fp32", lean=rt.lean, max_seq_len=rt.max_seq_len,
                            native_kernels=rt.native_kernels, kernel_cache=rt.kernel_cache)  # fmt: skip
    return EngineConfig(runtime=runtime, precision=PrecisionConfig(mode="full"))


def model_fingerprint(model: Path) -> str:
    """The checkpoint's fingerprint (formats/qtier.source_fingerprint: config.json and sampled weight bytes)."""
    return str(source_fingerprint(open_index(model))["fingerprint"])


def eval_window(requested: int, declared: int | None, max_positions: int, kv_len: int) -> tuple[int, str]:
    """The window `moetier eval` scores over and where it came from: `requested` (--window) when given, else
    the window the model declares it was trained on (`declared_window`), else its context length capped at
    1024 and at the KV cache (`kv_len`). A window past the KV cache is a ConfigError."""
    if requested:
        win, source = requested, "--window"
    elif declared:
        win, source = declared, f"train_window of {TRAIN_WINDOW_FILE}"
    else:
        win, source = min(max_positions, 1024, kv_len), "context length"
    if win > kv_len:
        raise ConfigError(f"window of {win} tokens ({source}) exceeds the KV cache of {kv_len} tokens")
    return win, source


def declared_window(model: Path) -> int | None:
    """The window a model was trained on, when its folder says so: `train_window` in MODEL/moetier.json
    (a positive int); None when the file is absent. A malformed file is a ConfigError naming it."""
    path = Path(model) / TRAIN_WINDOW_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from exc
    value = data.get("train_window") if isinstance(data, dict) else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ConfigError(f"{path}: train_window must be an integer of at least 2, got {value!r}")
    return value


__all__ = [
    "FORMAT", "TOP_K", "TRAIN_WINDOW_FILE", "Comparison", "QualitySummary", "RefLogprobs", "check_finite", "collect",
    "compare", "declared_window", "eval_window", "kl_per_token", "model_fingerprint", "reference_config", "safe_exp",
    "summarize", "tokens_digest", "top1_agreement",
]  # fmt: skip
