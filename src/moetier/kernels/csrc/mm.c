/* Matrix kernels of the decode step (see mm.h for the formats and ISA paths). */
#include "mm.h"

#include <float.h>
#include <math.h>
#include <string.h>

static inline int64_t al64(int64_t n) { return (n + MT_ALIGN - 1) / MT_ALIGN * MT_ALIGN; }

/* block index -> group index without a division in the inner loops (per = blocks a group: a power of two
 * for the group sizes 32..256, any count for per-row groups) */
typedef struct {
    int64_t per;
    int shift; /* log2(per), or -1 */
} gdiv_t;
static inline gdiv_t gdiv(int64_t per) {
    gdiv_t g = {per, (per & (per - 1)) == 0 ? __builtin_ctzll((unsigned long long)per) : -1};
    return g;
}
static inline int64_t gof(gdiv_t g, int64_t b) { return g.shift >= 0 ? b >> g.shift : b / g.per; }

/* fp16 -> fp32, exact (GGUF blocks' own scales; bf16.h) */
static inline float f16f(uint16_t h) { return h2f(h); }

/* kind 4 with fp4 (mm.h): an MXFP4 block's e8m0 exponent e -> 2^(e - 128) in fp32, built from its bits (exact:
 * e >= 2 normal, biased exponent e - 1; e = 1, 0 the subnormals 2^-127, 2^-128; 255 NaN) */
static float E8F[256];
__attribute__((constructor)) static void e8_table(void) {
    for (uint32_t e = 0; e < 256; e++) {
        const uint32_t u = e >= 2 ? (e - 1) << 23 : 0x00200000u << e;
        memcpy(&E8F[e], &u, 4);
    }
    E8F[255] = NAN;
}
float mt_e8_to_f32(uint8_t e) { return E8F[e]; }

/* bytes of one weight scale: a bf16 / fp16 one, or an e8m0 exponent byte (fp4) */
static inline int64_t sbytes(const mt_w* w) { return w->fp4 ? 1 : 2; }
/* the scales of weight row r (G a row), and the address of the i-th scale after s */
static inline const void* srow(const mt_w* w, int64_t r, int64_t G) { return (const char*)w->s + r * G * sbytes(w); }
static inline const void* sat(const mt_w* w, const void* s, int64_t i) { return (const char*)s + i * sbytes(w); }
/* scale i after s as fp32: bf16, fp16 where the weight says so (mt_w.sf16), or an e8m0 exponent (mt_w.fp4) */
static inline float scl(const mt_w* w, const void* s, int64_t i) {
    if (w->fp4) return E8F[((const uint8_t*)s)[i]];
    const uint16_t h = ((const uint16_t*)s)[i];
    return w->sf16 ? f16f(h) : bf2f(h);
}

/* kind 4 with fp4 (mm.h): a nibble's MXFP4 value doubled (FP4S), and that plus 12 for the unsigned paths (FP4U) */
static const int8_t FP4S[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const int8_t FP4U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

#if MT_ISA == 3
/* 16 e8m0 exponent bytes (the low 16 bytes of e) as fp32 2^(e - 128): 1.0 scaled by e - 128 (vscalef: exact, and
 * subnormal for e = 0, 1 with the default MXCSR), NaN where e = 255 */
static inline __m512 e8x16(__m128i e) {
    const __m512i v = _mm512_cvtepu8_epi32(e);
    const __m512 f = _mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(128))));
    return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(255)), f, _mm512_set1_ps(NAN));
}
/* 16 weight scales (masked) as fp32 */
static inline __m512 sv16(const mt_w* w, __mmask16 m, const void* p) {
    if (w->fp4) return e8x16(_mm_maskz_loadu_epi8(m, p));
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (w->sf16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

const char* mt_isa_name(void) {
#if MT_ISA == 3
    return "avx512-bf16-vnni";
#elif MT_ISA == 2 && MT_VNNI256
    return "avx2+vnni";
#elif MT_ISA == 2
    return "avx2";
#else
    return "c";
#endif
}

/* ============================================================================ ggml's block types */

mt_gg_type mt_gg_types[MT_GG_TYPES];
mt_gg_form mt_gg_forms[MT_GG_FORMS] = {{-1, NULL, 0, 0}, {-1, NULL, 0, 0}, {-1, NULL, 0, 0},
                                       {-1, NULL, 0, 0}, {-1, NULL, 0, 0}, {-1, NULL, 0, 0}};

int64_t moetier_gg_register(int64_t type, void* dot, int64_t blck, int64_t tsize, int64_t vtype, void* from,
                            int64_t vblk, int64_t vsize) {
    if (type < 0 || type >= MT_GG_TYPES || !dot || !from || blck <= 0 || tsize <= 0 || vblk <= 0 || vsize <= 0)
        return -1;
    int f = -1;
    for (int i = 0; i < MT_GG_FORMS && f < 0; i++)
        if (mt_gg_forms[i].vtype == vtype) f = i;
    for (int i = 0; i < MT_GG_FORMS && f < 0; i++)
        if (mt_gg_forms[i].vtype < 0) {
            mt_gg_forms[i].from = (mt_gg_from_t)from;
            mt_gg_forms[i].vblk = vblk;
            mt_gg_forms[i].vsize = vsize;
            mt_gg_forms[i].vtype = vtype; /* last: a reader that sees the type sees the rest */
            f = i;
        }
    if (f < 0) return -2;
    mt_gg_types[type].blck = blck;
    mt_gg_types[type].tsize = tsize;
    mt_gg_types[type].form = MT_F_GG + f;
    mt_gg_types[type].dot = (mt_gg_dot_t)dot;
    return 0;
}

/* rows [r0, r1) of a ggml-kind weight against nt records: one dot call per (row, record) */
static void mm_gg(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow, int64_t nt,
                  float* const* yrow, const float* alpha) {
    const mt_gg_type* t = &mt_gg_types[w->kind - MT_KIND_GG];
    const int64_t rb = K / t->blck * t->tsize;
    const char* q = (const char*)w->q;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < nt; i++) {
            float v;
            t->dot((int)K, &v, 0, q + r * rb, 0, A->base + (int64_t)arow[i] * A->rec, 0, 1);
            if (alpha)
                yrow[i][r] += alpha[i] * v;
            else
                yrow[i][r] = v;
        }
}

/* a ggml record: the row (fp32, or bf16 widened a chunk at a time) through the form's from_float */
static void prep_gg(const mt_act* A, int64_t r, const float* xf, const uint16_t* xb) {
    const mt_gg_form* f = &mt_gg_forms[A->form - MT_F_GG];
    char* o = A->base + r * A->rec;
    if (xf) {
        f->from(xf, o, A->K);
        return;
    }
    float tmp[1024];
    const int64_t chunk = 1024 / f->vblk * f->vblk;
    for (int64_t j = 0; j < A->K; j += chunk) {
        const int64_t n = A->K - j < chunk ? A->K - j : chunk;
        for (int64_t l = 0; l < n; l++) tmp[l] = bf2f(xb[j + l]);
        f->from(tmp, o + j / f->vblk * f->vsize, n);
    }
}

/* ============================================================================ activation records */

/* Q record: q int8 [K] | d fp32 [nb] | n int32 [nb] | init int32 [8 nb] | dx fp32 [8 nb] | gs fp32 [K/gsz] */
int64_t mt_act_rec_bytes(int form, int64_t K, int64_t gsz) {
    if (form == MT_F_BF16) return al64(K * (MT_ISA == 3 ? 2 : 4));
    if (form >= MT_F_GG) {
        const mt_gg_form* f = &mt_gg_forms[form - MT_F_GG];
        return f->vtype < 0 ? 0 : al64(K / f->vblk * f->vsize);
    }
    const int64_t nb = K / MT_QB, ng = gsz > 0 ? K / gsz : 0;
    return al64(K) + 2 * al64(nb * 4) + 2 * al64(nb * 8 * 4) + al64(ng * 4);
}

int64_t mt_act_init(mt_act* A, int form, int64_t K, int64_t gsz, void* buf, int64_t rows) {
    const int64_t nb = K / MT_QB;
    A->form = form;
    A->K = K;
    A->gsz = form == MT_F_BF16 || form >= MT_F_GG ? 0 : gsz;
    A->rec = mt_act_rec_bytes(form, K, A->gsz);
    A->off_d = al64(K);
    A->off_n = A->off_d + al64(nb * 4);
    A->off_init = A->off_n + al64(nb * 4);
    A->off_gs = A->off_init + 2 * al64(nb * 8 * 4);
    A->base = (char*)buf;
    return A->rec * rows;
}

static inline char* rec_of(const mt_act* A, int64_t r) { return A->base + r * A->rec; }
static inline float* rec_d(const mt_act* A, int64_t r) { return (float*)(rec_of(A, r) + A->off_d); }
static inline int32_t* rec_n(const mt_act* A, int64_t r) { return (int32_t*)(rec_of(A, r) + A->off_n); }
static inline int32_t* rec_init(const mt_act* A, int64_t r) { return (int32_t*)(rec_of(A, r) + A->off_init); }
static inline float* rec_dx(const mt_act* A, int64_t r) {
    return (float*)(rec_of(A, r) + A->off_init + al64(A->K / MT_QB * 8 * 4));
}
static inline float* rec_gs(const mt_act* A, int64_t r) { return (float*)(rec_of(A, r) + A->off_gs); }

/* one block of 32: int8 values, scale, integer sum; NaN / Inf -> d = NaN, q = 0 */
static inline void quant_block(const float* x, int8_t* q, float* d, int32_t* n) {
#if MT_ISA == 3
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
    const __m512 big = _mm512_set1_ps(FLT_MAX);
    const __mmask16 bad = _mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ);
    if (bad) {
        memset(q, 0, MT_QB);
        *d = NAN;
        *n = 0;
        return;
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(i1));
    *d = amax / 127.0f;
    *n = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
    float amax = 0.0f;
    int bad = 0;
    for (int j = 0; j < MT_QB; j++) {
        const float ax = fabsf(x[j]);
        bad |= !(ax <= FLT_MAX);
        amax = ax > amax ? ax : amax;
    }
    if (bad) {
        memset(q, 0, MT_QB);
        *d = NAN;
        *n = 0;
        return;
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < MT_QB; j++) {
        int v = (int)nearbyintf(x[j] * id);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q[j] = (int8_t)v;
        s += v;
    }
    *d = amax / 127.0f;
    *n = s;
#endif
}

/* fill the derived parts of a Q record (init, dx, gs) from its d and n */
static void finish_q(const mt_act* A, int64_t r) {
    const int64_t K = A->K, nb = K / MT_QB;
    const float* d = rec_d(A, r);
    const int32_t* n = rec_n(A, r);
    int32_t* init = rec_init(A, r);
    float* dx = rec_dx(A, r);
    const int32_t zc = A->form == MT_F_Q4 ? 8 : 128; /* symmetric zero of the kind that reads this form */
#if MT_ISA == 3
    memset(init, 0, (size_t)nb * 8 * 4);
    if (A->form == MT_F_Q4) {
        const int64_t full = nb / 4 * 4;
        for (int64_t b = 0; b < full; b++) {
            const int64_t G = b / 4, j = b % 4;
            init[G * 16 + 4 * j] = -zc * n[b];
            for (int l = 0; l < 4; l++) dx[G * 16 + 4 * j + l] = d[b];
        }
        for (int64_t b = full; b < nb; b++) {
            const int64_t o = full / 4 * 16 + (b - full) * 8;
            init[o] = -zc * n[b];
            for (int l = 0; l < 8; l++) dx[o + l] = d[b];
        }
    } else {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t o = b / 2 * 16 + (b % 2) * 8;
            init[o] = -zc * n[b];
            for (int l = 0; l < 8; l++) dx[o + l] = d[b];
        }
    }
#else
    for (int64_t b = 0; b < nb; b++) {
        for (int l = 0; l < 8; l++) init[b * 8 + l] = 0;
        init[b * 8] = -zc * n[b];
        dx[b * 8] = d[b];
    }
#endif
    if (A->gsz > 0) {
        const int64_t per = A->gsz / MT_QB;
        float* gs = rec_gs(A, r);
        for (int64_t g = 0; g < K / A->gsz; g++) {
            float s = 0.0f;
            for (int64_t b = g * per; b < (g + 1) * per; b++) s += d[b] * (float)n[b];
            gs[g] = s;
        }
    }
}

/* a Q record from fp32 values (xf) or bf16 values (xb), a block at a time */
static void prep_q(const mt_act* A, int64_t r, const float* xf, const uint16_t* xb) {
    const int64_t nb = A->K / MT_QB;
    int8_t* q = (int8_t*)rec_of(A, r);
    float* d = rec_d(A, r);
    int32_t* n = rec_n(A, r);
#if MT_ISA == 3
    const int64_t full = A->form == MT_F_Q4 ? nb / 4 * 4 : 0; /* Q4: low halves of 4 blocks, then high halves */
#endif
    float blk[MT_QB];
    int8_t tmp[MT_QB];
    for (int64_t b = 0; b < nb; b++) {
        const float* x = xf ? xf + b * MT_QB : blk;
        if (!xf)
            for (int j = 0; j < MT_QB; j++) blk[j] = bf2f(xb[b * MT_QB + j]);
#if MT_ISA == 3
        if (b < full) {
            quant_block(x, tmp, d + b, n + b);
            const int64_t G = b / 4, j = b % 4;
            memcpy(q + G * 128 + j * 16, tmp, 16);
            memcpy(q + G * 128 + 64 + j * 16, tmp + 16, 16);
            continue;
        }
#endif
        (void)tmp;
        quant_block(x, q + b * MT_QB, d + b, n + b);
    }
    finish_q(A, r);
}

void mt_act_prep_f32(const mt_act* A, int64_t r, const float* x) {
    const int64_t K = A->K;
    if (A->form >= MT_F_GG) {
        prep_gg(A, r, x, NULL);
        return;
    }
    if (A->form != MT_F_BF16) {
        prep_q(A, r, x, NULL);
        return;
    }
#if MT_ISA == 3
    uint16_t* o = (uint16_t*)rec_of(A, r);
    int64_t j = 0;
    for (; j + 16 <= K; j += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j));
        _mm256_storeu_si256((__m256i*)(o + j), (__m256i)b);
    }
    for (; j < K; j++) o[j] = f2bf(x[j]);
#elif MT_ISA == 2
    static const int src[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    float* o = (float*)rec_of(A, r);
    int64_t j = 0;
    for (; j + 16 <= K; j += 16) /* [0-3, 8-11, 4-7, 12-15]: the order the widening unpack gives */
        for (int l = 0; l < 16; l++) o[j + l] = bf2f(f2bf(x[j + src[l]]));
    for (; j < K; j++) o[j] = bf2f(f2bf(x[j]));
#else
    float* o = (float*)rec_of(A, r);
    for (int64_t j = 0; j < K; j++) o[j] = bf2f(f2bf(x[j]));
#endif
}

void mt_act_prep_bf16(const mt_act* A, int64_t r, const uint16_t* x) {
    const int64_t K = A->K;
    if (A->form >= MT_F_GG) {
        prep_gg(A, r, NULL, x);
        return;
    }
    if (A->form != MT_F_BF16) {
        prep_q(A, r, NULL, x);
        return;
    }
#if MT_ISA == 3
    memcpy(rec_of(A, r), x, (size_t)K * 2);
#elif MT_ISA == 2
    static const int src[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    float* o = (float*)rec_of(A, r);
    int64_t j = 0;
    for (; j + 16 <= K; j += 16)
        for (int l = 0; l < 16; l++) o[j + l] = bf2f(x[j + src[l]]);
    for (; j < K; j++) o[j] = bf2f(x[j]);
#else
    float* o = (float*)rec_of(A, r);
    for (int64_t j = 0; j < K; j++) o[j] = bf2f(x[j]);
#endif
}

/* the zero term's activation part for group size `group`: the record's gs when it was made for that size */
static inline float group_sum(const mt_act* A, int64_t r, int64_t group, int64_t g) {
    if (A->gsz == group) return rec_gs(A, r)[g];
    const float* d = rec_d(A, r);
    const int32_t* n = rec_n(A, r);
    const int64_t per = group / MT_QB;
    float s = 0.0f;
    for (int64_t b = g * per; b < (g + 1) * per; b++) s += d[b] * (float)n[b];
    return s;
}

/* sum over groups of s_g * z_g * gs_g for one weight row (z NULL: the constant zc) */
static inline float zero_term(const mt_w* w, int64_t K, int64_t r, const mt_act* A, int64_t ar, float zc) {
    const int64_t G = K / w->group;
    const void* s = srow(w, r, G);
    const uint16_t* z = w->z ? w->z + r * G : NULL;
    float t = 0.0f;
    int64_t g = 0;
#if MT_ISA == 3
    if (z != NULL && A->gsz == w->group && G >= 8) { /* 16 groups a step: bf16 s and z widened, times the sums */
        const float* gs = rec_gs(A, ar);
        __m512 acc = _mm512_setzero_ps();
        for (; g < G; g += 16) {
            const __mmask16 m = G - g >= 16 ? 0xffff : (__mmask16)((1u << (G - g)) - 1);
            const __m512 sv = sv16(w, m, sat(w, s, g));
            const __m512 zv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, z + g)), 16));
            acc = _mm512_fmadd_ps(_mm512_mul_ps(sv, zv), _mm512_maskz_loadu_ps(m, gs + g), acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
#endif
    if (A->gsz == w->group) { /* a few groups (short rows, per-row int8): scalar, the record's group sums */
        const float* gs = rec_gs(A, ar);
        for (; g < G; g++) t += scl(w, s, g) * (z ? bf2f(z[g]) : zc) * gs[g];
        return t;
    }
    for (; g < G; g++) t += scl(w, s, g) * (z ? bf2f(z[g]) : zc) * group_sum(A, ar, w->group, g);
    return t;
}

static inline void put(float* const* yrow, const float* alpha, int64_t i, int64_t r, float v) {
    if (alpha)
        yrow[i][r] += alpha[i] * v;
    else
        yrow[i][r] = v;
}

/* ============================================================================ plain C (reference path) */

#if MT_ISA == 0
static inline int32_t block_isum_c(int64_t kind, int64_t fp4, const uint8_t* row, const int8_t* a, int64_t b) {
    int32_t s = 0;
    if (kind == 4 && fp4) { /* MXFP4 values, signed: no zero shift */
        const uint8_t* q = row + b * 16;
        for (int j = 0; j < 16; j++) s += FP4S[q[j] & 15] * a[b * MT_QB + j] + FP4S[q[j] >> 4] * a[b * MT_QB + j + 16];
        return s;
    }
    if (kind == 8) {
        const int8_t* q = (const int8_t*)row + b * MT_QB;
        for (int j = 0; j < MT_QB; j++) s += ((int32_t)q[j] + 128) * a[b * MT_QB + j];
    } else if (kind == 4) {
        const uint8_t* q = row + b * 16;
        for (int j = 0; j < 16; j++) s += (q[j] & 15) * a[b * MT_QB + j] + (q[j] >> 4) * a[b * MT_QB + j + 16];
    } else {
        const uint8_t* q = row + (b / 4) * 32;
        const int sh = 2 * (int)(b % 4);
        for (int j = 0; j < MT_QB; j++) s += ((q[j] >> sh) & 3) * a[b * MT_QB + j];
    }
    return s;
}

static inline float zc_of(int64_t kind) { return kind == 8 ? 128.0f : (kind == 4 ? 8.0f : 2.0f); }

/* one quantised row . one Q record, exact integer block sums (the reference every path is tested against) */
static float dot_q_c(const mt_w* w, int64_t K, int64_t r, const mt_act* A, int64_t ar) {
    const int64_t nb = K / MT_QB, G = K / w->group, per = w->group / MT_QB;
    const uint8_t* row = (const uint8_t*)w->q + r * mt_row_bytes(w->kind, K);
    const int8_t* a = (const int8_t*)rec_of(A, ar);
    const float* d = rec_d(A, ar);
    const void* s = srow(w, r, G);
    float acc = 0.0f;
    const gdiv_t gd = gdiv(per);
    for (int64_t b = 0; b < nb; b++)
        acc += d[b] * scl(w, s, gof(gd, b)) * (float)block_isum_c(w->kind, w->fp4, row, a, b);
    return w->fp4 ? acc : acc - zero_term(w, K, r, A, ar, zc_of(w->kind)); /* MXFP4 values are signed: no zero */
}

static void mm_c(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow, int64_t nt,
                 float* const* yrow, const float* alpha) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < nt; i++) {
            float v;
            if (w->kind == 16) {
                const uint16_t* wr = (const uint16_t*)w->q + r * K;
                const float* x = (const float*)rec_of(A, arow[i]);
                v = 0.0f;
                for (int64_t j = 0; j < K; j++) v += bf2f(wr[j]) * x[j];
            } else {
                v = dot_q_c(w, K, r, A, arow[i]);
            }
            put(yrow, alpha, i, r, v);
        }
}
#endif

/* ============================================================================ AVX2 */
#if MT_ISA >= 2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256i idot_u(__m256i v, __m256i a) { /* unsigned weights <= 15 times signed activations */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(v, a), _mm256_set1_epi16(1));
}
static inline __m256i idot_s(__m256i q, __m256i a) { /* signed x signed, |q| <= 128, |a| <= 127 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)),
                             _mm256_set1_epi16(1));
}
/* the 32 values of block b of a 4-bit row, natural order, as bytes 0..15 */
static inline __m256i nib32(const uint8_t* row, int64_t b) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)(row + b * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}
/* 2-bit block b, natural order */
static inline __m256i crumb32(const uint8_t* row, int64_t b) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(row + (b / 4) * 32));
    return _mm256_and_si256(_mm256_srli_epi16(raw, 2 * (int)(b % 4)), _mm256_set1_epi8(3));
}
#endif

#if MT_ISA == 2
#if MT_VNNI256
#if defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif
#endif

/* one bf16 row . one fp32 (permuted) activation: 32 values a step, four accumulator chains */
static inline float bf16_row2(const uint16_t* w, int64_t K, const float* xf) {
    const __m256i zero = _mm256_setzero_si256();
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 32 <= K; j += 32) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(w + j)), v1 = _mm256_loadu_si256((const __m256i*)(w + j + 16));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v0)), _mm256_loadu_ps(xf + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v0)), _mm256_loadu_ps(xf + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v1)), _mm256_loadu_ps(xf + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v1)), _mm256_loadu_ps(xf + j + 24), a3);
    }
    for (; j + 16 <= K; j += 16) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(w + j));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v0)), _mm256_loadu_ps(xf + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v0)), _mm256_loadu_ps(xf + j + 8), a1);
    }
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; j < K; j++) s += bf2f(w[j]) * xf[j];
    return s;
}

/* block b of a quantised row as 8 int32 partial sums against the activation block (the integer sum of
 * (v - zc) * a for symmetric rows, of v * a (VNNI or 4/2-bit) or q * a (8-bit, no VNNI) otherwise) */
static inline __m256i block_isum2(int64_t kind, int sym, int64_t fp4, const uint8_t* row, const int8_t* a,
                                  const int32_t* init, int64_t b) {
    const __m256i av = _mm256_loadu_si256((const __m256i*)(a + b * MT_QB));
    if (kind == 8) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(row + b * MT_QB));
#if MT_VNNI256
        const __m256i i0 = sym ? _mm256_loadu_si256((const __m256i*)(init + b * 8)) : _mm256_setzero_si256();
        return DPBUSD256(i0, _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)), av);
#else
        (void)sym;
        (void)init;
        return idot_s(q, av); /* q = v - 128: the symmetric sum as it is; asymmetric rows shift the zero by 128 */
#endif
    }
    if (kind == 4) {
        const __m256i v = nib32(row, b);
#if MT_VNNI256
        __m256i i0 = sym ? _mm256_loadu_si256((const __m256i*)(init + b * 8)) : _mm256_setzero_si256();
        if (fp4) /* value + 12 against the start value scaled from -8 to -12 times the block sum (exact: a multiple of 8) */
            return DPBUSD256(_mm256_srai_epi32(_mm256_mullo_epi32(i0, _mm256_set1_epi32(3)), 1),
                             _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)FP4U)), v), av);
        return DPBUSD256(i0, v, av);
#else
        (void)init;
        if (fp4) return idot_s(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)FP4S)), v), av);
        return sym ? idot_s(_mm256_sub_epi8(v, _mm256_set1_epi8(8)), av) : idot_u(v, av);
#endif
    }
    (void)init;
    (void)sym;
    return idot_u(crumb32(row, b), av);
}

/* the constant the zero term uses for this path (what block_isum2 left in the integer sums) */
static inline float zshift2(int64_t kind, int sym) {
    if (kind == 2) return sym ? 2.0f : 0.0f; /* 2-bit: v * a always; zero term with zc or z */
#if MT_VNNI256
    return 0.0f; /* symmetric: the start value took it; asymmetric: v * a, zero term with z */
#else
    if (kind == 8) return sym ? 0.0f : -128.0f; /* q * a: zero term with z - 128 */
    return 0.0f;                                /* 4-bit: (v - 8) * a symmetric, v * a asymmetric */
#endif
}

/* one quantised row . one Q record: two blocks a step into two accumulator chains (one row at a time: a
 * single sequential stream per thread, see the AVX-512 section) */
static float q_row2(const mt_w* w, int64_t K, int64_t r, const mt_act* A, int64_t ar) {
    const int64_t nb = K / MT_QB, G = K / w->group, per = w->group / MT_QB, rb = mt_row_bytes(w->kind, K);
    const int sym = w->z == NULL;
    const uint8_t* row = (const uint8_t*)w->q + r * rb;
    const void* s = srow(w, r, G);
    const int8_t* a = (const int8_t*)rec_of(A, ar);
    const float* d = rec_d(A, ar);
    const int32_t* init = rec_init(A, ar);
    const gdiv_t gd = gdiv(per);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m256i i0 = block_isum2(w->kind, sym, w->fp4, row, a, init, b);
        const __m256i i1 = block_isum2(w->kind, sym, w->fp4, row, a, init, b + 1);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(d[b] * scl(w, s, gof(gd, b))), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(d[b + 1] * scl(w, s, gof(gd, b + 1))), a1);
    }
    if (b < nb)
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_isum2(w->kind, sym, w->fp4, row, a, init, b)),
                             _mm256_set1_ps(d[b] * scl(w, s, gof(gd, b))), a0);
    float v = hsum8(_mm256_add_ps(a0, a1));
    const float zs = zshift2(w->kind, sym);
    if (!sym) {
        for (int64_t g = 0; g < G; g++) v -= scl(w, s, g) * (bf2f(w->z[r * G + g]) + zs) * group_sum(A, ar, w->group, g);
    } else if (zs != 0.0f) {
        for (int64_t g = 0; g < G; g++) v -= scl(w, s, g) * zs * group_sum(A, ar, w->group, g);
    }
    return v;
}

static void mm_avx2(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow,
                    int64_t nt, float* const* yrow, const float* alpha) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < nt; i++) {
            const float v = w->kind == 16 ? bf16_row2((const uint16_t*)w->q + r * K, K, (const float*)rec_of(A, arow[i]))
                                          : q_row2(w, K, r, A, arow[i]);
            put(yrow, alpha, i, r, v);
        }
}

#endif

/* ============================================================================ AVX-512 BF16 + VNNI */
#if MT_ISA == 3
#define MAXT 4

/* kind 4 with fp4 (mm.h): the nibbles as MXFP4 value + 12, and the symmetric start value scaled from -8 to -12
 * times the block sum (exact: it is a multiple of 8); both unchanged for plain int4 */
static inline __m512i fp4n(const mt_w* w, __m512i v) {
    return w->fp4 ? _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)FP4U)), v) : v;
}
static inline __m512i fp4i(const mt_w* w, __m512i i) {
    return w->fp4 ? _mm512_srai_epi32(_mm512_mullo_epi32(i, _mm512_set1_epi32(3)), 1) : i;
}

/* One weight row at a time, streamed front to back (one sequential stream per thread: on this project's
 * AVX-512 EPYC, 4 interleaved rows read 23 GB/s where one row at a time reads 28-31, the machine's
 * 32 GB/s two-thread read rate), against up to MAXT activation rows; two accumulator chains per
 * activation row so the FMA latency does not bound a stream. */

/* bf16 row . TB bf16 activation rows, 64 values a step */
static inline __attribute__((always_inline)) void bf16_row3(const uint16_t* w, int64_t K, const mt_act* A,
                                                             const int32_t* arow, const int TB, float* out) {
    __m512 a0[MAXT], a1[MAXT];
    const uint16_t* x[MAXT];
    for (int t = 0; t < TB; t++) {
        x[t] = (const uint16_t*)rec_of(A, arow[t]);
        a0[t] = a1[t] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i w0 = _mm512_loadu_si512((const void*)(w + k)), w1 = _mm512_loadu_si512((const void*)(w + k + 32));
        for (int t = 0; t < TB; t++) {
            a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)w0, (__m512bh)_mm512_loadu_si512((const void*)(x[t] + k)));
            a1[t] = _mm512_dpbf16_ps(a1[t], (__m512bh)w1, (__m512bh)_mm512_loadu_si512((const void*)(x[t] + k + 32)));
        }
    }
    for (; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? 0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);
        const __m512i w0 = _mm512_maskz_loadu_epi16(m, w + k);
        for (int t = 0; t < TB; t++)
            a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)w0, (__m512bh)_mm512_maskz_loadu_epi16(m, x[t] + k));
    }
    for (int t = 0; t < TB; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

static const int32_t IDX4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

/* the weight row's scales of blocks b .. b + nblk - 1, each repeated over the lanes its block has (8 lanes a
 * block for 2 blocks, 4 for 4) */
static const int32_t IDX2[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};

static inline __m512 wscale(const mt_w* w, const void* s, int64_t b, gdiv_t gd, int nblk) {
    const __m512i idx = _mm512_loadu_si512((const void*)(nblk == 4 ? IDX4 : IDX2));
    if (gd.per == 1 && w->fp4) { /* MXFP4: nblk consecutive e8m0 exponent bytes, widened in one go */
        int32_t e4 = 0;
        memcpy(&e4, (const uint8_t*)s + b, (size_t)nblk);
        return _mm512_permutexvar_ps(idx, e8x16(_mm_cvtsi32_si128(e4)));
    }
    if (gd.per == 1) { /* a scale per block (Q8_0 / Q4_0): nblk consecutive bf16 scales, widened in one go */
        const uint16_t* h = (const uint16_t*)s + b;
        const __m128i raw = nblk == 4 ? _mm_loadl_epi64((const __m128i*)h) : _mm_cvtsi32_si128(*(const int32_t*)h);
        const __m128 f = w->sf16 ? _mm_cvtph_ps(raw) : _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(raw), 16));
        return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
    }
    const int64_t g0 = gof(gd, b), g1 = gof(gd, b + nblk - 1);
    if (g0 == g1) return _mm512_set1_ps(scl(w, s, g0));
    if (nblk == 2)
        return _mm512_insertf32x8(_mm512_set1_ps(scl(w, s, g0)), _mm256_set1_ps(scl(w, s, g1)), 1);
    const __m128 v = _mm_setr_ps(scl(w, s, g0), scl(w, s, gof(gd, b + 1)), scl(w, s, gof(gd, b + 2)), scl(w, s, g1));
    return _mm512_permutexvar_ps(_mm512_loadu_si512((const void*)IDX4), _mm512_castps128_ps512(v));
}

/* 8-bit row . TB Q8 records: 2 blocks (64 values) per vpdpbusd, 4 blocks a step; an odd tail block masked */
static inline __attribute__((always_inline)) void q8_row3(const mt_w* w, int64_t K, int64_t r, const mt_act* A,
                                                           const int32_t* arow, const int TB, float* out) {
    const int64_t nb = K / MT_QB, G = K / w->group;
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const int sym = w->z == NULL;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t* q = (const int8_t*)w->q + r * K;
    const void* s = srow(w, r, G);
    __m512 a0[MAXT], a1[MAXT];
    const int8_t* a[MAXT];
    const int32_t* init[MAXT];
    const float* dx[MAXT];
    for (int t = 0; t < TB; t++) {
        a[t] = (const int8_t*)rec_of(A, arow[t]);
        init[t] = rec_init(A, arow[t]);
        dx[t] = rec_dx(A, arow[t]);
        a0[t] = a1[t] = _mm512_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(q + b * MT_QB)), flip);
        const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(q + b * MT_QB + 64)), flip);
        const __m512 s0 = wscale(w, s, b, gd, 2), s1 = wscale(w, s, b + 2, gd, 2);
        for (int t = 0; t < TB; t++) {
            const __m512i i0 = sym ? _mm512_loadu_si512((const void*)(init[t] + b * 8)) : _mm512_setzero_si512();
            const __m512i i1 = sym ? _mm512_loadu_si512((const void*)(init[t] + b * 8 + 16)) : _mm512_setzero_si512();
            const __m512i p0 = _mm512_dpbusd_epi32(i0, w0, _mm512_loadu_si512((const void*)(a[t] + b * MT_QB)));
            const __m512i p1 = _mm512_dpbusd_epi32(i1, w1, _mm512_loadu_si512((const void*)(a[t] + b * MT_QB + 64)));
            a0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(s0, _mm512_loadu_ps(dx[t] + b * 8)), a0[t]);
            a1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(s1, _mm512_loadu_ps(dx[t] + b * 8 + 16)),
                                    a1[t]);
        }
    }
    for (; b < nb; b += 2) { /* 2 blocks, or the last one alone in the low lanes */
        const int one = b + 1 == nb;
        const __mmask64 mb = one ? 0xffffffffull : ~0ull;
        const __mmask16 ml = one ? 0xff : 0xffff;
        const __m512i w0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mb, q + b * MT_QB), _mm512_maskz_mov_epi8(mb, flip));
        const __m512 s0 = one ? _mm512_set1_ps(scl(w, s, gof(gd, b))) : wscale(w, s, b, gd, 2);
        for (int t = 0; t < TB; t++) {
            const __m512i i0 = sym ? _mm512_maskz_loadu_epi32(ml, init[t] + b * 8) : _mm512_setzero_si512();
            const __m512i p0 = _mm512_dpbusd_epi32(i0, w0, _mm512_maskz_loadu_epi8(mb, a[t] + b * MT_QB));
            a0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(s0, _mm512_maskz_loadu_ps(ml, dx[t] + b * 8)),
                                    a0[t]);
        }
    }
    for (int t = 0; t < TB; t++) {
        float v = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
        if (!sym) v -= zero_term(w, K, r, A, arow[t], 0.0f);
        out[t] = v;
    }
}

/* 4-bit row . TB Q4 records: 4 blocks (64 bytes) per step pair of vpdpbusd, 8 blocks a step against the
 * permuted record; tail blocks one at a time */
static inline __attribute__((always_inline)) void q4_row3(const mt_w* w, int64_t K, int64_t r, const mt_act* A,
                                                           const int32_t* arow, const int TB, float* out) {
    const int64_t nb = K / MT_QB, G = K / w->group, full = nb / 4 * 4;
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const int sym = w->z == NULL;
    const __m512i lo4 = _mm512_set1_epi8(15);
    const uint8_t* q = (const uint8_t*)w->q + r * (K / 2);
    const void* s = srow(w, r, G);
    __m512 a0[MAXT], a1[MAXT];
    const int8_t* a[MAXT];
    const int32_t* init[MAXT];
    const float* dx[MAXT];
    for (int t = 0; t < TB; t++) {
        a[t] = (const int8_t*)rec_of(A, arow[t]);
        init[t] = rec_init(A, arow[t]);
        dx[t] = rec_dx(A, arow[t]);
        a0[t] = a1[t] = _mm512_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 8 <= full; b += 8) {
        const int64_t Gi = b / 4;
        const __m512i r0 = _mm512_loadu_si512((const void*)(q + b * 16)), r1 = _mm512_loadu_si512((const void*)(q + b * 16 + 64));
        const __m512i l0 = fp4n(w, _mm512_and_si512(r0, lo4)), h0 = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(r0, 4), lo4));
        const __m512i l1 = fp4n(w, _mm512_and_si512(r1, lo4)), h1 = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(r1, 4), lo4));
        const __m512 s0 = wscale(w, s, b, gd, 4), s1 = wscale(w, s, b + 4, gd, 4);
        for (int t = 0; t < TB; t++) {
            const int8_t* ag = a[t] + Gi * 128;
            const __m512i i0 = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init[t] + Gi * 16)) : _mm512_setzero_si512());
            const __m512i i1 = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init[t] + Gi * 16 + 16)) : _mm512_setzero_si512());
            const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i0, l0, _mm512_loadu_si512((const void*)ag)), h0,
                                                   _mm512_loadu_si512((const void*)(ag + 64)));
            const __m512i p1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i1, l1, _mm512_loadu_si512((const void*)(ag + 128))),
                                                   h1, _mm512_loadu_si512((const void*)(ag + 192)));
            a0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(s0, _mm512_loadu_ps(dx[t] + Gi * 16)), a0[t]);
            a1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(s1, _mm512_loadu_ps(dx[t] + Gi * 16 + 16)),
                                    a1[t]);
        }
    }
    for (; b < full; b += 4) {
        const int64_t Gi = b / 4;
        const __m512i r0 = _mm512_loadu_si512((const void*)(q + b * 16));
        const __m512i l0 = fp4n(w, _mm512_and_si512(r0, lo4)), h0 = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(r0, 4), lo4));
        const __m512 s0 = wscale(w, s, b, gd, 4);
        for (int t = 0; t < TB; t++) {
            const int8_t* ag = a[t] + Gi * 128;
            const __m512i i0 = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init[t] + Gi * 16)) : _mm512_setzero_si512());
            const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i0, l0, _mm512_loadu_si512((const void*)ag)), h0,
                                                   _mm512_loadu_si512((const void*)(ag + 64)));
            a0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(s0, _mm512_loadu_ps(dx[t] + Gi * 16)), a0[t]);
        }
    }
    for (; b < nb; b++) { /* natural-order tail blocks */
        const int64_t o = full / 4 * 16 + (b - full) * 8;
        const __m512i v = fp4n(w, _mm512_zextsi256_si512(nib32(q, b)));
        const __m512 sv = _mm512_set1_ps(scl(w, s, gof(gd, b)));
        for (int t = 0; t < TB; t++) {
            const __m512i av = _mm512_maskz_loadu_epi8(0xffffffffull, a[t] + b * MT_QB);
            const __m512i iv = fp4i(w, sym ? _mm512_maskz_loadu_epi32(0xff, init[t] + o) : _mm512_setzero_si512());
            const __m512 dv = _mm512_maskz_loadu_ps(0xff, dx[t] + o);
            a0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(iv, v, av)), _mm512_mul_ps(sv, dv), a0[t]);
        }
    }
    for (int t = 0; t < TB; t++) {
        float v = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
        if (!sym) v -= zero_term(w, K, r, A, arow[t], 0.0f);
        out[t] = v;
    }
}

/* 4 sums of 16 lanes each, in one vector: the 4 rows of a short-row block reduced together */
static inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* the zero terms of 4 consecutive rows with 4G <= 16 groups in all (short rows): their s and z are one
 * contiguous run each, widened in one go, times the record's group sums tiled over the 4 rows */
static inline void zero_terms4(const mt_w* w, int64_t G, int64_t r, const mt_act* A, int64_t ar, float* out) {
    static const int32_t TILE[4][16] = {{0}, {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1},
                                        {0}, {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}};
    const __mmask16 m = (__mmask16)((1u << (4 * G)) - 1);
    const __m512 sv = sv16(w, m, srow(w, r, G));
    const __m512 zv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w->z + r * G)), 16));
    const __m512 g = _mm512_maskz_loadu_ps((__mmask16)((1u << G) - 1), rec_gs(A, ar));
    const __m512 gt = G == 1 ? _mm512_set1_ps(_mm512_cvtss_f32(g)) : _mm512_permutexvar_ps(_mm512_loadu_si512((const void*)TILE[G - 1]), g);
    float prod[16];
    _mm512_storeu_ps(prod, _mm512_mul_ps(_mm512_mul_ps(sv, zv), gt));
    for (int i = 0; i < 4; i++) {
        float t = 0.0f;
        for (int64_t k = 0; k < G; k++) t += prod[i * G + k];
        out[i] -= t;
    }
}

/* short 4-bit rows (K a multiple of 128 up to 512: 4 such rows are one contiguous run of at most 1 KB), 4
 * rows against one Q4 record: the per-row costs (setup, reduction, zero term) shared by the 4; with groups of
 * 128 or more (each 4-block step inside one group) the 4 rows' scales are widened once and broadcast per step */
static inline void q4_rows4_short3(const mt_w* w, int64_t K, int64_t r, const mt_act* A, int64_t ar, float* out) {
    const int64_t G = K / w->group;
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const int sym = w->z == NULL, fast = w->group % 128 == 0 && (G == 1 || G == 2 || G == 4);
    const __m512i lo4 = _mm512_set1_epi8(15);
    const int8_t* a = (const int8_t*)rec_of(A, ar);
    const int32_t* init = rec_init(A, ar);
    const float* dx = rec_dx(A, ar);
    __m512 svall = _mm512_setzero_ps();
    if (fast)
        svall = sv16(w, (__mmask16)((1u << (4 * G)) - 1), srow(w, r, G));
    __m512 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / MT_QB; b += 4) {
        const int64_t Gi = b / 4;
        const __m512i alo = _mm512_loadu_si512((const void*)(a + Gi * 128)), ahi = _mm512_loadu_si512((const void*)(a + Gi * 128 + 64));
        const __m512i iv = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init + Gi * 16)) : _mm512_setzero_si512());
        const __m512 dv = _mm512_loadu_ps(dx + Gi * 16);
        const int64_t gi = fast ? gof(gd, b) : 0;
        for (int i = 0; i < 4; i++) {
            const __m512i raw = _mm512_loadu_si512((const void*)((const uint8_t*)w->q + (r + i) * (K / 2) + b * 16));
            const __m512i l = fp4n(w, _mm512_and_si512(raw, lo4)), h = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4));
            const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iv, l, alo), h, ahi);
            const __m512 sc = fast ? _mm512_permutexvar_ps(_mm512_set1_epi32((int)(i * G + gi)), svall)
                                   : wscale(w, srow(w, r + i, G), b, gd, 4);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sc, dv), acc[i]);
        }
    }
    _mm_storeu_ps(out, hsum4x16(acc[0], acc[1], acc[2], acc[3]));
    if (!sym) {
        if (4 * G <= 16 && A->gsz == w->group && (G == 1 || G == 2 || G == 4))
            zero_terms4(w, G, r, A, ar, out);
        else
            for (int i = 0; i < 4; i++) out[i] -= zero_term(w, K, r + i, A, ar, 0.0f);
    }
}

/* short 8-bit rows (K a multiple of 64 up to 256), 4 rows against one Q8 record; a row with one group (a
 * per-row scale) takes its scale after the sum */
static inline void q8_rows4_short3(const mt_w* w, int64_t K, int64_t r, const mt_act* A, int64_t ar, float* out) {
    const int64_t G = K / w->group;
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const int sym = w->z == NULL, one = G == 1;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t* a = (const int8_t*)rec_of(A, ar);
    const int32_t* init = rec_init(A, ar);
    const float* dx = rec_dx(A, ar);
    __m512 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / MT_QB; b += 2) {
        const __m512i av = _mm512_loadu_si512((const void*)(a + b * MT_QB));
        const __m512i iv = sym ? _mm512_loadu_si512((const void*)(init + b * 8)) : _mm512_setzero_si512();
        const __m512 dv = _mm512_loadu_ps(dx + b * 8);
        for (int i = 0; i < 4; i++) {
            const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512((const void*)((const int8_t*)w->q + (r + i) * K + b * MT_QB)), flip);
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(iv, wv, av));
            acc[i] = one ? _mm512_fmadd_ps(p, dv, acc[i])
                         : _mm512_fmadd_ps(p, _mm512_mul_ps(wscale(w, srow(w, r + i, G), b, gd, 2), dv), acc[i]);
        }
    }
    __m128 v = hsum4x16(acc[0], acc[1], acc[2], acc[3]);
    if (one) v = _mm_mul_ps(v, _mm_setr_ps(scl(w, w->s, r), scl(w, w->s, r + 1), scl(w, w->s, r + 2), scl(w, w->s, r + 3)));
    _mm_storeu_ps(out, v);
    if (!sym) {
        if (4 * G <= 16 && A->gsz == w->group && (G == 1 || G == 2 || G == 4))
            zero_terms4(w, G, r, A, ar, out);
        else
            for (int i = 0; i < 4; i++) out[i] -= zero_term(w, K, r + i, A, ar, 0.0f);
    }
}

/* Blocks of 4 weight rows x up to MAXT activation rows, for calls of several activation rows (prefill, batches):
 * compute-bound there, so each weight vector loaded feeds MAXT products and each activation vector 4 */
#define MAXR 4
static inline __attribute__((always_inline)) void bf16_blk3(const uint16_t* W, int64_t K, int64_t r, const int R,
                                                             const mt_act* A, const int32_t* arow, const int TB,
                                                             float out[MAXR][MAXT]) {
    __m512 acc[MAXR][MAXT];
    const uint16_t* x[MAXT];
    for (int t = 0; t < TB; t++) x[t] = (const uint16_t*)rec_of(A, arow[t]);
    for (int i = 0; i < R; i++)
        for (int t = 0; t < TB; t++) acc[i][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i xv[MAXT];
        for (int t = 0; t < TB; t++) xv[t] = _mm512_loadu_si512((const void*)(x[t] + k));
        for (int i = 0; i < R; i++) {
            const __m512i wv = _mm512_loadu_si512((const void*)(W + (r + i) * K + k));
            for (int t = 0; t < TB; t++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)wv, (__m512bh)xv[t]);
        }
    }
    if (k < K) {
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512i xv[MAXT];
        for (int t = 0; t < TB; t++) xv[t] = _mm512_maskz_loadu_epi16(m, x[t] + k);
        for (int i = 0; i < R; i++) {
            const __m512i wv = _mm512_maskz_loadu_epi16(m, W + (r + i) * K + k);
            for (int t = 0; t < TB; t++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)wv, (__m512bh)xv[t]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < TB; t++) out[i][t] = _mm512_reduce_add_ps(acc[i][t]);
}

static inline __attribute__((always_inline)) void q8_blk3(const mt_w* w, int64_t K, int64_t r, const int R,
                                                           const mt_act* A, const int32_t* arow, const int TB,
                                                           float out[MAXR][MAXT]) {
    const int64_t nb = K / MT_QB, G = K / w->group;
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const int sym = w->z == NULL;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MAXR][MAXT];
    const int8_t* a[MAXT];
    const int32_t* init[MAXT];
    const float* dx[MAXT];
    for (int t = 0; t < TB; t++) {
        a[t] = (const int8_t*)rec_of(A, arow[t]);
        init[t] = rec_init(A, arow[t]);
        dx[t] = rec_dx(A, arow[t]);
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < TB; t++) acc[i][t] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512i av[MAXT], iv[MAXT];
        __m512 dv[MAXT];
        for (int t = 0; t < TB; t++) {
            av[t] = _mm512_loadu_si512((const void*)(a[t] + b * MT_QB));
            iv[t] = sym ? _mm512_loadu_si512((const void*)(init[t] + b * 8)) : _mm512_setzero_si512();
            dv[t] = _mm512_loadu_ps(dx[t] + b * 8);
        }
        for (int i = 0; i < R; i++) {
            const __m512i wv = _mm512_xor_si512(
                _mm512_loadu_si512((const void*)((const int8_t*)w->q + (r + i) * K + b * MT_QB)), flip);
            const __m512 sv = wscale(w, srow(w, r + i, G), b, gd, 2);
            for (int t = 0; t < TB; t++)
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(iv[t], wv, av[t])),
                                            _mm512_mul_ps(sv, dv[t]), acc[i][t]);
        }
    }
    if (b < nb) {
        __m512i av[MAXT], iv[MAXT];
        __m512 dv[MAXT];
        for (int t = 0; t < TB; t++) {
            av[t] = _mm512_maskz_loadu_epi8(0xffffffffull, a[t] + b * MT_QB);
            iv[t] = sym ? _mm512_maskz_loadu_epi32(0xff, init[t] + b * 8) : _mm512_setzero_si512();
            dv[t] = _mm512_maskz_loadu_ps(0xff, dx[t] + b * 8);
        }
        for (int i = 0; i < R; i++) {
            const __m512i wv = _mm512_xor_si512(
                _mm512_maskz_loadu_epi8(0xffffffffull, (const int8_t*)w->q + (r + i) * K + b * MT_QB), flip);
            const __m512 sv = _mm512_set1_ps(scl(w, w->s, (r + i) * G + gof(gd, b)));
            for (int t = 0; t < TB; t++)
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(iv[t], wv, av[t])),
                                            _mm512_mul_ps(sv, dv[t]), acc[i][t]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < TB; t++) {
            float v = _mm512_reduce_add_ps(acc[i][t]);
            if (!sym) v -= zero_term(w, K, r + i, A, arow[t], 0.0f);
            out[i][t] = v;
        }
}

static inline __attribute__((always_inline)) void q4_blk3(const mt_w* w, int64_t K, int64_t r, const int R,
                                                           const mt_act* A, const int32_t* arow, const int TB,
                                                           float out[MAXR][MAXT]) {
    const int64_t nb = K / MT_QB, G = K / w->group, rb = K / 2, full = nb / 4 * 4;
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const int sym = w->z == NULL;
    const __m512i lo4 = _mm512_set1_epi8(15);
    __m512 acc[MAXR][MAXT];
    const int8_t* a[MAXT];
    const int32_t* init[MAXT];
    const float* dx[MAXT];
    for (int t = 0; t < TB; t++) {
        a[t] = (const int8_t*)rec_of(A, arow[t]);
        init[t] = rec_init(A, arow[t]);
        dx[t] = rec_dx(A, arow[t]);
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < TB; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < full; b += 4) {
        const int64_t Gi = b / 4;
        __m512i alo[MAXT], ahi[MAXT], iv[MAXT];
        __m512 dv[MAXT];
        for (int t = 0; t < TB; t++) {
            alo[t] = _mm512_loadu_si512((const void*)(a[t] + Gi * 128));
            ahi[t] = _mm512_loadu_si512((const void*)(a[t] + Gi * 128 + 64));
            iv[t] = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init[t] + Gi * 16)) : _mm512_setzero_si512());
            dv[t] = _mm512_loadu_ps(dx[t] + Gi * 16);
        }
        for (int i = 0; i < R; i++) {
            const __m512i raw = _mm512_loadu_si512((const void*)((const uint8_t*)w->q + (r + i) * rb + b * 16));
            const __m512i vlo = fp4n(w, _mm512_and_si512(raw, lo4)), vhi = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4));
            const __m512 sv = wscale(w, srow(w, r + i, G), b, gd, 4);
            for (int t = 0; t < TB; t++) {
                const __m512i is = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iv[t], vlo, alo[t]), vhi, ahi[t]);
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(sv, dv[t]), acc[i][t]);
            }
        }
    }
    for (int64_t b = full; b < nb; b++) {
        const int64_t o = full / 4 * 16 + (b - full) * 8;
        for (int i = 0; i < R; i++) {
            const __m512i v = fp4n(w, _mm512_zextsi256_si512(nib32((const uint8_t*)w->q + (r + i) * rb, b)));
            const __m512 sv = _mm512_set1_ps(scl(w, w->s, (r + i) * G + gof(gd, b)));
            for (int t = 0; t < TB; t++) {
                const __m512i av = _mm512_maskz_loadu_epi8(0xffffffffull, a[t] + b * MT_QB);
                const __m512i iv = fp4i(w, sym ? _mm512_maskz_loadu_epi32(0xff, init[t] + o) : _mm512_setzero_si512());
                const __m512 dv = _mm512_maskz_loadu_ps(0xff, dx[t] + o);
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(iv, v, av)), _mm512_mul_ps(sv, dv),
                                            acc[i][t]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < TB; t++) {
            float v = _mm512_reduce_add_ps(acc[i][t]);
            if (!sym) v -= zero_term(w, K, r + i, A, arow[t], 0.0f);
            out[i][t] = v;
        }
}

/* 4 weight rows against one Q record (TB = 1, decode), each row streamed front to back in turn (one sequential
 * stream, as q4_row3 / q8_row3), their 4 accumulators reduced together; the same sums as 4 calls of the one-row
 * kernels, in one reduction */
static inline __m512 q4_acc1(const mt_w* w, int64_t K, int64_t r, const int8_t* a, const int32_t* init, const float* dx,
                             gdiv_t gd) {
    const int64_t nb = K / MT_QB, G = K / w->group, full = nb / 4 * 4;
    const int sym = w->z == NULL;
    const __m512i lo4 = _mm512_set1_epi8(15);
    const uint8_t* q = (const uint8_t*)w->q + r * (K / 2);
    const void* s = srow(w, r, G);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= full; b += 8) {
        const int64_t Gi = b / 4;
        const __m512i r0 = _mm512_loadu_si512((const void*)(q + b * 16)), r1 = _mm512_loadu_si512((const void*)(q + b * 16 + 64));
        const __m512i l0 = fp4n(w, _mm512_and_si512(r0, lo4)), h0 = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(r0, 4), lo4));
        const __m512i l1 = fp4n(w, _mm512_and_si512(r1, lo4)), h1 = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(r1, 4), lo4));
        const int8_t* ag = a + Gi * 128;
        const __m512i i0 = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init + Gi * 16)) : _mm512_setzero_si512());
        const __m512i i1 = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init + Gi * 16 + 16)) : _mm512_setzero_si512());
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i0, l0, _mm512_loadu_si512((const void*)ag)), h0,
                                               _mm512_loadu_si512((const void*)(ag + 64)));
        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i1, l1, _mm512_loadu_si512((const void*)(ag + 128))), h1,
                                               _mm512_loadu_si512((const void*)(ag + 192)));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(wscale(w, s, b, gd, 4), _mm512_loadu_ps(dx + Gi * 16)), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(wscale(w, s, b + 4, gd, 4), _mm512_loadu_ps(dx + Gi * 16 + 16)), a1);
    }
    for (; b < full; b += 4) {
        const int64_t Gi = b / 4;
        const __m512i r0 = _mm512_loadu_si512((const void*)(q + b * 16));
        const __m512i l0 = fp4n(w, _mm512_and_si512(r0, lo4)), h0 = fp4n(w, _mm512_and_si512(_mm512_srli_epi16(r0, 4), lo4));
        const int8_t* ag = a + Gi * 128;
        const __m512i i0 = fp4i(w, sym ? _mm512_loadu_si512((const void*)(init + Gi * 16)) : _mm512_setzero_si512());
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i0, l0, _mm512_loadu_si512((const void*)ag)), h0,
                                               _mm512_loadu_si512((const void*)(ag + 64)));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(wscale(w, s, b, gd, 4), _mm512_loadu_ps(dx + Gi * 16)), a0);
    }
    for (; b < nb; b++) {
        const int64_t o = full / 4 * 16 + (b - full) * 8;
        const __m512i v = fp4n(w, _mm512_zextsi256_si512(nib32(q, b)));
        const __m512i iv = fp4i(w, sym ? _mm512_maskz_loadu_epi32(0xff, init + o) : _mm512_setzero_si512());
        const __m512i av = _mm512_maskz_loadu_epi8(0xffffffffull, a + b * MT_QB);
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(iv, v, av)),
                             _mm512_mul_ps(_mm512_set1_ps(scl(w, s, gof(gd, b))), _mm512_maskz_loadu_ps(0xff, dx + o)), a0);
    }
    return _mm512_add_ps(a0, a1);
}

static inline void q4_rows4_seq3(const mt_w* w, int64_t K, int64_t r, const mt_act* A, int64_t ar, float* out) {
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const int8_t* a = (const int8_t*)rec_of(A, ar);
    const int32_t* init = rec_init(A, ar);
    const float* dx = rec_dx(A, ar);
    const __m512 v0 = q4_acc1(w, K, r, a, init, dx, gd), v1 = q4_acc1(w, K, r + 1, a, init, dx, gd);
    const __m512 v2 = q4_acc1(w, K, r + 2, a, init, dx, gd), v3 = q4_acc1(w, K, r + 3, a, init, dx, gd);
    _mm_storeu_ps(out, hsum4x16(v0, v1, v2, v3));
    if (w->z != NULL)
        for (int i = 0; i < 4; i++) out[i] -= zero_term(w, K, r + i, A, ar, 0.0f);
}

/* 2-bit rows: one block at a time, 256-bit (a rarely used kind: the low tier of dynamic precision) */
static float q2_row3(const mt_w* w, int64_t K, int64_t r, const mt_act* A, int64_t ar) {
    const int64_t nb = K / MT_QB, G = K / w->group;
    const gdiv_t gd = gdiv(w->group / MT_QB);
    const uint8_t* row = (const uint8_t*)w->q + r * (K / 4);
    const int8_t* a = (const int8_t*)rec_of(A, ar);
    const float* d = rec_d(A, ar);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i is = _mm256_dpbusd_epi32(_mm256_setzero_si256(), crumb32(row, b),
                                               _mm256_loadu_si256((const __m256i*)(a + b * MT_QB)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(d[b] * scl(w, w->s, r * G + gof(gd, b))), acc);
    }
    return hsum8(acc) - zero_term(w, K, r, A, ar, 2.0f);
}

#define DISPATCH_T(CALL)                \
    switch (TB) {                       \
        case 1: CALL(1); break;         \
        case 2: CALL(2); break;         \
        case 3: CALL(3); break;         \
        default: CALL(4); break;        \
    }

static void mm_avx512(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow,
                      int64_t nt, float* const* yrow, const float* alpha) {
    float out[MAXT];
    if (w->kind == 2) {
        for (int64_t r = r0; r < r1; r++)
            for (int64_t i = 0; i < nt; i++) put(yrow, alpha, i, r, q2_row3(w, K, r, A, arow[i]));
        return;
    }
    int64_t r = r0;
    /* short rows (at most 256 bytes: 4 of them one contiguous run of at most 1 KB): 4 at a time, the activation
     * loaded once. Longer rows interleaved this way read slower from memory (512-byte rows of int4 K=1024: 14
     * against 29 GB/s one row at a time on this project's AVX-512 EPYC), so they stream one row at a time. */
    const int short4 = nt <= 2 && ((w->kind == 4 && K % 128 == 0 && K <= 512) || (w->kind == 8 && K % 64 == 0 && K <= 256));
    if (!short4 && nt == 1 && w->kind == 4) /* decode: 4 rows in turn, reduced together */
        for (; r + 4 <= r1; r += 4) {
            q4_rows4_seq3(w, K, r, A, arow[0], out);
            for (int k = 0; k < 4; k++) put(yrow, alpha, 0, r + k, out[k]);
        }
    if (short4)
        for (; r + 4 <= r1; r += 4)
            for (int64_t i = 0; i < nt; i++) {
                if (w->kind == 4)
                    q4_rows4_short3(w, K, r, A, arow[i], out);
                else
                    q8_rows4_short3(w, K, r, A, arow[i], out);
                for (int k = 0; k < 4; k++) put(yrow, alpha, i, r + k, out[k]);
            }
    if (nt >= 3) { /* several activation rows: 4-row blocks, then the rows left one at a time */
        float ob[MAXR][MAXT];
        for (; r + MAXR <= r1; r += MAXR)
            for (int64_t i0 = 0; i0 < nt; i0 += MAXT) {
                const int TB = nt - i0 >= MAXT ? MAXT : (int)(nt - i0);
                const int32_t* ar = arow + i0;
                if (w->kind == 16) {
#define BB(n) bf16_blk3((const uint16_t*)w->q, K, r, MAXR, A, ar, n, ob)
                    DISPATCH_T(BB)
#undef BB
                } else if (w->kind == 8) {
#define QB8(n) q8_blk3(w, K, r, MAXR, A, ar, n, ob)
                    DISPATCH_T(QB8)
#undef QB8
                } else {
#define QB4(n) q4_blk3(w, K, r, MAXR, A, ar, n, ob)
                    DISPATCH_T(QB4)
#undef QB4
                }
                for (int k = 0; k < MAXR; k++)
                    for (int t = 0; t < TB; t++) put(yrow, alpha, i0 + t, r + k, ob[k][t]);
            }
    }
    for (; r < r1; r++) {
        for (int64_t i0 = 0; i0 < nt; i0 += MAXT) {
            const int TB = nt - i0 >= MAXT ? MAXT : (int)(nt - i0);
            const int32_t* ar = arow + i0;
            if (w->kind == 16) {
                const uint16_t* wr = (const uint16_t*)w->q + r * K;
#define BF(n) bf16_row3(wr, K, A, ar, n, out)
                DISPATCH_T(BF)
#undef BF
            } else if (w->kind == 8) {
#define Q8(n) q8_row3(w, K, r, A, ar, n, out)
                DISPATCH_T(Q8)
#undef Q8
            } else {
#define Q4(n) q4_row3(w, K, r, A, ar, n, out)
                DISPATCH_T(Q4)
#undef Q4
            }
            for (int t = 0; t < TB; t++) put(yrow, alpha, i0 + t, r, out[t]);
        }
    }
}
#endif

/* ============================================================================ fp8 e4m3fn rows (kind 9) */

static float F8F[256];          /* e4m3fn byte -> fp32 */
static uint16_t F8B[128];       /* |e4m3fn| (7 bits) -> bf16 bits, exact; 0x7f: NaN */
static uint8_t F8HI[128], F8LO[128]; /* its high and low bytes (the VBMI byte tables) */
__attribute__((constructor)) static void f8_tables(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e == 15 && m == 7 ? NAN : (e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7));
        F8F[b] = b & 0x80 ? -v : v;
        if (b < 128) {
            uint32_t u;
            memcpy(&u, &v, 4);
            F8B[b] = (uint16_t)(u >> 16); /* exact: at most 4 significant bits */
            F8HI[b] = (uint8_t)(F8B[b] >> 8);
            F8LO[b] = (uint8_t)(F8B[b] & 0xff);
        }
    }
}
float mt_f8_to_f32(uint8_t b) { return F8F[b]; }

#if MT_ISA == 3
/* 32 fp8 values -> 32 bf16: the 7-bit magnitude through a 128-entry table (two 64-entry vpermt2w, picked by bit
 * 6), the sign bit moved to bit 15 */
static inline __m512i f8_bf16x32(const uint8_t* p, const __m512i* L) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(const void*)p));
    const __m512i lo = _mm512_permutex2var_epi16(L[0], v, L[1]), hi = _mm512_permutex2var_epi16(L[2], v, L[3]);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(v, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
}

#if defined(__AVX512VBMI__)
/* 64 fp8 values -> 64 bf16 (AVX512-VBMI): the high and the low byte of each value's bf16 from two 128-entry byte
 * tables (vpermt2b on the 7-bit magnitude), the sign or-ed into the high byte, then bytes paired into words per
 * 128-bit lane: *a holds values [0-7, 16-23, 32-39, 48-55], *b [8-15, 24-31, 40-47, 56-63] (f8_x64 orders the
 * activation alike) */
static inline void f8_bf16x64(const uint8_t* p, const __m512i* T, __m512i* a, __m512i* b) {
    const __m512i v = _mm512_loadu_si512((const void*)p);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(T[0], v, T[1]), v,
                                                 _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (v & 0x80) */
    const __m512i lo = _mm512_permutex2var_epi8(T[2], v, T[3]);
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}
static inline void f8_x64(const uint16_t* x, __m512i* a, __m512i* b) {
    const __m512i x0 = _mm512_loadu_si512((const void*)x), x1 = _mm512_loadu_si512((const void*)(x + 32));
    *a = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
    *b = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
}
#define MT_F8_VBMI 1
#else
#define MT_F8_VBMI 0
#endif

/* R weight rows x TB activation rows: per group, two accumulator chains per (row, activation) (a group of 128 is four
 * dependent vdpbf16ps otherwise, latency-bound), then one fmadd by the group's scale. T: the byte tables (VBMI, groups
 * of 64s) or L: the word tables (any group of 32s) */
static inline __attribute__((always_inline)) void f8_rows3(const mt_w* w, int64_t K, int64_t r, const int R,
                                                            const uint16_t* const* x, const int TB, const __m512i* L,
                                                            const __m512i* T, float* out) {
    const int64_t G = K / w->group, gs = w->group;
    __m512 tot[2][4];
    for (int j = 0; j < R; j++)
        for (int t = 0; t < TB; t++) tot[j][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 a0[2][4], a1[2][4];
        for (int j = 0; j < R; j++)
            for (int t = 0; t < TB; t++) a0[j][t] = a1[j][t] = _mm512_setzero_ps();
        int64_t k = g * gs;
        const int64_t end = k + gs;
#if MT_F8_VBMI
        if (T != NULL)
            for (; k + 64 <= end; k += 64) {
                __m512i xa[4], xb[4];
                for (int t = 0; t < TB; t++) f8_x64(x[t] + k, &xa[t], &xb[t]);
                for (int j = 0; j < R; j++) {
                    __m512i wa, wb;
                    f8_bf16x64((const uint8_t*)w->q + (r + j) * K + k, T, &wa, &wb);
                    for (int t = 0; t < TB; t++) {
                        a0[j][t] = _mm512_dpbf16_ps(a0[j][t], (__m512bh)wa, (__m512bh)xa[t]);
                        a1[j][t] = _mm512_dpbf16_ps(a1[j][t], (__m512bh)wb, (__m512bh)xb[t]);
                    }
                }
            }
#else
        (void)T;
#endif
        for (; k + 64 <= end; k += 64)
            for (int j = 0; j < R; j++) {
                const uint8_t* q = (const uint8_t*)w->q + (r + j) * K;
                const __m512i w0 = f8_bf16x32(q + k, L), w1 = f8_bf16x32(q + k + 32, L);
                for (int t = 0; t < TB; t++) {
                    a0[j][t] = _mm512_dpbf16_ps(a0[j][t], (__m512bh)w0, (__m512bh)_mm512_loadu_si512((const void*)(x[t] + k)));
                    a1[j][t] = _mm512_dpbf16_ps(a1[j][t], (__m512bh)w1,
                                                (__m512bh)_mm512_loadu_si512((const void*)(x[t] + k + 32)));
                }
            }
        if (k < end) /* a group of an odd number of 32s */
            for (int j = 0; j < R; j++) {
                const __m512i w0 = f8_bf16x32((const uint8_t*)w->q + (r + j) * K + k, L);
                for (int t = 0; t < TB; t++)
                    a0[j][t] = _mm512_dpbf16_ps(a0[j][t], (__m512bh)w0, (__m512bh)_mm512_loadu_si512((const void*)(x[t] + k)));
            }
        for (int j = 0; j < R; j++) {
            const __m512 sc = _mm512_set1_ps(((const float*)(const void*)w->s)[(r + j) * G + g]);
            for (int t = 0; t < TB; t++) tot[j][t] = _mm512_fmadd_ps(_mm512_add_ps(a0[j][t], a1[j][t]), sc, tot[j][t]);
        }
    }
    for (int j = 0; j < R; j++)
        for (int t = 0; t < TB; t++) out[j * 4 + t] = _mm512_reduce_add_ps(tot[j][t]);
}

static void mm_f8(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow,
                  int64_t nt, float* const* yrow, const float* alpha) {
    __m512i L[4], Tb[4];
    for (int i = 0; i < 4; i++) L[i] = _mm512_loadu_si512((const void*)(F8B + 32 * i));
    for (int i = 0; i < 2; i++) {
        Tb[i] = _mm512_loadu_si512((const void*)(F8HI + 64 * i));
        Tb[2 + i] = _mm512_loadu_si512((const void*)(F8LO + 64 * i));
    }
    const __m512i* T = MT_F8_VBMI && w->group % 64 == 0 ? Tb : NULL;
    float out[8];
    for (int64_t i0 = 0; i0 < nt; i0 += 4) {
        const int TB = nt - i0 < 4 ? (int)(nt - i0) : 4;
        const uint16_t* x[4];
        for (int t = 0; t < TB; t++) x[t] = (const uint16_t*)(const void*)rec_of(A, arow[i0 + t]);
        int64_t r = r0;
        if (TB <= 2) /* decode: two weight rows a pass, so four chains run at once */
            for (; r + 2 <= r1; r += 2) {
                if (TB == 1) f8_rows3(w, K, r, 2, x, 1, L, T, out);
                else f8_rows3(w, K, r, 2, x, 2, L, T, out);
                for (int j = 0; j < 2; j++)
                    for (int t = 0; t < TB; t++) put(yrow, alpha, i0 + t, r + j, out[j * 4 + t]);
            }
        for (; r < r1; r++) {
            switch (TB) {
                case 1: f8_rows3(w, K, r, 1, x, 1, L, T, out); break;
                case 2: f8_rows3(w, K, r, 1, x, 2, L, T, out); break;
                case 3: f8_rows3(w, K, r, 1, x, 3, L, T, out); break;
                default: f8_rows3(w, K, r, 1, x, 4, L, T, out); break;
            }
            for (int t = 0; t < TB; t++) put(yrow, alpha, i0 + t, r, out[t]);
        }
    }
}
#elif MT_ISA == 2
/* 8 fp8 values (as uint32 lanes) -> fp32: the 7-bit magnitude placed at fp32's exponent and mantissa, times
 * 2^120 (the exponent bias difference; e4m3 subnormals land on fp32 subnormals, scaled exactly), sign, NaN */
static inline __m256 f8_f32x8(__m256i v) {
    const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
    __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
    f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24)));
    return _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
}

static void mm_f8(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow,
                  int64_t nt, float* const* yrow, const float* alpha) {
    /* the record's fp32 values come permuted per 16 as [0-3, 8-11, 4-7, 12-15] (mt_act_prep_bf16): the bytes of
     * each 16 weights are shuffled the same way before widening */
    const __m128i perm = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    const int64_t G = K / w->group;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* q = (const uint8_t*)w->q + r * K;
        const float* s = (const float*)(const void*)w->s + r * G;
        for (int64_t i = 0; i < nt; i++) {
            const float* x = (const float*)(const void*)rec_of(A, arow[i]);
            __m256 tot = _mm256_setzero_ps();
            for (int64_t g = 0; g < G; g++) {
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                for (int64_t k = g * w->group; k < (g + 1) * w->group; k += 16) {
                    const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)(const void*)(q + k)), perm);
                    a0 = _mm256_fmadd_ps(f8_f32x8(_mm256_cvtepu8_epi32(b)), _mm256_loadu_ps(x + k), a0);
                    a1 = _mm256_fmadd_ps(f8_f32x8(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), _mm256_loadu_ps(x + k + 8), a1);
                }
                tot = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(s[g]), tot);
            }
            put(yrow, alpha, i, r, hsum8(tot));
        }
    }
}
#else
static void mm_f8(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow,
                  int64_t nt, float* const* yrow, const float* alpha) {
    const int64_t G = K / w->group;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* q = (const uint8_t*)w->q + r * K;
        const float* s = (const float*)(const void*)w->s + r * G;
        for (int64_t i = 0; i < nt; i++) {
            const float* x = (const float*)(const void*)rec_of(A, arow[i]);
            float tot = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                float acc = 0.0f;
                for (int64_t k = g * w->group; k < (g + 1) * w->group; k++) acc += F8F[q[k]] * x[k];
                tot += acc * s[g];
            }
            put(yrow, alpha, i, r, tot);
        }
    }
}
#endif

void mt_mm(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow, int64_t nt,
           float* const* yrow, const float* alpha) {
    if (w->kind == MT_KIND_F8) {
        mm_f8(w, K, r0, r1, A, arow, nt, yrow, alpha);
        return;
    }
    if (mt_is_gg(w->kind)) {
        mm_gg(w, K, r0, r1, A, arow, nt, yrow, alpha);
        return;
    }
#if MT_ISA == 3
    mm_avx512(w, K, r0, r1, A, arow, nt, yrow, alpha);
#elif MT_ISA == 2
    mm_avx2(w, K, r0, r1, A, arow, nt, yrow, alpha);
#else
    mm_c(w, K, r0, r1, A, arow, nt, yrow, alpha);
#endif
}

/* ============================================================================ elementwise */

#if MT_ISA == 3
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), _mm512_max_ps(_mm512_set1_ps(-87.3365447504f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#elif MT_ISA == 2
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-87.3365447504f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n in two factors, so n = 128 (x near the upper clamp) does not overflow the exponent field */
    const __m256i e = _mm256_cvtps_epi32(n);
    const __m256i h = _mm256_srai_epi32(e, 1);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    const __m256 f2 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, h), _mm256_set1_epi32(127)), 23));
    /* NaN input: keep it (the clamp kept x NaN; the integer path would not) */
    const __m256 res = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
    return _mm256_blendv_ps(res, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

float mt_expf(float x) { return expf(x); }

void mt_round_bf16(float* x, int64_t n) {
    int64_t j = 0;
#if MT_ISA == 3
    for (; j + 16 <= n; j += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j)); /* round to nearest even; NaN stays NaN */
        _mm512_storeu_ps(x + j, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16)));
    }
#endif
    for (; j < n; j++) x[j] = bf2f(f2bf(x[j]));
}

void mt_exp_inplace(float* x, int64_t n, float shift) {
    int64_t j = 0;
#if MT_ISA == 3
    const __m512 s = _mm512_set1_ps(shift);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(x + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), s)));
#elif MT_ISA == 2
    const __m256 s = _mm256_set1_ps(shift);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), s)));
#endif
    for (; j < n; j++) x[j] = expf(x[j] - shift);
}

float mt_sumsq(const float* x, int64_t n) {
    int64_t j = 0;
    float s = 0.0f;
#if MT_ISA == 3
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (; j + 32 <= n; j += 32) {
        const __m512 u = _mm512_loadu_ps(x + j), v = _mm512_loadu_ps(x + j + 16);
        a = _mm512_fmadd_ps(u, u, a);
        b = _mm512_fmadd_ps(v, v, b);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#elif MT_ISA == 2
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m256 u = _mm256_loadu_ps(x + j), v = _mm256_loadu_ps(x + j + 8);
        a = _mm256_fmadd_ps(u, u, a);
        b = _mm256_fmadd_ps(v, v, b);
    }
    s = hsum8(_mm256_add_ps(a, b));
#endif
    for (; j < n; j++) s += x[j] * x[j];
    return s;
}

void mt_silu_mul(float* g, const float* u, int64_t n) {
    int64_t j = 0;
#if MT_ISA == 3
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j + 16 <= n; j += 16) {
        const __m512 x = _mm512_loadu_ps(g + j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(g + j, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), u ? _mm512_loadu_ps(u + j) : one));
    }
#elif MT_ISA == 2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(g + j);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), u ? _mm256_loadu_ps(u + j) : one));
    }
#endif
    for (; j < n; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * (u ? u[j] : 1.0f);
}
