/* Times aiayn_beam_attention (src/aiayn/kernels/beam_attention.c) alone, on one decoding worker's share
 * of the translation benchmark (32 sentences x beam 4, 4 heads of d_k = d_v = 64, 1 thread): random
 * queries, keys and values, random ancestors. Built and run by bench/beam_attention_ab.sh.
 *   driver N REPS [cross]   -> "self|cross n=N: T us per call, t ns per (row,head,key)"
 * With DUMP=FILE set, the last call's output (float32) is written to FILE. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int aiayn_beam_attention(const void *q, const void *k, const void *v, void *out, const int64_t *anc,
                         const uint8_t *pad, const int64_t *dims, const int64_t *strides, float scale,
                         int bf16, int nthreads);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float uniform(void) { return (float)(rand() % 1000) / 1000.0f - 0.5f; }

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s N REPS [cross]\n", argv[0]);
        return 2;
    }
    const int64_t Bs = 32, H = 4, g = 4, n = atoi(argv[1]), K = 64, Dv = 64;
    const int reps = atoi(argv[2]), cross = argc > 3;
    const int64_t slots = cross ? n : n * g; /* key rows per (sentence, head) */
    float *q = malloc(sizeof(float) * Bs * g * H * K), *k = malloc(sizeof(float) * Bs * H * slots * K);
    float *v = malloc(sizeof(float) * Bs * H * slots * Dv), *out = malloc(sizeof(float) * Bs * g * H * Dv);
    int64_t *anc = malloc(sizeof(int64_t) * Bs * g * n);
    uint8_t *pad = calloc((size_t)(Bs * n), 1);
    srand(1);
    for (int64_t i = 0; i < Bs * g * H * K; i++) q[i] = uniform();
    for (int64_t i = 0; i < Bs * H * slots * K; i++) k[i] = uniform(), v[i] = uniform();
    for (int64_t i = 0; i < Bs * g * n; i++) anc[i] = rand() % g;
    const int64_t dims[6] = {Bs, H, g, n, K, Dv};
    /* q (N,H,1,K) contiguous; k, v (Bs,H,slots,K); ancestors (Bs,g,n); pad (Bs,n) */
    const int64_t strides[12] = {g * H * K, K, H * K, H * slots * K, slots * K, K,
                                 H * slots * Dv, slots * Dv, Dv, g * n, n, n};
    const double t0 = now();
    for (int r = 0; r < reps; r++)
        aiayn_beam_attention(q, k, v, out, cross ? NULL : anc, cross ? pad : NULL, dims, strides, 0.125f, 0, 1);
    const double dt = (now() - t0) / reps;
    if (getenv("DUMP")) {
        FILE *f = fopen(getenv("DUMP"), "wb");
        fwrite(out, sizeof(float), (size_t)(Bs * g * H * Dv), f);
        fclose(f);
    }
    printf("%s n=%ld: %.1f us per call, %.2f ns per (row,head,key)\n", cross ? "cross" : "self", (long)n, dt * 1e6,
           dt * 1e9 / (double)(Bs * g * H * n));
    return 0;
}
