/* exp(x) for x <= 0, written so that compiled loops around it vectorize (libm's expf is a call per
 * element): for the softmax of beam_attention.c and the log-softmax of logits_topk.c, both after the
 * maximum is subtracted. Used by the C kernels of aiayn/kernels/loader.py. */
#ifndef AIAYN_VEXP_H
#define AIAYN_VEXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a softmax after the maximum is subtracted): 2^(x log2 e) split into 2^i * 2^f,
 * f in [0, 1), 2^f by a degree-6 polynomial, 2^i in the exponent bits. The polynomial is 1 + f q(f),
 * q the minimax fit of (2^f - 1) / f for the relative error on [0, 1] (Lawson's iteration; so
 * exp(0) = 1 exactly): 2.0e-9 in exact arithmetic, and with its six float32 FMAs rounding partial
 * sums of positive terms, within gamma_6 = 3.6e-7 (under 6.5e-8 over a grid of 2^21 values of f).
 * The rounding of x log2(e) adds about |x| 2^-24. Written out so that the compiler vectorizes the
 * loop around it. */
/* its coefficients, highest power first (the scalar and vector forms share them), and its clamp */
#define VEXP_C6 2.161293944126455e-4f
#define VEXP_C5 1.246784000048557e-3f
#define VEXP_C4 9.675452191778022e-3f
#define VEXP_C3 5.548528034671261e-2f
#define VEXP_C2 2.402293056032848e-1f
#define VEXP_C1 6.931470444402397e-1f
#define VEXP_LOG2E 1.44269504088896341f
#define VEXP_MIN (-87.0f)

static inline float exp_nonpositive(float x) {
    float t = (x > VEXP_MIN ? x : VEXP_MIN) * VEXP_LOG2E; /* not fmaxf: a libm call per element */
    float i = floorf(t);
    float f = t - i;
    float p = VEXP_C6;
    p = fmaf(p, f, VEXP_C5);
    p = fmaf(p, f, VEXP_C4);
    p = fmaf(p, f, VEXP_C3);
    p = fmaf(p, f, VEXP_C2);
    p = fmaf(p, f, VEXP_C1);
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
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(VEXP_MIN)), _mm512_set1_ps(VEXP_LOG2E));
    const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, i);
    __m512 p = _mm512_set1_ps(VEXP_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(VEXP_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(VEXP_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(VEXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(VEXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(VEXP_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* exp_nonpositive of 8 values at once, the same steps (the AVX2 + FMA builds: x86-64-v3). */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(VEXP_MIN)), _mm256_set1_ps(VEXP_LOG2E));
    const __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, i);
    __m256 p = _mm256_set1_ps(VEXP_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(VEXP_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(VEXP_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(VEXP_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(VEXP_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(VEXP_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#endif
