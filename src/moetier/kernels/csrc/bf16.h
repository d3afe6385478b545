/* bf16 <-> fp32 and fp16 <-> fp32 conversions shared by the kernel sources (plain C; fp16 by F16C where the
 * compiler targets it, the same values either way). */
#ifndef MOETIER_BF16_H
#define MOETIER_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even; NaN stays NaN */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__F16C__) && !defined(MT_FORCE_C)
#include <immintrin.h>
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f2h(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else
/* fp16 -> fp32, exact */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f)
        u = sign | 0x7f800000u | (m << 13); /* Inf / NaN */
    else if (e != 0)
        u = sign | ((e + 112) << 23) | (m << 13);
    else if (m == 0)
        u = sign;
    else { /* subnormal: normalise */
        int sh = 0;
        uint32_t mm = m;
        while (!(mm & 0x400u)) mm <<= 1, sh++;
        u = sign | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> fp16, round to nearest even; overflow to Inf, NaN stays NaN (as F16C's conversion) */
static inline uint16_t f2h(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN, quiet */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                     /* rounds past 65504: Inf */
    if (a >= 0x38800000u) {                                                       /* normal fp16 */
        const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
        return (uint16_t)(sign | (r >> 13));
    }
    if (a < 0x33000000u) return sign; /* below half the smallest subnormal: zero */
    /* subnormal fp16: the value times 2^24, rounded to nearest even */
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, sh = 126 - e; /* 14 .. 24 */
    uint32_t v = m >> sh;
    const uint32_t rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
    if (rem > half || (rem == half && (v & 1u))) v++;
    return (uint16_t)(sign | v);
}
#endif
#endif
