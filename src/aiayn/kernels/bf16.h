/* bfloat16 <-> float32 for the C kernels of aiayn/kernels/loader.py: widening is exact; narrowing rounds
 * to nearest even, as PyTorch's conversion does, and keeps NaN a NaN. */
#ifndef AIAYN_BF16_H
#define AIAYN_BF16_H
#include <stdint.h>
#include <string.h>

static inline float f32_of_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* float32's own (identity) forms of the two, for kernels written once for both element types */
static inline float f32_of_f32(float x) { return x; }
static inline float f32_to_f32(float x) { return x; }

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bfloat16 values widened to float32 */
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 float32 -> bfloat16: f32_to_bf16 16 at a time (nearest even, NaN kept a NaN) */
static inline void store16_bf16(uint16_t *p, __m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

/* float32's own forms of the two */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void store16_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
#endif

#endif
