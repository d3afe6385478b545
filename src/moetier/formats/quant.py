"""Group-wise asymmetric weight quantisation: fitting (HQQ, RTN), canonical bit packing, dequantisation.

A weight W [N, K] (PyTorch Linear convention) is cut along K into G = K // g groups of g
consecutive elements and stored as

    W[n, k] ~= (q[n, k] - zero[n, k // g]) * scale[n, k // g]

with q an unsigned integer in [0, 2^bits - 1] and scale, zero bf16 floats (zero not rounded
to an integer, HQQ style). Canonical tensors of one matrix: `q` uint8 [N, K * bits // 8]
(element k of a byte's run sits at bits (k % per) * bits, per = 8 // bits), `scale` and
`zero` bf16 [N, G]. qformat.py turns them into the compute kernels' own formats.

Invariants:
- `unpack_bits(pack_bits(q, b), b, K) == q` exactly; dequantisation is a pure function
  of the canonical tensors.
- method "rtn": min/max scale and zero. Method "hqq": per group the best of a small search over
  shrunk ranges (min/max clipping), then HQQ's half-quadratic proximal solve of the zero
  (Badri & Shaji 2023: p = 0.7, beta = 10, kappa = 1.01, 20 iterations, best iterate kept).
  HQQ alone fixes the scale at min/max, which leaves int2 at ~44% error on a gaussian; the
  range search brings it to ~32%.
- "hqq" never measures worse than "rtn" in Frobenius weight error: every group keeps the
  better of the two fits after the bf16 rounding of scale and zero.
- Everything is vectorised over all groups of a matrix at once, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.errors import CheckpointError, ConfigError
from moetier.formats.layout import ExpertLayout
from moetier.types import Precision

BITS = {Precision.INT8: 8, Precision.INT4: 4, Precision.INT2: 2}
DEFAULT_GROUP = {Precision.INT4: 128, Precision.INT2: 64}  # int8: one group per row (g = K)
FALLBACK_GROUPS = (256, 128, 64, 32)
METHODS = ("hqq", "rtn")
MATRICES = ("w13", "w2")

# HQQ proximal solver (Badri & Shaji 2023), defaults of the paper.
HQQ_ITERS, HQQ_BETA, HQQ_KAPPA, HQQ_P = 20, 10.0, 1.01, 0.7
# Shrink factors of the min/max range tried (per group) to initialise the HQQ solve.
RANGE_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55)


@dataclass(frozen=True)
class QuantSpec:
    """How to quantise: a precision below FULL and a requested group size (None: the precision's default)."""

    precision: Precision
    group_size: int | None = None

    def __post_init__(self) -> None:
        try:
            precision = Precision(self.precision)
        except ValueError:
            raise ConfigError(f"unknown precision {self.precision!r}; expected one of int8, int4, int2") from None
        if precision not in BITS:
            raise ConfigError(f"QuantSpec needs a quantised precision (int8, int4, int2), got {precision.value!r}")
        object.__setattr__(self, "precision", precision)
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 32 or g % 32):
            raise ConfigError(
                f"group_size must be None (the precision's default) or a positive multiple of 32 "
                f"(32, 64, 128, 256, or a matrix's K for one group per row), got {g!r}"
            )

    @property
    def bits(self) -> int:
        return BITS[self.precision]


def resolve_group(spec: QuantSpec, k: int, *, shape: tuple[int, int] | None = None) -> int:
    """Group size used for a matrix with `k` in features: the requested (or default) group if it
    divides k, else the largest of (256, 128, 64, 32) not above it that does. int8 defaults to k."""
    want = spec.group_size if spec.group_size is not None else DEFAULT_GROUP.get(spec.precision, k)
    if k > 0 and k % want == 0:
        return want
    for g in FALLBACK_GROUPS:
        if g <= want and k % g == 0:
            return g
    what = f"a matrix of shape {list(shape)}" if shape is not None else f"a matrix with K={k} in features"
    raise ConfigError(
        f"cannot quantise {what} to {spec.precision.value}: group size {want} does not divide K={k} "
        f"and neither does any of {FALLBACK_GROUPS} at or below it"
    )


@dataclass
class QMatrix:
    """One quantised matrix in canonical form."""

    q: torch.Tensor  # uint8 [N, K * bits // 8]
    scale: torch.Tensor  # bf16 [N, G]
    zero: torch.Tensor  # bf16 [N, G]
    n: int
    k: int
    spec: QuantSpec

    @property
    def group(self) -> int:
        return self.k // self.scale.shape[1]


# --------------------------------------------------------------------------- bit packing


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] integers in [0, 2^bits) -> uint8 [N, K * bits // 8], element k at bits (k % per) * bits."""
    n, k = q.shape
    per = 8 // bits
    if k % per:
        raise ValueError(f"K={k} is not a multiple of {per} ({bits}-bit packing)")
    q3 = q.to(torch.uint8).reshape(n, k // per, per)  # [N, K/per, per]
    out = q3[..., 0].clone()  # [N, K/per]
    for i in range(1, per):  # over the <= 4 bit fields of a byte, not over rows or groups
        out |= q3[..., i] << (bits * i)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """uint8 [N, K * bits // 8] -> uint8 [N, K], the inverse of pack_bits."""
    n = packed.shape[0]
    per = 8 // bits
    if per == 1:
        return packed.reshape(n, k)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # [per]
    return ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).view(n, k)  # [N, K/per, per] -> [N, K]


# --------------------------------------------------------------------------- fitting


def _rtn_params(wg: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max scale and float zero per group. wg [N, G, g] fp32 -> scale, zero [N, G, 1]."""
    mn, mx = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)  # [N, G, 1]
    # bf16 parameters resolve ~2^-8 of the group's magnitude: a flatter group is a constant
    span = torch.maximum(mx - mn, torch.maximum(mn.abs(), mx.abs()) * 2.0**-7)
    scale = torch.where(span > 0, span / qmax, torch.ones_like(span))
    return scale, -mn / scale


def _group_sse(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    """Squared error per group of the fit (scale, zero) with q rounded to nearest. -> [N, G, 1]"""
    q = (wg / scale + zero).round_().clamp_(0, qmax)
    err = wg - (q - zero) * scale
    return (err * err).sum(-1, keepdim=True)


def _range_search(wg: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the best (squared error) of the min/max range shrunk by each of RANGE_RATIOS, the
    window centred on the range and its zero then refit by least squares. -> scale, zero [N, G, 1]"""
    mid = (wg.amin(-1, keepdim=True) + wg.amax(-1, keepdim=True)) / 2  # [N, G, 1]
    base, _ = _rtn_params(wg, qmax)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (sse, scale, zero)
    for r in RANGE_RATIOS:
        s = base * r
        wn = wg / s  # [N, G, g], in quantisation steps
        q = (wn + (qmax / 2 - mid / s)).round_().clamp_(0, qmax)
        z = (q - wn).mean(-1, keepdim=True)
        err = _group_sse(wg, s, z, qmax)
        if best is None:
            best = (err, s, z)
            continue
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better, s, best[1]), torch.where(better, z, best[2]))
    assert best is not None
    return best[1], best[2]


def _shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Generalised soft threshold, the proximal operator of |x|^p: sign(x) relu(|x| - |x|^(p-1) / beta).
    It is 0 wherever |x|^(2-p) <= 1/beta, so the (slow) power is taken on the other elements only."""
    a = x.abs()
    keep = a > beta ** (-1.0 / (2.0 - p))
    out = torch.zeros_like(x)
    if bool(keep.any()):
        v = a[keep]
        out[keep] = (v - v.pow(p - 1) / beta).relu_() * torch.sign(x[keep])
    return out


def _hqq_zero(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    """HQQ's half-quadratic solve of the zero for a fixed scale, all groups at once:
        q = clamp(round(W/s + z)); We = shrink_lp(W - (q - z) s); z = mean(q - (W - We)/s); beta *= kappa
    keeping, per group, the iterate of least squared error (the start included); stops once no group
    improves. wg [N, G, g], scale, zero [N, G, 1] -> zero [N, G, 1]"""
    wn = wg / scale  # [N, G, g], in quantisation steps
    best_err, best_zero = torch.full_like(zero, float("inf")), zero
    beta = HQQ_BETA
    for it in range(HQQ_ITERS + 1):
        q = (wn + zero).round_().clamp_(0, qmax)  # [N, G, g]
        d = wn - q + zero  # W - Wr, in steps
        err = (d * d).sum(-1, keepdim=True)  # per group (scale fixed): the squared error up to s^2
        better = err < best_err
        if it > 0 and not bool(better.any()):
            break
        best_err, best_zero = torch.where(better, err, best_err), torch.where(better, zero, best_zero)
        if it == HQQ_ITERS:
            break
        we = _shrink_lp(d.mul_(scale), beta, HQQ_P).div_(scale)  # sparse error model, in steps
        zero = (q - wn + we).mean(-1, keepdim=True)
        beta *= HQQ_KAPPA
    return best_zero


def _finalize(
    wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round scale and zero to bf16, recompute q with the rounded values, and refit the zero (least
    squares, rounded again) where that lowers the group's error. -> q [N, G, g], scale, zero, sse [N, G, 1]"""
    s = scale.to(torch.bfloat16).float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # an underflowed scale
    z = zero.to(torch.bfloat16).float()
    q = (wg / s + z).round_().clamp_(0, qmax)
    err = wg - (q - z) * s
    sse = (err * err).sum(-1, keepdim=True)
    z2 = (q - wg / s).mean(-1, keepdim=True).to(torch.bfloat16).float()
    q2 = (wg / s + z2).round_().clamp_(0, qmax)
    err2 = wg - (q2 - z2) * s
    sse2 = (err2 * err2).sum(-1, keepdim=True)
    better = sse2 < sse
    return torch.where(better, q2, q), s, torch.where(better, z2, z), torch.where(better, sse2, sse)


def quantize_matrix(w: torch.Tensor, spec: QuantSpec, method: str = "hqq") -> QMatrix:
    """w [N, K] float -> canonical QMatrix. "rtn": min/max scale, round to nearest. "hqq": per group the
    best of a range search, then HQQ's proximal zero solve; whichever of hqq and rtn fits a group better
    (after bf16 rounding) is kept, so hqq is never worse than rtn in weight error."""
    if method not in METHODS:
        raise ConfigError(f"unknown quantisation method {method!r}; expected one of {METHODS}")
    if w.dim() != 2 or not w.is_floating_point():
        raise CheckpointError(f"can only quantise a 2-D float matrix, got {w.dtype} of shape {list(w.shape)}")
    n, k = w.shape
    g = resolve_group(spec, k, shape=(n, k))
    wf = w.detach().to(torch.float32)
    if not bool(torch.isfinite(wf).all()):
        raise CheckpointError(f"matrix of shape {[n, k]} holds non-finite values (inf or nan); cannot quantise it")
    qmax = 2**spec.bits - 1
    wg = wf.reshape(n, k // g, g)  # [N, G, g]
    q, s, z, sse = _finalize(wg, *_rtn_params(wg, qmax), qmax)
    if method == "hqq":
        s_h, z_h = _range_search(wg, qmax)
        q_h, s_h, z_h, sse_h = _finalize(wg, s_h, _hqq_zero(wg, s_h, z_h, qmax), qmax)
        better = sse_h < sse  # [N, G, 1]
        q, s, z = torch.where(better, q_h, q), torch.where(better, s_h, s), torch.where(better, z_h, z)
    return QMatrix(
        q=pack_bits(q.reshape(n, k), spec.bits),
        scale=s.reshape(n, k // g).to(torch.bfloat16),
        zero=z.reshape(n, k // g).to(torch.bfloat16),
        n=n,
        k=k,
        spec=spec,
    )


# --------------------------------------------------------------------------- dequantisation


def dequantize_into(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, out: torch.Tensor
) -> torch.Tensor:
    """Canonical tensors -> out [N, K] (any float dtype), (q - zero) * scale computed in out's dtype.
    Temporaries are uint8 bit fields of one N x K/per slice each; no float temporary of W's size."""
    n, k = out.shape
    per, mask = 8 // bits, 2**bits - 1
    g = k // scale.shape[1]
    if per == 1:
        out.copy_(q)
    else:
        fields = out.view(n, k // per, per)  # [N, K/per, per]
        for i in range(per):  # over the bit fields of a byte, not over rows or groups
            fields[..., i].copy_((q >> (bits * i)) & mask)
    og = out.view(n, k // g, g)  # [N, G, g]
    og.sub_(zero.unsqueeze(-1)).mul_(scale.unsqueeze(-1))
    return out


def dequantize(qm: QMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> W [N, K] in `dtype`, computed in fp32 and rounded once."""
    out = torch.empty((qm.n, qm.k), dtype=torch.float32, device=qm.q.device)
    dequantize_into(qm.q, qm.scale.float(), qm.zero.float(), qm.spec.bits, out)
    return out.to(dtype)


def relative_error(w: torch.Tensor, qm: QMatrix) -> float:
    """||W - dequantize(qm)||_F / ||W||_F."""
    wf = w.detach().float()
    return float((wf - dequantize(qm)).norm() / wf.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- experts


def expert_tensor_specs(
    layout: ExpertLayout, spec: QuantSpec, dtype: torch.dtype
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The canonical quantised tensors of one expert: name -> (dtype, shape). Biases stay in `dtype`."""
    h, i, b = layout.hidden, layout.inter, spec.bits
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for m, (n, k) in zip(MATRICES, ((2 * i, h), (i, h) if layout.down_rows else (h, i)), strict=True):
        groups = k // resolve_group(spec, k, shape=(n, k))
        out[f"{m}.q"] = (torch.uint8, (n, k * b // 8))
        out[f"{m}.scale"] = (torch.bfloat16, (n, groups))
        out[f"{m}.zero"] = (torch.bfloat16, (n, groups))
    if layout.has_bias:
        out["b13"] = (dtype, (2 * i,))
        out["b2"] = (dtype, (h,))
    return out


def quantize_expert(
    pieces: dict[str, torch.Tensor], spec: QuantSpec, method: str = "hqq", down_rows: bool = False
) -> dict[str, torch.Tensor]:
    """Full-precision canonical pieces {gate [I,H], up [I,H], down [H,I], (gate_bias, up_bias, down_bias)}
    -> canonical quantised tensors {w13.q, w13.scale, w13.zero, w2.*, (b13 [2I], b2 [H])}. With
    `down_rows` the down piece is [I, H] (its rows: one per neuron) and is quantised along H."""
    missing = [p for p in ("gate", "up", "down") if p not in pieces]
    if missing:
        raise CheckpointError(f"expert pieces lack {missing}; got {sorted(pieces)}")
    gate, up, down = pieces["gate"], pieces["up"], pieces["down"]
    want_down = gate.shape if down_rows else gate.shape[::-1]
    if gate.dim() != 2 or gate.shape != up.shape or down.dim() != 2 or down.shape != want_down:
        raise CheckpointError(
            f"expert pieces disagree: gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} "
            f"(expected gate = up = [I, H] and down = {'[I, H]' if down_rows else '[H, I]'})"
        )
    inter, hidden = gate.shape
    bias_names = ("gate_bias", "up_bias", "down_bias")
    present = [p for p in bias_names if p in pieces]
    if present and len(present) != 3:
        raise CheckpointError(f"expert has biases {present} but not all of {list(bias_names)}")
    out: dict[str, torch.Tensor] = {}
    for m, w in (("w13", torch.cat([gate, up])), ("w2", down)):  # w13 [2I, H], w2 [H, I]
        qm = quantize_matrix(w, spec, method)
        out[f"{m}.q"], out[f"{m}.scale"], out[f"{m}.zero"] = qm.q, qm.scale, qm.zero
    if present:
        gb, ub, db = (pieces[p] for p in bias_names)
        if gb.shape != (inter,) or ub.shape != (inter,) or db.shape != (hidden,):
            raise CheckpointError(
                f"expert biases disagree with I={inter}, H={hidden}: gate_bias {list(gb.shape)}, "
                f"up_bias {list(ub.shape)}, down_bias {list(db.shape)}"
            )
        out["b13"] = torch.cat([gb, ub])  # [2I], model dtype
        out["b2"] = db.clone()  # [H]
    return out
