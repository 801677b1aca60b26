/* The label-smoothed cross-entropy of training (§5.4; aiayn/train/objective.py, _SmoothedCrossEntropy),
 * one row of the logits at a time.
 *
 * Compiled and loaded with the decoding kernels by aiayn/kernels/loader.py. The logits z (N, V), float32 or
 * bfloat16 with row stride zs, are the largest tensor of a small model's training step (``aiayn demo``:
 * about 2,000 rows of 8,000 per process and step). PyTorch's operations read and write each (N, V) block
 * six or seven times (widen, subtract, exp, scale, shift, narrow), and the block does not stay in the
 * core's cache between them; here each row is read once forward (two passes over a row that stays in
 * cache) and once backward, and the gradient is written once.
 *
 *   forward:  m = max_v z_v,  log_z = m + log(sum_v exp(z_v - m)),  sum_z = sum_v z_v   (float32)
 *   backward: g_v = a exp(z_v - log_z) - c for every v, then g_pad += c and g_gold -= e,
 *             in the operations' order of the PyTorch path (a, c, e per row: objective.py says what
 *             they are), written in z's dtype (rounded to nearest even for bfloat16).
 * exp is vexp.h's exp_nonpositive (both arguments are <= 0; relative error within 3.6e-7, and exp of
 * anything below -87 is taken at -87, about 1.6e-38, where PyTorch's would be 0 or a denormal).
 * With AVX-512 the passes run 16 values at a time with intrinsics, with AVX2 + FMA 8 at a time (GCC
 * leaves a float sum or maximum in order, one value at a time), both with float32 partial sums
 * (tests/kernels/reference.py bounds their error for any order of the additions); elsewhere plain loops
 * with double sums. The gradient is the same bits in every build (the same operations on each value).
 * Rows are split among nthreads threads.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "lanes.h"
#include "split.h"
#include "vexp.h"

typedef struct {
    const void *z;
    int64_t V, zs, begin, end, pad;
    const int64_t *gold;
    const float *log_z_in, *a, *c, *e;
    float *log_z, *sum_z;
    void *g;
    int bf16, backward;
} ce_t;

/* g's value at v (the scalar form of the vector loop, for the tail and the pad and gold columns) */
static inline float grad_at(float x, float lz, float a, float c) { return exp_nonpositive(x - lz) * a - c; }

#if defined(__AVX512F__)
#define DEFINE_CE(NAME, T, LOAD, LOAD16, STORE, STORE16)                                            \
    static void NAME##_forward(const T *z, int64_t V, float *log_z, float *sum_z) {                 \
        __m512 vm = _mm512_set1_ps(-INFINITY), vs = _mm512_setzero_ps();                            \
        int64_t v = 0;                                                                              \
        for (; v + 16 <= V; v += 16) {                                                              \
            const __m512 x = LOAD16(z + v);                                                         \
            vm = _mm512_max_ps(vm, x);                                                              \
            vs = _mm512_add_ps(vs, x);                                                              \
        }                                                                                           \
        float m = _mm512_reduce_max_ps(vm), s = _mm512_reduce_add_ps(vs);                           \
        for (int64_t j = v; j < V; j++) {                                                           \
            const float x = LOAD(z[j]);                                                             \
            m = x > m ? x : m;                                                                      \
            s += x;                                                                                 \
        }                                                                                           \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                  \
        const __m512 vmm = _mm512_set1_ps(m);                                                       \
        for (v = 0; v + 32 <= V; v += 32) {                                                         \
            a0 = _mm512_add_ps(a0, exp_nonpositive16(_mm512_sub_ps(LOAD16(z + v), vmm)));           \
            a1 = _mm512_add_ps(a1, exp_nonpositive16(_mm512_sub_ps(LOAD16(z + v + 16), vmm)));      \
        }                                                                                           \
        float se = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                     \
        for (; v < V; v++) se += exp_nonpositive(LOAD(z[v]) - m);                                   \
        *log_z = m + logf(se);                                                                      \
        *sum_z = s;                                                                                 \
    }                                                                                               \
    static void NAME##_backward(const T *z, int64_t V, float lz, float a, float c, T *g) {          \
        const __m512 vl = _mm512_set1_ps(lz), va = _mm512_set1_ps(a), vc = _mm512_set1_ps(c);       \
        int64_t v = 0;                                                                              \
        for (; v + 16 <= V; v += 16) {                                                              \
            const __m512 p = exp_nonpositive16(_mm512_sub_ps(LOAD16(z + v), vl));                   \
            STORE16(g + v, _mm512_sub_ps(_mm512_mul_ps(p, va), vc));                                \
        }                                                                                           \
        for (; v < V; v++) g[v] = STORE(grad_at(LOAD(z[v]), lz, a, c));                             \
    }
DEFINE_CE(ce_f32, float, f32_of_f32, load16_f32, f32_to_f32, store16_f32)
DEFINE_CE(ce_bf16, uint16_t, f32_of_bf16, load16_bf16, f32_to_bf16, store16_bf16)
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX-512 path's steps of 16 as two vectors of 8 (two accumulators each for the maximum, the sum and
 * the sum of exponentials); the gradient 8 at a time. */
#define DEFINE_CE(NAME, T, LOAD, LOAD8, STORE, STORE8)                                              \
    static void NAME##_forward(const T *z, int64_t V, float *log_z, float *sum_z) {                 \
        __m256 vm0 = _mm256_set1_ps(-INFINITY), vm1 = vm0, vs0 = _mm256_setzero_ps(), vs1 = vs0;    \
        int64_t v = 0;                                                                              \
        for (; v + 16 <= V; v += 16) {                                                              \
            const __m256 x0 = LOAD8(z + v), x1 = LOAD8(z + v + 8);                                  \
            vm0 = _mm256_max_ps(vm0, x0);                                                           \
            vm1 = _mm256_max_ps(vm1, x1);                                                           \
            vs0 = _mm256_add_ps(vs0, x0);                                                           \
            vs1 = _mm256_add_ps(vs1, x1);                                                           \
        }                                                                                           \
        float m = max8(_mm256_max_ps(vm0, vm1)), s = sum8(_mm256_add_ps(vs0, vs1));                 \
        for (int64_t j = v; j < V; j++) {                                                           \
            const float x = LOAD(z[j]);                                                             \
            m = x > m ? x : m;                                                                      \
            s += x;                                                                                 \
        }                                                                                           \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                  \
        const __m256 vmm = _mm256_set1_ps(m);                                                       \
        for (v = 0; v + 16 <= V; v += 16) {                                                         \
            a0 = _mm256_add_ps(a0, exp_nonpositive8(_mm256_sub_ps(LOAD8(z + v), vmm)));             \
            a1 = _mm256_add_ps(a1, exp_nonpositive8(_mm256_sub_ps(LOAD8(z + v + 8), vmm)));         \
        }                                                                                           \
        float se = sum8(_mm256_add_ps(a0, a1));                                                     \
        for (; v < V; v++) se += exp_nonpositive(LOAD(z[v]) - m);                                   \
        *log_z = m + logf(se);                                                                      \
        *sum_z = s;                                                                                 \
    }                                                                                               \
    static void NAME##_backward(const T *z, int64_t V, float lz, float a, float c, T *g) {          \
        const __m256 vl = _mm256_set1_ps(lz), va = _mm256_set1_ps(a), vc = _mm256_set1_ps(c);       \
        int64_t v = 0;                                                                              \
        for (; v + 8 <= V; v += 8) {                                                                \
            const __m256 p = exp_nonpositive8(_mm256_sub_ps(LOAD8(z + v), vl));                     \
            STORE8(g + v, _mm256_sub_ps(_mm256_mul_ps(p, va), vc));                                 \
        }                                                                                           \
        for (; v < V; v++) g[v] = STORE(grad_at(LOAD(z[v]), lz, a, c));                             \
    }
DEFINE_CE(ce_f32, float, f32_of_f32, load8_f32, f32_to_f32, store8_f32)
DEFINE_CE(ce_bf16, uint16_t, f32_of_bf16, load8_bf16, f32_to_bf16, store8_bf16)
#else
#define DEFINE_CE(NAME, T, LOAD, STORE)                                                             \
    static void NAME##_forward(const T *z, int64_t V, float *log_z, float *sum_z) {                 \
        float m = -INFINITY;                                                                        \
        double s = 0.0, se = 0.0; /* float32 sums over thousands of terms would drift */            \
        for (int64_t v = 0; v < V; v++) {                                                           \
            const float x = LOAD(z[v]);                                                             \
            m = x > m ? x : m; /* not fmaxf: a libm call per element */                             \
            s += x;                                                                                 \
        }                                                                                           \
        for (int64_t v = 0; v < V; v++) se += exp_nonpositive(LOAD(z[v]) - m);                     \
        *log_z = m + logf((float)se);                                                               \
        *sum_z = (float)s;                                                                          \
    }                                                                                               \
    static void NAME##_backward(const T *z, int64_t V, float lz, float a, float c, T *g) {          \
        for (int64_t v = 0; v < V; v++) g[v] = STORE(grad_at(LOAD(z[v]), lz, a, c));                \
    }
DEFINE_CE(ce_f32, float, f32_of_f32, f32_to_f32)
DEFINE_CE(ce_bf16, uint16_t, f32_of_bf16, f32_to_bf16)
#endif

/* The pad and gold columns of a backward row, in the PyTorch path's order: (p a - c) + c at pad, then
 * + (-e) at gold (which may be pad itself). */
#define DEFINE_FIX(NAME, T, LOAD, STORE)                                                            \
    static void NAME(const T *z, int64_t pad, int64_t gold, float lz, float a, float c, float e, T *g) { \
        const float at_pad = grad_at(LOAD(z[pad]), lz, a, c) + c;                                   \
        g[pad] = STORE(at_pad);                                                                     \
        const float before = gold == pad ? at_pad : grad_at(LOAD(z[gold]), lz, a, c);               \
        g[gold] = STORE(before + (-e));                                                             \
    }
DEFINE_FIX(fix_f32, float, f32_of_f32, f32_to_f32)
DEFINE_FIX(fix_bf16, uint16_t, f32_of_bf16, f32_to_bf16)

/* The rows [begin, end) of one task, forward or backward, for one element type. */
#define DEFINE_ROWS(NAME, T, CE, FIX)                                                               \
    static void NAME(const ce_t *w) {                                                               \
        for (int64_t r = w->begin; r < w->end; r++) {                                              \
            const T *z = (const T *)w->z + r * w->zs;                                               \
            if (!w->backward) {                                                                     \
                CE##_forward(z, w->V, w->log_z + r, w->sum_z + r);                                  \
                continue;                                                                           \
            }                                                                                       \
            T *g = (T *)w->g + r * w->V;                                                            \
            CE##_backward(z, w->V, w->log_z_in[r], w->a[r], w->c[r], g);                            \
            FIX(z, w->pad, w->gold[r], w->log_z_in[r], w->a[r], w->c[r], w->e[r], g);               \
        }                                                                                           \
    }
DEFINE_ROWS(rows_f32, float, ce_f32, fix_f32)
DEFINE_ROWS(rows_bf16, uint16_t, ce_bf16, fix_bf16)

static void *ce_work(void *arg) {
    const ce_t *w = (const ce_t *)arg;
    if (w->bf16) rows_bf16(w);
    else rows_f32(w);
    return NULL;
}

static void ce_run(ce_t proto, int64_t N, int nthreads) {
    nthreads = split_threads(nthreads, N);
    ce_t tasks[MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        tasks[i] = proto;
        tasks[i].begin = N * i / nthreads;
        tasks[i].end = N * (i + 1) / nthreads;
    }
    run_split(ce_work, tasks, sizeof tasks[0], nthreads);
}

/* Forward: log_z (N,) and sum_z (N,) float32 of the rows of z. */
void aiayn_ce_forward(const void *z, int64_t N, int64_t V, int64_t zs, int bf16, float *log_z, float *sum_z,
                      int nthreads) {
    ce_t w = {z, V, zs, 0, 0, 0, NULL, NULL, NULL, NULL, NULL, log_z, sum_z, NULL, bf16, 0};
    ce_run(w, N, nthreads);
}

/* Backward: g (N, V) contiguous, z's dtype, from log_z, a, c, e (N,) float32 and the gold ids (N,). */
void aiayn_ce_backward(const void *z, int64_t N, int64_t V, int64_t zs, int bf16, const float *log_z,
                       const float *a, const float *c, const float *e, const int64_t *gold, int64_t pad, void *g,
                       int nthreads) {
    ce_t w = {z, V, zs, 0, 0, pad, gold, log_z, a, c, e, NULL, NULL, g, bf16, 1};
    ce_run(w, N, nthreads);
}
