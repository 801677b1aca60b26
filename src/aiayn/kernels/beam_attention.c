/* Eq. 1, softmax(q K^T / sqrt(d_k)) V, for one step of beam search, on the CPU.
 *
 * Compiled and loaded by aiayn/kernels/loader.py, which says why it exists and how it is tested. The
 * library is built without FMA contraction (for int8_rows.c), so the products below ask for fmaf.
 * Shapes (elements; the last dimension of every tensor is contiguous):
 *   Bs sentences, g beams (decoder rows) per sentence, H heads, n key positions, K d_k, Dv d_v;
 *   q   row (s, h, r): q + s*qs + h*qh + r*qr, K values;
 *   key (s, h, t):    k + s*ks + h*kh + t*kt, K values (v likewise, Dv values);
 *   out (s*g + r, h): out + ((s*g + r)*H + h)*Dv, Dv values, i.e. (N, H*Dv) with N = Bs*g.
 * Two kinds of step:
 *   shared-slot self-attention (anc != NULL): the keys of position j of row r are in slot
 *     anc[s, r, j] of that position, t = j*g + slot (DecoderCache's shared beam slots); the last
 *     position, n - 1, is the row's own new slot r. Each row reads only its own prefix.
 *   encoder-decoder attention (anc == NULL): the g rows of a sentence attend to its n source
 *     positions, t = j, skipping those where pad[s, j] != 0.
 * Arithmetic in float32 (bfloat16 inputs are widened, the output rounded to nearest even), the
 * softmax with the row maximum subtracted. Work items (s, h) are split among nthreads threads.
 * With AVX-512, beam 4 and d_k = d_v of 32 or 64 (every preset's beam and heads) the four rows' queries
 * and accumulators stay in registers (DEFINE_FAST: the same operations in the same order), and the
 * softmax runs 16 scores at a time (softmax_row).
 * With AVX2 + FMA (x86-64-v3: Haswell to Skylake client, Zen 1 to 3) the inner products run 8 floats at
 * a time for d_k, d_v multiples of 8, the softmax 8 scores at a time (the last n % 8 one by one), and
 * beam 4 with d_k = d_v of 32 or 64 takes a DEFINE_FAST sized for AVX2's 16 registers: the four rows'
 * scores position by position, the weighted values one row (d_v 64) or two (32) at a time with their
 * accumulators in registers across all positions; again the general loop's numbers, bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "lanes.h"
#include "split.h"
#include "vexp.h"

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *anc;
    const uint8_t *pad;
    const void *nk, *nv; /* the step's new keys and values, or NULL (see aiayn_beam_attention_append) */
    int64_t Bs, H, g, n, K, Dv;
    int64_t qs, qh, qr, ks, kh, kt, vs, vh, vt, anc_s, anc_r, pad_s, nks, nkh, nvs, nvh;
    float scale;
    int64_t begin, end; /* work items s*H + h in [begin, end) */
    int status;
} job_t;


/* The two inner products of the loop below: d = q . k over K, and acc += p v over Dv. With AVX-512
 * and lengths that are multiples of 16 (d_k = d_v = 64 in every preset), or with AVX2 + FMA and
 * multiples of 8, they are written with intrinsics; compiled loops over such short lengths spent most
 * of their time in set-up code. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC(n) (((n) & 15) == 0)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC(n) (((n) & 7) == 0)
#else
#define VEC(n) 0
#endif

#if defined(__AVX512F__)
#define DEFINE_DOT_AXPY(SUFFIX, T, LOAD, LOAD16)                                                  \
    static inline float dot_##SUFFIX(const float *q, const T *k, int64_t K) {                     \
        if (VEC(K)) {                                                                             \
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                            \
            int64_t i = 0;                                                                        \
            for (; i + 32 <= K; i += 32) {                                                        \
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), LOAD16(k + i), a0);                  \
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), LOAD16(k + i + 16), a1);        \
            }                                                                                     \
            if (i < K) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), LOAD16(k + i), a0);           \
            return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                   \
        }                                                                                         \
        float d = 0.0f;                                                                           \
        for (int64_t i = 0; i < K; i++) d = fmaf(q[i], LOAD(k[i]), d);                            \
        return d;                                                                                 \
    }                                                                                             \
    static inline void axpy_##SUFFIX(float p, const T *v, float *acc, int64_t Dv) {               \
        if (VEC(Dv)) {                                                                            \
            const __m512 pp = _mm512_set1_ps(p);                                                  \
            for (int64_t d = 0; d < Dv; d += 16)                                                  \
                _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pp, LOAD16(v + d), _mm512_loadu_ps(acc + d))); \
            return;                                                                               \
        }                                                                                         \
        for (int64_t d = 0; d < Dv; d++) acc[d] = fmaf(p, LOAD(v[d]), acc[d]);                    \
    }
DEFINE_DOT_AXPY(f32, float, f32_of_f32, load16_f32)
DEFINE_DOT_AXPY(bf16, uint16_t, f32_of_bf16, load16_bf16)
#elif defined(__AVX2__) && defined(__FMA__)
/* As the AVX-512 forms, 8 lanes: two accumulators over alternate blocks of 8, then their sum. */
#define DEFINE_DOT_AXPY(SUFFIX, T, LOAD, LOAD8)                                                   \
    static inline float dot_##SUFFIX(const float *q, const T *k, int64_t K) {                     \
        if (VEC(K)) {                                                                             \
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                            \
            int64_t i = 0;                                                                        \
            for (; i + 16 <= K; i += 16) {                                                        \
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), LOAD8(k + i), a0);                   \
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), LOAD8(k + i + 8), a1);           \
            }                                                                                     \
            if (i < K) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), LOAD8(k + i), a0);            \
            return sum8(_mm256_add_ps(a0, a1));                                                  \
        }                                                                                         \
        float d = 0.0f;                                                                           \
        for (int64_t i = 0; i < K; i++) d = fmaf(q[i], LOAD(k[i]), d);                            \
        return d;                                                                                 \
    }                                                                                             \
    static inline void axpy_##SUFFIX(float p, const T *v, float *acc, int64_t Dv) {               \
        if (VEC(Dv)) {                                                                            \
            const __m256 pp = _mm256_set1_ps(p);                                                  \
            for (int64_t d = 0; d < Dv; d += 8)                                                   \
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pp, LOAD8(v + d), _mm256_loadu_ps(acc + d))); \
            return;                                                                               \
        }                                                                                         \
        for (int64_t d = 0; d < Dv; d++) acc[d] = fmaf(p, LOAD(v[d]), acc[d]);                    \
    }
DEFINE_DOT_AXPY(f32, float, f32_of_f32, load8_f32)
DEFINE_DOT_AXPY(bf16, uint16_t, f32_of_bf16, load8_bf16)
#else
#define DEFINE_DOT_AXPY(SUFFIX, T, LOAD)                                                          \
    static inline float dot_##SUFFIX(const float *q, const T *k, int64_t K) {                     \
        float d = 0.0f;                                                                           \
        _Pragma("omp simd reduction(+:d)")                                                        \
        for (int64_t i = 0; i < K; i++) d = fmaf(q[i], LOAD(k[i]), d);                            \
        return d;                                                                                 \
    }                                                                                             \
    static inline void axpy_##SUFFIX(float p, const T *v, float *acc, int64_t Dv) {               \
        _Pragma("omp simd")                                                                       \
        for (int64_t d = 0; d < Dv; d++) acc[d] = fmaf(p, LOAD(v[d]), acc[d]);                    \
    }
DEFINE_DOT_AXPY(f32, float, f32_of_f32)
DEFINE_DOT_AXPY(bf16, uint16_t, f32_of_bf16)
#endif

/* Software prefetch of the keys and values of position j (all its key rows: g slots, or one source
 * position): the caches are read once per step and are not in any cache by then; the hardware
 * prefetchers alone left this loop waiting on memory (about 2.5x slower than with warm caches). */
#define PREFETCH_AHEAD 4
static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Position j of one (sentence, head): its g slots (all of them, which lie together: fetching only the
 * slots some row's prefix uses was slower), or its one source position. kb, vb: that item's bases. */
static inline void prefetch_position(const char *kb, const char *vb, int64_t rows, int64_t j, int64_t kt_bytes,
                                     int64_t vt_bytes, int64_t k_bytes, int64_t v_bytes) {
    for (int64_t r = 0; r < rows; r++) {
        prefetch_bytes(kb + (j * rows + r) * kt_bytes, k_bytes);
        prefetch_bytes(vb + (j * rows + r) * vt_bytes, v_bytes);
    }
}

/* The key (and value) row that row r reads at position j: with shared slots (anc) the slot its prefix
 * holds there, j * g + anc[r, j], or its own new slot r at the last position; else source position j. */
static inline int64_t key_row(const int64_t *anc, int64_t anc_r, int64_t g, int64_t n, int64_t j, int64_t r) {
    return anc ? j * g + (j == n - 1 ? r : anc[r * anc_r + j]) : j;
}

#if defined(__AVX512F__)
/* The same work item for beam 4 with d_k = d_v = 16 * C (C = 2 or 4: d_k 32 or 64), with the four rows'
 * queries and value accumulators held in registers instead of reloaded from scratch at every key (the
 * loop below otherwise spends most of its time loading and storing them). The same operations in the
 * same order as dot_* and axpy_*, so the same numbers, bit for bit. Scores go to sc (4, n) and the
 * weighted values to acc (4, Dv) as in the general loop; the softmax between them is the caller's. */
#define FAST_G 4
#define DEFINE_FAST(SUFFIX, T, LOAD16)                                                            \
    static inline __attribute__((always_inline)) void scores4_##SUFFIX(                           \
        const int C, const float *qf, const T *kb, int64_t kt, const int64_t *anc, int64_t anc_r, \
        const uint8_t *pad, int64_t n, float *sc, const T *vb, int64_t rows,                      \
        int64_t kt_b, int64_t vt_b, int64_t k_b, int64_t v_b) {                                   \
        __m512 q[FAST_G][4];                                                                      \
        for (int r = 0; r < FAST_G; r++)                                                          \
            for (int c = 0; c < C; c++) q[r][c] = _mm512_loadu_ps(qf + r * 16 * C + 16 * c);      \
        for (int64_t j = 0; j < n; j++) {                                                         \
            if (j + PREFETCH_AHEAD < n)                                                           \
                prefetch_position((const char *)kb, (const char *)vb, rows, j + PREFETCH_AHEAD,   \
                                  kt_b, vt_b, k_b, v_b);                                          \
            if (pad && pad[j]) {                                                                  \
                for (int r = 0; r < FAST_G; r++) sc[r * n + j] = -INFINITY;                       \
                continue;                                                                         \
            }                                                                                     \
            for (int r = 0; r < FAST_G; r++) {                                                    \
                const int64_t t = key_row(anc, anc_r, FAST_G, n, j, r);                           \
                const T *kp = kb + t * kt;                                                        \
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                        \
                for (int c = 0; c < C; c += 2) {                                                  \
                    a0 = _mm512_fmadd_ps(q[r][c], LOAD16(kp + 16 * c), a0);                       \
                    a1 = _mm512_fmadd_ps(q[r][c + 1], LOAD16(kp + 16 * c + 16), a1);              \
                }                                                                                 \
                sc[r * n + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                      \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    static inline __attribute__((always_inline)) void values4_##SUFFIX(                           \
        const int C, const float *sc, const T *vb, int64_t vt, const int64_t *anc, int64_t anc_r, \
        const uint8_t *pad, int64_t n, float *acc) {                                              \
        __m512 a[FAST_G][4];                                                                      \
        for (int r = 0; r < FAST_G; r++)                                                          \
            for (int c = 0; c < C; c++) a[r][c] = _mm512_setzero_ps();                            \
        for (int64_t j = 0; j < n; j++) {                                                         \
            if (pad && pad[j]) continue;                                                          \
            for (int r = 0; r < FAST_G; r++) {                                                    \
                const float p = sc[r * n + j];                                                    \
                if (p == 0.0f) continue;                                                          \
                const int64_t t = key_row(anc, anc_r, FAST_G, n, j, r);                           \
                const T *vp = vb + t * vt;                                                        \
                const __m512 pp = _mm512_set1_ps(p);                                              \
                for (int c = 0; c < C; c++) a[r][c] = _mm512_fmadd_ps(pp, LOAD16(vp + 16 * c), a[r][c]); \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < FAST_G; r++)                                                          \
            for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + r * 16 * C + 16 * c, a[r][c]);     \
    }
DEFINE_FAST(f32, float, load16_f32)
DEFINE_FAST(bf16, uint16_t, load16_bf16)
/* C for the fast path, or 0 for the general loop */
static inline int fast_c(int64_t g, int64_t K, int64_t Dv) {
    return g == FAST_G && K == Dv && (K == 32 || K == 64) ? (int)(K / 16) : 0;
}
#define FAST_SCORES(SUFFIX, C, ...) ((C) == 2 ? scores4_##SUFFIX(2, __VA_ARGS__) : scores4_##SUFFIX(4, __VA_ARGS__))
#define FAST_VALUES(SUFFIX, C, ...) ((C) == 2 ? values4_##SUFFIX(2, __VA_ARGS__) : values4_##SUFFIX(4, __VA_ARGS__))
#elif defined(__AVX2__) && defined(__FMA__)
/* The same work item for beam 4 with d_k = d_v = 8 * C (C = 4 or 8: d_k 32 or 64), in AVX2's 16
 * registers of 8 floats, which do not hold the four rows' queries or accumulators (4 C registers each):
 * the scores position by position as in the general loop, the four rows' queries held in locals (the
 * compiler keeps what its registers hold and reads the rest from the stack: queries read from qf
 * instead were reloaded at every key, as the stores to sc may alias them); the weighted values 8 / C
 * rows at a time (1 at d_v 64, 2 at 32), their C accumulators in registers over all n positions
 * instead of loaded and stored at every key as axpy_* does. The same operations in the same order as
 * dot_* and axpy_*, so the same numbers, bit for bit. Scores go to sc (4, n) and the weighted values
 * to acc (4, Dv); the softmax between them is the caller's. */
#define FAST_G 4
#define DEFINE_FAST(SUFFIX, T, LOAD8)                                                             \
    static inline __attribute__((always_inline)) void scores4_##SUFFIX(                           \
        const int C, const float *qf, const T *kb, int64_t kt, const int64_t *anc, int64_t anc_r, \
        const uint8_t *pad, int64_t n, float *sc, const T *vb, int64_t rows,                      \
        int64_t kt_b, int64_t vt_b, int64_t k_b, int64_t v_b) {                                   \
        __m256 q[FAST_G][8];                                                                      \
        for (int r = 0; r < FAST_G; r++)                                                          \
            for (int c = 0; c < C; c++) q[r][c] = _mm256_loadu_ps(qf + r * 8 * C + 8 * c);        \
        for (int64_t j = 0; j < n; j++) {                                                         \
            if (j + PREFETCH_AHEAD < n)                                                           \
                prefetch_position((const char *)kb, (const char *)vb, rows, j + PREFETCH_AHEAD,   \
                                  kt_b, vt_b, k_b, v_b);                                          \
            if (pad && pad[j]) {                                                                  \
                for (int r = 0; r < FAST_G; r++) sc[r * n + j] = -INFINITY;                       \
                continue;                                                                         \
            }                                                                                     \
            for (int r = 0; r < FAST_G; r++) {                                                    \
                const int64_t t = key_row(anc, anc_r, FAST_G, n, j, r);                           \
                const T *kp = kb + t * kt;                                                        \
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                        \
                for (int c = 0; c < C; c += 2) {                                                  \
                    a0 = _mm256_fmadd_ps(q[r][c], LOAD8(kp + 8 * c), a0);                         \
                    a1 = _mm256_fmadd_ps(q[r][c + 1], LOAD8(kp + 8 * c + 8), a1);                 \
                }                                                                                 \
                sc[r * n + j] = sum8(_mm256_add_ps(a0, a1));                                     \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    static inline __attribute__((always_inline)) void values4_##SUFFIX(                           \
        const int C, const float *sc, const T *vb, int64_t vt, const int64_t *anc, int64_t anc_r, \
        const uint8_t *pad, int64_t n, float *acc) {                                              \
        const int R = 8 / C; /* rows per pass: their accumulators fill 8 registers */             \
        for (int r0 = 0; r0 < FAST_G; r0 += R) {                                                  \
            __m256 a[2][8];                                                                       \
            for (int r = 0; r < R; r++)                                                           \
                for (int c = 0; c < C; c++) a[r][c] = _mm256_setzero_ps();                        \
            for (int64_t j = 0; j < n; j++) {                                                     \
                if (pad && pad[j]) continue;                                                      \
                for (int r = 0; r < R; r++) {                                                     \
                    const float p = sc[(r0 + r) * n + j];                                         \
                    if (p == 0.0f) continue;                                                      \
                    const int64_t t = key_row(anc, anc_r, FAST_G, n, j, r0 + r);                  \
                    const T *vp = vb + t * vt;                                                    \
                    const __m256 pp = _mm256_set1_ps(p);                                          \
                    for (int c = 0; c < C; c++) a[r][c] = _mm256_fmadd_ps(pp, LOAD8(vp + 8 * c), a[r][c]); \
                }                                                                                 \
            }                                                                                     \
            for (int r = 0; r < R; r++)                                                           \
                for (int c = 0; c < C; c++) _mm256_storeu_ps(acc + (r0 + r) * 8 * C + 8 * c, a[r][c]); \
        }                                                                                         \
    }
DEFINE_FAST(f32, float, load8_f32)
DEFINE_FAST(bf16, uint16_t, load8_bf16)
static inline int fast_c(int64_t g, int64_t K, int64_t Dv) {
    return g == FAST_G && K == Dv && (K == 32 || K == 64) ? (int)(K / 8) : 0;
}
#define FAST_SCORES(SUFFIX, C, ...) ((C) == 4 ? scores4_##SUFFIX(4, __VA_ARGS__) : scores4_##SUFFIX(8, __VA_ARGS__))
#define FAST_VALUES(SUFFIX, C, ...) ((C) == 4 ? values4_##SUFFIX(4, __VA_ARGS__) : values4_##SUFFIX(8, __VA_ARGS__))
#else
static inline int fast_c(int64_t g, int64_t K, int64_t Dv) { (void)g; (void)K; (void)Dv; return 0; }
#define FAST_SCORES(SUFFIX, C, ...) ((void)0)
#define FAST_VALUES(SUFFIX, C, ...) ((void)0)
#endif

#if defined(__AVX512F__)
/* The lanes of a 16-wide block with `left` elements still to go: all 16, or the first `left`. */
static inline __mmask16 tail16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}
#endif

/* sr (n) <- softmax(sr), in place; -inf scores get weight 0, and a row of only -inf all zeros. */
static inline void softmax_row(float *sr, int64_t n) {
#if defined(__AVX512F__)
    /* 16 scores at a time, the tail masked: the scalar loop below spent ~20 cycles a score here */
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vm = ninf;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = tail16(n - j);
        vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(ninf, k, sr + j));
    }
    const float m = _mm512_reduce_max_ps(vm);
    float sum = 0.0f;
    if (m > -INFINITY) {
        const __m512 vmax = _mm512_set1_ps(m);
        __m512 vs = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail16(n - j);
            const __m512 x = _mm512_mask_loadu_ps(ninf, k, sr + j);
            const __mmask16 live = _mm512_mask_cmp_ps_mask(k, x, ninf, _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_sub_ps(x, vmax)));
            _mm512_mask_storeu_ps(sr + j, k, e);
            vs = _mm512_add_ps(vs, e);
        }
        sum = _mm512_reduce_add_ps(vs);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* 8 scores at a time, the last n % 8 by the scalar steps (exp_nonpositive8 gives exp_nonpositive's
     * bits): the compiled loop does not vectorize a sum over exp_nonpositive */
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const int64_t n8 = n & ~(int64_t)7;
    __m256 vm = ninf;
    for (int64_t j = 0; j < n8; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sr + j));
    float m = max8(vm);
    for (int64_t j = n8; j < n; j++) m = sr[j] > m ? sr[j] : m;
    float sum = 0.0f;
    if (m > -INFINITY) {
        const __m256 vmax = _mm256_set1_ps(m);
        __m256 vs = _mm256_setzero_ps();
        for (int64_t j = 0; j < n8; j += 8) {
            const __m256 x = _mm256_loadu_ps(sr + j);
            const __m256 live = _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ);
            const __m256 e = _mm256_and_ps(live, exp_nonpositive8(_mm256_sub_ps(x, vmax)));
            _mm256_storeu_ps(sr + j, e);
            vs = _mm256_add_ps(vs, e);
        }
        sum = sum8(vs);
        for (int64_t j = n8; j < n; j++) {
            const float e = sr[j] == -INFINITY ? 0.0f : exp_nonpositive(sr[j] - m);
            sr[j] = e;
            sum += e;
        }
    }
#else
    float m = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < n; j++) m = sr[j] > m ? sr[j] : m;
    if (m > -INFINITY) {
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t j = 0; j < n; j++) {
            const float e = sr[j] == -INFINITY ? 0.0f : exp_nonpositive(sr[j] - m);
            sr[j] = e;
            sum += e;
        }
    }
#endif
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t j = 0; j < n; j++) sr[j] *= inv;
}

/* Per (sentence, head): the g rows' queries, then position by position (so the slots of a position,
 * which lie together, are read together, and a slot shared by several rows' prefixes once) the rows'
 * scores, the softmax of each row, and position by position again the weighted values.
 * Scratch: qf (g, K), sc (g, n), acc (g, Dv) floats. */
#define DEFINE_RUN(NAME, SUFFIX, T, LOAD, STORE, DOT, AXPY)                                       \
    static void NAME(job_t *jb, float *qf, float *sc, float *acc) {                               \
        const T *q = (const T *)jb->q, *k = (const T *)jb->k, *v = (const T *)jb->v;              \
        T *out = (T *)jb->out;                                                                    \
        const int64_t H = jb->H, g = jb->g, n = jb->n, K = jb->K, Dv = jb->Dv;                    \
        const int fc = fast_c(g, K, Dv); /* the register-blocked path, or 0 */                    \
        for (int64_t w = jb->begin; w < jb->end; w++) {                                           \
            const int64_t s = w / H, h = w % H;                                                   \
            const T *kb = k + s * jb->ks + h * jb->kh, *vb = v + s * jb->vs + h * jb->vh;         \
            const int64_t *anc = jb->anc ? jb->anc + s * jb->anc_s : NULL; /* row r: + r*anc_r */ \
            const uint8_t *pad = jb->pad ? jb->pad + s * jb->pad_s : NULL;                        \
            if (jb->nk) /* the append: row r's new key and value into its own slot at position n-1 */ \
                for (int64_t r = 0; r < g; r++) {                                                 \
                    const T *nkp = (const T *)jb->nk + (s * g + r) * jb->nks + h * jb->nkh;       \
                    const T *nvp = (const T *)jb->nv + (s * g + r) * jb->nvs + h * jb->nvh;       \
                    memcpy((T *)kb + ((n - 1) * g + r) * jb->kt, nkp, (size_t)K * sizeof(T));     \
                    memcpy((T *)vb + ((n - 1) * g + r) * jb->vt, nvp, (size_t)Dv * sizeof(T));    \
                }                                                                                 \
            for (int64_t r = 0; r < g; r++) {                                                     \
                const T *qp = q + s * jb->qs + h * jb->qh + r * jb->qr;                           \
                for (int64_t i = 0; i < K; i++) qf[r * K + i] = LOAD(qp[i]) * jb->scale;          \
            }                                                                                     \
            const int64_t rows = anc ? g : 1; /* key rows at one position */                      \
            const int64_t kt_b = jb->kt * (int64_t)sizeof(T), vt_b = jb->vt * (int64_t)sizeof(T); \
            const int64_t k_b = K * (int64_t)sizeof(T), v_b = Dv * (int64_t)sizeof(T);            \
            for (int64_t x = (w == jb->begin ? w : w + 1); x <= w + 1 && x < jb->end; x++) {      \
                /* the first positions of this item (the first one only) and of the next */       \
                const int64_t sx = x / H, hx = x % H;                                             \
                const char *kx = (const char *)(k + sx * jb->ks + hx * jb->kh);                   \
                const char *vx = (const char *)(v + sx * jb->vs + hx * jb->vh);                   \
                for (int64_t j = 0; j < n && j < PREFETCH_AHEAD; j++)                             \
                    prefetch_position(kx, vx, rows, j, kt_b, vt_b, k_b, v_b);                     \
            }                                                                                     \
            if (fc) {                                                                             \
                FAST_SCORES(SUFFIX, fc, qf, kb, jb->kt, anc, jb->anc_r, pad, n, sc, vb, rows, kt_b,    \
                            vt_b, k_b, v_b);                                                      \
            } else {                                                                              \
                for (int64_t j = 0; j < n; j++) {                                                 \
                    if (j + PREFETCH_AHEAD < n)                                                   \
                        prefetch_position((const char *)kb, (const char *)vb, rows, j + PREFETCH_AHEAD, \
                                          kt_b, vt_b, k_b, v_b);                                  \
                    const int skip = pad && pad[j];                                               \
                    for (int64_t r = 0; r < g; r++) {                                             \
                        if (skip) { sc[r * n + j] = -INFINITY; continue; }                        \
                        const int64_t t = key_row(anc, jb->anc_r, g, n, j, r);                    \
                        sc[r * n + j] = DOT(qf + r * K, kb + t * jb->kt, K);                      \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t r = 0; r < g; r++) {                                                     \
                softmax_row(sc + r * n, n);                                                       \
                for (int64_t d = 0; d < Dv; d++) acc[r * Dv + d] = 0.0f;                          \
            }                                                                                     \
            if (fc) {                                                                             \
                FAST_VALUES(SUFFIX, fc, sc, vb, jb->vt, anc, jb->anc_r, pad, n, acc);             \
            } else {                                                                              \
                for (int64_t j = 0; j < n; j++) {                                                 \
                    if (pad && pad[j]) continue;                                                  \
                    for (int64_t r = 0; r < g; r++) {                                             \
                        const float p = sc[r * n + j];                                            \
                        if (p == 0.0f) continue;                                                  \
                        const int64_t t = key_row(anc, jb->anc_r, g, n, j, r);                    \
                        AXPY(p, vb + t * jb->vt, acc + r * Dv, Dv);                               \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t r = 0; r < g; r++) {                                                     \
                T *op = out + ((s * g + r) * H + h) * Dv;                                         \
                for (int64_t d = 0; d < Dv; d++) op[d] = STORE(acc[r * Dv + d]);                  \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_RUN(run_f32, f32, float, f32_of_f32, f32_to_f32, dot_f32, axpy_f32)
DEFINE_RUN(run_bf16, bf16, uint16_t, f32_of_bf16, f32_to_bf16, dot_bf16, axpy_bf16)

typedef struct {
    job_t job;
    int bf16;
} task_t;

static void *work(void *arg) {
    task_t *t = (task_t *)arg;
    job_t *jb = &t->job;
    const int64_t g = jb->g;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(g * (jb->K + jb->n + jb->Dv)));
    if (!scratch) { jb->status = 1; return NULL; }
    float *qf = scratch, *sc = qf + g * jb->K, *acc = sc + g * jb->n;
    if (t->bf16) run_bf16(jb, qf, sc, acc);
    else run_f32(jb, qf, sc, acc);
    free(scratch);
    jb->status = 0;
    return NULL;
}

/* dims: Bs, H, g, n, K, Dv. strides: qs, qh, qr, ks, kh, kt, vs, vh, vt, anc_s, anc_r, pad_s, nks, nkh,
 * nvs, nvh. With shared slots, nk and nv (or NULL) are the step's new keys and values, row s*g + r's of
 * head h at nk + (s*g + r)*nks + h*nkh (nv likewise): each work item first writes its rows' into their
 * own slots at position n - 1 of k and v (DecoderCache.append's copy, done where they are read next).
 * Returns 0, or 1 if scratch memory could not be had. */
int aiayn_beam_attention_append(const void *q, void *k, void *v, void *out, const int64_t *anc,
                                const uint8_t *pad, const void *nk, const void *nv, const int64_t *dims,
                                const int64_t *strides, float scale, int bf16, int nthreads) {
    job_t base = {q, k, v, out, anc, pad, anc ? nk : NULL, anc ? nv : NULL,
                  dims[0], dims[1], dims[2], dims[3], dims[4], dims[5],
                  strides[0], strides[1], strides[2], strides[3], strides[4], strides[5],
                  strides[6], strides[7], strides[8], strides[9], strides[10], strides[11],
                  strides[12], strides[13], strides[14], strides[15], scale, 0, 0, 0};
    const int64_t items = base.Bs * base.H;
    nthreads = split_threads(nthreads, items);
    task_t tasks[MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        tasks[i].job = base;
        tasks[i].job.begin = items * i / nthreads;
        tasks[i].job.end = items * (i + 1) / nthreads;
        tasks[i].bf16 = bf16;
    }
    run_split(work, tasks, sizeof tasks[0], nthreads);
    int status = 0;
    for (int i = 0; i < nthreads; i++) status |= tasks[i].job.status;
    return status;
}

/* The same without an append: strides as above, the first 12. */
int aiayn_beam_attention(const void *q, const void *k, const void *v, void *out, const int64_t *anc,
                         const uint8_t *pad, const int64_t *dims, const int64_t *strides, float scale,
                         int bf16, int nthreads) {
    int64_t all[16] = {0};
    memcpy(all, strides, 12 * sizeof(int64_t));
    return aiayn_beam_attention_append(q, (void *)k, (void *)v, out, anc, pad, NULL, NULL, dims, all, scale,
                                       bf16, nthreads);
}
