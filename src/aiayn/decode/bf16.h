/* bfloat16 <-> float32 for the C kernels of aiayn/decode/kernel.py: widening is exact; narrowing rounds
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

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bfloat16 values widened to float32 */
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#endif
