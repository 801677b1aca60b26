/* Eq. 1, softmax(Q K^T / sqrt(d_k)) V, over whole sequences, forward and backward, on the CPU: the
 * attention of training (encoder self-attention, masked decoder self-attention, encoder-decoder attention).
 *
 * Compiled and loaded with the decoding kernels by aiayn/kernels/loader.py, which says why it exists and how
 * it is tested; used by aiayn/execution/attention.py (_KernelAttention). Each (batch row, head) is a product of
 * a few dozen queries with a few dozen keys of d_k = 32 or 64 values: PyTorch's fused attention spent 1.2-1.3 ms
 * forward and 1.7 ms backward on each of ``aiayn demo``'s calls (2,048 tokens, 4 heads), where the arithmetic
 * is 26 MFLOP. Here each (b, h) is read once into float32 scratch (the keys, and backward the values, also
 * transposed, so that the loops over key positions are 16 wide) and computed there: with AVX-512 and
 * d_k = d_v = 32 or 64, four queries at a time (fast_forward, fast_backward; 0.6 ms and 1.0-1.2 ms); elsewhere
 * one query at a time in plain loops (item_forward, item_backward), which are slower than PyTorch's: the model
 * takes the kernel only where aiayn_seq_attention_fast says the fast path is.
 *
 * Shapes (elements; the last dimension of every tensor is contiguous):
 *   B batch rows, H heads, T query positions, S key positions, K d_k, Dv d_v;
 *   q (b, h, i): q + b*qb + h*K + i*qt, K values (the (B, T, H*K) layout of a projection's output, or a
 *     slice of a fused one: qt is its row length); k (b, h, j) and v (b, h, j) likewise with kb, kt, vb, vt;
 *   out (b, i, h): out + (b*T + i)*H*Dv + h*Dv, Dv values: (B, T, H*Dv), the heads concatenated for W^O;
 *   lse (b, h, i): lse + (b*H + h)*T + i, float32, log sum_j exp(s_ij), kept for the backward;
 *   mask (b, j): key j of row b may be attended to iff mask[b*ms + j] != 0 (NULL: all may);
 *   causal: query i sees keys j <= i + S - T (bottom-right aligned, as aiayn/model/attention.py).
 * Backward: from dout (B, T, H*Dv) contiguous, dq (B, T, H*K), dk (B, S, H*K), dv (B, S, H*Dv), contiguous.
 * s_ij = (q_i * scale) . k_j, p_ij = exp(s_ij - lse_i); with dp_ij = dout_i . v_j and D_i = sum_j p_ij dp_ij
 * (= dout_i . out_i), ds_ij = p_ij (dp_ij - D_i): dq_i = scale sum_j ds_ij k_j, dk_j = sum_i ds_ij (q_i *
 * scale), dv_j = sum_i p_ij dout_i. The backward recomputes p from lse, as flash attention does, and needs
 * neither out nor the (T, S) weights.
 * Arithmetic in float32 (bfloat16 inputs widened, outputs rounded to nearest even); exp is vexp.h's. A
 * query row with no key to see (all masked) gets a zero output and zero gradients, where PyTorch's would be
 * NaN. Work items (b, h) are split among nthreads threads. Returns 0, or 1 if scratch memory could not be had.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "split.h"
#include "vexp.h"

#define FAST_R 4 /* queries per block on the AVX-512 path */

typedef struct {
    const void *q, *k, *v, *dout;
    void *out, *dq, *dk, *dv;
    float *lse_out;
    const float *lse_in;
    const uint8_t *mask;
    int64_t B, H, T, S, K, Dv, qb, qt, kb, kt, vb, vt, ms;
    int causal, bf16, backward;
    float scale;
    int64_t begin, end; /* work items b*H + h in [begin, end) */
    int status;
} sa_t;

static inline float load_at(const void *p, int64_t i, int bf16) {
    return bf16 ? f32_of_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_row(void *p, int64_t i, const float *x, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *o = (uint16_t *)p + i;
        for (int64_t e = 0; e < n; e++) o[e] = f32_to_bf16(x[e]);
    } else {
        memcpy((float *)p + i, x, sizeof(float) * (size_t)n);
    }
}

/* The keys j of query i: [0, lim) minus masked ones. */
static inline int64_t key_limit(const sa_t *w, int64_t i) {
    if (!w->causal) return w->S;
    const int64_t lim = i + w->S - w->T + 1;
    return lim < 0 ? 0 : (lim > w->S ? w->S : lim);
}

/* out[j] = a . b_j for j < lim, from bt (n, Sp): the rows b_j transposed. */
static inline void row_product(const float *a, const float *bt, int64_t n, int64_t Sp, int64_t lim, float *out) {
    for (int64_t j = 0; j < lim; j++) out[j] = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        const float ad = a[d];
        const float *bd = bt + d * Sp;
#pragma omp simd
        for (int64_t j = 0; j < lim; j++) out[j] = fmaf(ad, bd[j], out[j]);
    }
}

/* s[j] = (q * scale) . k_j for j < lim, from kt (K, Sp) transposed keys; masked keys -inf. Returns max. */
static inline float scores(const float *qs, const float *kt, int64_t K, int64_t Sp, int64_t lim, const uint8_t *mask,
                           float *s) {
    row_product(qs, kt, K, Sp, lim, s);
    if (mask)
        for (int64_t j = 0; j < lim; j++)
            if (!mask[j]) s[j] = -INFINITY;
    float m = -INFINITY;
    for (int64_t j = 0; j < lim; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* p[j] = exp(s[j] - c), exactly 0 for masked keys (exp_nonpositive stops at exp(-87)). */
static inline void weights(const float *s, float c, int64_t lim, const uint8_t *mask, float *p) {
#pragma omp simd
    for (int64_t j = 0; j < lim; j++) p[j] = exp_nonpositive(s[j] - c);
    if (mask)
        for (int64_t j = 0; j < lim; j++)
            if (!mask[j]) p[j] = 0.0f;
}

static void item_forward(const sa_t *w, int64_t b, int64_t h, float *buf) {
    const int64_t T = w->T, S = w->S, K = w->K, Dv = w->Dv, Sp = (S + 15) & ~(int64_t)15;
    float *kt = buf, *vv = kt + K * Sp, *qs = vv + S * Dv, *s = qs + K, *p = s + Sp, *o = p + Sp;
    const int64_t q0 = b * w->qb + h * K, k0 = b * w->kb + h * K, v0 = b * w->vb + h * Dv;
    for (int64_t j = 0; j < S; j++) {
        for (int64_t d = 0; d < K; d++) kt[d * Sp + j] = load_at(w->k, k0 + j * w->kt + d, w->bf16);
        for (int64_t e = 0; e < Dv; e++) vv[j * Dv + e] = load_at(w->v, v0 + j * w->vt + e, w->bf16);
    }
    const uint8_t *mask = w->mask ? w->mask + b * w->ms : NULL;
    for (int64_t i = 0; i < T; i++) {
        const int64_t lim = key_limit(w, i);
        for (int64_t d = 0; d < K; d++) qs[d] = load_at(w->q, q0 + i * w->qt + d, w->bf16) * w->scale;
        for (int64_t e = 0; e < Dv; e++) o[e] = 0.0f;
        const float m = scores(qs, kt, K, Sp, lim, mask, s);
        float lse = -INFINITY;
        if (m > -INFINITY) {
            weights(s, m, lim, mask, p);
            float l = 0.0f;
            for (int64_t j = 0; j < lim; j++) l += p[j];
            const float inv = 1.0f / l;
            for (int64_t j = 0; j < lim; j++) {
                const float pj = p[j] * inv;
                const float *vj = vv + j * Dv;
#pragma omp simd
                for (int64_t e = 0; e < Dv; e++) o[e] = fmaf(pj, vj[e], o[e]);
            }
            lse = m + logf(l);
        }
        store_row(w->out, (b * T + i) * w->H * Dv + h * Dv, o, Dv, w->bf16);
        w->lse_out[(b * w->H + h) * T + i] = lse;
    }
}

static void item_backward(const sa_t *w, int64_t b, int64_t h, float *buf) {
    const int64_t T = w->T, S = w->S, K = w->K, Dv = w->Dv, H = w->H, Sp = (S + 15) & ~(int64_t)15;
    float *kt = buf, *vt = kt + K * Sp, *kk = vt + Dv * Sp, *dk = kk + S * K, *dv = dk + S * K, *qs = dv + S * Dv,
          *g = qs + K, *dq = g + Dv, *s = dq + K, *p = s + Sp, *dp = p + Sp;
    const int64_t q0 = b * w->qb + h * K, k0 = b * w->kb + h * K, v0 = b * w->vb + h * Dv;
    for (int64_t j = 0; j < S; j++) {
        for (int64_t d = 0; d < K; d++) {
            const float x = load_at(w->k, k0 + j * w->kt + d, w->bf16);
            kt[d * Sp + j] = x;
            kk[j * K + d] = x;
        }
        for (int64_t e = 0; e < Dv; e++) vt[e * Sp + j] = load_at(w->v, v0 + j * w->vt + e, w->bf16);
    }
    memset(dk, 0, sizeof(float) * (size_t)(S * K));
    memset(dv, 0, sizeof(float) * (size_t)(S * Dv));
    const uint8_t *mask = w->mask ? w->mask + b * w->ms : NULL;
    for (int64_t i = 0; i < T; i++) {
        const int64_t lim = key_limit(w, i);
        const float lse = w->lse_in[(b * H + h) * T + i];
        for (int64_t d = 0; d < K; d++) dq[d] = 0.0f;
        if (lse > -INFINITY) {
            for (int64_t d = 0; d < K; d++) qs[d] = load_at(w->q, q0 + i * w->qt + d, w->bf16) * w->scale;
            for (int64_t e = 0; e < Dv; e++) g[e] = load_at(w->dout, (b * T + i) * H * Dv + h * Dv + e, w->bf16);
            scores(qs, kt, K, Sp, lim, mask, s);
            weights(s, lse, lim, mask, p);
            row_product(g, vt, Dv, Sp, lim, dp); /* dp_j = dout_i . v_j */
            float D = 0.0f;
            for (int64_t j = 0; j < lim; j++) D = fmaf(p[j], dp[j], D);
            for (int64_t j = 0; j < lim; j++) {
                const float pj = p[j], ds = pj * (dp[j] - D);
                const float *kj = kk + j * K;
                float *dkj = dk + j * K, *dvj = dv + j * Dv;
#pragma omp simd
                for (int64_t d = 0; d < K; d++) {
                    dq[d] = fmaf(ds, kj[d], dq[d]);
                    dkj[d] = fmaf(ds, qs[d], dkj[d]);
                }
#pragma omp simd
                for (int64_t e = 0; e < Dv; e++) dvj[e] = fmaf(pj, g[e], dvj[e]);
            }
            for (int64_t d = 0; d < K; d++) dq[d] *= w->scale;
        }
        store_row(w->dq, (b * T + i) * H * K + h * K, dq, K, w->bf16);
    }
    for (int64_t j = 0; j < S; j++) {
        store_row(w->dk, (b * S + j) * H * K + h * K, dk + j * K, K, w->bf16);
        store_row(w->dv, (b * S + j) * H * Dv + h * Dv, dv + j * Dv, Dv, w->bf16);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* The same work item for d_k = d_v = 16 * C (C = 2 or 4: d_k 32 or 64, every preset's), four queries at a
 * time: their scores against 16 keys are four 16-wide accumulators over d (the keys transposed and padded
 * with zeros to Sp, a multiple of 16, so every chunk is whole), the softmax runs 16 scores at a time, and
 * the products with the values (and, backward, the updates of dq, dk and dv) take each key's row once for
 * the four queries. bias[j] is 0 for a key that may be attended to and -inf for a masked or padding one.
 * The arithmetic is the plain loops' up to the order of the sums. */
static inline __m512 load16_any(const void *p, int64_t i, int bf16) {
    return bf16 ? load16_bf16((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}

/* One (b, h)'s keys and values, widened to float32: kt (16C, Sp) and vt transposed (the 16 values of a
 * key row scattered down a column), kk and vv row by row, and the keys' bias. NULL for those not wanted. */
static inline __attribute__((always_inline)) void gather_keys(const int C, const sa_t *w, int64_t b, int64_t h,
                                                              int64_t Sp, float *kt, float *kk, float *vt,
                                                              float *vv, float *bias) {
    const int64_t S = w->S, K = 16 * C, k0 = b * w->kb + h * K, v0 = b * w->vb + h * K;
    const __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)Sp));
    for (int64_t j = 0; j < S; j++) {
        for (int c = 0; c < C; c++) {
            const __m512 x = load16_any(w->k, k0 + j * w->kt + 16 * c, w->bf16);
            _mm512_i32scatter_ps(kt + 16 * c * Sp + j, down, x, 4);
            if (kk) _mm512_storeu_ps(kk + j * K + 16 * c, x);
            const __m512 y = load16_any(w->v, v0 + j * w->vt + 16 * c, w->bf16);
            if (vt) _mm512_i32scatter_ps(vt + 16 * c * Sp + j, down, y, 4);
            if (vv) _mm512_storeu_ps(vv + j * K + 16 * c, y);
        }
        bias[j] = !w->mask || w->mask[b * w->ms + j] ? 0.0f : -INFINITY;
    }
    for (int64_t j = S; j < Sp; j++) {
        for (int64_t d = 0; d < K; d++) {
            kt[d * Sp + j] = 0.0f;
            if (vt) vt[d * Sp + j] = 0.0f;
        }
        bias[j] = -INFINITY;
    }
}

/* out (4, Sp) = a (4, 16C) x bt (16C, Sp) [+ bias (Sp)] */
static inline __attribute__((always_inline)) void product4(const int C, const float *a, const float *bt, int64_t Sp,
                                                           const float *bias, float *out) {
    for (int64_t j = 0; j < Sp; j += 16) {
        __m512 acc[FAST_R];
        for (int r = 0; r < FAST_R; r++) acc[r] = _mm512_setzero_ps();
        for (int d = 0; d < 16 * C; d++) {
            const __m512 x = _mm512_loadu_ps(bt + d * Sp + j);
            for (int r = 0; r < FAST_R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * 16 * C + d]), x, acc[r]);
        }
        const __m512 bj = bias ? _mm512_loadu_ps(bias + j) : _mm512_setzero_ps();
        for (int r = 0; r < FAST_R; r++) _mm512_storeu_ps(out + r * Sp + j, _mm512_add_ps(acc[r], bj));
    }
}

/* rows r < R of x (4, 16C) <- 16C values of row r of src from base (times scale), zeros below */
static inline __attribute__((always_inline)) void load_rows(const int C, const void *src, int64_t base,
                                                            int64_t stride, int64_t R, float scale, int bf16,
                                                            float *x) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < FAST_R; r++)
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(x + (r * C + c) * 16, r < R ? _mm512_mul_ps(load16_any(src, base + r * stride + 16 * c, bf16), sc)
                                                         : _mm512_setzero_ps());
}

static inline void store16(void *p, int64_t i, __m512 x, int bf16) {
    if (bf16) store16_bf16((uint16_t *)p + i, x);
    else _mm512_storeu_ps((float *)p + i, x);
}

/* s[j] <- exp(s[j] - c) for the keys j < lim whose score is not -inf (masked), 0 for the others; returns
 * the row's sum. */
static inline float exp_row(float *s, int64_t Sp, int64_t lim, float c) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512i jj = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i vl = _mm512_set1_epi32((int)lim);
    const __m512 vc = _mm512_set1_ps(c), ninf = _mm512_set1_ps(-INFINITY);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < Sp; j += 16, jj = _mm512_add_epi32(jj, step)) {
        const __m512 x = _mm512_loadu_ps(s + j);
        const __mmask16 keep = _mm512_cmplt_epi32_mask(jj, vl) & _mm512_cmp_ps_mask(x, ninf, _CMP_GT_OQ);
        const __m512 p = _mm512_maskz_mov_ps(keep, exp_nonpositive16(_mm512_sub_ps(x, vc)));
        _mm512_storeu_ps(s + j, p);
        sum = _mm512_add_ps(sum, p);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The row maximum of s over keys j < lim (-inf if none). */
static inline float max_row(const float *s, int64_t Sp, int64_t lim) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512i jj = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i vl = _mm512_set1_epi32((int)lim);
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Sp; j += 16, jj = _mm512_add_epi32(jj, step))
        m = _mm512_mask_max_ps(m, _mm512_cmplt_epi32_mask(jj, vl), m, _mm512_loadu_ps(s + j));
    return _mm512_reduce_max_ps(m);
}

static inline __attribute__((always_inline)) void fast_forward(const int C, const sa_t *w, int64_t b, int64_t h,
                                                               float *buf) {
    const int64_t T = w->T, S = w->S, K = 16 * C, H = w->H, Sp = (S + 15) & ~(int64_t)15;
    float *kt = buf, *vv = kt + K * Sp, *qs = vv + S * K, *s = qs + FAST_R * K, *bias = s + FAST_R * Sp;
    gather_keys(C, w, b, h, Sp, kt, NULL, NULL, vv, bias);
    const int64_t q0 = b * w->qb + h * K;
    for (int64_t i0 = 0; i0 < T; i0 += FAST_R) {
        const int64_t R = T - i0 < FAST_R ? T - i0 : FAST_R;
        load_rows(C, w->q, q0 + i0 * w->qt, w->qt, R, w->scale, w->bf16, qs);
        product4(C, qs, kt, Sp, bias, s);
        int64_t top = 0;
        for (int64_t r = 0; r < FAST_R; r++) {
            float *sr = s + r * Sp;
            const int64_t lim = r < R ? key_limit(w, i0 + r) : 0;
            const float m = max_row(sr, Sp, lim);
            const float l = exp_row(sr, Sp, lim, m); /* all zero if m is -inf */
            if (r < R) w->lse_out[(b * H + h) * T + i0 + r] = m > -INFINITY ? m + logf(l) : -INFINITY;
            if (m > -INFINITY) {
                const __m512 inv = _mm512_set1_ps(1.0f / l);
                for (int64_t j = 0; j < Sp; j += 16) _mm512_storeu_ps(sr + j, _mm512_mul_ps(_mm512_loadu_ps(sr + j), inv));
                top = lim > top ? lim : top;
            }
        }
        __m512 o[FAST_R][4];
        for (int r = 0; r < FAST_R; r++)
            for (int c = 0; c < C; c++) o[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < top; j++) {
            __m512 vj[4];
            for (int c = 0; c < C; c++) vj[c] = _mm512_loadu_ps(vv + j * K + 16 * c);
            for (int r = 0; r < FAST_R; r++) {
                const __m512 p = _mm512_set1_ps(s[r * Sp + j]);
                for (int c = 0; c < C; c++) o[r][c] = _mm512_fmadd_ps(p, vj[c], o[r][c]);
            }
        }
        for (int64_t r = 0; r < R; r++)
            for (int c = 0; c < C; c++) store16(w->out, (b * T + i0 + r) * H * K + h * K + 16 * c, o[r][c], w->bf16);
    }
}

static inline __attribute__((always_inline)) void fast_backward(const int C, const sa_t *w, int64_t b, int64_t h,
                                                                float *buf) {
    const int64_t T = w->T, S = w->S, K = 16 * C, H = w->H, Sp = (S + 15) & ~(int64_t)15;
    float *kt = buf, *vt = kt + K * Sp, *kk = vt + K * Sp, *dk = kk + Sp * K, *dv = dk + Sp * K, *qs = dv + Sp * K,
          *g = qs + FAST_R * K, *s = g + FAST_R * K, *dp = s + FAST_R * Sp, *bias = dp + FAST_R * Sp;
    gather_keys(C, w, b, h, Sp, kt, kk, vt, NULL, bias);
    memset(dk, 0, sizeof(float) * (size_t)(S * K));
    memset(dv, 0, sizeof(float) * (size_t)(S * K));
    const int64_t q0 = b * w->qb + h * K;
    for (int64_t i0 = 0; i0 < T; i0 += FAST_R) {
        const int64_t R = T - i0 < FAST_R ? T - i0 : FAST_R;
        load_rows(C, w->q, q0 + i0 * w->qt, w->qt, R, w->scale, w->bf16, qs);
        load_rows(C, w->dout, (b * T + i0) * H * K + h * K, H * K, R, 1.0f, w->bf16, g);
        product4(C, qs, kt, Sp, bias, s);
        product4(C, g, vt, Sp, NULL, dp);
        int64_t top = 0;
        for (int64_t r = 0; r < FAST_R; r++) {
            float *sr = s + r * Sp, *dr = dp + r * Sp;
            const float lse = r < R ? w->lse_in[(b * H + h) * T + i0 + r] : -INFINITY;
            const int64_t lim = lse > -INFINITY ? key_limit(w, i0 + r) : 0;
            exp_row(sr, Sp, lim, lse); /* p = exp(s - lse), 0 outside the row's keys */
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < Sp; j += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(sr + j), _mm512_loadu_ps(dr + j), acc);
            const __m512 D = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
            for (int64_t j = 0; j < Sp; j += 16) /* ds = p (dp - D) */
                _mm512_storeu_ps(dr + j, _mm512_mul_ps(_mm512_loadu_ps(sr + j), _mm512_sub_ps(_mm512_loadu_ps(dr + j), D)));
            top = lim > top ? lim : top;
        }
        __m512 dq[FAST_R][4], qv[FAST_R][4], gv[FAST_R][4];
        for (int r = 0; r < FAST_R; r++)
            for (int c = 0; c < C; c++) {
                dq[r][c] = _mm512_setzero_ps();
                qv[r][c] = _mm512_loadu_ps(qs + r * K + 16 * c);
                gv[r][c] = _mm512_loadu_ps(g + r * K + 16 * c);
            }
        for (int64_t j = 0; j < top; j++) {
            __m512 kj[4], dkj[4], dvj[4];
            for (int c = 0; c < C; c++) {
                kj[c] = _mm512_loadu_ps(kk + j * K + 16 * c);
                dkj[c] = _mm512_loadu_ps(dk + j * K + 16 * c);
                dvj[c] = _mm512_loadu_ps(dv + j * K + 16 * c);
            }
            for (int r = 0; r < FAST_R; r++) {
                const __m512 ds = _mm512_set1_ps(dp[r * Sp + j]), p = _mm512_set1_ps(s[r * Sp + j]);
                for (int c = 0; c < C; c++) {
                    dq[r][c] = _mm512_fmadd_ps(ds, kj[c], dq[r][c]);
                    dkj[c] = _mm512_fmadd_ps(ds, qv[r][c], dkj[c]);
                    dvj[c] = _mm512_fmadd_ps(p, gv[r][c], dvj[c]);
                }
            }
            for (int c = 0; c < C; c++) {
                _mm512_storeu_ps(dk + j * K + 16 * c, dkj[c]);
                _mm512_storeu_ps(dv + j * K + 16 * c, dvj[c]);
            }
        }
        const __m512 sc = _mm512_set1_ps(w->scale);
        for (int64_t r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                store16(w->dq, (b * T + i0 + r) * H * K + h * K + 16 * c, _mm512_mul_ps(dq[r][c], sc), w->bf16);
    }
    for (int64_t j = 0; j < S; j++)
        for (int c = 0; c < C; c++) {
            store16(w->dk, (b * S + j) * H * K + h * K + 16 * c, _mm512_loadu_ps(dk + j * K + 16 * c), w->bf16);
            store16(w->dv, (b * S + j) * H * K + h * K + 16 * c, _mm512_loadu_ps(dv + j * K + 16 * c), w->bf16);
        }
}

/* d_k = d_v = 16 C with C = 2 or 4, or 0 (the plain loops) */
static inline int fast_c(const sa_t *w) {
    return w->K == w->Dv && (w->K == 32 || w->K == 64) ? (int)(w->K / 16) : 0;
}
#else
static inline int fast_c(const sa_t *w) {
    (void)w;
    return 0;
}
#endif

/* Whether the dims d_k, d_v take the AVX-512 path here (the plain loops are slower than PyTorch's). */
int aiayn_seq_attention_fast(int64_t K, int64_t Dv) {
    sa_t w;
    memset(&w, 0, sizeof w);
    w.K = K;
    w.Dv = Dv;
    return fast_c(&w);
}

static void *sa_work(void *arg) {
    sa_t *w = (sa_t *)arg;
    const int64_t Sp = (w->S + 15) & ~(int64_t)15, K = w->K, Dv = w->Dv, S = w->S;
    const int C = fast_c(w);
    int64_t floats;
    if (C) floats = w->backward ? 5 * K * Sp + 2 * FAST_R * K + (2 * FAST_R + 1) * Sp
                                : 2 * K * Sp + FAST_R * K + (FAST_R + 1) * Sp;
    else floats = w->backward ? (K + Dv) * Sp + 2 * S * K + S * Dv + 2 * K + Dv + 3 * Sp
                              : K * Sp + S * Dv + K + 2 * Sp + Dv;
    float *buf = (float *)malloc(sizeof(float) * (size_t)floats);
    if (!buf) {
        w->status = 1;
        return NULL;
    }
    for (int64_t it = w->begin; it < w->end; it++) {
        const int64_t b = it / w->H, h = it % w->H;
#if defined(__AVX512F__)
        if (C == 2) {
            if (w->backward) fast_backward(2, w, b, h, buf);
            else fast_forward(2, w, b, h, buf);
            continue;
        }
        if (C == 4) {
            if (w->backward) fast_backward(4, w, b, h, buf);
            else fast_forward(4, w, b, h, buf);
            continue;
        }
#endif
        if (w->backward) item_backward(w, b, h, buf);
        else item_forward(w, b, h, buf);
    }
    free(buf);
    return NULL;
}

static int sa_run(sa_t proto, int nthreads) {
    const int64_t items = proto.B * proto.H;
    nthreads = split_threads(nthreads, items);
    sa_t tasks[MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        tasks[i] = proto;
        tasks[i].begin = items * i / nthreads;
        tasks[i].end = items * (i + 1) / nthreads;
        tasks[i].status = 0;
    }
    run_split(sa_work, tasks, sizeof tasks[0], nthreads);
    int status = 0;
    for (int i = 0; i < nthreads; i++) status |= tasks[i].status;
    return status;
}

/* dims: B, H, T, S, K, Dv; strides: qb, qt, kb, kt, vb, vt, ms (mask's row stride). */
int aiayn_seq_attention_forward(const void *q, const void *k, const void *v, const uint8_t *mask, const int64_t *dims,
                                const int64_t *strides, int causal, float scale, int bf16, void *out, float *lse,
                                int nthreads) {
    sa_t w = {q, k, v, NULL, out, NULL, NULL, NULL, lse, NULL, mask,
              dims[0], dims[1], dims[2], dims[3], dims[4], dims[5],
              strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6],
              causal, bf16, 0, scale, 0, 0, 0};
    return sa_run(w, nthreads);
}

int aiayn_seq_attention_backward(const void *q, const void *k, const void *v, const uint8_t *mask, const int64_t *dims,
                                 const int64_t *strides, int causal, float scale, int bf16, const float *lse,
                                 const void *dout, void *dq, void *dk, void *dv, int nthreads) {
    sa_t w = {q, k, v, dout, NULL, dq, dk, dv, NULL, lse, mask,
              dims[0], dims[1], dims[2], dims[3], dims[4], dims[5],
              strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6],
              causal, bf16, 1, scale, 0, 0, 0};
    return sa_run(w, nthreads);
}
