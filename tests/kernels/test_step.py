"""The decode step's native calls (kernels/step.py over csrc/step.c) against float64 references of the same math.

One random layer per case: the attention half (RMSNorm, QKV with bias, q/k norms per head or over the whole
projection, clipping, RoPE at each row's position, the K/V cache write, GQA attention over each row's own
cache, the output projection with bias, the residual, the post-attention norm, the router's softmax top-k with
or without renormalisation) for a prompt of several rows (causal through the cache) then single-row steps and a
batch of rows on different caches; the MoE half (routed experts from slot descriptors, a gated shared expert,
a dense MLP layer, down rows of the sparse layout, pairs of id -1 skipped: bit for bit the routing written without
them, any other negative id refused) and the head. The reference rounds where the kernels round (bf16 outputs of
projections, q / k after RoPE, the attention output, each residual add), so the only differences are fp32
accumulation and the rounding that follows it."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from moetier.kernels import decode, native
from moetier.kernels.decode import KIND_BF16, ROWS
from moetier.kernels.step import DESC, Activation, AttnLayer, AttnSpec, Head, MoeLayer, Step, desc_row
from moetier.store.pool import SlotViews

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    got = decode.load(True, None)
    if got is None:
        pytest.skip(f"no native kernels here: {native.load_error(True, None)}")
    return got


def r(t: torch.Tensor) -> torch.Tensor:
    """Round to bf16, back to float64 (where the kernels round)."""
    return t.to(BF16).double()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def rope_table(n: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]  # [n, hd/2]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(BF16), ang.sin().to(BF16)


def rotate(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = u.shape[-1] // 2
    rot = torch.cat([-u[..., half:], u[..., :half]], -1)
    return u * cos.double() + rot * sin.double()


class Layer:
    """Random weights of one layer and its float64 reference."""

    def __init__(self, h: int, nh: int, nkv: int, hd: int, e: int, k: int, qk: int, clip: float, bias: bool,
                 norm_topk: bool, round_w: bool, gptoss: bool = False, *, seed: int) -> None:  # fmt: skip
        """`gptoss`: GPT-OSS's attention sinks (one logit a head), a sliding window of 4 positions and a router
        bias."""
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int, s: float = 0.1) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * s).to(BF16)

        self.h, self.nh, self.nkv, self.hd, self.e, self.k = h, nh, nkv, hd, e, k
        self.qk, self.clip, self.norm_topk, self.round_w, self.eps = qk, clip, norm_topk, round_w, 1e-6
        n = (nh + 2 * nkv) * hd
        self.wqkv, self.wo = rnd(n, h), rnd(h, nh * hd)
        self.bqkv = rnd(n) if bias else None
        self.bo = rnd(h) if bias else None
        self.in_norm, self.post_norm = (1 + rnd(h)).contiguous(), (1 + rnd(h)).contiguous()
        qn = hd if qk == 1 else nh * hd
        kn = hd if qk == 1 else nkv * hd
        self.q_norm = (1 + rnd(qn)) if qk else None
        self.k_norm = (1 + rnd(kn)) if qk else None
        self.router = rnd(e, h, s=0.5)
        self.router_b = rnd(e, s=0.5) if gptoss else None
        self.sinks = rnd(nh, s=1.0) if gptoss else None
        self.window = 4 if gptoss else 0
        self.cos, self.sin = rope_table(64, hd)
        spec = AttnSpec(h, nh, nkv, hd, self.eps, clip, qk, e, k, norm_topk, round_w)
        self.native = AttnLayer(spec, 0, self.in_norm, self.post_norm, self.wqkv, self.bqkv, self.wo, self.bo,
                                self.q_norm, self.k_norm, self.cos, self.sin, self.router, self.sinks, self.window,
                                self.router_b)  # fmt: skip

    def ref(self, x: torch.Tensor, pos: list[int], kc: list[torch.Tensor], vc: list[torch.Tensor],
            wide: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [T, H] rows (bf16; `wide`: any, the fp32 residual stream) at `pos` writing into float64 caches kc/vc
        (one [nkv, 64, hd] each, per row) -> (x after attention, h, top-k ids, weights), float64. `wide`: the
        kernels' wide mode, which rounds only what a matmul reads (the normed rows, h) and keeps fp16 caches."""
        T, nh, nkv, hd = x.shape[0], self.nh, self.nkv, self.hd
        def rr(t: torch.Tensor) -> torch.Tensor:  # the roundings the wide mode leaves out
            return t if wide else r(t)

        xd = x.double()
        hn = r(rms(xd, self.in_norm, self.eps))
        qkv = hn @ self.wqkv.double().T + (self.bqkv.double() if self.bqkv is not None else 0)
        qkv = rr(qkv)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
        if self.qk == 2:
            q, k = rr(rms(q, self.q_norm, self.eps)), rr(rms(k, self.k_norm, self.eps))  # type: ignore[arg-type]
        if self.clip > 0:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if self.qk == 1:
            q, k = rr(rms(q, self.q_norm, self.eps)), rr(rms(k, self.k_norm, self.eps))  # type: ignore[arg-type]
        p = torch.tensor(pos)
        cos, sin = self.cos[p][:, None], self.sin[p][:, None]  # [T, 1, hd]
        q, k = rr(rotate(q, cos, sin)), rr(rotate(k, cos, sin))
        if wide:  # the caches hold fp16
            k, v = k.half().double(), v.half().double()
        for t in range(T):  # every row's K/V first: prompt rows see each other through the cache
            kc[t][:, pos[t]] = k[t]
            vc[t][:, pos[t]] = v[t]
        att = torch.empty(T, nh, hd, dtype=torch.float64)
        for t in range(T):
            lo = max(0, pos[t] + 1 - self.window) if self.window else 0  # the sliding window's first position
            for head in range(nh):
                g = head // (nh // nkv)
                s = kc[t][g, lo : pos[t] + 1] @ q[t, head] / math.sqrt(hd)
                if self.sinks is not None:  # the head's sink joins the softmax, then is dropped
                    s = torch.cat([s, self.sinks[head].double().reshape(1)])
                    att[t, head] = torch.softmax(s, -1)[:-1] @ vc[t][g, lo : pos[t] + 1]
                else:
                    att[t, head] = torch.softmax(s, -1) @ vc[t][g, lo : pos[t] + 1]
        o = rr(r(att.reshape(T, nh * hd)) @ self.wo.double().T + (self.bo.double() if self.bo is not None else 0))
        xo = rr(xd + o)
        h = r(rms(xo, self.post_norm, self.eps))
        logits = rr(h @ self.router.double().T + (self.router_b.double() if self.router_b is not None else 0))
        probs = torch.softmax(logits, -1)
        w, ids = probs.topk(self.k, -1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return xo, h, ids, (r(w) if self.round_w and not wide else w)


CASES = {  # h, nh, nkv, hd, e, k, qk norm, clip, bias, norm_topk, round_w
    "qwen3": (128, 4, 2, 32, 8, 2, 1, 0.0, False, True, True),
    "qwen2": (96, 4, 4, 24, 6, 2, 0, 0.0, True, False, True),
    "olmoe": (64, 4, 4, 16, 6, 2, 2, 0.35, False, False, True),
    "mixtral": (64, 8, 2, 8, 4, 2, 0, 0.0, False, True, False),
    "gpt_oss": (64, 4, 2, 16, 8, 2, 0, 0.0, True, True, True, True),  # sinks, window 4, router bias
}


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_half_matches_float64(case: str, isa: str, wide: bool) -> None:
    """A 6-row prompt on one cache, 3 single-row steps on it, then one row on each of 3 caches (a batch), on every
    path this CPU builds. bf16 step: within the bf16 roundings the reference repeats. Wide (csrc/step.h mt_step.xw):
    the fp32 residual stream updated in place, fp16 caches, nothing rounded but what a matmul reads, so the kernels
    meet a reference without those roundings far more tightly (1e-3 against 2e-2)."""
    lib = native.load(True, None, isa)
    if lib is None:
        pytest.skip(f"no {isa} build here: {native.load_error(True, None, isa)}")
    L = Layer(*CASES[case], seed=len(case))  # type: ignore[arg-type, misc]
    h, nkv, hd, k = L.h, L.nkv, L.hd, L.k
    step = Step(lib, 8, h, 1, k, L.e, [L.native], [], None, 64, 2, wide=wide)
    assert step.stream.dtype == (torch.float32 if wide else BF16) and step.stream.shape == (8, h)
    step.layer(0)
    step.s.nthreads = 2
    kv = torch.float16 if wide else BF16
    caches = [(torch.zeros(1, nkv, 64, hd, dtype=kv), torch.zeros(1, nkv, 64, hd, dtype=kv)) for _ in range(3)]
    refc = [(torch.zeros(nkv, 64, hd, dtype=torch.float64), torch.zeros(nkv, 64, hd, dtype=torch.float64))
            for _ in range(3)]  # fmt: skip
    tol_x, tol_h, tol_w, tol_kv = (1e-3, 1e-2, 5e-3, 2e-3) if wide else (2e-2, 3e-2, 1e-2, 2e-2)
    g = torch.Generator().manual_seed(7)
    calls = [([0] * 6, list(range(6)))] + [([0], [6 + i]) for i in range(3)] + [([0, 1, 2], [9, 0, 0])]
    for which, pos in calls:
        T = len(pos)
        x = torch.randn(T, h, generator=g)  # wide: fp32 values bf16 cannot hold
        x = x if wide else x.to(BF16)
        step.stream[:T].copy_(x)
        for t, (c, p) in enumerate(zip(which, pos, strict=True)):
            step.pos[t], step.cap[t] = p, 64
            step.kc[t], step.vc[t] = caches[c][0].data_ptr(), caches[c][1].data_ptr()
        step.s.T = T
        step.attn(L.native)
        xo, hn, ids, w = L.ref(x, pos, [refc[c][0] for c in which], [refc[c][1] for c in which], wide=wide)
        assert float((step.stream[:T].double() - xo).abs().max()) <= tol_x * float(xo.abs().amax()), case
        assert float((step.h[:T].double() - hn).abs().max()) <= tol_h * float(hn.abs().amax()), case
        got_ids = step.ids[0, :T].long()
        agree = (got_ids == ids).all(-1)
        assert float(agree.float().mean()) >= 0.8, (case, got_ids, ids)  # bf16 near-ties may swap an expert
        # wide: unrounded weights, but h is rounded from x (bf16, as the experts read it): an ulp flip moves one
        # by about 1e-3
        assert torch.allclose(step.wts[0, :T][agree].double(), w[agree], atol=tol_w), case
        for c, p in zip(which, pos, strict=True):  # the caches hold the reference's K and V in their dtype
            for got, want in ((caches[c][0][0, :, p], refc[c][0][:, p]), (caches[c][1][0, :, p], refc[c][1][:, p])):
                assert float((got.double() - want).abs().max()) <= tol_kv * float(want.abs().max()), case


@pytest.mark.parametrize("isa", ["native", "c"])
def test_f16_conversions_match_torch(isa: str) -> None:
    """The wide caches' fp32 <-> fp16 conversions (bf16.h f2h / h2f: F16C, or plain C in the `c` build) are
    torch's: nearest even, subnormals, overflow to Inf, NaN kept, and back exactly."""
    got_lib = native.load(True, None, isa)
    if got_lib is None:
        pytest.skip(f"no {isa} build here: {native.load_error(True, None, isa)}")
    special = [65504.0, 65519.0, 65520.0, -1e6, float("inf"), 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-25 + 2.0**-40,
               1e-9, 6.1035e-5, 2.0**-14 - 2.0**-30, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -0.0, 0.1, -7.3]
    x = torch.cat([torch.tensor(special), torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 3e4,
                   torch.randn(4096, generator=torch.Generator().manual_seed(5)) * 1e-5,
                   torch.tensor([float("nan")])]).float()  # fmt: skip
    h = torch.empty(x.numel(), dtype=torch.float16)
    back = torch.empty_like(x)
    got_lib.moetier_f16_roundtrip(x.data_ptr(), x.numel(), h.data_ptr(), back.data_ptr())
    want = x.half()
    assert torch.equal(h.view(torch.int16)[:-1], want.view(torch.int16)[:-1])  # bit for bit (NaN's payload aside)
    assert bool(torch.isnan(h[-1])) and bool(torch.isnan(back[-1]))
    assert torch.equal(back[:-1], want.float()[:-1])


def _bf16_slot(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, SlotViews]:
    i2, hh = w13.shape
    row = torch.cat([w13.reshape(-1), w2.reshape(-1)]).contiguous()
    views = SlotViews(row[: i2 * hh].view(i2, hh), row[i2 * hh :].view(hh, i2 // 2), None, None, row, {})
    return row, views


def _bf16_experts(h: int, inter: int, e: int, g: torch.Generator) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, SlotViews]], torch.Tensor]:  # fmt: skip
    """e random bf16 experts (w13 [2I, H], w2 [H, I], N(0, 0.2)), their slots and descriptor table [E, DESC]."""
    experts = [((torch.randn(2 * inter, h, generator=g) * 0.2).to(BF16),
                (torch.randn(h, inter, generator=g) * 0.2).to(BF16)) for _ in range(e)]  # fmt: skip
    slots = [_bf16_slot(*w) for w in experts]
    return experts, slots, torch.tensor([desc_row(s[1]) for s in slots], dtype=torch.int64)


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """float64 SwiGLU expert of rows x; the down rows read the activation rounded to bf16, as the kernels do."""
    gu = x @ w13.double().T
    n = w13.shape[0] // 2
    return r(torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]) @ w2.double().T


def _moe_step(lib: ctypes.CDLL, moe: MoeLayer, h: int, e: int, ids: torch.Tensor, g: torch.Generator) -> tuple[
        Step, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A Step for the MoE half of T rows routed by ids [T, k]: (step, residual x0, input h, weights), random."""
    t, k = ids.shape
    step = Step(lib, t, h, 1, k, e, [], [moe], None, 0, 2)
    step.layer(0)
    step.s.nthreads, step.s.T = 2, t
    x0, hin = torch.randn(t, h, generator=g).to(BF16), torch.randn(t, h, generator=g).to(BF16)
    wts = torch.rand(t, k, generator=g)
    step.x[:t].copy_(x0)
    step.h[:t].copy_(hin)
    step.ids[0, :t].copy_(ids)
    step.wts[0, :t].copy_(wts)
    return step, x0, hin, wts


def test_moe_half_matches_float64(lib: ctypes.CDLL) -> None:
    """Routed bf16 experts by descriptor (a batch of rows with repeated experts), a sigmoid-gated shared expert,
    and a dense MLP layer (E = 0), each added to the residual."""
    h, inter, e, k, ish = 64, 32, 6, 2, 48
    g = torch.Generator().manual_seed(3)
    experts, slots, table = _bf16_experts(h, inter, e, g)
    sh13, sh2 = (torch.randn(2 * ish, h, generator=g) * 0.2).to(BF16), (torch.randn(h, ish, generator=g) * 0.2).to(BF16)
    gate = (torch.randn(h, generator=g) * 0.3).to(BF16)
    for shared in (False, True):
        moe = MoeLayer(h, inter, e, k, (sh13, sh2, gate) if shared else None)
        ids = torch.tensor([[1, 4], [4, 1], [0, 5], [2, 4]], dtype=torch.int32)
        step, x0, hin, wts = _moe_step(lib, moe, h, e, ids, g)
        for ex in range(e):
            row = desc_row(slots[ex][1])
            assert row is not None
            moe.desc[ex] = None
        for ex in set(ids.reshape(-1).tolist()):
            moe.desc[ex] = table.data_ptr() + 8 * DESC * ex
        step.moe(moe)
        y = torch.zeros(4, h, dtype=torch.float64)
        for t in range(4):
            for j in range(k):
                ex = int(ids[t, j])
                y[t] += float(wts[t, j]) * _swiglu(hin[t : t + 1].double(), *experts[ex])[0]
            if shared:
                gt = float(r(torch.sigmoid(r(hin[t].double() @ gate.double()))))
                y[t] += gt * _swiglu(hin[t : t + 1].double(), sh13, sh2)[0]
        want = r(x0.double() + r(y))
        assert float((step.x[:4].double() - want).abs().max()) <= 2e-2 * float(want.abs().max()), shared
    dense = MoeLayer(h, 0, 0, 0, (sh13, sh2, None))  # a dense MLP layer
    step = Step(lib, 2, h, 1, 1, 1, [], [dense], None, 0, 2)
    step.layer(0)
    step.s.nthreads, step.s.T = 2, 2
    x0, hin = torch.randn(2, h, generator=g).to(BF16), torch.randn(2, h, generator=g).to(BF16)
    step.x[:2].copy_(x0)
    step.h[:2].copy_(hin)
    step.moe(dense)
    want = r(x0.double() + r(_swiglu(hin.double(), sh13, sh2)))
    assert float((step.x[:2].double() - want).abs().max()) <= 2e-2 * float(want.abs().max())


def test_wide_moe_half_and_head_match_float64(lib: ctypes.CDLL) -> None:
    """The wide mode's MoE half adds the experts' fp32 sum to the fp32 residual unrounded (the shared expert's gate
    unrounded too), and its head reads that residual and returns fp32 logits, NaN counted."""
    h, inter, e, k, ish, v = 64, 32, 6, 2, 48, 96
    g = torch.Generator().manual_seed(13)
    experts, _slots, table = _bf16_experts(h, inter, e, g)  # _slots: the memory the table points at
    sh13, sh2 = (torch.randn(2 * ish, h, generator=g) * 0.2).to(BF16), (torch.randn(h, ish, generator=g) * 0.2).to(BF16)
    gate = (torch.randn(h, generator=g) * 0.3).to(BF16)
    moe = MoeLayer(h, inter, e, k, (sh13, sh2, gate))
    wh, norm = (torch.randn(v, h, generator=g) * 0.2).to(BF16), (1 + torch.randn(h, generator=g) * 0.1).to(BF16)
    head = Head(norm, wh, 1e-6)
    step = Step(lib, 4, h, 1, k, e, [], [moe], head, 0, 2, wide=True)
    assert step.out.dtype == torch.float32
    step.layer(0)
    step.s.nthreads, step.s.T = 2, 4
    ids = torch.tensor([[1, 4], [4, 1], [0, 5], [2, 4]], dtype=torch.int32)
    x0, hin = torch.randn(4, h, generator=g) * 3, torch.randn(4, h, generator=g).to(BF16)
    wts = torch.rand(4, k, generator=g)
    step.xw[:4].copy_(x0)
    step.h[:4].copy_(hin)
    step.ids[0, :4].copy_(ids)
    step.wts[0, :4].copy_(wts)
    for ex in set(ids.reshape(-1).tolist()):
        moe.desc[ex] = table.data_ptr() + 8 * DESC * ex
    step.moe(moe)

    y = torch.zeros(4, h, dtype=torch.float64)
    for t in range(4):
        for j in range(k):
            y[t] += float(wts[t, j]) * _swiglu(hin[t : t + 1].double(), *experts[int(ids[t, j])])[0]
        y[t] += float(torch.sigmoid(hin[t].double() @ gate.double())) * _swiglu(hin[t : t + 1].double(), sh13, sh2)[0]
    want = x0.double() + y  # no rounding: x0 holds values bf16 cannot
    assert float((step.xw[:4].double() - want).abs().max()) <= 1e-4 * float(want.abs().max())
    logits, bad = step.head(head, 4)
    ref = r(rms(step.xw[:4].double(), norm, 1e-6)) @ wh.double().T  # the normed rows rounded: the matmul's input
    assert bad == 0 and float((logits.double() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    step.xw[2, 7] = float("inf")  # a row's Inf: its logits are NaN (inf / inf in the norm), counted
    logits, bad = step.head(head, 4)
    assert bad == v and bool(torch.isnan(logits[2]).all()) and bool(torch.isfinite(logits[[0, 1, 3]]).all())


def test_moe_half_gpt_oss_experts_match_float64(lib: ctypes.CDLL) -> None:
    """GPT-OSS's experts (csrc/step.h act 1): biases read from each slot's descriptor and added to the gate/up and
    down outputs, gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate); one expert
    without biases in the same call; an unknown activation refused."""
    h, inter, e, k, alpha, limit = 64, 32, 5, 2, 1.702, 0.6  # a low limit: the clamps bind on these values
    g = torch.Generator().manual_seed(11)
    experts = []
    for ex in range(e):
        w13 = (torch.randn(2 * inter, h, generator=g) * 0.2).to(BF16)
        w2 = (torch.randn(h, inter, generator=g) * 0.2).to(BF16)
        b13 = None if ex == 3 else (torch.randn(2 * inter, generator=g) * 0.3).to(BF16)
        b2 = None if ex == 3 else (torch.randn(h, generator=g) * 0.3).to(BF16)
        parts = [w13.reshape(-1), w2.reshape(-1)] + ([b13, b2] if b13 is not None and b2 is not None else [])
        row = torch.cat(parts).contiguous()
        n13, n2 = 2 * inter * h, h * inter
        views = SlotViews(row[:n13].view(2 * inter, h), row[n13 : n13 + n2].view(h, inter),
                          None if b13 is None else row[n13 + n2 : n13 + n2 + 2 * inter],
                          None if b2 is None else row[n13 + n2 + 2 * inter :], row, {})  # fmt: skip
        experts.append((w13, w2, b13, b2, row, views))
    table = torch.tensor([desc_row(x[5]) for x in experts], dtype=torch.int64)  # [E, DESC]
    assert int(table[3, 11]) == -1 and int(table[0, 11]) == 2 * (2 * inter * h + h * inter)

    def expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
               b2: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        gu = x @ w13.double().T + (b13.double() if b13 is not None else 0.0)
        gate, up = gu[:, :inter].clamp(max=limit), gu[:, inter:].clamp(-limit, limit)
        a = (up + 1) * gate * torch.sigmoid(alpha * gate)
        return r(a) @ w2.double().T + (b2.double() if b2 is not None else 0.0)  # down rows read bf16 activations

    moe = MoeLayer(h, inter, e, k, act=Activation(1, alpha, limit))
    ids = torch.tensor([[1, 4], [4, 3], [0, 3], [2, 4]], dtype=torch.int32)
    step, x0, hin, wts = _moe_step(lib, moe, h, e, ids, g)
    for ex in range(e):
        moe.desc[ex] = table.data_ptr() + 8 * DESC * ex
    step.moe(moe)
    y = torch.zeros(4, h, dtype=torch.float64)
    for t in range(4):
        for j in range(k):
            w13, w2, b13, b2 = experts[int(ids[t, j])][:4]
            y[t] += float(wts[t, j]) * expert(hin[t : t + 1].double(), w13, w2, b13, b2)[0]
    want = r(x0.double() + r(y))
    assert float((step.x[:4].double() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    silu = (step.x[:4].double() - want).abs().max()  # the same call read as SiLU experts is far off: act is used
    moe.s.act = 0
    step.x[:4].copy_(x0)
    step.moe(moe)
    assert float((step.x[:4].double() - want).abs().max()) > 10 * float(silu) + 1e-3
    moe.s.act = 7
    with pytest.raises(ValueError, match="refused"):
        step.moe(moe)


def test_head_matches_float64_and_refuses_small_scratch(lib: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(5)
    h, v = 64, 200
    w, norm = (torch.randn(v, h, generator=g) * 0.2).to(BF16), (1 + torch.randn(h, generator=g) * 0.1).to(BF16)
    head = Head(norm, w, 1e-6)
    step = Step(lib, 3, h, 1, 1, 1, [], [], head, 0, 2)
    step.s.nthreads = 2
    x = torch.randn(3, h, generator=g).to(BF16)
    step.x[:3].copy_(x)
    logits, bad = step.head(head, 3)
    want = r(r(rms(x.double(), norm, 1e-6)) @ w.double().T)
    assert float((logits.double() - want).abs().max()) <= 2e-2 * float(want.abs().max()) and bad == 0
    step.x[1, 5] = float("nan")  # one row's NaN: every logit of that row is NaN, and counted (the engine's check)
    logits, bad = step.head(head, 3)
    assert bad == v and bool(torch.isnan(logits[1]).all()) and bool(torch.isfinite(logits[[0, 2]]).all())
    step.s.scratch_bytes = 16  # a call never writes past the scratch it is given
    with pytest.raises(ValueError, match="scratch is too small"):
        step.head(head, 3)


def test_moe_half_reads_down_rows_as_the_standard_layout(lib: ctypes.CDLL) -> None:
    """bf16 slots of the sparse layout (down rows [I, H], w2 kind | MT_ROWS) in the MoE half: against float64, and
    beside standard slots in one call; 6 rows on one expert (more than one block of 4 pairs) and H = 1056 (more
    than one 512-column chunk per thread's slice)."""
    h, inter, e, k = 1056, 32, 4, 2
    g = torch.Generator().manual_seed(21)
    experts = [((torch.randn(2 * inter, h, generator=g) * 0.1).to(BF16), (torch.randn(h, inter, generator=g) * 0.1)
                .to(BF16)) for _ in range(e)]  # fmt: skip
    slots = []
    for ex, (w13, w2) in enumerate(experts):
        if ex % 2:  # odd experts: the sparse layout
            row = torch.cat([w13.reshape(-1), w2.T.contiguous().reshape(-1)]).contiguous()
            rows = row[2 * inter * h :].view(inter, h)
            views = SlotViews(row[: 2 * inter * h].view(2 * inter, h), rows.t(), None, None, row, {}, down_rows=rows)
        else:
            row, views = _bf16_slot(w13, w2)
        slots.append((row, views))
    table = torch.tensor([desc_row(s[1]) for s in slots], dtype=torch.int64)  # [E, DESC]
    assert int(table[1, 10]) == KIND_BF16 | ROWS and int(table[0, 10]) == KIND_BF16
    ids = torch.tensor([[1, 0], [1, 2], [3, 1], [1, 0], [1, 3], [2, 1]], dtype=torch.int32)
    moe = MoeLayer(h, inter, e, k)
    step, x0, hin, wts = _moe_step(lib, moe, h, e, ids, g)
    for ex in range(e):
        moe.desc[ex] = table.data_ptr() + 8 * DESC * ex
    step.moe(moe)
    y = torch.zeros(6, h, dtype=torch.float64)
    for t in range(6):
        for j in range(k):
            w13, w2 = experts[int(ids[t, j])]
            gu = hin[t : t + 1].double() @ w13.double().T
            a = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            y[t] += float(wts[t, j]) * (r(a) @ w2.double().T)[0]
    want = r(x0.double() + r(y))
    assert float((step.x[:6].double() - want).abs().max()) <= 2e-2 * float(want.abs().max())


# --- a pair whose id is -1 (a routing override's "no expert"): skipped, its weight never read ----------------------


def _run(lib: ctypes.CDLL, h: int, inter: int, e: int, ids: torch.Tensor, wts: torch.Tensor, x0: torch.Tensor,
         hin: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x0 + the MoE half of rows hin routed by ids / wts [T, k] (bf16 [T, H])."""
    t, k = ids.shape
    moe = MoeLayer(h, inter, e, k)
    step = Step(lib, t, h, 1, k, e, [], [moe], None, 0, 2)
    step.layer(0)
    step.s.nthreads, step.s.T = 2, t
    step.x[:t].copy_(x0)
    step.h[:t].copy_(hin)
    step.ids[0, :t].copy_(ids)
    step.wts[0, :t].copy_(wts)
    for ex in range(e):
        moe.desc[ex] = None
    for ex in set(ids.reshape(-1).tolist()) - {-1}:
        moe.desc[ex] = table.data_ptr() + 8 * DESC * ex
    step.moe(moe)
    return step.x[:t].clone()


def test_skipped_pairs_equal_the_reduced_routing_bit_for_bit(lib: ctypes.CDLL) -> None:
    h, inter, e = 64, 32, 6
    g = torch.Generator().manual_seed(7)
    experts, _slots, table = _bf16_experts(h, inter, e, g)  # _slots: the memory the table points at
    x0, hin = torch.randn(4, h, generator=g).to(BF16), torch.randn(4, h, generator=g).to(BF16)
    # top-2 routing with one pair per row skipped (its weight garbage: it must not be read)
    ids = torch.tensor([[1, -1], [-1, 4], [0, -1], [5, -1]], dtype=torch.int32)
    wts = torch.tensor([[0.7, 123.0], [float("nan"), 0.4], [1.0, -9.0], [0.25, 1e30]])
    got = _run(lib, h, inter, e, ids, wts, x0, hin, table)
    kept = ids >= 0
    ids1 = ids[kept].reshape(4, 1)  # the same routing written with top-1: the pairs computed
    wts1 = wts[kept].reshape(4, 1)
    want = _run(lib, h, inter, e, ids1, wts1, x0, hin, table)
    assert torch.equal(got, want)
    # and against float64 by hand
    for t in range(4):
        ex = int(ids1[t, 0])
        w13, w2 = (w.double() for w in experts[ex])
        gu = hin[t : t + 1].double() @ w13.T
        a = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = float(wts1[t, 0]) * (a.to(BF16).double() @ w2.T)[0]
        ref = (x0[t].double() + y.to(BF16).double()).to(BF16).double()
        assert float((got[t].double() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


def test_a_row_with_every_pair_skipped_adds_nothing(lib: ctypes.CDLL) -> None:
    h, inter, e = 64, 32, 4
    g = torch.Generator().manual_seed(8)
    _, _slots, table = _bf16_experts(h, inter, e, g)  # _slots: the memory the table points at
    x0, hin = torch.randn(2, h, generator=g).to(BF16), torch.randn(2, h, generator=g).to(BF16)
    ids = torch.tensor([[-1, -1], [2, 3]], dtype=torch.int32)
    got = _run(lib, h, inter, e, ids, torch.rand(2, 2, generator=g), x0, hin, table)
    assert torch.equal(got[0], x0[0])


def test_other_negative_ids_are_refused(lib: ctypes.CDLL) -> None:
    h, inter, e = 64, 32, 4
    g = torch.Generator().manual_seed(9)
    _, _slots, table = _bf16_experts(h, inter, e, g)  # _slots: the memory the table points at
    x0, hin = torch.randn(1, h, generator=g).to(BF16), torch.randn(1, h, generator=g).to(BF16)
    with pytest.raises(Exception, match="MoE half"):
        _run(lib, h, inter, e, torch.tensor([[-2, 1]], dtype=torch.int32), torch.rand(1, 2), x0, hin, table)
