/* bfloat16 <-> float32 for the CPU kernels, one value or sixteen at a time, rounding
 * as torch does (to nearest, ties to even; a NaN stays a NaN). The sixteen-wide forms
 * are GCC vector extensions: one AVX-512 register, two AVX2 ones.
 */
#ifndef TANDEM_BF16_H
#define TANDEM_BF16_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* The vector helpers are static and inlined: no call crosses an ABI with them. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef float v16sf __attribute__((vector_size(64)));
typedef uint32_t v16su __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));
typedef uint16_t v16hu __attribute__((vector_size(32)));

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline v16sf bf16x16_load(const uint16_t *p) {
    v16hu raw;
    memcpy(&raw, p, sizeof raw);
    return (v16sf)(__builtin_convertvector(raw, v16su) << 16);
}

/* The bits of f rounded to bfloat16, in the high half of each lane. */
static inline v16su bf16x16_bits(v16sf f) {
    const v16su bits = (v16su)f;
    const v16si nan = (v16si)((bits & 0x7fffffffu) > 0x7f800000u);
    const v16su rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    return (v16su)((nan & (v16si)(bits | 0x400000u)) | (~nan & (v16si)rounded)) & 0xffff0000u;
}

/* f rounded to bfloat16, as a float: what storing it and loading it back gives. */
static inline v16sf bf16x16_round(v16sf f) { return (v16sf)bf16x16_bits(f); }

static inline void bf16x16_store(uint16_t *p, v16sf f) {
    const v16hu out = __builtin_convertvector(bf16x16_bits(f) >> 16, v16hu);
    memcpy(p, &out, sizeof out);
}

#endif
