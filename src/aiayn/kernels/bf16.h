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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* 8 bfloat16 values widened to float32 (the AVX2 + FMA builds: x86-64-v3) */
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 float32 -> bfloat16: f32_to_bf16 8 at a time (nearest even, NaN kept a NaN) */
static inline void store8_bf16(uint16_t *p, __m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000)); /* both operands non-negative */
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    /* 8 int32 holding 16-bit values -> 8 uint16: pack within lanes, then gather the two halves */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

/* float32's own forms of the two */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void store8_f32(float *p, __m256 x) { _mm256_storeu_ps(p, x); }
#endif

#endif
