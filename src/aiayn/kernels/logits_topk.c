/* The end of a beam-search step: log-softmax over the vocabulary, then each row's k best tokens.
 *
 * Compiled and loaded with beam_attention.c by aiayn/kernels/loader.py, which says why and how it is
 * tested. For each row z of the logits (R, V), float32 or bfloat16, row stride zs:
 *   m = max_v z_v,  s = sum_v exp(z_v - m),  log p_v = (z_v - m) - log s
 * (log_softmax, in the order PyTorch's CPU kernel computes it), and the k largest log p_v over the
 * tokens v not in banned[0..nb), best first, into val (R, k) float32 and idx (R, k) int64; among
 * equal values the lower token id comes first. Only those k values are written: the (R, V)
 * log-probabilities that the search would otherwise write, read back and mask never exist.
 * Per row, two passes over its V logits (which stay in the core's cache between them): the maximum
 * and the k best (the k best of z are the k best of log p, which is z shifted), then the sum of
 * exponentials; with AVX-512 (16 values a vector) or AVX2 + FMA (8, two vectors a block) both are
 * written with intrinsics (GCC vectorizes neither: a reduction over exp_nonpositive, a block test), with
 * plain loops otherwise. The vector paths sum in float32 partial sums (32 with AVX-512, 16 with AVX2),
 * the plain loops in double: tests/kernels/reference.py's log_softmax_tolerance bounds the sum's error
 * for any order of the additions. Rows are split among nthreads threads.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "lanes.h"
#include "split.h"
#include "vexp.h"

typedef struct {
    const void *z;
    int64_t V, zs, k, nb, begin, end;
    const int64_t *banned;
    float *val;
    int64_t *idx;
    int bf16;
} rows_t;

static inline int is_banned(int64_t v, const int64_t *banned, int64_t nb) {
    for (int64_t b = 0; b < nb; b++)
        if (banned[b] == v) return 1;
    return 0;
}

/* Insert (x, v) into the best-first list tv/ti of *cnt entries (at most k): a full list drops its last. */
static inline void push(float *tv, int64_t *ti, int64_t *cnt, int64_t k, float x, int64_t v) {
    int64_t p = *cnt < k ? (*cnt)++ : k - 1;
    while (p > 0 && tv[p - 1] < x) {
        tv[p] = tv[p - 1];
        ti[p] = ti[p - 1];
        p--;
    }
    tv[p] = x;
    ti[p] = v;
}

/* Offer token v of value x to the list: taken while it holds fewer than k, or if x beats its k-th best;
 * never a banned token. */
static inline void offer(float *tv, int64_t *ti, int64_t *cnt, int64_t k, float x, int64_t v,
                         const int64_t *banned, int64_t nb) {
    if ((*cnt < k || x > tv[k - 1]) && !is_banned(v, banned, nb)) push(tv, ti, cnt, k, x, v);
}

/* One row: the k best of z over the tokens not banned, best first, raw (tv, ti; returns how many, at
 * most k) and the maximum m. Blocks of 16 are compared with the k-th best so far as a whole (with
 * AVX-512 one compare per block, with AVX2 two; a block above it is scanned token by token). */
#define BLOCK 16
#if defined(__AVX512F__)
#define DEFINE_ROW(NAME, T, LOAD, LOAD16)                                                         \
    static float NAME(const T *z, int64_t V, const int64_t *banned, int64_t nb, int64_t k,        \
                      float *tv, int64_t *ti, int64_t *cnt) {                                     \
        __m512 vm = _mm512_set1_ps(-INFINITY);                                                    \
        int64_t v0 = 0;                                                                           \
        for (; v0 + BLOCK <= V; v0 += BLOCK) {                                                    \
            const __m512 x = LOAD16(z + v0);                                                      \
            vm = _mm512_max_ps(vm, x);                                                            \
            if (*cnt == k && !_mm512_cmp_ps_mask(x, _mm512_set1_ps(tv[k - 1]), _CMP_GT_OQ)) continue; \
            for (int64_t j = v0; j < v0 + BLOCK; j++) offer(tv, ti, cnt, k, LOAD(z[j]), j, banned, nb); \
        }                                                                                         \
        float m = _mm512_reduce_max_ps(vm);                                                       \
        for (int64_t j = v0; j < V; j++) {                                                        \
            const float xj = LOAD(z[j]);                                                          \
            m = xj > m ? xj : m;                                                                  \
            offer(tv, ti, cnt, k, xj, j, banned, nb);                                             \
        }                                                                                         \
        return m;                                                                                 \
    }                                                                                             \
    static float NAME##_sum_exp(const T *z, int64_t V, float m) {                                 \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                \
        const __m512 vm = _mm512_set1_ps(m);                                                      \
        int64_t v = 0;                                                                            \
        for (; v + 2 * BLOCK <= V; v += 2 * BLOCK) {                                              \
            a0 = _mm512_add_ps(a0, exp_nonpositive16(_mm512_sub_ps(LOAD16(z + v), vm)));          \
            a1 = _mm512_add_ps(a1, exp_nonpositive16(_mm512_sub_ps(LOAD16(z + v + BLOCK), vm)));  \
        }                                                                                         \
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                    \
        for (; v < V; v++) s += exp_nonpositive(LOAD(z[v]) - m);                                  \
        return s;                                                                                 \
    }
DEFINE_ROW(row_f32, float, f32_of_f32, load16_f32)
DEFINE_ROW(row_bf16, uint16_t, f32_of_bf16, load16_bf16)
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX-512 path with a block of 16 as two vectors of 8: a block is scanned if either holds a value
 * above the k-th best (both compares, not one of their maximum, which would drop a lane beside a NaN). */
#define DEFINE_ROW(NAME, T, LOAD, LOAD8)                                                          \
    static float NAME(const T *z, int64_t V, const int64_t *banned, int64_t nb, int64_t k,        \
                      float *tv, int64_t *ti, int64_t *cnt) {                                     \
        __m256 vm0 = _mm256_set1_ps(-INFINITY), vm1 = vm0;                                        \
        int64_t v0 = 0;                                                                           \
        for (; v0 + BLOCK <= V; v0 += BLOCK) {                                                    \
            const __m256 x0 = LOAD8(z + v0), x1 = LOAD8(z + v0 + 8);                              \
            vm0 = _mm256_max_ps(vm0, x0);                                                         \
            vm1 = _mm256_max_ps(vm1, x1);                                                         \
            if (*cnt == k) {                                                                      \
                const __m256 t = _mm256_set1_ps(tv[k - 1]);                                       \
                const __m256 above = _mm256_or_ps(_mm256_cmp_ps(x0, t, _CMP_GT_OQ),               \
                                                  _mm256_cmp_ps(x1, t, _CMP_GT_OQ));              \
                if (!_mm256_movemask_ps(above)) continue;                                         \
            }                                                                                     \
            for (int64_t j = v0; j < v0 + BLOCK; j++) offer(tv, ti, cnt, k, LOAD(z[j]), j, banned, nb); \
        }                                                                                         \
        float m = max8(_mm256_max_ps(vm0, vm1));                                                  \
        for (int64_t j = v0; j < V; j++) {                                                        \
            const float xj = LOAD(z[j]);                                                          \
            m = xj > m ? xj : m;                                                                  \
            offer(tv, ti, cnt, k, xj, j, banned, nb);                                             \
        }                                                                                         \
        return m;                                                                                 \
    }                                                                                             \
    static float NAME##_sum_exp(const T *z, int64_t V, float m) {                                 \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                \
        const __m256 vm = _mm256_set1_ps(m);                                                      \
        int64_t v = 0;                                                                            \
        for (; v + BLOCK <= V; v += BLOCK) {                                                      \
            a0 = _mm256_add_ps(a0, exp_nonpositive8(_mm256_sub_ps(LOAD8(z + v), vm)));            \
            a1 = _mm256_add_ps(a1, exp_nonpositive8(_mm256_sub_ps(LOAD8(z + v + 8), vm)));        \
        }                                                                                         \
        float s = sum8(_mm256_add_ps(a0, a1));                                                    \
        for (; v < V; v++) s += exp_nonpositive(LOAD(z[v]) - m);                                  \
        return s;                                                                                 \
    }
DEFINE_ROW(row_f32, float, f32_of_f32, load8_f32)
DEFINE_ROW(row_bf16, uint16_t, f32_of_bf16, load8_bf16)
#else
#define DEFINE_ROW(NAME, T, LOAD)                                                                 \
    static float NAME(const T *z, int64_t V, const int64_t *banned, int64_t nb, int64_t k,        \
                      float *tv, int64_t *ti, int64_t *cnt) {                                     \
        float m = -INFINITY;                                                                      \
        int64_t v0 = 0;                                                                           \
        for (; v0 < V; v0 += BLOCK) {                                                             \
            const int64_t end = v0 + BLOCK < V ? v0 + BLOCK : V;                                  \
            float bm = -INFINITY;                                                                 \
            for (int64_t j = v0; j < end; j++) {                                                  \
                const float xj = LOAD(z[j]);                                                      \
                bm = xj > bm ? xj : bm; /* not fmaxf: a libm call per element */                  \
            }                                                                                     \
            m = bm > m ? bm : m;                                                                  \
            if (*cnt == k && !(bm > tv[k - 1])) continue;                                         \
            for (int64_t j = v0; j < end; j++) offer(tv, ti, cnt, k, LOAD(z[j]), j, banned, nb);  \
        }                                                                                         \
        return m;                                                                                 \
    }                                                                                             \
    static float NAME##_sum_exp(const T *z, int64_t V, float m) {                                 \
        double s = 0.0; /* one float32 sum over thousands of terms would drift (1e-5 measured) */ \
        for (int64_t v = 0; v < V; v++) s += exp_nonpositive(LOAD(z[v]) - m);                     \
        return (float)s;                                                                          \
    }
DEFINE_ROW(row_f32, float, f32_of_f32)
DEFINE_ROW(row_bf16, uint16_t, f32_of_bf16)
#endif

#define DEFINE_ROWS(NAME, T, ROW)                                                                 \
    static void NAME(rows_t *w) {                                                                 \
        const int64_t k = w->k;                                                                   \
        for (int64_t r = w->begin; r < w->end; r++) {                                             \
            const T *z = (const T *)w->z + r * w->zs;                                             \
            float *tv = w->val + r * k;                                                           \
            int64_t *ti = w->idx + r * k, cnt = 0;                                                \
            const float m = ROW(z, w->V, w->banned, w->nb, k, tv, ti, &cnt);                      \
            const float log_s = logf(ROW##_sum_exp(z, w->V, m));                                  \
            for (int64_t j = 0; j < cnt; j++) tv[j] = (tv[j] - m) - log_s;                        \
            for (int64_t j = cnt; j < k; j++) { tv[j] = -INFINITY; ti[j] = 0; } /* V - nb < k */  \
        }                                                                                         \
    }

DEFINE_ROWS(rows_f32, float, row_f32)
DEFINE_ROWS(rows_bf16, uint16_t, row_bf16)

static void *work(void *arg) {
    rows_t *w = (rows_t *)arg;
    if (w->bf16) rows_bf16(w);
    else rows_f32(w);
    return NULL;
}

void aiayn_log_softmax_topk(const void *z, int64_t R, int64_t V, int64_t zs, int bf16, int64_t k,
                            const int64_t *banned, int64_t nb, float *val, int64_t *idx, int nthreads) {
    nthreads = split_threads(nthreads, R);
    rows_t tasks[MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        rows_t t = {z, V, zs, k, nb, R * i / nthreads, R * (i + 1) / nthreads, banned, val, idx, bf16};
        tasks[i] = t;
    }
    run_split(work, tasks, sizeof tasks[0], nthreads);
}
