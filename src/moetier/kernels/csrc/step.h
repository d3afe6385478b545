/* The decode step's two native calls per layer (step.c), and the structs Python fills once per engine.
 *
 * moetier_attn_half(L, S): for S->T rows of the residual stream x [T, H] (bf16, updated in place):
 *   input RMSNorm -> QKV projection (+ bias) -> q/k norms (whole projection, then clip, or per head) ->
 *   RoPE (rotate-half, table rows at each row's position) -> K/V written into each row's cache at its
 *   position -> GQA attention of each row over its cache positions 0..pos (so prefill rows of one sequence
 *   are causal; with `window` > 0 only the last `window` of them, and with `sinks` each head's sink logit joins the
 *   softmax's denominator) -> output projection (+ bias) -> x += it -> h = post-attention RMSNorm(x) -> with a native
 *   router, the router logits (bf16, as the reference rounds them), softmax in fp32, top-k (ties: lower id
 *   first), optional renormalisation, weights optionally rounded to bf16 -> S->ids, S->wts, S->logits.
 * moetier_moe_half(M, S, desc): x += sum over each row's (expert, weight) pairs of weight * SwiGLU_e(h)
 *   (an id of -1 is no expert: the pair is skipped, its weight unread; routing overrides, policies/routing.py)
 *   (experts in ascending id, fp32 sums, rounded once) + the shared expert (sigmoid-gated where the family
 *   gates it); desc[e] points at expert e's slot descriptor (DESC int64: slot address, kind, then per
 *   matrix w13 [2I, H] and w2 [H, I]: group, q / scale / zero byte offsets from the address, -1 for none,
 *   then w2's kind: the two matrices may differ, e.g. a GGUF file's Q4_K gate/up and Q6_K down; then the byte
 *   offsets of the biases b13 [2I] and b2 [H], bf16, -1 for none), NULL for experts no row routed to. `act`: 0
 *   SiLU(gate) * up; 1 GPT-OSS: gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate *
 *   sigmoid(alpha * gate); biases are added to the projections' outputs before the activation and combine.
 *   A dense MLP layer is the shared slot with E = 0. `mode`: 3 for one
 *   call; a call whose experts do not fit the compute tier's slots at once runs as groups of them in
 *   ascending id, the first with bit 1 (start the fp32 sum), the last with bit 2 (shared expert, residual),
 *   each with desc set for its own experts only (NULL: skipped), so the result has the bits of one call.
 * moetier_head(Hd, x, xw, T, logits, logits_w, ...): final RMSNorm of x (bf16) or, where xw is not NULL, of xw
 *   (fp32) and the output head -> logits [T, V] bf16, or fp32 into logits_w where it is not NULL; returns the
 *   number of logits that are NaN or Inf (>= 0), so the caller's finite check costs nothing more.
 *
 * Rounding follows the bf16 reference where it rounds a tensor (projection outputs, q/k after RoPE, the
 * attention output, each residual add, the router logits and weights); inside a step everything is fp32.
 * With S->xw (the wide residual stream, llama.cpp's numerics) none of those is rounded: only what a matmul reads
 * (the normed rows, q for the bf16 K cache, the K/V cache, the experts' activations) takes the weights' form.
 * Scratch: every call gets one caller-owned buffer and its size; `*_scratch_bytes` give the exact need for
 * T rows (and, for attention, the longest position), and a call with less returns -2 instead of writing
 * past it. Return codes: 0 ok (the head: >= 0), -1 a shape or kind the kernels refuse, -2 scratch too small.
 */
#ifndef MOETIER_STEP_H
#define MOETIER_STEP_H
#include <stdint.h>

#include "mm.h"

#define MT_DESC 13

typedef struct {
    int64_t H, nh, nkv, hd, max_pos;
    int64_t qk_norm; /* 0 none, 1 per head (weights [hd]), 2 whole projection (weights [nh hd] / [nkv hd]) */
    int64_t router;  /* 0: none here (the caller routes h), 1: softmax then top-k */
    int64_t E, topk, norm_topk, round_w;
    int64_t layer; /* index into each row's cache [L, nkv, cap, hd] */
    float eps, clip, scale, pad; /* clip <= 0: no clipping */
    const uint16_t *in_norm, *post_norm, *q_norm, *k_norm, *bqkv, *bo; /* bf16; NULL where absent */
    const uint16_t *cos, *sin;                                         /* bf16 [max_pos, hd] */
    const uint16_t* router_w;                                          /* bf16 [E, H] */
    mt_w wqkv, wo;
    const uint16_t* sinks; /* bf16 [nh]: each head's learned sink logit in its softmax (GPT-OSS); NULL: none */
    int64_t window;        /* > 0: a row attends to its last `window` positions only (sliding window); 0: all */
    const uint16_t* router_b; /* bf16 [E]: the router's bias, added to its logits (GPT-OSS); NULL: none */
} mt_attn;

typedef struct {
    int64_t T;
    uint16_t* x;         /* [T, H] residual stream, updated in place */
    uint16_t* h;         /* [T, H] the MoE half's input */
    const int64_t* pos;  /* [T] */
    uint16_t* const* kc; /* [T] each row's K cache base [L, nkv, cap, hd] */
    uint16_t* const* vc;
    const int64_t* cap; /* [T] */
    int32_t* ids;       /* [T, topk] */
    float* wts;         /* [T, topk] */
    uint16_t* logits;   /* [T, E] */
    void* scratch;
    int64_t scratch_bytes, nthreads;
    float* xw; /* [T, H] fp32: the wide residual stream (read and updated instead of x; nothing is rounded to bf16
                * but what a matmul reads: no rounding of projection outputs, q/k, attention, router logits and
                * weights, the shared gate, or the residual adds), and the K/V caches hold fp16 (llama.cpp's
                * default cache type: 3 more mantissa bits than bf16); NULL: x, rounded as the bf16 reference */
} mt_step;

typedef struct {
    int64_t H, I, E, topk;
    int64_t Is;              /* shared expert's intermediate size, 0 for none */
    mt_w sh13, sh2;          /* [2 Is, H], [H, Is] */
    const uint16_t* sh_gate; /* bf16 [H]: sigmoid(h . g) scales the shared expert; NULL: ungated */
    int64_t act;             /* routed experts' activation: 0 SiLU(gate) * up, 1 GPT-OSS (alpha, limit) */
    float alpha, limit;
} mt_moe;

typedef struct {
    int64_t H, V;
    float eps, pad;
    const uint16_t* norm; /* [H] */
    mt_w w;               /* [V, H] */
} mt_head;

int64_t moetier_attn_scratch_bytes(const mt_attn* L, int64_t T, int64_t max_len, int64_t nthreads);
int64_t moetier_attn_half(const mt_attn* L, const mt_step* S);
int64_t moetier_moe_half_scratch_bytes(const mt_moe* M, int64_t T);
int64_t moetier_moe_half(const mt_moe* M, const mt_step* S, const int64_t* const* desc, int64_t mode);
int64_t moetier_head_scratch_bytes(const mt_head* Hd, int64_t T);
int64_t moetier_head(const mt_head* Hd, const uint16_t* x, const float* xw, int64_t T, uint16_t* logits,
                     float* logits_w, void* scratch, int64_t scratch_bytes, int64_t nthreads);
#endif
