/* bfloat16 <-> float32 for the C kernels of aiayn/decode/kernel.py: widening is exact; narrowing rounds
 * to nearest even, as PyTorch's conversion does, and keeps NaN a NaN. */
#ifndef AIAYN_BF16_H
#define AIAYN_BF16_H
#include <stdint.h>
#include <string.h>

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

#endif
