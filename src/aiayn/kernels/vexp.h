/* exp(x) for x <= 0, written so that compiled loops around it vectorize (libm's expf is a call per
 * element): for the softmax of beam_attention.c and the log-softmax of logits_topk.c, both after the
 * maximum is subtracted. Used by the C kernels of aiayn/kernels/loader.py. */
#ifndef AIAYN_VEXP_H
#define AIAYN_VEXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a softmax after the maximum is subtracted): 2^(x log2 e) split into 2^i * 2^f,
 * f in [0, 1), 2^f by a degree-6 polynomial (relative error about 2e-7), 2^i in the exponent bits.
 * Written out so that the compiler vectorizes the loop around it. */
static inline float exp_nonpositive(float x) {
    float t = (x > -87.0f ? x : -87.0f) * 1.44269504088896341f; /* not fmaxf: a libm call per element */
    float i = floorf(t);
    float f = t - i;
    float p = 1.535336188319500e-4f;
    p = fmaf(p, f, 1.339887440266574e-3f);
    p = fmaf(p, f, 9.618437357674640e-3f);
    p = fmaf(p, f, 5.550332471162809e-2f);
    p = fmaf(p, f, 2.402264791363012e-1f);
    p = fmaf(p, f, 6.931472028550421e-1f);
    p = fmaf(p, f, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)i + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* exp_nonpositive of 16 values at once, the same steps (GCC does not vectorize a reduction over
 * exp_nonpositive, so a sum of exponentials is written with this). */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, i);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* exp_nonpositive of 8 values at once, the same steps (the AVX2 + FMA builds: x86-64-v3). */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504088896341f));
    const __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, i);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#endif
