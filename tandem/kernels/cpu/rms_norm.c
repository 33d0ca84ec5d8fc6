/* RMSNorm of bfloat16 rows in one pass, with the residual add before it fused in.
 *
 * Per row, as Hugging Face's LlamaRMSNorm computes it in bfloat16 (and
 * tandem.engine.model.RMSNorm with torch's ops):
 *     h = bf16(x + residual)                  (when a residual is given; h is stored)
 *     r = 1 / sqrt(mean(float(h)^2) + eps)    (float32)
 *     y = bf16(float(w) * float(bf16(float(h) * r)))
 * torch's ops take 8-10 dispatches and temporaries for this (30-70 us a call on a
 * 2-core VM, 61 calls a decode step); this is one call of a few microseconds. The only
 * difference from torch's result is the order of the float32 sum of squares (16
 * partial sums here), which moves the rare output that lies within a float32
 * rounding of a bfloat16 tie by one bfloat16 unit (tests/engine/test_layers.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* The sum of squares is kept in 16 lanes, element i in lane i % 16, added up in lane
 * order at the end. */
static void norm_row(const uint16_t *x, const uint16_t *residual, uint16_t *h_out,
                     const uint16_t *w, float eps, uint16_t *y, int64_t dim) {
    const int64_t whole = dim - dim % 16;
    int64_t i;
    if (residual) {
        for (i = 0; i < whole; i += 16)
            bf16x16_store(h_out + i, bf16x16_load(x + i) + bf16x16_load(residual + i));
        for (; i < dim; i++)
            h_out[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(residual[i]));
        x = h_out;
    }
    v16sf lanes = {0};
    for (i = 0; i < whole; i += 16) {
        const v16sf v = bf16x16_load(x + i);
        lanes += v * v;
    }
    float partial[16];
    memcpy(partial, &lanes, sizeof partial);
    for (int l = 0; i < dim; i++, l++) {
        const float v = bf16_to_float(x[i]);
        partial[l] += v * v;
    }
    float sum = 0.0f;
    for (int l = 0; l < 16; l++) sum += partial[l];
    const float r = 1.0f / sqrtf(sum / (float)dim + eps);
    for (i = 0; i < whole; i += 16)
        bf16x16_store(y + i, bf16x16_load(w + i) * bf16x16_round(bf16x16_load(x + i) * r));
    for (; i < dim; i++) {
        const float normed = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * r));
        y[i] = float_to_bf16(bf16_to_float(w[i]) * normed);
    }
}

/* x, residual, h_out, y: [rows, dim] contiguous; residual and h_out both NULL or not.
 * Returns 0, or -1 for a shape it does not take. */
int tandem_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *h_out,
                         const uint16_t *weight, float eps, uint16_t *y, int64_t rows,
                         int64_t dim, int threads) {
    if (rows < 0 || dim < 1 || (residual == NULL) != (h_out == NULL)) return -1;
    /* A decode step's few rows are not worth waking the other threads for. */
    if (rows * dim < (1 << 16)) threads = 1;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * dim, residual ? residual + r * dim : NULL, h_out ? h_out + r * dim : NULL,
                 weight, eps, y + r * dim, dim);
    return 0;
}
