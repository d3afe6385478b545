/* Sparse SwiGLU experts of one MoE layer call: the gather path of intra-expert activation sparsity.
 *
 * A call takes n_exp experts, each with its (token, router weight) pairs, and computes for every
 * token t the combined output  out[t] = sum over pairs (e, t, w) of  w * expert_e(x[t]),  where
 *     a = silu(x[t] . Wg_i)                   for every neuron i (dense: each gate row read once)
 *     m = |a| >= thr, per pair and per block of `block` neurons (a block is on if any neuron is)
 *     h = m * a * (x[t] . Wu_i)               only for neurons in the union of m over e's pairs
 *     y = sum_i h_i * Wd_i                    Wd stored as [I, H]: a neuron's down weights are a row
 * An expert is one pool slot: gate rows [I, H] | up rows [I, H] | down rows [I, H], contiguous.
 * Only the up and down rows of active neurons are read. Accumulation is fp32; `out` is written in
 * the weights' dtype (bf16: round to nearest even), `accumulate` adds to what it holds.
 *
 * Loops are plain C that the compiler vectorises (-O3 -march=native); bf16 dot products use the
 * AVX512-BF16 pair instruction where the target has it (1.2x at one token, about 1.6-2x from four
 * tokens per expert, on this project's CPU). Threads are OpenMP; the
 * shared object links libgomp.so.1, which resolves to the copy torch has already loaded, so the
 * process keeps one OpenMP runtime and one thread pool.
 *
 * Returns the number of active (pair, neuron) entries. Arrays (P = pairs, nb = I / block):
 *   wptr [n_exp] slot addresses; start [n_exp + 1] pair offsets; tok [P] token of each pair;
 *   rw [P] router weights; mask_out [P, I] uint8 or NULL; scratch: xs [n_tok, H] fp32,
 *   act [P, I] fp32, flat [n_exp * nb] int32, ys [n_tok, H] fp32.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* bf16 dot product: AVX512-BF16 pairs (products exact in fp32, fp32 accumulation) where the
 * compiler targets it, else plain C on fp32 copies */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
static inline float dot_bf16(const uint16_t* restrict w, const uint16_t* restrict x, const float* restrict xf,
                             int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + j), (__m512bh)_mm512_loadu_si512(x + j));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + j + 32), (__m512bh)_mm512_loadu_si512(x + j + 32));
    }
    for (; j + 32 <= n; j += 32)
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + j), (__m512bh)_mm512_loadu_si512(x + j));
    float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; j < n; j++) acc += bf2f(w[j]) * xf[j];
    return acc;
}
#define DOT_BF16(w, x, xf, n) dot_bf16(w, x, xf, n)
#else
#define DOT_BF16(w, x, xf, n) moetier_sparse_moe_bf16_dot(w, xf, n)
#endif
#define DOT_F32(w, x, xf, n) moetier_sparse_moe_f32_dot(w, xf, n)

#define LOAD_BF16(v) bf2f(v)
#define STORE_BF16(v) f2bf(v)
#define LOAD_F32(v) (v)
#define STORE_F32(v) (v)

#define DEFINE_KERNEL(NAME, T, LOAD, STORE, DOT)                                                             \
    static inline float NAME##_dot(const T* restrict w, const float* restrict x, int64_t n) {            \
        float acc = 0.0f;                                                                               \
        _Pragma("omp simd reduction(+:acc)") for (int64_t j = 0; j < n; j++) acc += LOAD(w[j]) * x[j];  \
        return acc;                                                                                     \
    }                                                                                                   \
    int64_t NAME(const T* x, int64_t n_tok, int64_t H, int64_t I, int64_t block, float thr,             \
                 int64_t n_exp, const int64_t* wptr, const int64_t* start, const int32_t* tok,          \
                 const float* rw, T* out, int accumulate, uint8_t* mask_out, float* xs, float* act,     \
                 int32_t* flat, float* ys, int nthreads) {                                              \
        const int64_t nb = I / block;                                                                   \
        int64_t n_flat = 0, pairs = 0;                                                                  \
        _Pragma("omp parallel num_threads(nthreads)") {                                                 \
            /* 1. tokens to fp32 */                                                                     \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n_tok; t++) {                   \
                for (int64_t j = 0; j < H; j++) xs[t * H + j] = LOAD(x[t * H + j]);                     \
            }                                                                                           \
            /* 2. every gate row of every expert: act[p, i] = silu(x[tok[p]] . wg_i) */                 \
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < n_exp * I; r++) {               \
                const int64_t e = r / I, i = r % I;                                                     \
                const T* row = (const T*)wptr[e] + i * H;                                               \
                for (int64_t p = start[e]; p < start[e + 1]; p++) {                                     \
                    float g = DOT(row, x + (int64_t)tok[p] * H, xs + (int64_t)tok[p] * H, H);           \
                    act[p * I + i] = g / (1.0f + expf(-g));                                             \
                }                                                                                       \
            }                                                                                           \
            /* 3. masks per (pair, block): inactive activations zeroed; the union of active blocks    \
                  of each expert, flattened as e * nb + b */                                            \
            _Pragma("omp single") {                                                                     \
                for (int64_t e = 0; e < n_exp; e++) {                                                   \
                    for (int64_t b = 0; b < nb; b++) {                                                  \
                        int any = 0;                                                                    \
                        for (int64_t p = start[e]; p < start[e + 1]; p++) {                             \
                            float* a = act + p * I + b * block;                                         \
                            int on = 0;                                                                 \
                            for (int64_t j = 0; j < block; j++) on |= fabsf(a[j]) >= thr;               \
                            if (!on) memset(a, 0, (size_t)block * sizeof(float));                       \
                            if (mask_out) memset(mask_out + p * I + b * block, on, (size_t)block);      \
                            any |= on;                                                                  \
                            pairs += on ? block : 0;                                                    \
                        }                                                                               \
                        if (any) flat[n_flat++] = (int32_t)(e * nb + b);                                \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            /* 4. up rows of active neurons: act[p, i] *= x[tok[p]] . wu_i */                           \
            _Pragma("omp for schedule(static)") for (int64_t f = 0; f < n_flat * block; f++) {          \
                const int64_t eb = flat[f / block], e = eb / nb, i = (eb % nb) * block + f % block;     \
                const T* row = (const T*)wptr[e] + (I + i) * H;                                         \
                for (int64_t p = start[e]; p < start[e + 1]; p++) {                                     \
                    float* a = act + p * I + i;                                                         \
                    if (*a != 0.0f) *a *= DOT(row, x + (int64_t)tok[p] * H, xs + (int64_t)tok[p] * H, H); \
                }                                                                                       \
            }                                                                                           \
            /* 5. down rows, each thread owning a slice of the H output columns: ys[tok] += w h wd_i */ \
            const int nt = omp_get_num_threads(), me = omp_get_thread_num();                            \
            const int64_t per = ((H + nt - 1) / nt + 15) / 16 * 16;                                     \
            const int64_t lo = me * per < H ? me * per : H, hi = lo + per < H ? lo + per : H;           \
            for (int64_t t = 0; t < n_tok; t++) {                                                       \
                float* y = ys + t * H;                                                                  \
                if (accumulate) {                                                                       \
                    for (int64_t j = lo; j < hi; j++) y[j] = LOAD(out[t * H + j]);                      \
                } else {                                                                                \
                    for (int64_t j = lo; j < hi; j++) y[j] = 0.0f;                                      \
                }                                                                                       \
            }                                                                                           \
            for (int64_t f = 0; f < n_flat * block; f++) {                                              \
                const int64_t eb = flat[f / block], e = eb / nb, i = (eb % nb) * block + f % block;     \
                const T* row = (const T*)wptr[e] + (2 * I + i) * H;                                     \
                for (int64_t p = start[e]; p < start[e + 1]; p++) {                                     \
                    const float h = act[p * I + i] * rw[p];                                             \
                    if (h == 0.0f) continue;                                                            \
                    float* y = ys + (int64_t)tok[p] * H;                                                \
                    _Pragma("omp simd") for (int64_t j = lo; j < hi; j++) y[j] += h * LOAD(row[j]);     \
                }                                                                                       \
            }                                                                                           \
            for (int64_t t = 0; t < n_tok; t++) {                                                       \
                for (int64_t j = lo; j < hi; j++) out[t * H + j] = STORE(ys[t * H + j]);                \
            }                                                                                           \
        }                                                                                               \
        return pairs;                                                                                   \
    }

DEFINE_KERNEL(moetier_sparse_moe_bf16, uint16_t, LOAD_BF16, STORE_BF16, DOT_BF16)
DEFINE_KERNEL(moetier_sparse_moe_f32, float, LOAD_F32, STORE_F32, DOT_F32)

int moetier_sparse_abi(void) { return 4; }

/* ---------------------------------------------------------------------------------------------
 * Quantized experts (moetier quantize --for-sparsity): every matrix is row-major with rows of H
 * quantised along H in groups of g, W = (q - zero) * scale, q packed `bits` (8, 4, 2) to a byte
 * LSB first, scale and zero bf16 [rows, H/g]. Per expert six addresses: w13 q, scale, zero (gate
 * rows 0..I-1, up rows I..2I-1) and w2 q, scale, zero (down rows). Same math as above; x and out
 * are bf16 (x_bf16 = 1) or fp32. Tokens are kept in "plane" order: with per = 8 / bits values a
 * byte, plane p holds x[per * b + p], so each bit field of a byte meets a contiguous x run.
 * Each row is dequantised once into the calling thread's fp32 buffer (wbuf: nthreads x H; for down
 * rows only the thread's columns) and then used for all of the expert's tokens.
 */
/* Dequantise bytes b0..b1 of every plane of one row into w (plane order): w = (q - zero) * scale,
 * each byte's group gi = b / (g / per). */
static inline void qrow(float* restrict w, const uint8_t* restrict q, const uint16_t* sc, const uint16_t* zr,
                        int64_t H, int64_t g, int bits, int64_t b0, int64_t b1) {
    const int64_t per = 8 / bits, plane = H / per, gb = g / per; /* bytes of a group */
    for (int64_t lo = b0; lo < b1;) {
        const int64_t gi = lo / gb, hi = (gi + 1) * gb < b1 ? (gi + 1) * gb : b1;
        const float s = bf2f(sc[gi]), c = -s * bf2f(zr[gi]);
        if (bits == 8) {
            _Pragma("omp simd") for (int64_t b = lo; b < hi; b++) w[b] = s * (float)q[b] + c;
        } else if (bits == 4) {
            float* w1 = w + plane;
            _Pragma("omp simd") for (int64_t b = lo; b < hi; b++) {
                const uint8_t v = q[b];
                w[b] = s * (float)(v & 15u) + c;
                w1[b] = s * (float)(v >> 4) + c;
            }
        } else {
            float *w1 = w + plane, *w2 = w + 2 * plane, *w3 = w + 3 * plane;
            _Pragma("omp simd") for (int64_t b = lo; b < hi; b++) {
                const uint8_t v = q[b];
                w[b] = s * (float)(v & 3u) + c;
                w1[b] = s * (float)((v >> 2) & 3u) + c;
                w2[b] = s * (float)((v >> 4) & 3u) + c;
                w3[b] = s * (float)(v >> 6) + c;
            }
        }
        lo = hi;
    }
}

static inline float fdot(const float* restrict a, const float* restrict b, int64_t n) {
    float acc = 0.0f;
    _Pragma("omp simd reduction(+:acc)") for (int64_t j = 0; j < n; j++) acc += a[j] * b[j];
    return acc;
}

/* y (plane order) += h * w over bytes b0..b1 of every plane */
static inline void faxpy(float* restrict y, const float* restrict w, float h, int64_t H, int bits, int64_t b0,
                         int64_t b1) {
    const int64_t per = 8 / bits, plane = H / per;
    for (int64_t pl = 0; pl < per; pl++) {
        float* yp = y + pl * plane;
        const float* wp = w + pl * plane;
        _Pragma("omp simd") for (int64_t b = b0; b < b1; b++) yp[b] += h * wp[b];
    }
}

int64_t moetier_sparse_moe_quant(const void* x, int x_bf16, int64_t n_tok, int64_t H, int64_t I, int64_t block,
                                 float thr, int64_t bits, int64_t g, int64_t n_exp, const int64_t* wptr,
                                 const int64_t* start, const int32_t* tok, const float* rw, void* out, int accumulate,
                                 uint8_t* mask_out, float* xs, float* act, int32_t* flat, float* ys, float* wbuf,
                                 int nthreads) {
    const int64_t nb = I / block, per = 8 / bits, plane = H / per, G = H / g, rb = H * bits / 8;
    const uint16_t* xb = (const uint16_t*)x;
    const float* xf = (const float*)x;
    int64_t n_flat = 0, pairs = 0;
#define QROW(e, k, r) ((const uint8_t*)wptr[6 * (e) + 3 * (k)] + (r) * rb)
#define QSC(e, k, r) ((const uint16_t*)wptr[6 * (e) + 3 * (k) + 1] + (r) * G)
#define QZR(e, k, r) ((const uint16_t*)wptr[6 * (e) + 3 * (k) + 2] + (r) * G)
    _Pragma("omp parallel num_threads(nthreads)") {
        /* 1. tokens to fp32 in plane order */
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n_tok; t++) {
            float* xp = xs + t * H;
            for (int64_t j = 0; j < H; j++) xp[(j % per) * plane + j / per] = x_bf16 ? bf2f(xb[t * H + j]) : xf[t * H + j];
        }
        /* 2. gate rows */
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < n_exp * I; r++) {
            const int64_t e = r / I, i = r % I;
            float* w = wbuf + (int64_t)omp_get_thread_num() * H;
            qrow(w, QROW(e, 0, i), QSC(e, 0, i), QZR(e, 0, i), H, g, (int)bits, 0, plane);
            for (int64_t p = start[e]; p < start[e + 1]; p++) {
                const float gv = fdot(w, xs + (int64_t)tok[p] * H, H);
                act[p * I + i] = gv / (1.0f + expf(-gv));
            }
        }
        /* 3. masks and the union of active blocks */
        _Pragma("omp single") {
            for (int64_t e = 0; e < n_exp; e++) {
                for (int64_t b = 0; b < nb; b++) {
                    int any = 0;
                    for (int64_t p = start[e]; p < start[e + 1]; p++) {
                        float* a = act + p * I + b * block;
                        int on = 0;
                        for (int64_t j = 0; j < block; j++) on |= fabsf(a[j]) >= thr;
                        if (!on) memset(a, 0, (size_t)block * sizeof(float));
                        if (mask_out) memset(mask_out + p * I + b * block, on, (size_t)block);
                        any |= on;
                        pairs += on ? block : 0;
                    }
                    if (any) flat[n_flat++] = (int32_t)(e * nb + b);
                }
            }
        }
        /* 4. up rows of active neurons */
        _Pragma("omp for schedule(static)") for (int64_t f = 0; f < n_flat * block; f++) {
            const int64_t eb = flat[f / block], e = eb / nb, i = (eb % nb) * block + f % block;
            int any = 0;
            for (int64_t p = start[e]; p < start[e + 1]; p++) any |= act[p * I + i] != 0.0f;
            if (!any) continue;
            float* w = wbuf + (int64_t)omp_get_thread_num() * H;
            qrow(w, QROW(e, 0, I + i), QSC(e, 0, I + i), QZR(e, 0, I + i), H, g, (int)bits, 0, plane);
            for (int64_t p = start[e]; p < start[e + 1]; p++) {
                float* a = act + p * I + i;
                if (*a != 0.0f) *a *= fdot(w, xs + (int64_t)tok[p] * H, H);
            }
        }
        /* 5. down rows: each thread owns a 16-aligned byte range of every plane (natural columns
              per * b0 .. per * b1) */
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t bper = ((plane + nt - 1) / nt + 15) / 16 * 16;
        const int64_t b0 = me * bper < plane ? me * bper : plane, b1 = b0 + bper < plane ? b0 + bper : plane;
        float* w = wbuf + (int64_t)me * H;
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t pl = 0; pl < per; pl++)
                for (int64_t b = b0; b < b1; b++) ys[t * H + pl * plane + b] = 0.0f;
        for (int64_t f = 0; f < n_flat * block; f++) {
            const int64_t eb = flat[f / block], e = eb / nb, i = (eb % nb) * block + f % block;
            int dq = 0; /* dequantise this thread's part of the row once, for all of its tokens */
            for (int64_t p = start[e]; p < start[e + 1]; p++) {
                const float h = act[p * I + i] * rw[p];
                if (h == 0.0f) continue;
                if (!dq) qrow(w, QROW(e, 1, i), QSC(e, 1, i), QZR(e, 1, i), H, g, (int)bits, b0, b1), dq = 1;
                faxpy(ys + (int64_t)tok[p] * H, w, h, H, (int)bits, b0, b1);
            }
        }
        for (int64_t t = 0; t < n_tok; t++) {
            for (int64_t j = per * b0; j < per * b1; j++) {
                const float y = ys[t * H + (j % per) * plane + j / per];
                if (x_bf16) {
                    uint16_t* o = (uint16_t*)out + t * H + j;
                    *o = f2bf(accumulate ? bf2f(*o) + y : y);
                } else {
                    float* o = (float*)out + t * H + j;
                    *o = accumulate ? *o + y : y;
                }
            }
        }
    }
#undef QROW
#undef QSC
#undef QZR
    return pairs;
}
