/* Decode kernels: the matrix-vector products of one decode step, for bf16 and quantised weights.
 *
 * Two entry points, both parallel over output rows with OpenMP (the copy of libgomp torch loaded):
 *   moetier_gemv  y[M, N] = x[M, K] @ W[N, K].T           one weight matrix, M rows of activations
 *   moetier_moe   out[T, H] (+)= sum over (expert e, token t, weight w) pairs of w * e(x[t])
 *                 with e(x) = W2 (silu(W1 x) * (W3 x)), all active experts of one MoE layer call in
 *                 one call: (1) every gate/up row of every expert, (2) the activation, quantised
 *                 once per pair, (3) every output row, each thread owning a slice of H and summing
 *                 the experts in the order given (ascending expert id), so the result does not
 *                 depend on the number of threads.
 *
 * Weight kinds (`kind`):
 *   16  bf16 [N, K], row-major.
 *   8   int8: q int8 [N, K] = (stored value - 128), W = (q + 128 - zero) * scale.
 *   4   int4: q uint8 [N, K/2]; per block of 32 values, 16 bytes, byte j = v[j] | v[j + 16] << 4;
 *       W = (v - zero) * scale.
 *   2   int2: q uint8 [N, K/4]; per chunk of 128 values, 32 bytes, byte j = v[j] | v[j + 32] << 2 |
 *       v[j + 64] << 4 | v[j + 96] << 6; W = (v - zero) * scale.
 * scale and zero are bf16 [N, K / group] (group a multiple of 32 dividing K); zero NULL means the
 * symmetric constant (int8: 128, int4: 8, int2: 2), the Q8_0 / Q4_0 layout of the dense weights.
 *
 * Quantised products quantise the activation row once per call to int8 in blocks of 32 (scale
 * max|x| / 127, round to nearest even), as llama.cpp does, and use integer dot products: AVX2
 * (_mm256_maddubs_epi16) where the compiler targets it, plain C otherwise. bf16 products convert
 * the weights to fp32 and use FMA (AVX2) or plain C; all accumulation is fp32, outputs are rounded
 * once to bf16 (nearest even). AVX-512 / VNNI / AMX paths are not written: the AVX2 path runs there.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MT_AVX2 1
#else
#define MT_AVX2 0
#endif

#define ABI 2
#define QB 32 /* activation quantisation block */

int64_t moetier_decode_abi(void) { return ABI; }
int64_t moetier_decode_isa(void) { return MT_AVX2 ? 2 : 0; } /* 2 = AVX2+FMA, 0 = plain C */

/* ------------------------------------------------------------------------------------------ activations */

/* One activation row in the forms the dot products read: xf fp32 [K] (bf16 kind; with AVX2 each full
 * chunk of 16 is permuted as [0-3, 8-11, 4-7, 12-15] to match the bf16 unpack order), a int8 [K],
 * d fp32 [K/32] and da fp32 [K/32] = d * (sum of the block's int8 values) (quantised kinds). */
typedef struct {
    float* xf;
    int8_t* a;
    float* d;
    float* da; /* d[b] * (sum of the block's int8 values) */
} act_t;

static void prep_f32(const float* x, int64_t K, float* xf) {
    int64_t j = 0;
#if MT_AVX2
    for (; j + 16 <= K; j += 16) {
        memcpy(xf + j, x + j, 4 * sizeof(float));
        memcpy(xf + j + 4, x + j + 8, 4 * sizeof(float));
        memcpy(xf + j + 8, x + j + 4, 4 * sizeof(float));
        memcpy(xf + j + 12, x + j + 12, 4 * sizeof(float));
    }
#endif
    for (; j < K; j++) xf[j] = x[j];
}

static void prep_q8(const float* x, int64_t K, int8_t* a, float* d, float* da) {
    for (int64_t b = 0; b < K / QB; b++) {
        const float* xb = x + b * QB;
        float amax = 0.0f;
        for (int j = 0; j < QB; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float db = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int j = 0; j < QB; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            a[b * QB + j] = (int8_t)v;
            s += v;
        }
        d[b] = db;
        da[b] = db * (float)s;
    }
}

/* ------------------------------------------------------------------------------------------ dot products */

#if MT_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* bf16 row w [K] . activation (xf permuted as prep_f32 wrote it) */
static inline float dot_bf16(const uint16_t* restrict w, const float* restrict xf, int64_t K) {
    int64_t j = 0;
    float acc = 0.0f;
#if MT_AVX2
    const __m256i zero = _mm256_setzero_si256();
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; j + 32 <= K; j += 32) {
        __m256i v0 = _mm256_loadu_si256((const __m256i*)(w + j));
        __m256i v1 = _mm256_loadu_si256((const __m256i*)(w + j + 16));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v0)), _mm256_loadu_ps(xf + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v0)), _mm256_loadu_ps(xf + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v1)), _mm256_loadu_ps(xf + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v1)), _mm256_loadu_ps(xf + j + 24), a3);
    }
    for (; j + 16 <= K; j += 16) {
        __m256i v0 = _mm256_loadu_si256((const __m256i*)(w + j));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v0)), _mm256_loadu_ps(xf + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v0)), _mm256_loadu_ps(xf + j + 8), a1);
    }
    acc = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; j < K; j++) acc += bf2f(w[j]) * xf[j];
    return acc;
}

#if MT_AVX2
/* 8 int32 partial sums of 32 unsigned weight bytes (0..15 or 0..3) times 32 signed activations */
static inline __m256i idot_u(__m256i v, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(v, a), _mm256_set1_epi16(1));
}
/* the same for 32 signed int8 weights: |q| times a with q's sign (|q| <= 128, |a| <= 127: no saturation) */
static inline __m256i idot_s(__m256i q, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)),
                             _mm256_set1_epi16(1));
}
#endif

/* integer dot of one 32-value block b of a quantised row with the activation's block b */
static inline int32_t block_isum(int bits, const uint8_t* restrict q, const int8_t* restrict a, int64_t b) {
    int32_t s = 0;
    if (bits == 8) {
        const int8_t* qb = (const int8_t*)q + b * QB;
        for (int j = 0; j < QB; j++) s += (int32_t)qb[j] * a[b * QB + j];
    } else if (bits == 4) {
        const uint8_t* qb = q + b * 16;
        for (int j = 0; j < 16; j++) s += (qb[j] & 15) * a[b * QB + j] + (qb[j] >> 4) * a[b * QB + j + 16];
    } else {
        const uint8_t* qc = q + (b / 4) * 32;
        const int sh = 2 * (int)(b % 4);
        for (int j = 0; j < QB; j++) s += ((qc[j] >> sh) & 3) * a[b * QB + j];
    }
    return s;
}

#if MT_AVX2
/* 8 int32 partial sums of block b of a quantised row (bits) with the activation's block b */
static inline __m256i block_ivec(int bits, int sym, const uint8_t* restrict q, const int8_t* restrict a, int64_t b) {
    const __m256i av = _mm256_loadu_si256((const __m256i*)(a + b * QB));
    if (bits == 8) return idot_s(_mm256_loadu_si256((const __m256i*)(q + b * QB)), av);
    if (bits == 4) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(q + b * 16));
        const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
        return sym ? idot_s(_mm256_sub_epi8(v, _mm256_set1_epi8(8)), av) : idot_u(v, av); /* sym: v - 8 */
    }
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(q + (b / 4) * 32));
    return idot_u(_mm256_and_si256(_mm256_srli_epi16(raw, 2 * (int)(b % 4)), _mm256_set1_epi8(3)), av);
}
#endif

#if MT_AVX2
/* symmetric int8 / int4 rows with one scale per block of 32 (the dense Q8_0 / Q4_0 layouts): the scales of
 * 8 blocks at a time are converted and folded into the activation's block scales with vector ops, and
 * four accumulators keep the FMA chains independent */
static float dot_q_g32(int bits, const uint8_t* restrict q, const uint16_t* restrict s, const act_t* act, int64_t K) {
    const int64_t nb = K / QB;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float sc[8];
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256i s16 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s + b)));
        _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(s16, 16)), _mm256_loadu_ps(act->d + b)));
        for (int j = 0; j < 8; j++)
            acc[j & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(bits, 1, q, act->a, b + j)), _mm256_set1_ps(sc[j]),
                                         acc[j & 3]);
    }
    for (; b < nb; b++)
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(bits, 1, q, act->a, b)),
                                 _mm256_set1_ps(act->d[b] * bf2f(s[b])), acc[0]);
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}
#endif

#if MT_AVX2
/* asymmetric rows (the experts' per-group scale and zero), one function per width so every block's unpack
 * is straight-line code; four accumulators keep the FMA chains independent */
#define DEFINE_DOT_ASYM(BITS, ZSHIFT)                                                                          \
    static float dot_asym##BITS(const uint8_t* restrict q, const uint16_t* restrict s, const uint16_t* restrict z, \
                                int64_t per, const act_t* act, int64_t K) {                                    \
        const int64_t nb = K / QB;                                                                             \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),                  \
               a3 = _mm256_setzero_ps();                                                                       \
        float zterm = 0.0f;                                                                                    \
        for (int64_t g0 = 0, gi = 0; g0 < nb; g0 += per, gi++) {                                             \
            const float sg = bf2f(s[gi]);                                                                      \
            float xs = 0.0f;                                                                                   \
            for (int64_t b = g0; b < g0 + per; b++) xs += act->da[b];                                         \
            zterm += sg * (bf2f(z[gi]) - (ZSHIFT)) * xs;                                                       \
            int64_t b = g0;                                                                                    \
            for (; b + 4 <= g0 + per; b += 4) {                                                                \
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(BITS, 0, q, act->a, b)),                   \
                                     _mm256_set1_ps(act->d[b] * sg), a0);                                     \
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(BITS, 0, q, act->a, b + 1)),               \
                                     _mm256_set1_ps(act->d[b + 1] * sg), a1);                                 \
                a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(BITS, 0, q, act->a, b + 2)),               \
                                     _mm256_set1_ps(act->d[b + 2] * sg), a2);                                 \
                a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(BITS, 0, q, act->a, b + 3)),               \
                                     _mm256_set1_ps(act->d[b + 3] * sg), a3);                                 \
            }                                                                                                  \
            for (; b < g0 + per; b++)                                                                          \
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(BITS, 0, q, act->a, b)),                    \
                                     _mm256_set1_ps(act->d[b] * sg), a0);                                     \
        }                                                                                                      \
        return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) - zterm;                     \
    }
DEFINE_DOT_ASYM(8, 128.0f) /* q is stored minus 128 */
DEFINE_DOT_ASYM(4, 0.0f)
DEFINE_DOT_ASYM(2, 0.0f)
#endif

/* quantised row (bits, its scale/zero rows of K/group entries; zero NULL = symmetric) . activation:
 * sum over groups of s_g * (sum_b d_b isum_b - z_g sum_b d_b asum_b), isum_b the block's integer dot */
static float dot_q(int bits, const uint8_t* restrict q, const uint16_t* restrict s, const uint16_t* restrict z,
                   int64_t group, const act_t* act, int64_t K) {
    const int64_t nb = K / QB, per = group / QB;
#if MT_AVX2
    if (per == 1 && z == NULL && bits != 2) return dot_q_g32(bits, q, s, act, K);
    if (z != NULL) return bits == 4 ? dot_asym4(q, s, z, per, act, K)
                        : (bits == 8 ? dot_asym8(q, s, z, per, act, K) : dot_asym2(q, s, z, per, act, K));
#endif
    const float zc = bits == 8 ? 128.0f : (bits == 4 ? 8.0f : 2.0f); /* symmetric zero, stored units */
    /* the zero term: asymmetric rows, and symmetric int2 (and int4 in plain C); AVX2 takes int4's 8 in the
     * integer dot (v - 8, as llama.cpp's Q4_0) */
    const int sym = z == NULL, need_z = !sym || (bits == 2) || (bits == 4 && !MT_AVX2);
    float zterm = 0.0f;
#if MT_AVX2
    __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
#else
    float total = 0.0f;
#endif
    for (int64_t g0 = 0, gi = 0; g0 < nb; g0 += per, gi++) {
        const float sg = bf2f(s[gi]);
        if (need_z) {
            float zg = z ? bf2f(z[gi]) : zc;
            if (bits == 8) zg -= 128.0f; /* q is stored minus 128 */
            float xs = 0.0f;
            for (int64_t b = g0; b < g0 + per; b++) xs += act->da[b];
            zterm += sg * zg * xs;
        }
        int64_t b = g0;
#if MT_AVX2
        for (; b + 2 <= g0 + per; b += 2) {
            v0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(bits, sym, q, act->a, b)), _mm256_set1_ps(act->d[b] * sg), v0);
            v1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(bits, sym, q, act->a, b + 1)),
                                 _mm256_set1_ps(act->d[b + 1] * sg), v1);
        }
        for (; b < g0 + per; b++)
            v0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_ivec(bits, sym, q, act->a, b)), _mm256_set1_ps(act->d[b] * sg), v0);
#else
        for (; b < g0 + per; b++) total += act->d[b] * sg * (float)block_isum(bits, q, act->a, b);
#endif
    }
#if MT_AVX2
    (void)block_isum;
    return hsum8(_mm256_add_ps(v0, v1)) - zterm;
#else
    return total - zterm;
#endif
}

/* one weight matrix (a kind and its pointers) */
typedef struct {
    int kind;
    const void* q;
    const uint16_t* s;
    const uint16_t* z;
    int64_t group;
} wmat_t;

static inline int64_t row_bytes(int kind, int64_t K) { return kind == 16 ? 2 * K : K * kind / 8; }

static inline float dot_row(const wmat_t* w, int64_t r, const act_t* act, int64_t K) {
    if (w->kind == 16) return dot_bf16((const uint16_t*)w->q + r * K, act->xf, K);
    const int64_t G = K / w->group;
    return dot_q(w->kind, (const uint8_t*)w->q + r * row_bytes(w->kind, K), w->s + r * G, w->z ? w->z + r * G : NULL,
                 w->group, act, K);
}

/* activation row i of a scratch laid out for rows of K values */
static inline act_t act_row(int kind, void* base, int64_t rows, int64_t i, int64_t K) {
    act_t a = {0, 0, 0, 0};
    if (kind == 16) {
        a.xf = (float*)base + i * K;
    } else {
        a.a = (int8_t*)base + i * K;
        a.d = (float*)((int8_t*)base + rows * K) + i * (K / QB);
        a.da = (float*)((int8_t*)base + rows * K) + rows * (K / QB) + i * (K / QB);
    }
    return a;
}

static inline void prep_row(int kind, const float* x, act_t* a, int64_t K) {
    if (kind == 16)
        prep_f32(x, K, a->xf);
    else
        prep_q8(x, K, a->a, a->d, a->da);
}

/* bytes of activation scratch for `rows` rows of K values of `kind` */
static int64_t act_bytes(int kind, int64_t rows, int64_t K) {
    return kind == 16 ? rows * K * 4 : rows * K + rows * (K / QB) * 8;
}

/* ------------------------------------------------------------------------------------------ gemv */

int64_t moetier_gemv_scratch_bytes(int64_t M, int64_t K, int kind) { return act_bytes(kind, M, K) + M * K * 4; }

/* y [M, N] bf16 = x [M, K] bf16 @ W.T; scratch of moetier_gemv_scratch_bytes(M, K, kind) bytes, 64-aligned */
int64_t moetier_gemv(const uint16_t* x, int64_t M, int64_t K, int64_t N, int kind, const void* q, const uint16_t* s,
                     const uint16_t* z, int64_t group, uint16_t* y, void* scratch, int nthreads) {
    if (K % QB && kind != 16) return -1;
    wmat_t w = {kind, q, s, z, group};
    float* xf32 = (float*)((char*)scratch + act_bytes(kind, M, K));
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            for (int64_t j = 0; j < K; j++) xf32[m * K + j] = bf2f(x[m * K + j]);
            act_t a = act_row(kind, scratch, M, m, K);
            prep_row(kind, xf32 + m * K, &a, K);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < N; r++) {
            for (int64_t m = 0; m < M; m++) {
                act_t a = act_row(kind, scratch, M, m, K);
                y[m * N + r] = f2bf(dot_row(&w, r, &a, K));
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ MoE */

/* per expert descriptor, int64 [n_exp, DESC]: slot address, kind, then per matrix (w13 [2I, H], w2 [H, I]):
 * group, q offset, scale offset, zero offset (bytes from the slot address; scale/zero -1 for bf16) */
#define DESC 10

static inline wmat_t desc_mat(const int64_t* d, int m) {
    const char* base = (const char*)(intptr_t)d[0];
    const int64_t* p = d + 2 + 4 * m;
    wmat_t w = {(int)d[1], base + p[1], p[2] >= 0 ? (const uint16_t*)(base + p[2]) : NULL,
                p[3] >= 0 ? (const uint16_t*)(base + p[3]) : NULL, p[0]};
    return w;
}

int64_t moetier_moe_scratch_bytes(int64_t T, int64_t H, int64_t I, int64_t P) {
    /* x in fp32 [T, H]; x as bf16 and q8 activations; h [P, 2I] fp32; act as bf16 and q8 forms; ys [T, H] */
    int64_t b = T * H * 4 + act_bytes(16, T, H) + act_bytes(8, T, H) + P * 2 * I * 4 + act_bytes(16, P, I) +
                act_bytes(8, P, I) + T * H * 4;
    return b + 64 * 8;
}

static inline char* take(char** cur, int64_t bytes) {
    char* p = *cur;
    *cur += (bytes + 63) / 64 * 64;
    return p;
}

/* out [T, H] bf16 (+)= sum over pairs (accumulate 0: out = the sum, 1: out += the sum, both rounded to bf16
 * once; 2: out is fp32 [T, H] and the sum is added to it unrounded, so a call split over groups of experts
 * in ascending id gives the bits of one call); pairs of expert e are start[e] .. start[e + 1] - 1 (token tok[p],
 * router weight rw[p]); experts in the order given. Returns 0, or -1 for a shape the kinds refuse. */
int64_t moetier_moe(const uint16_t* x, int64_t T, int64_t H, int64_t I, int64_t n_exp, const int64_t* desc,
                    const int64_t* start, const int32_t* tok, const float* rw, uint16_t* out, int accumulate,
                    void* scratch, int nthreads) {
    int any_q = 0, any_b = 0;
    for (int64_t e = 0; e < n_exp; e++) {
        int kind = (int)desc[e * DESC + 1];
        if (kind != 16 && (H % QB || I % QB || (kind == 2 && (H % 128 || I % 128)))) return -1;
        any_q |= kind != 16;
        any_b |= kind == 16;
    }
    const int64_t P = start[n_exp];
    char* cur = (char*)scratch;
    float* xf32 = (float*)take(&cur, T * H * 4);
    char* xb = take(&cur, act_bytes(16, T, H));
    char* xq = take(&cur, act_bytes(8, T, H));
    float* h = (float*)take(&cur, P * 2 * I * 4);
    char* hb = take(&cur, act_bytes(16, P, I));
    char* hq = take(&cur, act_bytes(8, P, I));
    float* ys = accumulate == 2 ? (float*)(void*)out : (float*)take(&cur, T * H * 4);
#pragma omp parallel num_threads(nthreads)
    {
        /* 0. the tokens' activations, in the forms the experts' kinds read */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t j = 0; j < H; j++) xf32[t * H + j] = bf2f(x[t * H + j]);
            act_t ab = act_row(16, xb, T, t, H), aq = act_row(8, xq, T, t, H);
            if (any_b) prep_row(16, xf32 + t * H, &ab, H);
            if (any_q) prep_row(8, xf32 + t * H, &aq, H);
        }
        /* 1. every gate and up row of every expert, for each of its pairs: h[p, r] = x[tok[p]] . w13_r */
#pragma omp for schedule(static)
        for (int64_t er = 0; er < n_exp * 2 * I; er++) {
            const int64_t e = er / (2 * I), r = er % (2 * I);
            const wmat_t w = desc_mat(desc + e * DESC, 0);
            char* base = w.kind == 16 ? xb : xq;
            for (int64_t p = start[e]; p < start[e + 1]; p++) {
                act_t a = act_row(w.kind == 16 ? 16 : 8, base, T, tok[p], H);
                h[p * 2 * I + r] = dot_row(&w, r, &a, H);
            }
        }
        /* 2. silu(gate) * up per pair, prepared for the expert's down rows */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            float* hp = h + p * 2 * I;
            for (int64_t i = 0; i < I; i++) {
                const float g = hp[i];
                hp[i] = g / (1.0f + expf(-g)) * hp[I + i];
            }
            int64_t e = 0;
            while (start[e + 1] <= p) e++;
            const int kind = (int)desc[e * DESC + 1];
            act_t a = act_row(kind == 16 ? 16 : 8, kind == 16 ? hb : hq, P, p, I);
            prep_row(kind == 16 ? 16 : 8, hp, &a, I);
        }
        /* 3. down rows: each thread owns a slice of H and sums the experts in the order given */
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t chunk = ((H + nt - 1) / nt + 15) / 16 * 16;
        const int64_t lo = me * chunk < H ? me * chunk : H, hi = lo + chunk < H ? lo + chunk : H;
        if (accumulate != 2)
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = lo; j < hi; j++) ys[t * H + j] = accumulate ? bf2f(out[t * H + j]) : 0.0f;
        for (int64_t e = 0; e < n_exp; e++) {
            const wmat_t w = desc_mat(desc + e * DESC, 1);
            for (int64_t p = start[e]; p < start[e + 1]; p++) {
                act_t a = act_row(w.kind == 16 ? 16 : 8, w.kind == 16 ? hb : hq, P, p, I);
                float* y = ys + (int64_t)tok[p] * H;
                const float wp = rw[p];
                for (int64_t j = lo; j < hi; j++) y[j] += wp * dot_row(&w, j, &a, I);
            }
        }
        if (accumulate != 2)
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = lo; j < hi; j++) out[t * H + j] = f2bf(ys[t * H + j]);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ RMSNorm */

/* y [M, H] bf16 = x / sqrt(mean(x^2) + eps) * w, per row, in fp32, rounded once; one thread (rows are
 * short: a decode step's hidden state or its heads) */
void moetier_rms_norm(const uint16_t* x, const uint16_t* w, int64_t M, int64_t H, float eps, uint16_t* y) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* xr = x + m * H;
        float ss = 0.0f;
        for (int64_t j = 0; j < H; j++) {
            const float v = bf2f(xr[j]);
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t j = 0; j < H; j++) y[m * H + j] = f2bf(bf2f(xr[j]) * r * bf2f(w[j]));
    }
}

