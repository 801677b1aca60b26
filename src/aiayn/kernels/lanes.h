/* The largest and the sum of a vector's 8 float lanes for the AVX2 + FMA paths of the C kernels of
 * aiayn/kernels/loader.py (AVX2 has no reduction instruction; AVX-512 has _mm512_reduce_*). One fixed
 * order, the two halves, then pairs, then the last two, so every kernel that ends a sum with it (the
 * beam step's dot products and its register-blocked path) gets the same bits. */
#ifndef AIAYN_LANES_H
#define AIAYN_LANES_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float max8(__m256 x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

static inline float sum8(__m256 x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif
#endif
