/* Small steps of a decode step, each one call where torch takes several dispatches
 * (or one slow one):
 *
 * tandem_rope_bf16: rotary embedding of bfloat16 heads, as tandem.engine.rope.
 * apply_rope computes it with torch's ops (and Hugging Face's x * cos +
 * rotate_half(x) * sin does), bit for bit: each product rounded to bfloat16, then
 * their sum.
 *     x        [tokens, heads, dim], token stride x_stride elements, heads contiguous
 *     cos, sin [tokens, dim] contiguous; sin with its first half negated (signed_sin)
 *     out      [tokens, heads, dim] contiguous
 *
 * tandem_store_rows: each token's K and V (token_bytes each: its KV heads, one after
 * another) copied into its slot of a cache of the same dtype, as torch's
 * index_copy_ does; nothing is written unless every slot lies in the cache.
 *     k, v     token strides k_stride, v_stride in bytes
 *     caches   [capacity slots, token_bytes] (one layer's), slots [tokens] int64
 *
 * tandem_argmax_f32: each row's index of its maximum, as torch's max(dim=-1).indices
 * gives it: the first maximum, or the first NaN in a row that has one.
 *     x        [rows, n] float32, row stride x_stride elements; out [rows] int64
 *
 * Built by tandem/kernels/cpu/build.py; the caller checks dtypes and shapes.
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"

/* bf16(bf16(x * c) + bf16(r * s)): torch's three ops, each rounded. */
static inline uint16_t rotate(uint16_t x, uint16_t r, uint16_t c, uint16_t s) {
    const float a = bf16_to_float(float_to_bf16(bf16_to_float(x) * bf16_to_float(c)));
    const float b = bf16_to_float(float_to_bf16(bf16_to_float(r) * bf16_to_float(s)));
    return float_to_bf16(a + b);
}

static inline v16sf rotate16(v16sf x, v16sf r, v16sf c, v16sf s) {
    return bf16x16_round(x * c) + bf16x16_round(r * s);
}

int tandem_rope_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos,
                     const uint16_t *sin, uint16_t *out, int64_t tokens, int64_t heads,
                     int64_t dim) {
    if (dim <= 0 || dim % 2) return -1;
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *row = x + t * x_stride + h * dim;
            uint16_t *o = out + (t * heads + h) * dim;
            /* rotated = roll(row, half): the second half first */
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                const v16sf lo = bf16x16_load(row + i), hi = bf16x16_load(row + half + i);
                bf16x16_store(o + i, rotate16(lo, hi, bf16x16_load(c + i), bf16x16_load(s + i)));
                bf16x16_store(o + half + i, rotate16(hi, lo, bf16x16_load(c + half + i),
                                                     bf16x16_load(s + half + i)));
            }
            for (; i < half; i++) {
                o[i] = rotate(row[i], row[i + half], c[i], s[i]);
                o[half + i] = rotate(row[half + i], row[i], c[half + i], s[half + i]);
            }
        }
    }
    return 0;
}

int tandem_store_rows(const uint8_t *k, int64_t k_stride, const uint8_t *v, int64_t v_stride,
                      uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t tokens,
                      int64_t capacity, int64_t token_bytes) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= capacity) return -2;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_cache + slots[t] * token_bytes, k + t * k_stride, (size_t)token_bytes);
        memcpy(v_cache + slots[t] * token_bytes, v + t * v_stride, (size_t)token_bytes);
    }
    return 0;
}

/* The first lane of m that is set, or -1. */
static inline int first_lane(v16si m) {
#ifdef __AVX512F__
    const unsigned mask = _mm512_cmpneq_epi32_mask((__m512i)m, _mm512_setzero_si512());
    return mask ? __builtin_ctz(mask) : -1;
#else
    for (int l = 0; l < 16; l++)
        if (m[l]) return l;
    return -1;
#endif
}

static int64_t argmax_row(const float *x, int64_t n) {
    const int64_t whole = n - n % 16;
    v16sf best;
    v16si nan = {0};
    int64_t i = 0;
    if (whole) {
        memcpy(&best, x, sizeof best);
        for (i = 16; i < whole; i += 16) {
            v16sf v;
            memcpy(&v, x + i, sizeof v);
            nan |= v != v;
            const v16si more = v > best;
            best = (v16sf)((more & (v16si)v) | (~more & (v16si)best));
        }
        nan |= best != best;
    }
    float top = whole ? best[0] : x[0];
    for (int l = 1; l < 16 && whole; l++) top = best[l] > top ? best[l] : top;
    int any_nan = 0;
    for (int l = 0; l < 16; l++) any_nan |= nan[l];
    for (; i < n; i++) {
        any_nan |= x[i] != x[i];
        top = x[i] > top ? x[i] : top;
    }
    /* the first NaN, else the first maximum */
    const v16sf wanted = (v16sf){0} + top;
    for (i = 0; i < whole; i += 16) {
        v16sf v;
        memcpy(&v, x + i, sizeof v);
        const int lane = first_lane(any_nan ? v != v : v == wanted);
        if (lane >= 0) return i + lane;
    }
    for (; i < n; i++)
        if (any_nan ? x[i] != x[i] : x[i] == top) return i;
    return 0;
}

int tandem_argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t n, int64_t *out,
                      int threads) {
    if (n < 1) return -1;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * x_stride, n);
    return 0;
}
