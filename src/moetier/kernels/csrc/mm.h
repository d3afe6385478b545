/* Matrix kernels of the decode step: activation rows prepared once, weight rows read once.
 *
 * ISA paths, chosen at compile time (the library is built with -march=native for the CPU it runs on;
 * kernels/native.py can force a lower path for tests with -DMT_FORCE_AVX2 / -DMT_FORCE_C):
 *   MT_ISA 3  AVX-512 F/BW/VL with AVX512-BF16 and AVX512-VNNI: bf16 rows by vdpbf16ps, integer rows by
 *             vpdpbusd on 64 bytes at a time (4 weight rows x up to 4 activation rows per pass);
 *   MT_ISA 2  AVX2 + FMA: bf16 rows widened to fp32 and FMA, integer rows by vpmaddubsw (or by 256-bit
 *             vpdpbusd where the CPU has AVX-VNNI or AVX512-VNNI/VL: MT_VNNI256), 4 weight rows a pass;
 *   MT_ISA 0  plain C (any CPU; the compiler vectorises what it can).
 * AVX-512 without BF16 and VNNI (Skylake-X class) takes the AVX2 path.
 *
 * Weight kinds (mt_w.kind), all row-major [N, K], K a multiple of 32 for the integer kinds:
 *   16  bf16.
 *   8   int8: q int8 = (v - 128), v in 0..255; W = (v - zero) * scale per group.
 *   4   int4: per block of 32 values 16 bytes, byte j = v[j] | v[j + 16] << 4; W = (v - zero) * scale.
 *   2   int2: per chunk of 128 values 32 bytes, byte j = v[j] | v[j+32] << 2 | v[j+64] << 4 | v[j+96] << 6.
 *   scale / zero: bf16 [N, K / group], group a multiple of 32 dividing K; zero NULL = the symmetric
 *   constant (8-bit 128, 4-bit 8, 2-bit 2), the Q8_0 / Q4_0 layout of the dense weights (group 32).
 *   sf16: the scales are fp16 instead (a GGUF file's Q8_0 / Q4_0 blocks split into their quants and their
 *   own fp16 scales, exact); callers pass kind | MT_SF16.
 *   fp4 (kind 4 only): each nibble indexes the MXFP4 (e2m1) values doubled, {0, 1, 2, 3, 4, 6, 8, 12} and their
 *   negatives, W = value * 2^(e - 128) per block of 32 (group 32, zero NULL), `s` pointing at the blocks' e8m0
 *   exponent bytes e as the checkpoint stores them, uint8 [N, K / 32] (cast): the slot keeps the file's 17 bytes a
 *   block. The kernels widen e exactly: e = 0 and 1 give the fp32 subnormals 2^-128 and 2^-127, e = 255 is NaN (the
 *   outputs that read the block are NaN); ISA 3 by vscalef (1.0 scaled by e - 128, NaN blended in), ISA 2 and 0 by
 *   a 256-entry fp32 table (mt_e8_to_f32). The integer paths read value + 12 (0..24) and shift the zero by 12
 *   instead of 8; callers pass 4 | MT_FP4.
 *   9   fp8 e4m3fn (MT_KIND_F8): one byte a value as the checkpoint stores it; `s` points at fp32 scales
 *       [N, K / group] (a block-scaled FP8 checkpoint's grid, one row of it per weight row), W = fp8 * scale;
 *       zero NULL; group a multiple of 32 dividing K. Reads the MT_F_BF16 activation form: each 32 values are
 *       widened to bf16 (exact: an e4m3 value has 4 significant bits) by a 128-entry table (ISA 3: vpermt2w, then
 *       vdpbf16ps), or to fp32 arithmetically (ISA 2), or by a 256-entry fp32 table (ISA 0); e4m3fn NaN stays NaN.
 *
 * Activation forms (mt_act), one record per row, 64-byte aligned:
 *   MT_F_BF16 (for kind 16): the row rounded to bf16 (ISA 3: bf16; ISA 2: fp32, each chunk of 16 permuted
 *             [0-3, 8-11, 4-7, 12-15] to match the widening unpack; ISA 0: fp32);
 *   MT_F_Q8   (kinds 8 and 2) and MT_F_Q4 (kind 4): int8 per block of 32 (scale d = max|x| / 127, round to
 *             nearest even), the block scales d, the integer block sums, the group sums
 *             gs[g] = sum over the group's blocks of d * (block sum) for the record's group size, and (ISA 3)
 *             the start values of the symmetric kinds' integer accumulators. ISA 3 keeps MT_F_Q4 rows
 *             permuted per 4 blocks (low halves of the 4 blocks, then high halves) to match the nibbles.
 *   A block holding NaN or Inf gets d = NaN, so the products that read it are NaN (NumericalError names
 *   them) rather than finite nonsense.
 *
 * Weight kinds MT_KIND_GG + t (t a ggml type id: GGUF's Q4_K, Q6_K, IQ4_XS, ...): rows of the type's own blocks
 * (K / block values a row, the file's bytes as stored), computed by ggml's CPU dot product for that type, which a
 * caller registers once (moetier_gg_register: ggml-python's `ggml_get_type_traits_cpu`, kernels/ggml.py). Their
 * activation form is MT_F_GG + i for the i-th registered vec_dot type: a record is the row converted by that
 * type's `from_float` (ggml's Q8_0 / Q8_K / F16 ... blocks). One row and one activation a dot call.
 *
 * All products accumulate in fp32; `mt_mm` writes or accumulates (with a weight per activation row) fp32
 * results through per-row output pointers. Nothing here allocates or starts threads: callers split rows.
 */
#ifndef MOETIER_MM_H
#define MOETIER_MM_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

#if defined(MT_FORCE_C)
#define MT_ISA 0
#elif !defined(MT_FORCE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define MT_ISA 3
#elif defined(__AVX2__) && defined(__FMA__)
#define MT_ISA 2
#else
#define MT_ISA 0
#endif

#if MT_ISA == 2 && !defined(MT_NO_VNNI) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define MT_VNNI256 1
#else
#define MT_VNNI256 0
#endif

#if MT_ISA > 0
#include <immintrin.h>
#endif

#define MT_QB 32 /* activation quantisation block */
#define MT_ALIGN 64

enum { MT_F_BF16 = 0, MT_F_Q8 = 1, MT_F_Q4 = 2, MT_F_GG = 3 };
#define MT_GG_FORMS 6                /* vec_dot types a process may register */
#define MT_NFORM (MT_F_GG + MT_GG_FORMS)
#define MT_KIND_GG 1000              /* kind = MT_KIND_GG + ggml type id */
#define MT_KIND_F8 9                 /* fp8 e4m3fn values, fp32 scales per group */
#define MT_GG_TYPES 64

/* ggml's CPU function types (ggml-cpu.h: ggml_vec_dot_t, ggml_from_float_t) */
typedef void (*mt_gg_dot_t)(int n, float* s, size_t bs, const void* x, size_t bx, const void* y, size_t by, int nrc);
typedef void (*mt_gg_from_t)(const float* x, void* y, int64_t k);

typedef struct {
    mt_gg_dot_t dot;      /* NULL: not registered */
    int64_t blck, tsize;  /* values and bytes per block of the weight type */
    int form;             /* the activation form its dot reads */
} mt_gg_type;

typedef struct {
    int64_t vtype;        /* ggml type of the activation blocks; -1: free */
    mt_gg_from_t from;
    int64_t vblk, vsize;
} mt_gg_form;

extern mt_gg_type mt_gg_types[MT_GG_TYPES];
extern mt_gg_form mt_gg_forms[MT_GG_FORMS];
/* register weight type `type` (0 ok, -1 bad arguments, -2 no free activation form) */
int64_t moetier_gg_register(int64_t type, void* dot, int64_t blck, int64_t tsize, int64_t vtype, void* from,
                            int64_t vblk, int64_t vsize);
static inline int mt_is_gg(int64_t kind) { return kind >= MT_KIND_GG && kind < MT_KIND_GG + MT_GG_TYPES; }
/* whether kind is a registered ggml kind whose blocks and activation blocks tile K */
static inline int mt_gg_ok(int64_t kind, int64_t K) {
    if (!mt_is_gg(kind)) return 0;
    const mt_gg_type* t = &mt_gg_types[kind - MT_KIND_GG];
    return t->dot != NULL && K % t->blck == 0 && K % mt_gg_forms[t->form - MT_F_GG].vblk == 0;
}

typedef struct {
    int64_t kind; /* 16, 8, 4, 2, or MT_KIND_GG + a ggml type */
    const void* q;
    const void* s;     /* bf16 [N, K / group] (fp16 with sf16); NULL for kind 16; kind 9: fp32 [N, K / group];
                          fp4: uint8 e8m0 exponents [N, K / 32] */
    const uint16_t* z; /* bf16 [N, K / group] or NULL (symmetric) */
    int64_t group;
    int64_t sf16; /* 1: the scales are fp16 (a GGUF file's Q8_0 / Q4_0 blocks, re-laid out), not bf16 */
    int64_t fp4;  /* kind 4: the nibbles are MXFP4 values, the scales e8m0 exponent bytes (see the kinds above) */
    int64_t rows; /* an expert's down matrix stored as rows of its neurons, [I, H] (the sparse layout), not [H, I];
                     kind 16 only (step.c moe_core) */
} mt_w;
/* a kind as callers pass it (gemv, slot descriptors): | MT_SF16 for fp16 scales */
#define MT_SF16 256
#define MT_FP4 512 /* kind 4 as MXFP4 values with e8m0 exponent bytes as scales, group 32 (mt_w.fp4) */
#define MT_ROWS 2048 /* (above the ggml kinds 1000..1063) kind 16 stored as down rows [I, H] (mt_w.rows): a slot descriptor's w2 kind only */

typedef struct {
    int form;
    int64_t K, gsz;             /* gsz: the group size the records' group sums are for (Q forms) */
    int64_t rec;                /* bytes per row record */
    int64_t off_d, off_n, off_init, off_gs; /* offsets in a record (Q forms) */
    char* base;
} mt_act;

/* bytes of one row record of `form` for K values (group sums for groups of gsz) */
int64_t mt_act_rec_bytes(int form, int64_t K, int64_t gsz);
/* lay `rows` records out at buf (64-byte aligned); returns the bytes used */
int64_t mt_act_init(mt_act* A, int form, int64_t K, int64_t gsz, void* buf, int64_t rows);
/* fill record r from fp32 values (rounded to bf16 first for MT_F_BF16) or from bf16 values */
void mt_act_prep_f32(const mt_act* A, int64_t r, const float* x);
void mt_act_prep_bf16(const mt_act* A, int64_t r, const uint16_t* x);
/* the activation form a weight kind reads */
static inline int mt_form_of(int64_t kind) {
    if (mt_is_gg(kind)) return mt_gg_types[kind - MT_KIND_GG].form;
    return kind == 16 || kind == MT_KIND_F8 ? MT_F_BF16 : (kind == 4 ? MT_F_Q4 : MT_F_Q8);
}
/* bytes of one weight row of `kind` with K values */
static inline int64_t mt_row_bytes(int64_t kind, int64_t K) {
    if (mt_is_gg(kind)) return K / mt_gg_types[kind - MT_KIND_GG].blck * mt_gg_types[kind - MT_KIND_GG].tsize;
    return kind == 16 ? 2 * K : (kind == MT_KIND_F8 ? K : K * kind / 8);
}

/* rows [r0, r1) of W (K values each) against `nt` activation records arow[0..nt) of A:
 * alpha NULL: yrow[i][r] = W_r . a_i;  else: yrow[i][r] += alpha[i] * (W_r . a_i) */
void mt_mm(const mt_w* w, int64_t K, int64_t r0, int64_t r1, const mt_act* A, const int32_t* arow, int64_t nt,
           float* const* yrow, const float* alpha);

/* one fp8 e4m3fn value as fp32 (NaN for 0x7f / 0xff) */
float mt_f8_to_f32(uint8_t b);
/* one MXFP4 block's e8m0 exponent e as the kernels' fp32 scale 2^(e - 128) (exact: e = 0, 1 subnormal; 255 NaN) */
float mt_e8_to_f32(uint8_t e);

/* elementwise helpers on fp32 rows */
float mt_sumsq(const float* x, int64_t n);
void mt_silu_mul(float* g, const float* u, int64_t n); /* g = silu(g) * u in fp32 (the down rows' activation form
                                                          rounds it once); u NULL: g = silu(g) */
float mt_expf(float x);
void mt_round_bf16(float* x, int64_t n); /* x = x rounded to bf16 (nearest even), as fp32 */
void mt_exp_inplace(float* x, int64_t n, float shift); /* x = exp(x - shift) */

/* name of the compiled path ("avx512-bf16-vnni", "avx2+vnni", "avx2", "c") */
const char* mt_isa_name(void);
#endif
