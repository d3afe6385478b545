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
#include "mm.h"

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

int moetier_sparse_abi(void) { return 5; }

/* ---------------------------------------------------------------------------------------------
 * Quantized experts (moetier quantize --for-sparsity): every matrix is row-major with rows of H
 * quantised along H in groups of g, W = (q - zero) * scale, q packed `bits` (8, 4, 2) to a byte
 * LSB first, scale and zero bf16 [rows, H/g]. Per expert six addresses: w13 q, scale, zero (gate
 * rows 0..I-1, up rows I..2I-1) and w2 q, scale, zero (down rows). Same math as above; x and out
 * are bf16 (x_bf16 = 1) or fp32. Tokens are kept in "plane" order: with per = 8 / bits values a
 * byte, plane p holds x[per * b + p], so each bit field of a byte meets a contiguous x run.
 * Each row is dequantised once into the calling thread's fp32 buffer (wbuf: nthreads x H; for down
 * rows only the thread's columns) and then used for all of the expert's tokens.
 * 4-bit rows under bf16 activations take the integer path below instead (qbuf, sized by
 * moetier_sparse_quant_qbytes; NULL keeps the fp32 path).
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

/* Blocks b0..b1 of pairs p0..p1 (one expert's): a block with no |activation| >= thr (nor NaN) is zeroed; cnt[b] = the
 * pairs with block b on; mask_out (or NULL) gets each neuron's flag. */
static void mask_blocks(float* act, int64_t I, int64_t block, float thr, int64_t p0, int64_t p1, int64_t b0,
                        int64_t b1, uint8_t* mask_out, int32_t* cnt) {
    for (int64_t b = b0; b < b1; b++) cnt[b] = 0;
    if (block == 1) { /* the paper's per-neuron mask (the default): one branch-free pass the compiler vectorises */
        for (int64_t p = p0; p < p1; p++) {
            float* a = act + p * I;
            _Pragma("omp simd") for (int64_t i = b0; i < b1; i++) {
                const int on = !(fabsf(a[i]) < thr); /* NaN stays on: it reaches the output */
                a[i] = on ? a[i] : 0.0f;
                cnt[i] += on;
            }
            if (mask_out)
                for (int64_t i = b0; i < b1; i++) mask_out[p * I + i] = a[i] != 0.0f || thr <= 0.0f;
        }
        return;
    }
    for (int64_t p = p0; p < p1; p++)
        for (int64_t b = b0; b < b1; b++) {
            float* a = act + p * I + b * block;
            int on = 0;
            for (int64_t j = 0; j < block; j++) on |= !(fabsf(a[j]) < thr);
            if (!on)
                for (int64_t j = 0; j < block; j++) a[j] = 0.0f;
            if (mask_out) memset(mask_out + p * I + b * block, on, (size_t)block);
            cnt[b] += on;
        }
}

/* The integer path of 4-bit rows under bf16 activations (H and the group a multiple of 32; fp32 models keep
 * the exact fp32 path above, as their dense int4 experts do): a 4-bit row of this layout, byte b =
 * v[2b] | v[2b + 1] << 4, is an mm.h kind-4 row of the vector whose block of 32 holds the block's even
 * values, then its odd ones; so the gate and up rows are read by mt_mm (integer dot products, VNNI where
 * the CPU has it) against the tokens' Q4 records of x permuted the same way (int8 per block of 32, as
 * the dense int4 experts read x). The down rows stay the fp32 axpy above. Returns the bytes of the
 * scratch this path needs (records, row pointers, up values), 0 where it does not apply. */
static int q4_fast(int x_bf16, int64_t H, int64_t bits, int64_t g) {
    return x_bf16 && bits == 4 && H % MT_QB == 0 && g % MT_QB == 0;
}
static int64_t al64s(int64_t n) { return (n + 63) / 64 * 64; }
#define ROWWISE_MAX 4 /* tokens up to which the integer path runs each active neuron's up and down rows together */
int64_t moetier_sparse_quant_qbytes(int x_bf16, int64_t H, int64_t I, int64_t bits, int64_t g, int64_t n_tok,
                                    int64_t pairs, int64_t nthreads) {
    if (!q4_fast(x_bf16, H, bits, g)) return 0;
    return al64s(n_tok * mt_act_rec_bytes(MT_F_Q4, H, g)) + al64s(2 * pairs * (int64_t)sizeof(float*)) +
           al64s(pairs * I * (int64_t)sizeof(float)) +
           (n_tok <= ROWWISE_MAX ? al64s(nthreads * n_tok * H * (int64_t)sizeof(float)) : 0);
}

/* One down row into a private accumulator, for a few tokens (decode): y += h * (v - z) * s over the row, y
 * kept per 32 columns as [16 even columns | 16 odd] (the low and high nibbles of the row's 16 bytes there).
 * nsub: the row's 16-byte sub-blocks; a group is spg of them (sh = log2(spg) or -1). */
static inline void down_row(float* restrict y, const uint8_t* restrict q, const uint16_t* s, const uint16_t* z,
                            int64_t nsub, int64_t spg, int sh, float h) {
    for (int64_t j = 0; j < nsub; j++) {
        const int64_t gi = sh >= 0 ? j >> sh : j / spg;
        const float c = h * bf2f(s[gi]), zz = bf2f(z[gi]);
#if MT_ISA == 3
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * j)));
        const __m512 vz = _mm512_set1_ps(zz), vc = _mm512_set1_ps(c);
        const __m512 lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), vz);
        const __m512 hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), vz);
        _mm512_storeu_ps(y + 32 * j, _mm512_fmadd_ps(vc, lo, _mm512_loadu_ps(y + 32 * j)));
        _mm512_storeu_ps(y + 32 * j + 16, _mm512_fmadd_ps(vc, hi, _mm512_loadu_ps(y + 32 * j + 16)));
#else
        _Pragma("omp simd") for (int k = 0; k < 16; k++) {
            y[32 * j + k] += c * ((float)(q[16 * j + k] & 15u) - zz);
            y[32 * j + 16 + k] += c * ((float)(q[16 * j + k] >> 4) - zz);
        }
#endif
    }
}

/* Down rows of the integer path, one tile of 64 row bytes (128 output columns: the low nibbles give the even
 * columns, the high ones the odd) for TB (at most DT_MAX) pairs of expert e at once: for each active neuron of
 * the expert's active blocks flat[f0..f1), acc[c] += (h_c s) * v over the tile, and per 16-byte sub-block (one
 * group) the zero term -h_c s z, added at the end. acc [TB][128]: the even columns, then the odd. */
#if MT_ISA == 3
#define DT_MAX 2 /* 8 accumulator registers a pair */
#else
#define DT_MAX 4
#endif
static inline __attribute__((always_inline)) void down_tile(
    const int TB, const uint8_t* q2, const uint16_t* s2, const uint16_t* z2, int64_t rb, int64_t G, int64_t gb,
    int64_t c0, int64_t nsb, const int32_t* flat, int64_t f0, int64_t f1, int64_t nb, int64_t block, int64_t I,
    const float* act, const float* rw, int64_t p0, float acc[DT_MAX][128]) {
    float off[DT_MAX][4] = {{0}};
    int64_t gix[4]; /* each sub-block's group */
    for (int64_t sb = 0; sb < nsb; sb++) gix[sb] = (c0 + 16 * sb) / gb;
#if MT_ISA == 3
    __m512 a[DT_MAX][8];
    for (int c = 0; c < TB; c++)
        for (int k = 0; k < 8; k++) a[c][k] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi32(15);
#else
    for (int c = 0; c < TB; c++)
        for (int k = 0; k < 128; k++) acc[c][k] = 0.0f;
#endif
    const int64_t eb0 = flat[f0] / nb * nb; /* every flat[f0..f1) is this expert's: its blocks without a division */
    for (int64_t f = f0; f < f1; f++) {
        const int64_t i0 = (flat[f] - eb0) * block;
        if (f + 4 < f1) __builtin_prefetch(q2 + (flat[f + 4] - eb0) * block * rb + c0); /* scattered rows */
        for (int64_t i = i0; i < i0 + block; i++) {
            float h[DT_MAX];
            int any = 0;
            for (int c = 0; c < TB; c++) {
                h[c] = act[(p0 + c) * I + i] * rw[p0 + c];
                any |= h[c] != 0.0f;
            }
            if (!any) continue;
            const uint8_t* q = q2 + i * rb + c0;
            for (int64_t sb = 0; sb < nsb; sb++) {
                const float sc = bf2f(s2[i * G + gix[sb]]), z = bf2f(z2[i * G + gix[sb]]);
#if MT_ISA == 3
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * sb)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, m4)), hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                for (int c = 0; c < TB; c++) {
                    const float hs = h[c] * sc;
                    off[c][sb] -= hs * z;
                    a[c][sb] = _mm512_fmadd_ps(_mm512_set1_ps(hs), lo, a[c][sb]);
                    a[c][4 + sb] = _mm512_fmadd_ps(_mm512_set1_ps(hs), hi, a[c][4 + sb]);
                }
#else
                float lo[16], hi[16];
                for (int k = 0; k < 16; k++) lo[k] = (float)(q[16 * sb + k] & 15u), hi[k] = (float)(q[16 * sb + k] >> 4);
                for (int c = 0; c < TB; c++) {
                    const float hs = h[c] * sc;
                    off[c][sb] -= hs * z;
                    float *al = acc[c] + 16 * sb, *ah = acc[c] + 64 + 16 * sb;
                    _Pragma("omp simd") for (int k = 0; k < 16; k++) al[k] += hs * lo[k], ah[k] += hs * hi[k];
                }
#endif
            }
        }
    }
#if MT_ISA == 3
    for (int c = 0; c < TB; c++)
        for (int64_t sb = 0; sb < 4; sb++) {
            const __m512 o = _mm512_set1_ps(sb < nsb ? off[c][sb] : 0.0f);
            _mm512_storeu_ps(acc[c] + 16 * sb, _mm512_add_ps(a[c][sb], o));
            _mm512_storeu_ps(acc[c] + 64 + 16 * sb, _mm512_add_ps(a[c][4 + sb], o));
        }
#else
    for (int c = 0; c < TB; c++)
        for (int64_t sb = 0; sb < nsb; sb++)
            for (int k = 0; k < 16; k++) acc[c][16 * sb + k] += off[c][sb], acc[c][64 + 16 * sb + k] += off[c][sb];
#endif
}

int64_t moetier_sparse_moe_quant(const void* x, int x_bf16, int64_t n_tok, int64_t H, int64_t I, int64_t block,
                                 float thr, int64_t bits, int64_t g, int64_t n_exp, const int64_t* wptr,
                                 const int64_t* start, const int32_t* tok, const float* rw, void* out, int accumulate,
                                 uint8_t* mask_out, float* xs, float* act, int32_t* flat, float* ys, float* wbuf,
                                 uint8_t* qbuf, int nthreads) {
    const int64_t nb = I / block, per = 8 / bits, plane = H / per, G = H / g, rb = H * bits / 8;
    const int64_t pairs_n = start[n_exp];
    const uint16_t* xb = (const uint16_t*)x;
    const float* xf = (const float*)x;
    int64_t n_flat = 0, pairs = 0;
    const int fast = qbuf != NULL && q4_fast(x_bf16, H, bits, g);
    mt_act A;
    float **gptr = NULL, **uptr = NULL, *upv = NULL, *ybuf = NULL;
    const int rowwise = fast && n_tok <= ROWWISE_MAX;
    if (fast) { /* records | gate row pointers | up row pointers | up values | (rowwise) per-thread sums */
        const int64_t used = al64s(mt_act_init(&A, MT_F_Q4, H, g, qbuf, n_tok));
        gptr = (float**)(qbuf + used);
        uptr = gptr + pairs_n;
        upv = (float*)(qbuf + used + al64s(2 * pairs_n * (int64_t)sizeof(float*)));
        ybuf = (float*)((uint8_t*)upv + al64s(pairs_n * I * (int64_t)sizeof(float)));
        for (int64_t p = 0; p < pairs_n; p++) gptr[p] = act + p * I, uptr[p] = upv + p * I;
    }
    const int64_t nsub = H / 32, spg = g / 32; /* the down rows' 16-byte sub-blocks, and a group's */
    const int spg_sh = (spg & (spg - 1)) == 0 ? __builtin_ctzll((unsigned long long)spg) : -1;
    const int64_t rchunk = (16 + block - 1) / block * block; /* gate rows a work item on the integer path */
    const int64_t nrc = (I + rchunk - 1) / rchunk;
#define QROW(e, k, r) ((const uint8_t*)wptr[6 * (e) + 3 * (k)] + (r) * rb)
#define QSC(e, k, r) ((const uint16_t*)wptr[6 * (e) + 3 * (k) + 1] + (r) * G)
#define QZR(e, k, r) ((const uint16_t*)wptr[6 * (e) + 3 * (k) + 2] + (r) * G)
    _Pragma("omp parallel num_threads(nthreads)") {
        if (fast) {
            /* 1. the tokens' Q4 records of x, each block's even values then its odd ones */
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n_tok; t++) {
                float* xp = wbuf + (int64_t)omp_get_thread_num() * H;
                for (int64_t b = 0; b < H; b += MT_QB)
                    for (int64_t j = 0; j < MT_QB / 2; j++) {
                        const int64_t s0 = t * H + b + 2 * j;
                        xp[b + j] = x_bf16 ? bf2f(xb[s0]) : xf[s0];
                        xp[b + MT_QB / 2 + j] = x_bf16 ? bf2f(xb[s0 + 1]) : xf[s0 + 1];
                    }
                mt_act_prep_f32(&A, t, xp);
            }
            /* 2. gate rows, rchunk rows of one expert a work item (whole blocks: masked here as well); each
                  thread a contiguous share, so that its rows stream from memory in one run */
            _Pragma("omp for schedule(static)") for (int64_t it = 0; it < n_exp * nrc; it++) {
                const int64_t e = it / nrc, r0 = it % nrc * rchunk, r1 = r0 + rchunk < I ? r0 + rchunk : I;
                const int64_t p0 = start[e], np = start[e + 1] - p0;
                const mt_w w = {4, QROW(e, 0, 0), QSC(e, 0, 0), QZR(e, 0, 0), g};
                if (np) mt_mm(&w, H, r0, r1, &A, tok + p0, np, gptr + p0, NULL);
                for (int64_t p = p0; p < p0 + np; p++) mt_silu_mul(act + p * I + r0, NULL, r1 - r0);
                mask_blocks(act, I, block, thr, p0, p0 + np, r0 / block, r1 / block, mask_out, flat + e * nb);
            }
        } else {
            /* 1. tokens to fp32 in plane order */
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n_tok; t++) {
                float* xp = xs + t * H;
                for (int64_t j = 0; j < H; j++)
                    xp[(j % per) * plane + j / per] = x_bf16 ? bf2f(xb[t * H + j]) : xf[t * H + j];
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
        }
        /* 3. masks, an expert a work item: flat[e * nb + b] = the pairs with block b on (inactive activations
              zeroed), then compacted in place to the union of active blocks, (e * nb + b) ascending */
        if (!fast) /* (the integer path masks its gate rows' blocks as it computes them, on the same core) */
            _Pragma("omp for schedule(static)") for (int64_t e = 0; e < n_exp; e++)
                mask_blocks(act, I, block, thr, start[e], start[e + 1], 0, nb, mask_out, flat + e * nb);
        _Pragma("omp single") {
            for (int64_t eb = 0; eb < n_exp * nb; eb++)
                if (flat[eb]) pairs += flat[eb] * block, flat[n_flat++] = (int32_t)eb;
        }
        /* 4. up rows of active neurons. Rowwise (a few tokens: decode): each thread takes a contiguous share of
              the active blocks and runs each neuron's up row, then its down row into the thread's own sums
              (both rows read once, one after the other, the next blocks' rows prefetched: they are scattered),
              the threads' sums added in step 5. Otherwise a block of up rows a work item. */
        if (rowwise) {
            const int me = omp_get_thread_num();
            float* yme = ybuf + (int64_t)me * n_tok * H;
            for (int64_t j = 0; j < n_tok * H; j++) yme[j] = 0.0f;
            _Pragma("omp for schedule(static)") for (int64_t f = 0; f < n_flat; f++) {
                const int64_t e = flat[f] / nb, r0 = flat[f] % nb * block, p0 = start[e], np = start[e + 1] - p0;
                if (f + 2 < n_flat) {
                    const int64_t e2 = flat[f + 2] / nb, r2 = flat[f + 2] % nb * block;
                    for (int64_t o = 0; o < block * rb; o += 64) {
                        __builtin_prefetch(QROW(e2, 0, I + r2) + o);
                        __builtin_prefetch(QROW(e2, 1, r2) + o);
                    }
                }
                const mt_w w = {4, QROW(e, 0, I), QSC(e, 0, I), QZR(e, 0, I), g};
                mt_mm(&w, H, r0, r0 + block, &A, tok + p0, np, uptr + p0, NULL);
                for (int64_t i = r0; i < r0 + block; i++)
                    for (int64_t p = p0; p < p0 + np; p++) {
                        float* a = act + p * I + i;
                        if (*a == 0.0f) continue;
                        *a *= upv[p * I + i];
                        down_row(yme + (int64_t)tok[p] * H, QROW(e, 1, i), QSC(e, 1, i), QZR(e, 1, i), nsub, spg,
                                 spg_sh, *a * rw[p]);
                    }
            }
        } else if (fast) {
            const int64_t per_item = (16 + block - 1) / block; /* active blocks a work item: 16 rows or more */
            /* each thread a contiguous share of the active blocks (ascending: the rows stream from memory in
               order); dynamic scheduling handed them out alternately, 1.8x slower at 64 tokens */
            _Pragma("omp for schedule(static)") for (int64_t f0 = 0; f0 < n_flat; f0 += per_item) {
                const int64_t f1 = f0 + per_item < n_flat ? f0 + per_item : n_flat;
                for (int64_t f = f0; f < f1; f++) {
                    const int64_t e = flat[f] / nb, r0 = flat[f] % nb * block, p0 = start[e], np = start[e + 1] - p0;
                    if (f + 2 < n_flat) { /* the rows are scattered: the next but one's first lines on their way */
                        const int64_t e2 = flat[f + 2] / nb, r2 = flat[f + 2] % nb * block;
                        __builtin_prefetch(QROW(e2, 0, I + r2));
                        __builtin_prefetch(QROW(e2, 0, I + r2) + 64);
                    }
                    const mt_w w = {4, QROW(e, 0, I), QSC(e, 0, I), QZR(e, 0, I), g};
                    mt_mm(&w, H, r0, r0 + block, &A, tok + p0, np, uptr + p0, NULL);
                    for (int64_t p = p0; p < p0 + np; p++)
                        for (int64_t i = r0; i < r0 + block; i++)
                            if (act[p * I + i] != 0.0f) act[p * I + i] *= upv[p * I + i];
                }
            }
        } else {
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
        }
        /* 5. down rows. The integer path: a tile of 64 row bytes a work item, each expert's pairs DT_MAX at a time
              against the tile of every active neuron row (the tile of an expert's rows stays in L1), the
              sums kept in ys [token, the tile's columns] (even columns, then odd), written out per tile. */
        if (rowwise) { /* the threads' sums, 32 columns a step: [16 even | 16 odd] back to natural order */
            const int nthr = omp_get_num_threads();
            _Pragma("omp for schedule(static)") for (int64_t j = 0; j < nsub; j++)
                for (int64_t t = 0; t < n_tok; t++) {
                    float acc[32];
                    for (int k = 0; k < 32; k++) acc[k] = 0.0f;
                    for (int th = 0; th < nthr; th++) {
                        const float* y = ybuf + ((int64_t)th * n_tok + t) * H + 32 * j;
                        for (int k = 0; k < 32; k++) acc[k] += y[k];
                    }
                    uint16_t* o = (uint16_t*)out + t * H + 32 * j;
                    for (int k = 0; k < 16; k++) {
                        o[2 * k] = f2bf(accumulate ? bf2f(o[2 * k]) + acc[k] : acc[k]);
                        o[2 * k + 1] = f2bf(accumulate ? bf2f(o[2 * k + 1]) + acc[16 + k] : acc[16 + k]);
                    }
                }
        } else if (fast) {
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t c0 = 0; c0 < rb; c0 += 64) {
                const int64_t nsb = (rb - c0 < 64 ? rb - c0 : 64) / 16, gb = g / 2;
                float acc[DT_MAX][128];
                const int64_t w16 = 16 * nsb; /* the tile's bytes: ys holds its w16 even sums, then w16 odd */
                for (int64_t t = 0; t < n_tok; t++)
                    for (int64_t k = 0; k < 2 * w16; k++) ys[t * H + 2 * c0 + k] = 0.0f;
                for (int64_t f0 = 0, f1 = 0; f0 < n_flat; f0 = f1) {
                    const int64_t e = flat[f0] / nb;
                    while (f1 < n_flat && flat[f1] / nb == e) f1++;
                    const uint8_t* q2 = QROW(e, 1, 0);
                    for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += DT_MAX) {
                        const int TB = start[e + 1] - p0 >= DT_MAX ? DT_MAX : (int)(start[e + 1] - p0);
#define DT(n) down_tile(n, q2, QSC(e, 1, 0), QZR(e, 1, 0), rb, G, gb, c0, nsb, flat, f0, f1, nb, block, I, act, rw, p0, acc)
                        switch (TB) {
                            case 1: DT(1); break;
#if DT_MAX > 2
                            case 2: DT(2); break;
                            case 3: DT(3); break;
#endif
                            default: DT(DT_MAX); break;
                        }
#undef DT
                        for (int c = 0; c < TB; c++) {
                            float* y = ys + (int64_t)tok[p0 + c] * H + 2 * c0;
                            for (int64_t k = 0; k < w16; k++) y[k] += acc[c][k], y[w16 + k] += acc[c][64 + k];
                        }
                    }
                }
                for (int64_t t = 0; t < n_tok; t++) {
                    const float* y = ys + t * H + 2 * c0;
                    uint16_t* o = (uint16_t*)out + t * H + 2 * c0;
                    for (int64_t k = 0; k < w16; k++) {
                        o[2 * k] = f2bf(accumulate ? bf2f(o[2 * k]) + y[k] : y[k]);
                        o[2 * k + 1] = f2bf(accumulate ? bf2f(o[2 * k + 1]) + y[w16 + k] : y[w16 + k]);
                    }
                }
            }
        } else {
        /* the fp32 path: each thread owns a 16-aligned byte range of every plane (natural columns
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
    }
#undef QROW
#undef QSC
#undef QZR
    return pairs;
}
