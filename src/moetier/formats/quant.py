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
- method "rtn": min/max scale and zero, rounded to bf16, the zero refit by least squares
  where that is better. Method "search" (the default): per group, the scale search of
  llama.cpp's K-quants: a few candidate scales (SEARCH_PLANS, per bit width), each rounded
  and refit (scale and offset) by least squares, the best kept, then a few alternating
  re-round / refit steps. Method "hqq" (the earlier default, ~10x slower and no better):
  the best of ten shrunk min/max ranges, then HQQ's half-quadratic proximal solve of the
  zero (Badri & Shaji 2023: p = 0.7, beta = 10, kappa = 1.01, 20 iterations, best kept).
- "search" and "hqq" never measure worse than "rtn" in Frobenius weight error: every group
  keeps the better of the two fits after the bf16 rounding of scale and zero.
- Every group is fitted independently of the others: quantising a matrix's rows together
  or apart, or several experts' matrices stacked (`quantize_stack`), gives the same bytes.
  Everything is vectorised over the groups of a chunk of rows (CHUNK_ELEMENTS), in fp32.
- `QMatrix.sq_err`, set by quantize_matrix, is ||W - dequantize||_F^2 summed per group in
  fp32 from the written q, scale and zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.errors import CheckpointError, ConfigError
from moetier.formats import quant_ggml
from moetier.formats.layout import ExpertLayout
from moetier.kernels import ggml
from moetier.types import GGML_PRECISIONS, Precision

BITS = {Precision.INT8: 8, Precision.INT4: 4, Precision.INT2: 2}
# ggml block precisions (formats/quant_ggml.py): the whole bits of each (Q4_K's 4.5 -> 4), for what counts bits in
# whole numbers (a tier manifest's "bits"); their exact bits a weight are types.GGML_PRECISIONS'
GGML_BITS = {Precision(p): int(bits) for p, (_, bits, _) in GGML_PRECISIONS.items()}
QUANTIZED = (*(p.value for p in BITS), *GGML_PRECISIONS)  # what `moetier quantize` writes
DEFAULT_GROUP = {Precision.INT4: 128, Precision.INT2: 64}  # int8: one group per row (g = K)
FALLBACK_GROUPS = (256, 128, 64, 32)
METHODS = ("search", "hqq", "rtn")
DEFAULT_METHOD = "search"
MATRICES = ("w13", "w2")
# rows fitted together by quantize_matrix: its fp32 temporaries (a few of this size, 4 MiB) stay in the
# caches; per element, 4x larger chunks measured ~4x slower on one core (memory-bound ops)
CHUNK_ELEMENTS = 1 << 20

# HQQ proximal solver (Badri & Shaji 2023), defaults of the paper.
HQQ_ITERS, HQQ_BETA, HQQ_KAPPA, HQQ_P = 20, 10.0, 1.01, 0.7
# Shrink factors of the min/max range tried (per group) to initialise the HQQ solve.
RANGE_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55)


@dataclass(frozen=True)
class SearchPlan:
    """How "search" fits a group: the inverse scales tried are (qmax + d) / (max - min) for d in `deltas`,
    over a window `centred` on the group's range or starting at its minimum; then up to `refits`
    alternating re-rounding / least-squares steps (stopped early once no group improves)."""

    deltas: tuple[float, ...]
    centred: bool
    refits: int


# per bit width; chosen by measurement on gaussian matrices and the benchmark model (docs/precision.md)
SEARCH_PLANS = {
    8: SearchPlan((-0.5, 0.5), centred=False, refits=2),
    4: SearchPlan((0.0, 0.5, 1.0), centred=False, refits=4),
    2: SearchPlan((-0.5, 0.5, 1.5), centred=True, refits=6),
}


@dataclass(frozen=True)
class QuantSpec:
    """How to quantise: a precision below FULL and a requested group size (None: the precision's default). A ggml
    block precision (q4_k ...: formats/quant_ggml.py) has no group size: its blocks are its groups."""

    precision: Precision
    group_size: int | None = None

    def __post_init__(self) -> None:
        try:
            precision = Precision(self.precision)
        except ValueError:
            raise ConfigError(f"unknown precision {self.precision!r}; expected one of {', '.join(QUANTIZED)}") from None
        if precision not in BITS and precision not in GGML_BITS:
            raise ConfigError(
                f"QuantSpec needs a quantised precision ({', '.join(QUANTIZED)}), got {precision.value!r}"
            )
        object.__setattr__(self, "precision", precision)
        g = self.group_size
        if precision in GGML_BITS and g is not None:
            raise ConfigError(f"{precision.value} is a ggml block type: its blocks are its groups; give no group size")
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 32 or g % 32):
            raise ConfigError(
                f"group_size must be None (the precision's default) or a positive multiple of 32 "
                f"(32, 64, 128, 256, or a matrix's K for one group per row), got {g!r}"
            )

    @property
    def bits(self) -> int:
        """Bits a weight (a ggml block precision: its integer class, GGML_BITS)."""
        return BITS[self.precision] if self.precision in BITS else GGML_BITS[self.precision]

    @property
    def ggml(self) -> bool:
        """Whether this is a ggml block precision (formats/quant_ggml.py)."""
        return self.precision in GGML_BITS


def resolve_group(spec: QuantSpec, k: int, *, shape: tuple[int, int] | None = None) -> int:
    """Group size used for a matrix with `k` in features: the requested (or default) group if it
    divides k, else the largest of (256, 128, 64, 32) not above it that does. int8 defaults to k. A ggml block
    precision: the values a block of the type the matrix takes (quant_ggml.block_type)."""
    if spec.ggml:
        return ggml.block_of(quant_ggml.block_type(spec.precision, k, shape))
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
    sq_err: float | None = None  # ||W - dequantize||_F^2 as measured by the fit (None: not known)

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


# --------------------------------------------------------------------------- fitting: "search" and "rtn"


@dataclass(frozen=True)
class _Stats:
    """One chunk of groups in the centred frame x = W - mid, mid = (min + max) / 2 of the group."""

    x: torch.Tensor  # [M, G, g] fp32
    n: int  # g, elements per group
    sx: torch.Tensor  # [M, G, 1] sum of x
    sxx: torch.Tensor  # [M, G, 1] sum of x * x


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _round_into(x: torch.Tensor, inv: torch.Tensor, off: torch.Tensor | float, qmax: int, out: torch.Tensor) -> None:
    """out = clamp(round(x * inv + off), 0, qmax): the integer codes. x, out [M, G, g]; inv, off [M, G, 1] or scalar"""
    torch.mul(x, inv, out=out).add_(off).round_().clamp_(0, qmax)


def _sums(q: torch.Tensor, x: torch.Tensor, tmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group sum(q), sum(q * q), sum(q * x). q, x, tmp (scratch) [M, G, g] -> three [M, G, 1]"""
    sq = q.sum(-1, keepdim=True)
    sqq = torch.mul(q, q, out=tmp).sum(-1, keepdim=True)
    sqx = torch.mul(q, x, out=tmp).sum(-1, keepdim=True)
    return sq, sqq, sqx


def _line_fit(q: torch.Tensor, st: _Stats, tmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-squares line x ~ a * q + b per group for fixed codes q [M, G, g], and its squared error
    (inf where q is constant or the slope is not positive). -> a, b, sse [M, G, 1]"""
    sq, sqq, sqx = _sums(q, st.x, tmp)
    det = st.n * sqq - sq * sq
    a = (st.n * sqx - sq * st.sx) / det
    b = (st.sx - a * sq) / st.n
    sse = st.sxx - a * sqx - b * st.sx
    ok = (det > 0) & (a > 0) & torch.isfinite(sse)
    return a, b, torch.where(ok, sse, torch.full_like(sse, float("inf")))


def _search(
    st: _Stats, span: torch.Tensor, qmax: int, plan: SearchPlan, q: torch.Tensor, tmp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scale search of llama.cpp's K-quants (make_qkx2_quants), all groups at once: for each inverse
    scale (qmax + d) / span of the plan, round, fit scale and offset by least squares, keep per group the
    best; then alternate re-rounding with the kept line and refitting while any group improves.
    A group that does not improve keeps its line, so the result of a group does not depend on the other
    groups fitted with it. span [M, G, 1] -> a, b, sse [M, G, 1] (x ~ a * q + b; sse inf: no fit)"""
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for d in plan.deltas:
        # window of (qmax + d) steps: centred on the range, or starting at its minimum (x = -span / 2)
        _round_into(st.x, (qmax + d) / span, qmax / 2 if plan.centred else (qmax + d) / 2, qmax, q)
        fit = _line_fit(q, st, tmp)
        if best is None:
            best = fit
            continue
        better = fit[2] < best[2]  # [M, G, 1]
        best = (torch.where(better, fit[0], best[0]), torch.where(better, fit[1], best[1]),
                torch.where(better, fit[2], best[2]))  # fmt: skip
    assert best is not None
    a, b, sse = best
    for _ in range(plan.refits):
        inv = 1.0 / a
        _round_into(st.x, inv, -b * inv, qmax, q)  # nearest codes of the kept line
        a2, b2, sse2 = _line_fit(q, st, tmp)
        better = sse2 < sse
        if not bool(better.any()):
            break
        a, b, sse = torch.where(better, a2, a), torch.where(better, b2, b), torch.where(better, sse2, sse)
    return a, b, sse


def _bf16_params(
    st: _Stats, mid: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int, q: torch.Tensor,
    tmp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Round scale and zero [M, G, 1] to bf16, take the nearest codes for them, and refit the zero by least
    squares for those codes (rounded to bf16 again) where that lowers the group's error.
    -> scale, zero (bf16 values in fp32), sse [M, G, 1] (from the group sums)"""
    s = _bf16(scale)
    s = torch.where(s > 0, s, torch.ones_like(s))  # an underflowed (or undefined) scale
    z = _bf16(zero)
    inv = 1.0 / s
    _round_into(st.x, inv, mid * inv + z, qmax, q)  # W / s + z = x / s + mid / s + z
    sq, sqq, sqx = _sums(q, st.x, tmp)

    def sse(c: torch.Tensor) -> torch.Tensor:  # sum((x - s q + c)^2), c = mid + s z
        return st.sxx - 2 * s * sqx + 2 * c * st.sx + s * s * sqq - 2 * s * c * sq + st.n * c * c

    z2 = _bf16(((s * sq - st.sx) / st.n - mid) / s)  # the least-squares c, as a zero
    e1, e2 = sse(mid + s * z), sse(mid + s * z2)
    better = e2 < e1
    return s, torch.where(better, z2, z), torch.where(better, e2, e1)


def _fit_chunk(
    wg: torch.Tensor, qmax: int, method: str, plan: SearchPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fit one chunk of groups with "rtn" or "search". wg [M, G, g] fp32 (not modified)
    -> q [M, G, g] (fp32 integers), scale, zero (bf16 values) [M, G, 1], squared error [M, G, 1]"""
    mn, mx = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)  # [M, G, 1]; NaN and inf show here
    if not bool(torch.isfinite(mn).all()) or not bool(torch.isfinite(mx).all()):
        raise _NonFinite
    mid = (mn + mx) / 2
    # bf16 parameters resolve ~2^-8 of the group's magnitude: a flatter group is a constant
    span = torch.maximum(mx - mn, torch.maximum(mn.abs(), mx.abs()) * 2.0**-7)
    span = torch.where(span > 0, span, torch.ones_like(span))  # an all-zero group
    x = wg - mid  # [M, G, g]
    q, tmp = torch.empty_like(x), torch.empty_like(x)  # codes, scratch [M, G, g]
    st = _Stats(x, x.shape[-1], x.sum(-1, keepdim=True), torch.mul(x, x, out=tmp).sum(-1, keepdim=True))
    s_rtn = span / qmax
    scale, zero, sse = _bf16_params(st, mid, s_rtn, -mn / s_rtn, qmax, q, tmp)  # min/max (rtn)
    if method == "search":
        a, b, fit_sse = _search(st, span, qmax, plan, q, tmp)
        ok = torch.isfinite(fit_sse)  # else keep rtn's, which is also compared below
        a = torch.where(ok, a, s_rtn)
        z = torch.where(ok, -(b + mid) / a, -mn / s_rtn)  # x ~ a q + b  <=>  W ~ (q - z) a
        s2, z2, sse2 = _bf16_params(st, mid, a, z, qmax, q, tmp)
        better = sse2 < sse  # never worse than rtn, after the bf16 rounding of both
        scale, zero = torch.where(better, s2, scale), torch.where(better, z2, zero)
    inv = 1.0 / scale
    _round_into(x, inv, mid * inv + zero, qmax, q)  # the nearest codes of the kept parameters
    err = torch.mul(q, scale, out=tmp)
    torch.sub(x, err, out=err).add_(mid + scale * zero)  # W - (q - zero) * scale
    sq_err = torch.mul(err, err, out=err).sum(-1, keepdim=True)
    return q, scale, zero, sq_err


class _NonFinite(Exception):
    """A chunk holds NaN or inf (turned into a CheckpointError naming the matrix)."""


# --------------------------------------------------------------------------- fitting: "hqq"


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


def _fit_hqq(wg: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "hqq" fit (the default before "search"; slower, kept for tiers written with it): per group the
    better of rtn and a range search + HQQ zero solve, after bf16 rounding. wg [M, G, g] fp32
    -> q [M, G, g], scale, zero [M, G, 1], squared error [M, G, 1]"""
    if not bool(torch.isfinite(wg).all()):
        raise _NonFinite
    q, s, z, sse = _finalize(wg, *_rtn_params(wg, qmax), qmax)
    s_h, z_h = _range_search(wg, qmax)
    q_h, s_h, z_h, sse_h = _finalize(wg, s_h, _hqq_zero(wg, s_h, z_h, qmax), qmax)
    better = sse_h < sse  # [M, G, 1]
    return (torch.where(better, q_h, q), torch.where(better, s_h, s), torch.where(better, z_h, z),
            torch.where(better, sse_h, sse))  # fmt: skip


# --------------------------------------------------------------------------- quantize_matrix


def quantize_matrix(w: torch.Tensor, spec: QuantSpec, method: str = DEFAULT_METHOD) -> QMatrix:
    """w [N, K] float -> canonical QMatrix (its `sq_err` set). "rtn": min/max scale and zero; "search":
    per group the best of a scale search with least-squares refits (see the module docstring); "hqq": the
    earlier range search + HQQ zero solve. "search" and "hqq" keep per group whichever of their fit and
    rtn's is better after bf16 rounding, so they never measure worse than rtn in weight error.
    Rows are fitted in chunks of about CHUNK_ELEMENTS; every group's result is independent of the
    others, so quantising rows together or apart gives the same bytes."""
    if method not in METHODS:
        raise ConfigError(f"unknown quantisation method {method!r}; expected one of {METHODS}")
    if spec.ggml:
        raise ConfigError(f"{spec.precision.value} is a ggml block type: quantise it with formats/quant_ggml.py")
    if w.dim() != 2 or not w.is_floating_point():
        raise CheckpointError(f"can only quantise a 2-D float matrix, got {w.dtype} of shape {list(w.shape)}")
    n, k = w.shape
    g = resolve_group(spec, k, shape=(n, k))
    w = w.detach()
    qmax = 2**spec.bits - 1
    plan = SEARCH_PLANS[spec.bits]
    packed = torch.empty((n, k * spec.bits // 8), dtype=torch.uint8, device=w.device)
    scale = torch.empty((n, k // g), dtype=torch.bfloat16, device=w.device)
    zero = torch.empty((n, k // g), dtype=torch.bfloat16, device=w.device)
    sq_err = 0.0
    # hqq's zero solve stops when no group of the whole matrix improves: it is fitted in one piece
    rows = n if method == "hqq" else max(1, CHUNK_ELEMENTS // k)
    for r0 in range(0, n, rows):  # over row chunks (cache-sized), not over groups
        r1 = min(n, r0 + rows)
        wg = w[r0:r1].to(torch.float32).contiguous().view(r1 - r0, k // g, g)  # [M, G, g], row-major: sums in one order
        try:
            q, s, z, sse = _fit_hqq(wg, qmax) if method == "hqq" else _fit_chunk(wg, qmax, method, plan)
        except _NonFinite:
            raise CheckpointError(
                f"matrix of shape {[n, k]} holds non-finite values (inf or nan); cannot quantise it"
            ) from None
        packed[r0:r1] = pack_bits(q.reshape(r1 - r0, k), spec.bits)
        scale[r0:r1] = s.reshape(r1 - r0, k // g)
        zero[r0:r1] = z.reshape(r1 - r0, k // g)
        sq_err += float(sse.sum(dtype=torch.float64))
    return QMatrix(q=packed, scale=scale, zero=zero, n=n, k=k, spec=spec, sq_err=sq_err)


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
    if spec.ggml and layout.down_rows:
        raise ConfigError(
            f"{spec.precision.value} tiers have no down-rows layout for --sparsity; sparse execution reads full, "
            "int8, int4 or int2 experts"
        )
    for m, (n, k) in zip(MATRICES, ((2 * i, h), (i, h) if layout.down_rows else (h, i)), strict=True):
        if spec.ggml:  # the type's blocks, rows as a GGUF file stores them
            out[f"{m}.q"] = (torch.uint8, (n, quant_ggml.row_bytes(spec.precision, k)))
            continue
        groups = k // resolve_group(spec, k, shape=(n, k))
        out[f"{m}.q"] = (torch.uint8, (n, k * b // 8))
        out[f"{m}.scale"] = (torch.bfloat16, (n, groups))
        out[f"{m}.zero"] = (torch.bfloat16, (n, groups))
    if layout.has_bias:
        out["b13"] = (dtype, (2 * i,))
        out["b2"] = (dtype, (h,))
    return out


def quantize_stack(w: torch.Tensor, spec: QuantSpec, method: str = DEFAULT_METHOD) -> tuple[list[QMatrix], float]:
    """w [B, N, K], one matrix per expert -> (B QMatrix, each what quantize_matrix(w[b]) gives, and their
    total squared error). Fitted together, as one [B * N, K] matrix, where the method allows it; "hqq" is
    fitted matrix by matrix."""
    if w.dim() != 3:
        raise CheckpointError(f"quantize_stack needs [experts, N, K], got shape {list(w.shape)}")
    b, n, k = w.shape
    if method == "hqq":
        qms = [quantize_matrix(m, spec, method) for m in w]
        return qms, sum(qm.sq_err or 0.0 for qm in qms)
    qm = quantize_matrix(w.reshape(b * n, k), spec, method)  # [B * N, K]
    q, scale, zero = qm.q.view(b, n, -1), qm.scale.view(b, n, -1), qm.zero.view(b, n, -1)
    return [QMatrix(q[e], scale[e], zero[e], n, k, spec) for e in range(b)], qm.sq_err or 0.0


def quantize_expert(
    pieces: dict[str, torch.Tensor], spec: QuantSpec, method: str = DEFAULT_METHOD, down_rows: bool = False
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
        if spec.ggml:  # rows of the type's blocks (formats/quant_ggml.py)
            out[f"{m}.q"] = quant_ggml.quantize_rows(
                w, quant_ggml.block_type(spec.precision, w.shape[1], (w.shape[0], w.shape[1]))
            )
            continue
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
