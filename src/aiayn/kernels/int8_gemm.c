/* The int8 product of Int8Linear (aiayn/decode/int8.py) for CPUs without VNNI, where oneDNN's int8 GEMM
 * (torch._int_mm) is either a slow reference loop or, held to AVX2, wrong (its u8 x s8 vpmaddubsw
 * saturates its int16 pair sums):
 *
 *   acc (N, O) int32 = x_q (N, I) int8 . W_q (O, I)^T      exactly,
 *
 * and, in the same pass, the rescaling y = ((float)acc * s_W[o]) * s_x[n] (+ b[o]) in float32 or
 * bfloat16: the operations of aiayn_rescale in int8_rows.c, in its order and without FMA contraction
 * (the library is built with -ffp-contract=off), so the results are bit-identical (tested).
 *
 * Exact: every int8 is widened to int16 and pairs are multiplied and summed into int32 lanes
 * (vpmaddwd): a pair sum is at most 2 * 127^2 in magnitude (quantize_rows never gives -128, and
 * vpmaddwd's int32 results cannot saturate anyway), and int32 holds I * 127^2 for I < 133,000.
 *
 * W_q is packed once (aiayn_int8_pack, at Int8Linear's construction) into blocks of OB = 16 outputs:
 * W_q[16 b + j, 2 p + t] is int16 number ((b * P + p) * 16 + j) * 2 + t, P = ceil(I / 2) pairs, with
 * zeros for the outputs past O and the column past an odd I. One step of the inner loop is then: the
 * pair (x[n, 2p], x[n, 2p+1]) broadcast, 16 outputs' pairs loaded (two AVX2 registers), multiplied and
 * added, for MR = 6 rows at once (AVX2: 12 accumulator registers of 8 int32). Plain loops otherwise.
 * The blocks of outputs are split among nthreads threads; x is widened to int16 once, by the caller.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "split.h"

#define OB 16 /* outputs per packed block */
#define MR 6  /* rows per register tile */
#define X_CHUNK_BYTES (192 * 1024) /* rows of widened x whose blocks are all done before the next rows (L2) */

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_I32 = 2 }; /* 0 and 1 as loader.py's _DTYPES */

/* Whether this build has the AVX2 tile loop (1) or only the plain loops (0), which are slower than
 * float32's products: decode/int8.py refuses precision int8 there. */
int aiayn_int8_gemm_vector(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* The packed size in int16 values (see above). */
int64_t aiayn_int8_packed_size(int64_t O, int64_t I) { return (O + OB - 1) / OB * ((I + 1) / 2) * OB * 2; }

/* w (O, I) int8, contiguous -> packed (aiayn_int8_packed_size(O, I) int16 values). */
void aiayn_int8_pack(const int8_t *w, int64_t O, int64_t I, int16_t *packed) {
    const int64_t P = (I + 1) / 2, nb = (O + OB - 1) / OB;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t p = 0; p < P; p++)
            for (int64_t j = 0; j < OB; j++)
                for (int64_t t = 0; t < 2; t++) {
                    const int64_t o = b * OB + j, i = 2 * p + t;
                    packed[((b * P + p) * OB + j) * 2 + t] = (int16_t)(o < O && i < I ? w[o * I + i] : 0);
                }
}

/* tile[r * OB + j] = sum_p x[r, 2p] w[p, j, 0] + x[r, 2p + 1] w[p, j, 1] for r < R rows of x (R <= MR),
 * x's rows xs int16 apart, w one packed block. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline __attribute__((always_inline)) void tile_dot(const int16_t *x, int64_t xs, const int16_t *w,
                                                           int64_t P, const int R, int32_t *tile) {
    __m256i acc[MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t p = 0; p < P; p++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + p * 2 * OB));      /* outputs 0..7 */
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + p * 2 * OB + OB)); /* outputs 8..15 */
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * p, sizeof pair);
            const __m256i xp = _mm256_set1_epi32(pair);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(xp, w0));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(xp, w1));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i *)(tile + r * OB), acc[r][0]);
        _mm256_storeu_si256((__m256i *)(tile + r * OB + 8), acc[r][1]);
    }
}
#else
static inline void tile_dot(const int16_t *x, int64_t xs, const int16_t *w, int64_t P, const int R, int32_t *tile) {
    for (int r = 0; r < R; r++) {
        int32_t acc[OB] = {0};
        const int16_t *xr = x + r * xs;
        for (int64_t p = 0; p < P; p++) {
            const int32_t a0 = xr[2 * p], a1 = xr[2 * p + 1];
            const int16_t *wp = w + p * 2 * OB;
            _Pragma("omp simd")
            for (int j = 0; j < OB; j++) acc[j] += a0 * wp[2 * j] + a1 * wp[2 * j + 1];
        }
        memcpy(tile + r * OB, acc, sizeof acc);
    }
}
#endif

/* One tile of R rows, with R a constant in each case (the AVX2 accumulators stay in registers). */
static void tile_rows(const int16_t *x, int64_t xs, const int16_t *w, int64_t P, int R, int32_t *tile) {
    switch (R) {
    case 1: tile_dot(x, xs, w, P, 1, tile); break;
    case 2: tile_dot(x, xs, w, P, 2, tile); break;
    case 3: tile_dot(x, xs, w, P, 3, tile); break;
    case 4: tile_dot(x, xs, w, P, 4, tile); break;
    case 5: tile_dot(x, xs, w, P, 5, tile); break;
    default: tile_dot(x, xs, w, P, MR, tile); break;
    }
}

typedef struct {
    const int16_t *x; /* (N, 2P) x_q widened to int16, the column past an odd I zero */
    const int16_t *w; /* packed W_q */
    int64_t N, P, O;
    const float *s_x, *s_w, *bias; /* (N,), (O,), (O,) or NULL; unused for OUT_I32 */
    int out;
    void *y;        /* (N, O) */
    int64_t b0, b1; /* this thread's blocks of outputs [b0, b1) */
} gemm_t;

/* Rows n0..n0+R-1, outputs 16 b.. of the tile into y: the int32 sums, or rescaled as aiayn_rescale does. */
static void store_tile(const gemm_t *g, int64_t n0, int R, int64_t b, const int32_t *tile) {
    const int64_t o0 = b * OB, m = g->O - o0 < OB ? g->O - o0 : OB, O = g->O;
    for (int r = 0; r < R; r++) {
        const int32_t *a = tile + r * OB;
        const int64_t n = n0 + r;
        if (g->out == OUT_I32) {
            memcpy((int32_t *)g->y + n * O + o0, a, m * sizeof(int32_t));
            continue;
        }
        const float sx = g->s_x[n], *sw = g->s_w + o0;
        float v[OB];
        if (g->bias) {
            const float *bo = g->bias + o0;
            _Pragma("omp simd")
            for (int64_t j = 0; j < m; j++) v[j] = (float)a[j] * sw[j] * sx + bo[j];
        } else {
            _Pragma("omp simd")
            for (int64_t j = 0; j < m; j++) v[j] = (float)a[j] * sw[j] * sx;
        }
        if (g->out == OUT_F32) {
            memcpy((float *)g->y + n * O + o0, v, m * sizeof(float));
        } else {
            uint16_t *yn = (uint16_t *)g->y + n * O + o0;
            _Pragma("omp simd")
            for (int64_t j = 0; j < m; j++) yn[j] = f32_to_bf16(v[j]);
        }
    }
}

static void *gemm_work(void *arg) {
    const gemm_t *g = (const gemm_t *)arg;
    const int64_t xs = 2 * g->P;
    int64_t rows = X_CHUNK_BYTES / (xs * (int64_t)sizeof(int16_t)) / MR * MR;
    if (rows < MR) rows = MR;
    int32_t tile[MR * OB];
    for (int64_t c0 = 0; c0 < g->N; c0 += rows) { /* a chunk of x's rows stays in cache over the blocks */
        const int64_t c1 = c0 + rows < g->N ? c0 + rows : g->N;
        for (int64_t b = g->b0; b < g->b1; b++) {
            const int16_t *wb = g->w + b * g->P * 2 * OB;
            for (int64_t n0 = c0; n0 < c1; n0 += MR) {
                const int R = c1 - n0 < MR ? (int)(c1 - n0) : MR;
                tile_rows(g->x + n0 * xs, xs, wb, g->P, R, tile);
                store_tile(g, n0, R, b, tile);
            }
        }
    }
    return NULL;
}

/* y (N, O) = x (N, I) int8 . W^T with W packed by aiayn_int8_pack(W, O, I): int32 sums (out = OUT_I32;
 * s_x, s_w, bias unused) or rescaled (OUT_F32, OUT_BF16; bias may be NULL). Returns 0, or 1 if scratch
 * memory could not be had. */
int aiayn_int8_gemm(const int8_t *x, int64_t N, int64_t I, const int16_t *packed, int64_t O, const float *s_x,
                    const float *s_w, const float *bias, int out, void *y, int nthreads) {
    if (N <= 0 || O <= 0) return 0;
    const int64_t P = (I + 1) / 2, nb = (O + OB - 1) / OB;
    int16_t *x16 = (int16_t *)malloc((size_t)(N * 2 * P + 1) * sizeof(int16_t));
    if (!x16) return 1;
    for (int64_t n = 0; n < N; n++) {
        int16_t *xn = x16 + n * 2 * P;
        const int8_t *src = x + n * I;
        _Pragma("omp simd")
        for (int64_t i = 0; i < I; i++) xn[i] = src[i];
        if (I & 1) xn[I] = 0;
    }
    gemm_t base = {x16, packed, N, P, O, s_x, s_w, bias, out, y, 0, 0};
    nthreads = split_threads(nthreads, nb);
    gemm_t tasks[MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        tasks[i] = base;
        tasks[i].b0 = nb * i / nthreads;
        tasks[i].b1 = nb * (i + 1) / nthreads;
    }
    run_split(gemm_work, tasks, sizeof tasks[0], nthreads);
    free(x16);
    return 0;
}
