/* The passes around an int8 product (aiayn/decode/int8.py, Int8Linear), one loop each instead of
 * PyTorch's six or so: per-row quantization of the input and rescaling of the int32 product.
 *
 * Compiled and loaded with beam_attention.c by aiayn/kernels/loader.py (without FMA contraction, so
 * each value is rounded as PyTorch's separate operations round it: the results are bit-identical,
 * tested). Rows are contiguous; x and y are float32 or bfloat16 (round to nearest even).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* quantize_rows: s[n] = max(max_i |x[n, i]|, 1e-12) / 127 (float32), q[n, i] = round_half_even(x[n, i] / s[n]). */
#define DEFINE_QUANTIZE(NAME, T, LOAD)                                                          \
    static void NAME(const T *x, int64_t N, int64_t I, int64_t xs, int8_t *q, float *s) {       \
        for (int64_t n = 0; n < N; n++) {                                                       \
            const T *row = x + n * xs;                                                          \
            float m = 0.0f;                                                                     \
            _Pragma("omp simd reduction(max:m)")                                                \
            for (int64_t i = 0; i < I; i++) {                                                   \
                const float a = fabsf(LOAD(row[i]));                                            \
                m = a > m ? a : m; /* not fmaxf, which is a libm call per element */            \
            }                                                                                   \
            const float sn = (m > 1e-12f ? m : 1e-12f) / 127.0f;                                \
            s[n] = sn;                                                                          \
            int8_t *qn = q + n * I;                                                             \
            _Pragma("omp simd")                                                                 \
            for (int64_t i = 0; i < I; i++) qn[i] = (int8_t)nearbyintf(LOAD(row[i]) / sn);      \
        }                                                                                       \
    }

static inline float load_f32(float x) { return x; }
DEFINE_QUANTIZE(quantize_f32, float, load_f32)
DEFINE_QUANTIZE(quantize_bf16, uint16_t, f32_of_bf16)

void aiayn_quantize_rows(const void *x, int64_t N, int64_t I, int64_t xs, int bf16, int8_t *q, float *s) {
    if (bf16) quantize_bf16((const uint16_t *)x, N, I, xs, q, s);
    else quantize_f32((const float *)x, N, I, xs, q, s);
}

/* rescale: y[n, o] = ((float)acc[n, o] * s_w[o]) * s_x[n] + bias[o] (bias may be NULL), y float32 or bfloat16. */
void aiayn_rescale(const int32_t *acc, int64_t N, int64_t O, const float *s_x, const float *s_w,
                   const float *bias, int bf16, void *y) {
    for (int64_t n = 0; n < N; n++) {
        const int32_t *a = acc + n * O;
        const float sx = s_x[n];
        if (bf16) {
            uint16_t *yn = (uint16_t *)y + n * O;
            if (bias) {
                _Pragma("omp simd")
                for (int64_t o = 0; o < O; o++) yn[o] = f32_to_bf16((float)a[o] * s_w[o] * sx + bias[o]);
            } else {
                _Pragma("omp simd")
                for (int64_t o = 0; o < O; o++) yn[o] = f32_to_bf16((float)a[o] * s_w[o] * sx);
            }
        } else {
            float *yn = (float *)y + n * O;
            if (bias) {
                _Pragma("omp simd")
                for (int64_t o = 0; o < O; o++) yn[o] = (float)a[o] * s_w[o] * sx + bias[o];
            } else {
                _Pragma("omp simd")
                for (int64_t o = 0; o < O; o++) yn[o] = (float)a[o] * s_w[o] * sx;
            }
        }
    }
}
