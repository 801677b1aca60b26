/* Eq. 1, softmax(q K^T / sqrt(d_k)) V, for one step of beam search, on the CPU.
 *
 * Compiled and loaded by aiayn/decode/kernel.py, which says why it exists and how it is tested. The
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
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *anc;
    const uint8_t *pad;
    int64_t Bs, H, g, n, K, Dv;
    int64_t qs, qh, qr, ks, kh, kt, vs, vh, vt, anc_s, anc_r, pad_s;
    float scale;
    int64_t begin, end; /* work items s*H + h in [begin, end) */
    int status;
} job_t;

static inline float f32_of_f32(float x) { return x; }
static inline float f32_to_f32(float x) { return x; }

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

/* exp(x) for x <= 0 (a softmax after the maximum is subtracted): 2^(x log2 e) split into 2^i * 2^f,
 * f in [0, 1), 2^f by a degree-6 polynomial (relative error about 2e-7), 2^i in the exponent bits.
 * Written out so that the compiler vectorizes the loop around it. */
static inline float exp_nonpositive(float x) {
    float t = fmaxf(x, -87.0f) * 1.44269504088896341f;
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

#define DEFINE_RUN(NAME, T, LOAD, STORE)                                                          \
    static void NAME(job_t *jb, float *qf, float *sc, float *acc) {                               \
        const T *q = (const T *)jb->q, *k = (const T *)jb->k, *v = (const T *)jb->v;              \
        T *out = (T *)jb->out;                                                                    \
        const int64_t H = jb->H, g = jb->g, n = jb->n, K = jb->K, Dv = jb->Dv;                    \
        for (int64_t w = jb->begin; w < jb->end; w++) {                                           \
            const int64_t s = w / H, h = w % H;                                                   \
            const T *kb = k + s * jb->ks + h * jb->kh, *vb = v + s * jb->vs + h * jb->vh;         \
            for (int64_t r = 0; r < g; r++) {                                                     \
                const T *qp = q + s * jb->qs + h * jb->qh + r * jb->qr;                           \
                for (int64_t i = 0; i < K; i++) qf[i] = LOAD(qp[i]) * jb->scale;                  \
                const int64_t *anc = jb->anc ? jb->anc + s * jb->anc_s + r * jb->anc_r : NULL;    \
                const uint8_t *pad = jb->pad ? jb->pad + s * jb->pad_s : NULL;                    \
                float m = -INFINITY;                                                              \
                for (int64_t j = 0; j < n; j++) {                                                 \
                    if (pad && pad[j]) { sc[j] = -INFINITY; continue; }                           \
                    const int64_t t = anc ? j * g + (j == n - 1 ? r : anc[j]) : j;                \
                    const T *kp = kb + t * jb->kt;                                                \
                    float d = 0.0f;                                                               \
                    _Pragma("omp simd reduction(+:d)")                                            \
                    for (int64_t i = 0; i < K; i++) d = fmaf(qf[i], LOAD(kp[i]), d);              \
                    sc[j] = d;                                                                    \
                    m = d > m ? d : m;                                                            \
                }                                                                                 \
                float sum = 0.0f;                                                                 \
                if (m > -INFINITY) {                                                              \
                    _Pragma("omp simd reduction(+:sum)")                                          \
                    for (int64_t j = 0; j < n; j++) {                                             \
                        const float e = sc[j] == -INFINITY ? 0.0f : exp_nonpositive(sc[j] - m);   \
                        sc[j] = e;                                                                \
                        sum += e;                                                                 \
                    }                                                                             \
                }                                                                                 \
                for (int64_t d = 0; d < Dv; d++) acc[d] = 0.0f;                                   \
                for (int64_t j = 0; sum > 0.0f && j < n; j++) {                                   \
                    const float p = sc[j];                                                        \
                    if (p == 0.0f) continue;                                                      \
                    const int64_t t = anc ? j * g + (j == n - 1 ? r : anc[j]) : j;                \
                    const T *vp = vb + t * jb->vt;                                                \
                    _Pragma("omp simd")                                                           \
                    for (int64_t d = 0; d < Dv; d++) acc[d] = fmaf(p, LOAD(vp[d]), acc[d]);       \
                }                                                                                 \
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;                                 \
                T *op = out + ((s * g + r) * H + h) * Dv;                                         \
                for (int64_t d = 0; d < Dv; d++) op[d] = STORE(acc[d] * inv);                     \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_RUN(run_f32, float, f32_of_f32, f32_to_f32)
DEFINE_RUN(run_bf16, uint16_t, f32_of_bf16, f32_to_bf16)

typedef struct {
    job_t job;
    int bf16;
} task_t;

static void *work(void *arg) {
    task_t *t = (task_t *)arg;
    job_t *jb = &t->job;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(jb->K + jb->n + jb->Dv));
    if (!scratch) { jb->status = 1; return NULL; }
    if (t->bf16) run_bf16(jb, scratch, scratch + jb->K, scratch + jb->K + jb->n);
    else run_f32(jb, scratch, scratch + jb->K, scratch + jb->K + jb->n);
    free(scratch);
    jb->status = 0;
    return NULL;
}

#define MAX_THREADS 64

/* dims: Bs, H, g, n, K, Dv. strides: qs, qh, qr, ks, kh, kt, vs, vh, vt, anc_s, anc_r, pad_s.
 * Returns 0, or 1 if scratch memory could not be had. */
int aiayn_beam_attention(const void *q, const void *k, const void *v, void *out, const int64_t *anc,
                         const uint8_t *pad, const int64_t *dims, const int64_t *strides, float scale,
                         int bf16, int nthreads) {
    job_t base = {q, k, v, out, anc, pad, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5],
                  strides[0], strides[1], strides[2], strides[3], strides[4], strides[5],
                  strides[6], strides[7], strides[8], strides[9], strides[10], strides[11],
                  scale, 0, 0, 0};
    const int64_t items = base.Bs * base.H;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > items) nthreads = (int)(items > 0 ? items : 1);
    task_t tasks[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 0; i < nthreads; i++) {
        tasks[i].job = base;
        tasks[i].job.begin = items * i / nthreads;
        tasks[i].job.end = items * (i + 1) / nthreads;
        tasks[i].bf16 = bf16;
    }
    for (int i = 1; i < nthreads; i++)
        started[i] = pthread_create(&threads[i], NULL, work, &tasks[i]) == 0;
    work(&tasks[0]);
    int status = tasks[0].job.status;
    for (int i = 1; i < nthreads; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else work(&tasks[i]); /* no thread to be had: do its share here */
        status |= tasks[i].job.status;
    }
    return status;
}
