/* The decode step's native calls (step.h) and the single ops kernels/decode.py binds (gemv, moe, rms_norm).
 *
 * Threads: every entry point runs one OpenMP parallel region (torch's libgomp) of `nthreads` threads;
 * matrix rows are split over the threads in blocks of 4 (16 for the MoE down rows, each thread owning a
 * slice of H so that experts are summed in the order given whatever the thread count).
 */
#include "step.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define ABI 12 /* kernels/native.py DECODE_ABI */

int64_t moetier_decode_abi(void) { return ABI; }
int64_t moetier_decode_isa(void) { return MT_ISA * 10 + MT_VNNI256; } /* 30, 21, 20, 0 */
const char* moetier_isa_name(void) { return mt_isa_name(); }

static inline int64_t al64(int64_t n) { return (n + MT_ALIGN - 1) / MT_ALIGN * MT_ALIGN; }

static inline char* take(char** cur, int64_t bytes) {
    char* p = *cur;
    *cur += al64(bytes);
    return p;
}

/* [lo, hi) of n items for thread `me` of `nt`, in multiples of `align` */
static inline void span(int64_t n, int64_t align, int nt, int me, int64_t* lo, int64_t* hi) {
    int64_t per = (n + nt - 1) / nt;
    per = (per + align - 1) / align * align;
    *lo = (int64_t)me * per < n ? (int64_t)me * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* this thread's share (4-row blocks) of rows [0, N) of W against T activation records */
static inline void mm_share(const mt_w* w, int64_t K, int64_t N, const mt_act* A, const int32_t* ident, int64_t T,
                            float* const* rows, int nt, int me) {
    int64_t lo, hi;
    span(N, 4, nt, me, &lo, &hi);
    if (hi > lo) mt_mm(w, K, lo, hi, A, ident, T, rows, NULL);
}

static inline int kind_ok(int64_t kind, int64_t K, int64_t group) {
    if (kind == 16) return 1;
    if (mt_is_gg(kind)) return mt_gg_ok(kind, K);
    if (kind != 8 && kind != 4 && kind != 2 && kind != MT_KIND_F8) return 0;
    if (K % MT_QB || group <= 0 || group % MT_QB || K % group) return 0;
    return kind != 2 || K % 128 == 0;
}

/* a weight's MXFP4 form (mt_w.fp4) is kind 4, symmetric, with an e8m0 exponent byte per block of 32 */
static inline int fp4_ok(const mt_w* w) { return !w->fp4 || (w->kind == 4 && w->z == NULL && w->group == MT_QB); }

static inline float round_bf(float v) { return bf2f(f2bf(v)); }

/* y [H] bf16 = rmsnorm(x) * w of an fp32 row (the wide residual stream), fp32 math, rounded once */
static void rms_rowf(const float* x, const uint16_t* w, int64_t H, float eps, uint16_t* y) {
    const float r = 1.0f / sqrtf(mt_sumsq(x, H) / (float)H + eps);
    for (int64_t j = 0; j < H; j++) y[j] = f2bf(x[j] * r * bf2f(w[j]));
}

/* the same of a bf16 row, through tmp [H] fp32 */
static void rms_row(const uint16_t* x, const uint16_t* w, int64_t H, float eps, uint16_t* y, float* tmp) {
    for (int64_t j = 0; j < H; j++) tmp[j] = bf2f(x[j]);
    rms_rowf(tmp, w, H, eps, y);
}

/* the same on fp32 values in place, rounded to bf16 values (wide: kept in fp32) */
static void rms_f32(float* x, const uint16_t* w, int64_t n, float eps, int wide) {
    const float r = 1.0f / sqrtf(mt_sumsq(x, n) / (float)n + eps);
    if (wide)
        for (int64_t j = 0; j < n; j++) x[j] = x[j] * r * bf2f(w[j]);
    else
        for (int64_t j = 0; j < n; j++) x[j] = round_bf(x[j] * r * bf2f(w[j]));
}

/* ============================================================================ the MoE core */

typedef struct {
    int64_t T, H, I, n;   /* rows, hidden, expert intermediate, experts */
    const mt_w* w13;      /* [n] gate/up [2I, H] */
    const mt_w* w2;       /* [n] down [H, I] */
    const int64_t* start; /* [n + 1] pairs of expert j: start[j] .. start[j + 1] - 1 */
    const int32_t* tok;   /* [P] */
    const float* rw;      /* [P] */
    const uint16_t* const* b13; /* [n] bf16 [2I] or NULL each; NULL: no expert has biases */
    const uint16_t* const* b2;  /* [n] bf16 [H] or NULL each */
    int64_t act;                /* 0 SiLU(gate) * up, 1 GPT-OSS */
    float alpha, limit;
} moe_call;

/* GPT-OSS's GLU on one pair's fp32 gate g [n] and up u [n], into g: (clamp(u) + 1) * min(g, limit) * sigmoid */
static void gptoss_glu(float* g, const float* u, int64_t n, float alpha, float limit) {
    for (int64_t j = 0; j < n; j++) {
        const float a = g[j] < limit ? g[j] : limit; /* NaN stays NaN: the comparison is false */
        const float b = u[j] < -limit ? -limit : (u[j] > limit ? limit : u[j]);
        g[j] = (b + 1.0f) * (a / (1.0f + expf(-alpha * a)));
    }
}

static int64_t moe_core_bytes(int64_t T, int64_t H, int64_t I, int64_t P) {
    int64_t b = 0;
    for (int f = 0; f < MT_NFORM; f++)
        b += al64(mt_act_rec_bytes(f, H, MT_QB) * T) + al64(mt_act_rec_bytes(f, I, MT_QB) * P);
    b += al64(P * 2 * I * 4) + 3 * al64(P * 8) + al64(P * 4) + al64(P * 4) + 64;
    return b;
}

/* y[p][lo:hi] += rw[p] * sum_i h[p][i] * Wd[i, lo:hi] for cnt pairs, Wd bf16 down rows [I, H] (the sparse layout):
 * every neuron's row slice read once for all pairs, in ascending neuron order; sums in fp32 per pair, the whole
 * expert's sum scaled by rw[p] once at the end (as mt_mm scales a dot product) */
#if MT_ISA == 3
#define DR_MAXI 8192 /* intermediate sizes the paired path packs on the stack (larger: the generic loop) */
/* The same with AVX512-BF16 (h holds bf16 values: mt_round_bf16): neurons i, i + 1 interleaved per column into bf16
 * pairs (unpacklo / unpackhi of the two rows), each pair's (h_i, h_i+1) broadcast, vdpbf16ps: every weight read
 * once per 4 pairs, no conversion, the 4 pairs' sums of 32 columns in registers over all neurons. */
static void down_rows_bf16(const uint16_t* wd, int64_t H, int64_t I, int64_t lo, int64_t hi, float* const* h,
                           int64_t cnt, float* const* y, const float* rw) {
    uint32_t hp[4][DR_MAXI / 2]; /* each pair's (h_i, h_i+1) bf16 bits, packed */
    /* acc[0] lanes hold columns 0-3, 8-11, 16-19, 24-27 of the chunk; acc[1] 4-7, 12-15, 20-23, 28-31 */
    const __m512i ix0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i ix1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t p0 = 0; p0 < cnt; p0 += 4) {
        const int np = cnt - p0 < 4 ? (int)(cnt - p0) : 4;
        for (int q = 0; q < np; q++) {
            const float* hq = h[p0 + q];
            for (int64_t i = 0; i < I / 2; i++) {
                uint32_t a, b;
                memcpy(&a, hq + 2 * i, 4);
                memcpy(&b, hq + 2 * i + 1, 4);
                hp[q][i] = (a >> 16) | (b & 0xffff0000u);
            }
        }
        for (int64_t c = lo; c < hi; c += 64) { /* 64 columns a pass: two 32-column halves per row pair */
            const int64_t m = hi - c < 64 ? hi - c : 64;
            const int64_t ma = m < 32 ? m : 32, mb = m - ma;
            const __mmask32 ka = ma == 32 ? 0xffffffffu : (__mmask32)((1ull << ma) - 1);
            const __mmask32 kb = mb == 32 ? 0xffffffffu : (__mmask32)((1ull << mb) - 1);
            __m512 acc[4][4];
            for (int q = 0; q < 4; q++) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = _mm512_setzero_ps();
            for (int64_t i = 0; i < I; i += 2) {
                const uint16_t* w0 = wd + i * H + c;
                const uint16_t* w1 = w0 + H;
                const __m512i a0 = _mm512_maskz_loadu_epi16(ka, w0), a1 = _mm512_maskz_loadu_epi16(ka, w1);
                const __m512i b0 = _mm512_maskz_loadu_epi16(kb, w0 + 32), b1 = _mm512_maskz_loadu_epi16(kb, w1 + 32);
                const __m512bh al = (__m512bh)_mm512_unpacklo_epi16(a0, a1), ah = (__m512bh)_mm512_unpackhi_epi16(a0, a1);
                const __m512bh bl = (__m512bh)_mm512_unpacklo_epi16(b0, b1), bh = (__m512bh)_mm512_unpackhi_epi16(b0, b1);
                for (int q = 0; q < np; q++) {
                    const __m512bh hv = (__m512bh)_mm512_set1_epi32((int)hp[q][i / 2]);
                    acc[q][0] = _mm512_dpbf16_ps(acc[q][0], al, hv);
                    acc[q][1] = _mm512_dpbf16_ps(acc[q][1], ah, hv);
                    acc[q][2] = _mm512_dpbf16_ps(acc[q][2], bl, hv);
                    acc[q][3] = _mm512_dpbf16_ps(acc[q][3], bh, hv);
                }
            }
            for (int q = 0; q < np; q++) {
                float* o = y[p0 + q] + c;
                const __m512 s = _mm512_set1_ps(rw[p0 + q]);
                for (int half = 0; half < 2; half++) {
                    const int64_t mh = half ? mb : ma; /* columns of this half */
                    if (mh <= 0) break;
                    const __m512 x0 = acc[q][2 * half], x1 = acc[q][2 * half + 1];
                    const __mmask16 m0 = mh >= 16 ? 0xffff : (__mmask16)((1u << mh) - 1);
                    const __mmask16 m1 = mh >= 32 ? 0xffff : (mh > 16 ? (__mmask16)((1u << (mh - 16)) - 1) : 0);
                    float* oh = o + 32 * half;
                    const __m512 c0 = _mm512_permutex2var_ps(x0, ix0, x1); /* columns 0-15 of the half */
                    const __m512 c1 = _mm512_permutex2var_ps(x0, ix1, x1); /* columns 16-31 */
                    _mm512_mask_storeu_ps(oh, m0, _mm512_fmadd_ps(s, c0, _mm512_maskz_loadu_ps(m0, oh)));
                    if (m1) _mm512_mask_storeu_ps(oh + 16, m1, _mm512_fmadd_ps(s, c1, _mm512_maskz_loadu_ps(m1, oh + 16)));
                }
            }
        }
    }
}
#endif

static void down_rows(const uint16_t* wd, int64_t H, int64_t I, int64_t lo, int64_t hi, float* const* h, int64_t cnt,
                      float* const* y, const float* rw) {
#if MT_ISA == 3
    if (I % 2 == 0 && I <= DR_MAXI) {
        down_rows_bf16(wd, H, I, lo, hi, h, cnt, y, rw);
        return;
    }
#endif
    const int64_t n = hi - lo;
    float acc[4][512];
    for (int64_t c0 = 0; c0 < n; c0 += 512) {
        const int64_t m = n - c0 < 512 ? n - c0 : 512;
        for (int64_t p0 = 0; p0 < cnt; p0 += 4) {
            const int64_t np = cnt - p0 < 4 ? cnt - p0 : 4;
            for (int64_t q = 0; q < np; q++) memset(acc[q], 0, (size_t)m * 4);
            for (int64_t i = 0; i < I; i++) {
                const uint16_t* w = wd + i * H + lo + c0;
                for (int64_t q = 0; q < np; q++) {
                    const float a = h[p0 + q][i]; /* no skip of zeros: 0 * Inf must stay NaN, as in the dot */
                    float* o = acc[q];
#pragma omp simd
                    for (int64_t r = 0; r < m; r++) o[r] += a * bf2f(w[r]);
                }
            }
            for (int64_t q = 0; q < np; q++) {
                float* o = y[p0 + q] + lo + c0;
                const float s = rw[p0 + q];
                for (int64_t r = 0; r < m; r++) o[r] += s * acc[q][r];
            }
        }
    }
}

/* ys [T, H] fp32 += sum over pairs of rw * expert(x[tok]), experts in the order given (x bf16 [T, H]) */
static int64_t moe_core(const moe_call* c, const uint16_t* x, float* ys, char* scratch, int64_t bytes, int nthreads) {
    const int64_t T = c->T, H = c->H, I = c->I, n = c->n, P = c->start[n];
    if (P == 0) return 0;
    if (moe_core_bytes(T, H, I, P) > bytes) return -2;
    int used13[MT_NFORM] = {0}, used2[MT_NFORM] = {0};
    int64_t g13[MT_NFORM] = {0}, g2[MT_NFORM] = {0};
    for (int64_t j = 0; j < n; j++) {
        if (!kind_ok(c->w13[j].kind, H, c->w13[j].group) || !kind_ok(c->w2[j].kind, I, c->w2[j].group)) return -1;
        if (c->w2[j].rows && c->w2[j].kind != 16) return -1; /* down rows: bf16 only */
        if (!fp4_ok(&c->w13[j]) || !fp4_ok(&c->w2[j])) return -1;
        const int f13 = mt_form_of(c->w13[j].kind), f2 = mt_form_of(c->w2[j].kind);
        if (!used13[f13]) g13[f13] = c->w13[j].group;
        if (!used2[f2]) g2[f2] = c->w2[j].group;
        used13[f13] = used2[f2] = 1;
    }
    char* cur = scratch;
    mt_act ah[MT_NFORM], ad[MT_NFORM];
    for (int f = 0; f < MT_NFORM; f++) {
        if (used13[f]) take(&cur, mt_act_init(&ah[f], f, H, f ? g13[f] : 0, cur, T));
        if (used2[f]) take(&cur, mt_act_init(&ad[f], f, I, f ? g2[f] : 0, cur, P));
    }
    float* hb = (float*)take(&cur, P * 2 * I * 4);
    float** hp = (float**)take(&cur, P * 8);
    float** yp = (float**)take(&cur, P * 8);
    int32_t* pidx = (int32_t*)take(&cur, P * 4);
    int32_t* pe = (int32_t*)take(&cur, P * 4);
    for (int64_t j = 0; j < n; j++)
        for (int64_t p = c->start[j]; p < c->start[j + 1]; p++) {
            hp[p] = hb + p * 2 * I;
            yp[p] = ys + (int64_t)c->tok[p] * H;
            pidx[p] = (int32_t)p;
            pe[p] = (int32_t)j;
        }
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        /* 0. the rows' activations in the forms the experts read */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int f = 0; f < MT_NFORM; f++)
                if (used13[f]) mt_act_prep_bf16(&ah[f], t, x + t * H);
        /* 1. gate and up rows of every expert: a thread's share of all experts' rows */
        {
            int64_t lo, hi;
            span(n * 2 * I, 4, nt, me, &lo, &hi);
            for (int64_t j = lo / (2 * I); j < n && j * 2 * I < hi; j++) {
                const int64_t r0 = lo > j * 2 * I ? lo - j * 2 * I : 0;
                const int64_t r1 = hi < (j + 1) * 2 * I ? hi - j * 2 * I : 2 * I;
                const int64_t p0 = c->start[j], cnt = c->start[j + 1] - p0;
                if (cnt > 0 && r1 > r0)
                    mt_mm(&c->w13[j], H, r0, r1, &ah[mt_form_of(c->w13[j].kind)], c->tok + p0, cnt, hp + p0, NULL);
            }
        }
#pragma omp barrier
        /* 2. silu(gate) * up per pair, as the down rows' activation */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            const uint16_t* bias = c->b13 ? c->b13[pe[p]] : NULL;
            if (bias)
                for (int64_t r = 0; r < 2 * I; r++) hp[p][r] += bf2f(bias[r]);
            if (c->act == 1)
                gptoss_glu(hp[p], hp[p] + I, I, c->alpha, c->limit);
            else
                mt_silu_mul(hp[p], hp[p] + I, I);
            if (c->w2[pe[p]].rows)
                mt_round_bf16(hp[p], I); /* the bf16 form's activation, as mt_act_prep_f32 rounds it */
            else
                mt_act_prep_f32(&ad[mt_form_of(c->w2[pe[p]].kind)], p, hp[p]);
        }
        /* 3. down rows: each thread a slice of H, experts in the order given */
        {
            int64_t lo, hi;
            span(H, 16, nt, me, &lo, &hi);
            for (int64_t j = 0; j < n && hi > lo; j++) {
                const int64_t p0 = c->start[j], cnt = c->start[j + 1] - p0;
                if (cnt > 0 && c->w2[j].rows)
                    down_rows((const uint16_t*)c->w2[j].q, H, I, lo, hi, hp + p0, cnt, yp + p0, c->rw + p0);
                else if (cnt > 0)
                    mt_mm(&c->w2[j], I, lo, hi, &ad[mt_form_of(c->w2[j].kind)], pidx + p0, cnt, yp + p0, c->rw + p0);
                const uint16_t* bias = c->b2 ? c->b2[j] : NULL;
                if (bias)
                    for (int64_t p = p0; p < p0 + cnt; p++)
                        for (int64_t r = lo; r < hi; r++) yp[p][r] += c->rw[p] * bf2f(bias[r]);
            }
        }
    }
    return 0;
}

static inline mt_w desc_w(const int64_t* d, int m) {
    const char* base = (const char*)(intptr_t)d[0];
    const int64_t* p = d + 2 + 4 * m;
    const int64_t kind = m ? d[10] : d[1];
    const int sf = !mt_is_gg(kind) && (kind & MT_SF16), fp4 = !mt_is_gg(kind) && (kind & MT_FP4);
    const int rows = !mt_is_gg(kind) && (kind & MT_ROWS);
    mt_w w = {mt_is_gg(kind) ? kind : kind & ~(int64_t)(MT_SF16 | MT_FP4 | MT_ROWS), base + p[1],
              p[2] >= 0 ? (const uint16_t*)(base + p[2]) : NULL, p[3] >= 0 ? (const uint16_t*)(base + p[3]) : NULL, p[0],
              sf, fp4, rows};
    return w;
}

/* a descriptor's bias of matrix m (0: b13, 1: b2), NULL for none */
static inline const uint16_t* desc_b(const int64_t* d, int m) {
    return d[11 + m] >= 0 ? (const uint16_t*)((const char*)(intptr_t)d[0] + d[11 + m]) : NULL;
}

/* ============================================================================ MoE half */

/* bytes of the MoE half's bookkeeping (pairs grouped by expert) for T rows of k pairs over E experts */
static int64_t book_bytes(int64_t E, int64_t T, int64_t k) {
    const int64_t routed = 4 * al64((E + 1) * 8) + 2 * al64(T * k * 4) + 2 * al64(E * (int64_t)sizeof(mt_w)) +
                           2 * al64(E * 8);
    const int64_t shared = al64(2 * 8) + 2 * al64(T * 4);
    return routed > shared ? routed : shared;
}

int64_t moetier_moe_half_scratch_bytes(const mt_moe* M, int64_t T) {
    const int64_t P = T * M->topk;
    int64_t core = M->E > 0 ? moe_core_bytes(T, M->H, M->I, P) : 0;
    if (M->Is > 0) {
        const int64_t sh = moe_core_bytes(T, M->H, M->Is, T);
        core = core > sh ? core : sh;
    }
    return al64(T * M->H * 4) + book_bytes(M->E, T, M->topk) + core;
}

int64_t moetier_moe_half(const mt_moe* M, const mt_step* S, const int64_t* const* desc, int64_t mode) {
    const int64_t T = S->T, H = M->H, k = M->topk, E = M->E;
    if (moetier_moe_half_scratch_bytes(M, T) > S->scratch_bytes) return -2;
    char* cur = (char*)S->scratch;
    float* ys = (float*)take(&cur, T * H * 4);
    char* book = cur;
    char* core = book + book_bytes(E, T, k);
    const int64_t core_bytes = (char*)S->scratch + S->scratch_bytes - core;
    const int whole = (mode & 3) == 3; /* one call: every routed expert must have its slot */
    if (mode & 1) memset(ys, 0, (size_t)(T * H * 4));
    if (E > 0) {
        /* pairs grouped by expert (ascending id), tokens ascending within an expert */
        char* b = book;
        int64_t* cnt = (int64_t*)take(&b, (E + 1) * 8);
        int64_t* order = (int64_t*)take(&b, (E + 1) * 8);
        int64_t* st = (int64_t*)take(&b, (E + 1) * 8);
        int64_t* next = (int64_t*)take(&b, (E + 1) * 8);
        int32_t* tok = (int32_t*)take(&b, T * k * 4);
        float* rw = (float*)take(&b, T * k * 4);
        mt_w* w13 = (mt_w*)take(&b, E * (int64_t)sizeof(mt_w));
        mt_w* w2 = (mt_w*)take(&b, E * (int64_t)sizeof(mt_w));
        const uint16_t** b13 = (const uint16_t**)take(&b, E * 8);
        const uint16_t** b2 = (const uint16_t**)take(&b, E * 8);
        int biased = 0;
        memset(cnt, 0, (size_t)((E + 1) * 8));
        for (int64_t i = 0; i < T * k; i++) {
            const int32_t e = S->ids[i];
            if (e == -1) continue; /* a pair the routing override skipped (policies/routing.py): no expert */
            if (e < 0 || e >= E || (whole && desc[e] == NULL)) return -1;
            if (desc[e] != NULL) cnt[e]++; /* a group call: the experts given this time */
        }
        int64_t n = 0, acc = 0;
        for (int64_t e = 0; e < E; e++) {
            if (!cnt[e]) continue;
            order[n] = e;
            st[n] = acc;
            next[e] = acc;
            acc += cnt[e];
            w13[n] = desc_w(desc[e], 0);
            w2[n] = desc_w(desc[e], 1);
            b13[n] = desc_b(desc[e], 0);
            b2[n] = desc_b(desc[e], 1);
            biased |= b13[n] != NULL || b2[n] != NULL;
            n++;
        }
        st[n] = acc;
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < k; i++) {
                const int32_t e = S->ids[t * k + i];
                if (e < 0 || desc[e] == NULL) continue;
                const int64_t p = next[e]++;
                tok[p] = (int32_t)t;
                rw[p] = S->wts[t * k + i];
            }
        if (M->act != 0 && M->act != 1) return -1;
        moe_call c = {T, H, M->I, n, w13, w2, st, tok, rw, biased ? b13 : NULL, biased ? b2 : NULL, M->act,
                      M->alpha, M->limit};
        const int64_t rc = moe_core(&c, S->h, ys, core, core_bytes, (int)S->nthreads);
        if (rc) return rc;
    }
    if (!(mode & 2)) return 0; /* more groups of routed experts to come: ys stays in the scratch */
    if (M->Is > 0) { /* after the routed experts: their bookkeeping and core scratch are free again */
        char* b = book;
        int64_t* st = (int64_t*)take(&b, 2 * 8);
        int32_t* tok = (int32_t*)take(&b, T * 4);
        float* rw = (float*)take(&b, T * 4);
        st[0] = 0;
        st[1] = T;
        for (int64_t t = 0; t < T; t++) {
            tok[t] = (int32_t)t;
            rw[t] = 1.0f;
            if (M->sh_gate) { /* the gate's linear output rounded to bf16, its sigmoid too, as the reference */
                float g = 0.0f;
                for (int64_t j = 0; j < H; j++) g += bf2f(S->h[t * H + j]) * bf2f(M->sh_gate[j]);
                rw[t] = S->xw ? 1.0f / (1.0f + expf(-g)) : round_bf(1.0f / (1.0f + expf(-round_bf(g))));
            }
        }
        moe_call c = {T, H, M->Is, 1, &M->sh13, &M->sh2, st, tok, rw, NULL, NULL, 0, 0.0f, 0.0f};
        const int64_t rc = moe_core(&c, S->h, ys, core, core_bytes, (int)S->nthreads);
        if (rc) return rc;
    }
    if (S->xw) { /* the wide residual stream: x += the block's output in fp32, nothing rounded */
        for (int64_t i = 0; i < T * H; i++) S->xw[i] += ys[i];
        return 0;
    }
    /* x += the block's output, rounded to bf16 first, then the sum rounded (the reference's two roundings) */
    for (int64_t i = 0; i < T * H; i++) S->x[i] = f2bf(bf2f(S->x[i]) + round_bf(ys[i]));
    return 0;
}

/* ============================================================================ attention half */

static inline int64_t att_rows_n(const mt_attn* L) { return (L->nh + 2 * L->nkv) * L->hd; }

int64_t moetier_attn_scratch_bytes(const mt_attn* L, int64_t T, int64_t max_len, int64_t nthreads) {
    const int64_t H = L->H, N = att_rows_n(L), D = L->nh * L->hd, G = L->nh / L->nkv;
    int64_t b = 0;
    b += al64(mt_act_rec_bytes(mt_form_of(L->wqkv.kind), H, MT_QB) * T); /* normed x */
    b += al64(T * N * 4);                                                 /* qkv fp32 */
    b += al64(T * D * 4);                                                 /* q bf16, or fp32 (wide) */
    b += al64(T * D * 4);                                                 /* attention output fp32 */
    b += al64(mt_act_rec_bytes(mt_form_of(L->wo.kind), D, MT_QB) * T);   /* its activation */
    b += al64(T * H * 4);                                                 /* projection out */
    b += al64(mt_act_rec_bytes(MT_F_BF16, H, 0) * T);                     /* h for the router */
    b += al64(T * (L->E > 0 ? L->E : 1) * 4);                             /* router logits fp32 */
    b += al64(T * 8 * 4);                                                 /* pointer rows */
    b += nthreads * al64((G * max_len + 2 * H + 64) * 4);                 /* per thread: scores, rows */
    return b + 64 * 12;
}

static inline float dot_bf16_row(const uint16_t* a, const uint16_t* b, int64_t n) {
    int64_t j = 0;
    float s = 0.0f;
#if MT_ISA == 3
    __m512 acc = _mm512_setzero_ps();
    for (; j + 32 <= n; j += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void*)(a + j)),
                               (__m512bh)_mm512_loadu_si512((const void*)(b + j)));
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) s += bf2f(a[j]) * bf2f(b[j]);
    return s;
}

/* a [n] fp32 . b [n] fp16 (the wide step's q against its fp16 K cache) */
static inline float dot_f32_f16(const float* a, const uint16_t* b, int64_t n) {
    int64_t j = 0;
    float s = 0.0f;
#if MT_ISA == 3
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + j))), acc);
    s = _mm512_reduce_add_ps(acc);
#elif MT_ISA == 2 && defined(__F16C__)
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + j))), acc);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    s = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
#endif
    for (; j < n; j++) s += a[j] * h2f(b[j]);
    return s;
}

/* o [hd] += p * v [hd] (fp16 v: the wide step's V cache) */
static inline void axpy_f16(float* o, float p, const uint16_t* v, int64_t n) {
    int64_t j = 0;
#if MT_ISA == 3
    const __m512 pv = _mm512_set1_ps(p);
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(o + j, _mm512_fmadd_ps(pv, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(v + j))),
                                                _mm512_loadu_ps(o + j)));
#elif MT_ISA == 2 && defined(__F16C__)
    const __m256 pv = _mm256_set1_ps(p);
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(o + j, _mm256_fmadd_ps(pv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v + j))),
                                                _mm256_loadu_ps(o + j)));
#endif
    for (; j < n; j++) o[j] += p * h2f(v[j]);
}

/* o [hd] += p * v [hd] (bf16 v) */
static inline void axpy_bf16(float* o, float p, const uint16_t* v, int64_t n) {
    int64_t j = 0;
#if MT_ISA == 3
    const __m512 pv = _mm512_set1_ps(p);
    for (; j + 16 <= n; j += 16) {
        const __m512 vv =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + j))), 16));
        _mm512_storeu_ps(o + j, _mm512_fmadd_ps(pv, vv, _mm512_loadu_ps(o + j)));
    }
#elif MT_ISA == 2
    const __m256 pv = _mm256_set1_ps(p);
    for (; j + 8 <= n; j += 8) {
        const __m256 vv =
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(v + j))), 16));
        _mm256_storeu_ps(o + j, _mm256_fmadd_ps(pv, vv, _mm256_loadu_ps(o + j)));
    }
#endif
    for (; j < n; j++) o[j] += p * bf2f(v[j]);
}

/* top-k of probs [E] (descending, ties: lower id first) -> ids, values */
static void topk(const float* pr, int64_t E, int64_t k, int32_t* ids, float* val) {
    /* insertion into a descending list of k: a later id never displaces an equal value (ties: lower id first);
     * NaN compares false, so a row of NaN keeps valid ids and carries its NaN values on */
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        const float v = pr[e];
        if (n == k && !(v > val[k - 1])) continue;
        int64_t j = n < k ? n++ : k - 1;
        while (j > 0 && v > val[j - 1]) {
            val[j] = val[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        val[j] = v;
        ids[j] = (int32_t)e;
    }
}

int64_t moetier_attn_half(const mt_attn* L, const mt_step* S) {
    const int64_t T = S->T, H = L->H, nh = L->nh, nkv = L->nkv, hd = L->hd, N = att_rows_n(L), D = nh * hd;
    const int64_t G = nh / nkv, half = hd / 2, E = L->E;
    const int wide = S->xw != NULL; /* the fp32 residual stream: nothing rounded to bf16 but matmul inputs */
    if (!kind_ok(L->wqkv.kind, H, L->wqkv.group) || !kind_ok(L->wo.kind, D, L->wo.group) || !fp4_ok(&L->wqkv) ||
        !fp4_ok(&L->wo) || nh % nkv || hd % 2)
        return -1;
    int64_t max_len = 0;
    for (int64_t t = 0; t < T; t++) {
        if (S->pos[t] < 0 || S->pos[t] >= S->cap[t] || S->pos[t] >= L->max_pos) return -1;
        if (S->pos[t] + 1 > max_len) max_len = S->pos[t] + 1;
    }
    if (moetier_attn_scratch_bytes(L, T, max_len, S->nthreads) > S->scratch_bytes) return -2;
    char* cur = (char*)S->scratch;
    mt_act ax, ao, ar;
    take(&cur, mt_act_init(&ax, mt_form_of(L->wqkv.kind), H, L->wqkv.kind == 16 ? 0 : L->wqkv.group, cur, T));
    float* qkv = (float*)take(&cur, T * N * 4);
    uint16_t* qb = (uint16_t*)take(&cur, T * D * 4); /* [T, D] bf16, or (wide) fp32 */
    float* qf = (float*)qb;
    float* att = (float*)take(&cur, T * D * 4);
    take(&cur, mt_act_init(&ao, mt_form_of(L->wo.kind), D, L->wo.kind == 16 ? 0 : L->wo.group, cur, T));
    float* yo = (float*)take(&cur, T * H * 4);
    take(&cur, mt_act_init(&ar, MT_F_BF16, H, 0, cur, T));
    float* lg = (float*)take(&cur, T * (E > 0 ? E : 1) * 4);
    float** rows = (float**)take(&cur, T * 8 * 4);
    float** rq = rows;          /* [T] qkv rows */
    float** ry = rows + T;      /* [T] projection rows */
    float** rl = rows + 2 * T;  /* [T] logit rows */
    int32_t* ident = (int32_t*)(rows + 3 * T);
    for (int64_t t = 0; t < T; t++) {
        rq[t] = qkv + t * N;
        ry[t] = yo + t * H;
        rl[t] = lg + t * (E > 0 ? E : 1);
        ident[t] = (int32_t)t;
    }
    const int64_t per_thread = al64((G * max_len + 2 * H + 64) * 4);
    char* tbase = cur;
#pragma omp parallel num_threads((int)S->nthreads)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        float* tscr = (float*)(tbase + me * per_thread);
        float* sc = tscr;                  /* [G, max_len] scores */
        float* tmp = tscr + G * max_len;   /* [H] an fp32 row */
        uint16_t* hn = (uint16_t*)(tmp + H); /* [H] a bf16 row */
        /* 1. input RMSNorm -> the QKV projection's activation */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (wide)
                rms_rowf(S->xw + t * H, L->in_norm, H, L->eps, hn);
            else
                rms_row(S->x + t * H, L->in_norm, H, L->eps, hn, tmp);
            mt_act_prep_bf16(&ax, t, hn);
        }
        /* 2. QKV projection */
        mm_share(&L->wqkv, H, N, &ax, ident, T, rq, nt, me);
#pragma omp barrier
        /* 3. bias, rounding, q/k norms, clip, RoPE, K/V into the caches */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float* r = qkv + t * N;
            if (L->bqkv)
                for (int64_t j = 0; j < N; j++) r[j] += bf2f(L->bqkv[j]);
            if (!wide) mt_round_bf16(r, N);
            float *q = r, *k = r + D, *v = r + D + nkv * hd;
            if (L->qk_norm == 2) {
                rms_f32(q, L->q_norm, D, L->eps, wide);
                rms_f32(k, L->k_norm, nkv * hd, L->eps, wide);
            }
            if (L->clip > 0.0f)
                for (int64_t j = 0; j < N; j++) r[j] = r[j] > L->clip ? L->clip : (r[j] < -L->clip ? -L->clip : r[j]);
            if (L->qk_norm == 1) {
                for (int64_t h = 0; h < nh; h++) rms_f32(q + h * hd, L->q_norm, hd, L->eps, wide);
                for (int64_t h = 0; h < nkv; h++) rms_f32(k + h * hd, L->k_norm, hd, L->eps, wide);
            }
            const uint16_t* cs = L->cos + S->pos[t] * hd;
            const uint16_t* sn = L->sin + S->pos[t] * hd;
            for (int64_t h = 0; h < nh + nkv; h++) {
                float* u = h < nh ? q + h * hd : k + (h - nh) * hd;
                for (int64_t j = 0; j < half; j++) {
                    const float a = u[j], b = u[j + half];
                    tmp[j] = a * bf2f(cs[j]) - b * bf2f(sn[j]);
                    tmp[j + half] = b * bf2f(cs[j + half]) + a * bf2f(sn[j + half]);
                }
                if (h < nh && wide)
                    for (int64_t j = 0; j < hd; j++) qf[t * D + h * hd + j] = tmp[j];
                else if (h < nh)
                    for (int64_t j = 0; j < hd; j++) qb[t * D + h * hd + j] = f2bf(tmp[j]);
                else {
                    uint16_t* kc = S->kc[t] + ((L->layer * nkv + (h - nh)) * S->cap[t] + S->pos[t]) * hd;
                    if (wide)
                        for (int64_t j = 0; j < hd; j++) kc[j] = f2h(tmp[j]);
                    else
                        for (int64_t j = 0; j < hd; j++) kc[j] = f2bf(tmp[j]);
                }
            }
            for (int64_t h = 0; h < nkv; h++) {
                uint16_t* vc = S->vc[t] + ((L->layer * nkv + h) * S->cap[t] + S->pos[t]) * hd;
                if (wide)
                    for (int64_t j = 0; j < hd; j++) vc[j] = f2h(v[h * hd + j]);
                else
                    for (int64_t j = 0; j < hd; j++) vc[j] = f2bf(v[h * hd + j]);
            }
        }
        /* 4. attention: each (row, kv head) over the row's positions 0..pos */
#pragma omp for schedule(static)
        for (int64_t tg = 0; tg < T * nkv; tg++) {
            const int64_t t = tg / nkv, g = tg % nkv;
            const int64_t lo = L->window > 0 && S->pos[t] + 1 > L->window ? S->pos[t] + 1 - L->window : 0;
            const int64_t n = S->pos[t] + 1 - lo; /* positions lo .. pos */
            const uint16_t* kc = S->kc[t] + ((L->layer * nkv + g) * S->cap[t] + lo) * hd;
            const uint16_t* vc = S->vc[t] + ((L->layer * nkv + g) * S->cap[t] + lo) * hd;
            for (int64_t i = 0; i < G; i++) {
                const uint16_t* qh = qb + t * D + (g * G + i) * hd;
                const float* qw = qf + t * D + (g * G + i) * hd;
                float* s = sc + i * max_len;
                float m = -INFINITY;
                for (int64_t p = 0; p < n; p++) {
                    s[p] = (wide ? dot_f32_f16(qw, kc + p * hd, hd) : dot_bf16_row(qh, kc + p * hd, hd)) * L->scale;
                    m = s[p] > m ? s[p] : m;
                }
                const float sink = L->sinks ? bf2f(L->sinks[g * G + i]) : -INFINITY;
                m = sink > m ? sink : m;
                if (m != m || m == -INFINITY) m = 0.0f; /* NaN scores stay NaN through the exp below */
                mt_exp_inplace(s, n, m);
                float z = L->sinks ? expf(sink - m) : 0.0f; /* the sink's share of the softmax, then dropped */
                for (int64_t p = 0; p < n; p++) z += s[p];
                float* o = att + t * D + (g * G + i) * hd;
                for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
                if (wide)
                    for (int64_t p = 0; p < n; p++) axpy_f16(o, s[p], vc + p * hd, hd);
                else
                    for (int64_t p = 0; p < n; p++) axpy_bf16(o, s[p], vc + p * hd, hd);
                const float iz = 1.0f / z;
                for (int64_t j = 0; j < hd; j++) o[j] *= iz;
                if (!wide) mt_round_bf16(o, hd);
            }
        }
        /* 5. the output projection's activation */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) mt_act_prep_f32(&ao, t, att + t * D);
        mm_share(&L->wo, D, H, &ao, ident, T, ry, nt, me);
#pragma omp barrier
        /* 6. residual, post-attention norm, the router's activation */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (wide) {
                float* x = S->xw + t * H;
                for (int64_t j = 0; j < H; j++) x[j] += yo[t * H + j] + (L->bo ? bf2f(L->bo[j]) : 0.0f);
                rms_rowf(x, L->post_norm, H, L->eps, S->h + t * H);
            } else {
                uint16_t* x = S->x + t * H;
                for (int64_t j = 0; j < H; j++)
                    x[j] = f2bf(bf2f(x[j]) + round_bf(yo[t * H + j] + (L->bo ? bf2f(L->bo[j]) : 0.0f)));
                rms_row(x, L->post_norm, H, L->eps, S->h + t * H, tmp);
            }
            if (L->router) mt_act_prep_bf16(&ar, t, S->h + t * H);
        }
        /* 7. router logits, then softmax, top-k, renormalisation per row */
        if (L->router) {
            mt_w rw = {16, L->router_w, NULL, NULL, 0};
            mm_share(&rw, H, E, &ar, ident, T, rl, nt, me);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                float* l = lg + t * E;
                float m = -INFINITY;
                for (int64_t e = 0; e < E; e++) {
                    if (L->router_b) l[e] += bf2f(L->router_b[e]); /* one rounding of the biased linear, as torch's */
                    S->logits[t * E + e] = f2bf(l[e]);
                    if (!wide) l[e] = round_bf(l[e]);
                    m = l[e] > m ? l[e] : m;
                }
                if (m != m || m == -INFINITY) m = 0.0f;
                mt_exp_inplace(l, E, m);
                float z = 0.0f;
                for (int64_t e = 0; e < E; e++) z += l[e];
                for (int64_t e = 0; e < E; e++) l[e] /= z;
                int32_t* id = S->ids + t * L->topk;
                float* wv = S->wts + t * L->topk;
                topk(l, E, L->topk, id, wv);
                if (L->norm_topk) {
                    float s = 0.0f;
                    for (int64_t i = 0; i < L->topk; i++) s += wv[i];
                    for (int64_t i = 0; i < L->topk; i++) wv[i] /= s;
                }
                if (L->round_w && !wide)
                    for (int64_t i = 0; i < L->topk; i++) wv[i] = round_bf(wv[i]);
            }
        }
    }
    return 0;
}

/* ============================================================================ head */

int64_t moetier_head_scratch_bytes(const mt_head* Hd, int64_t T) {
    return al64(mt_act_rec_bytes(mt_form_of(Hd->w.kind), Hd->H, MT_QB) * T) + al64(T * Hd->V * 4) +
           al64(T * (Hd->H * 6 + 16)) + 64 * 4;
}

int64_t moetier_head(const mt_head* Hd, const uint16_t* x, const float* xw, int64_t T, uint16_t* logits,
                     float* logits_w, void* scratch, int64_t scratch_bytes, int64_t nthreads) {
    const int64_t H = Hd->H, V = Hd->V;
    if (!kind_ok(Hd->w.kind, H, Hd->w.group) || !fp4_ok(&Hd->w)) return -1;
    if (moetier_head_scratch_bytes(Hd, T) > scratch_bytes) return -2;
    char* cur = (char*)scratch;
    mt_act a;
    take(&cur, mt_act_init(&a, mt_form_of(Hd->w.kind), H, Hd->w.kind == 16 ? 0 : Hd->w.group, cur, T));
    float* y = (float*)take(&cur, T * V * 4);
    char* rowbuf = take(&cur, T * (H * 6 + 16));
    float** yr = (float**)rowbuf;
    int32_t* ident = (int32_t*)(rowbuf + T * 8);
    uint16_t* hn = (uint16_t*)(rowbuf + T * 12);
    float* tmp = (float*)(rowbuf + T * 12 + T * H * 2 + 16);
    for (int64_t t = 0; t < T; t++) {
        yr[t] = logits_w ? logits_w + t * V : y + t * V;
        ident[t] = (int32_t)t;
        if (xw)
            rms_rowf(xw + t * H, Hd->norm, H, Hd->eps, hn + t * H);
        else
            rms_row(x + t * H, Hd->norm, H, Hd->eps, hn + t * H, tmp);
        mt_act_prep_bf16(&a, t, hn + t * H);
    }
    int64_t bad = 0; /* logits that are NaN or Inf: the caller's finite check, for free */
#pragma omp parallel num_threads((int)nthreads) reduction(+ : bad)
    {
        int64_t lo, hi;
        span(V, 4, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        if (hi > lo) {
            mt_mm(&Hd->w, H, lo, hi, &a, ident, T, yr, NULL);
            if (logits_w) /* fp32 logits, written by mt_mm in place */
                for (int64_t t = 0; t < T; t++)
                    for (int64_t j = lo; j < hi; j++) bad += !isfinite(logits_w[t * V + j]);
            else
                for (int64_t t = 0; t < T; t++)
                    for (int64_t j = lo; j < hi; j++) {
                        const uint16_t b = f2bf(y[t * V + j]);
                        logits[t * V + j] = b;
                        bad += (b & 0x7f80) == 0x7f80; /* exponent all ones: Inf or NaN */
                    }
        }
    }
    return bad;
}

/* ============================================================================ single ops (kernels/decode.py) */

int64_t moetier_gemv_scratch_bytes(int64_t M, int64_t K, int kind) {
    if (!mt_is_gg(kind)) kind &= ~(MT_SF16 | MT_FP4);
    return al64(mt_act_rec_bytes(mt_form_of(kind), K, MT_QB) * M) + al64(M * 8) + al64(M * 4) + 64 * 3;
}

/* y [M, N] bf16 = x [M, K] bf16 @ W.T */
int64_t moetier_gemv(const uint16_t* x, int64_t M, int64_t K, int64_t N, int kind, const void* q, const void* s,
                     const uint16_t* z, int64_t group, uint16_t* y, void* scratch, int nthreads) {
    const int sf = !mt_is_gg(kind) && (kind & MT_SF16), fp4 = !mt_is_gg(kind) && (kind & MT_FP4);
    if (!mt_is_gg(kind)) kind &= ~(MT_SF16 | MT_FP4);
    mt_w w = {kind, q, s, z, kind == 16 ? 0 : group, sf, fp4};
    if (!kind_ok(kind, K, kind == 16 ? 1 : group) || !fp4_ok(&w)) return -1;
    (void)N;
    char* cur = (char*)scratch;
    mt_act a;
    take(&cur, mt_act_init(&a, mt_form_of(kind), K, kind == 16 ? 0 : group, cur, M));
    int32_t* ident = (int32_t*)take(&cur, M * 4);
    for (int64_t m = 0; m < M; m++) ident[m] = (int32_t)m;
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) mt_act_prep_bf16(&a, m, x + m * K);
        int64_t lo, hi;
        span(N, 4, nt, me, &lo, &hi);
        if (hi > lo) {
            float buf[4 * 64];
            /* through a small fp32 tile per row block, rounded once into y */
            for (int64_t r = lo; r < hi; r += 64) {
                const int64_t r1 = r + 64 < hi ? r + 64 : hi;
                for (int64_t m0 = 0; m0 < M; m0 += 4) {
                    const int64_t nm = M - m0 < 4 ? M - m0 : 4;
                    float* yr[4];
                    for (int64_t i = 0; i < nm; i++) yr[i] = buf + i * 64 - r;
                    mt_mm(&w, K, r, r1, &a, ident + m0, nm, yr, NULL);
                    for (int64_t i = 0; i < nm; i++)
                        for (int64_t j = r; j < r1; j++) y[(m0 + i) * N + j] = f2bf(yr[i][j]);
                }
            }
        }
    }
    return 0;
}

int64_t moetier_moe_scratch_bytes(int64_t T, int64_t H, int64_t I, int64_t P) {
    return moe_core_bytes(T, H, I, P) + al64(T * H * 4) + al64(P * 2 * (int64_t)sizeof(mt_w)) + 64 * 4;
}

/* out [T, H] (+)= sum over pairs (see csrc/step.h; accumulate 0: out = the sum, 1: out += the sum, both rounded
 * to bf16 once; 2: out is fp32 [T, H] and the sum is added unrounded); desc [n_exp, MT_DESC] contiguous */
int64_t moetier_moe(const uint16_t* x, int64_t T, int64_t H, int64_t I, int64_t n_exp, const int64_t* desc,
                    const int64_t* start, const int32_t* tok, const float* rw, uint16_t* out, int accumulate,
                    void* scratch, int nthreads) {
    const int64_t P = start[n_exp];
    char* cur = (char*)scratch;
    float* ys = accumulate == 2 ? (float*)(void*)out : (float*)take(&cur, T * H * 4);
    mt_w* w = (mt_w*)take(&cur, n_exp * 2 * (int64_t)sizeof(mt_w));
    for (int64_t e = 0; e < n_exp; e++) {
        const int64_t kind = desc[e * MT_DESC + 1];
        const int64_t k0 = mt_is_gg(kind) ? kind : kind & ~(int64_t)(MT_SF16 | MT_FP4);
        if (k0 != 16 && k0 != 8 && k0 != 4 && k0 != 2 && k0 != MT_KIND_F8 && !mt_is_gg(k0)) return -1;
        if (desc[e * MT_DESC + 11] >= 0 || desc[e * MT_DESC + 12] >= 0) return -1; /* SiLU experts, no biases */
        w[e] = desc_w(desc + e * MT_DESC, 0);
        w[n_exp + e] = desc_w(desc + e * MT_DESC, 1);
    }
    if (accumulate != 2)
        for (int64_t i = 0; i < T * H; i++) ys[i] = accumulate ? bf2f(out[i]) : 0.0f;
    moe_call c = {T, H, I, n_exp, w, w + n_exp, start, tok, rw, NULL, NULL, 0, 0.0f, 0.0f};
    const int64_t rc = moe_core(&c, x, ys, cur, moe_core_bytes(T, H, I, P), nthreads);
    if (rc) return rc;
    if (accumulate != 2)
        for (int64_t i = 0; i < T * H; i++) out[i] = f2bf(ys[i]);
    return 0;
}

/* h [n] = fp16 of x [n], back [n] = fp32 of h (the wide caches' conversions, bf16.h; for tests) */
void moetier_f16_roundtrip(const float* x, int64_t n, uint16_t* h, float* back) {
    for (int64_t i = 0; i < n; i++) {
        h[i] = f2h(x[i]);
        back[i] = h2f(h[i]);
    }
}

/* y [M, H] bf16 = rmsnorm(x) * w per row, fp32 math, rounded once */
void moetier_rms_norm(const uint16_t* x, const uint16_t* w, int64_t M, int64_t H, float eps, uint16_t* y) {
    float tmp[4096];
    for (int64_t m = 0; m < M; m++) {
        if (H <= 4096) {
            rms_row(x + m * H, w, H, eps, y + m * H, tmp);
            continue;
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < H; j++) ss += bf2f(x[m * H + j]) * bf2f(x[m * H + j]);
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t j = 0; j < H; j++) y[m * H + j] = f2bf(bf2f(x[m * H + j]) * r * bf2f(w[j]));
    }
}
