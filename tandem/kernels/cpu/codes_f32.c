/* A projection whose weights are a GGUF's codes, for the few rows of a float32 decode
 * step on any x86-64 or Arm CPU: y[M, N] = x[M, K] @ W^T (+ bias), float32 in and out.
 *
 * A CPU without native bfloat16 arithmetic runs the model in float32, where a decode
 * step of one row is bound by reading the dense weights: 4 bytes a weight. W is read
 * here as the GGUF stores it instead, along each row groups of 32 weights:
 * Q4_1 (q * d + m, q in 0..15): 16 bytes of codes and a float32 d and m, 0.75 bytes
 *       a weight;
 * Q8_0 (q * d, q in -128..127): 32 bytes of codes and a float32 d, 1.125 bytes.
 * Each group is expanded in registers to float32 weights, d * q + m (d * q is exact,
 * so this is one rounding, as the engine's loader makes the dense weights), and
 * multiplied with the rows of x, summed in float32 in another order than a dense
 * matmul's. The caller checks the layout at load through tandem_codes_dequant_f32,
 * the same expansion written out.
 *
 * Layout (tandem/engine/gguf_int4.py, pack_f32), per row of W, [N][K/32] groups:
 * Q4_1: codes [N][K/2] bytes, the low nibble of a group's byte j its weight j and the
 *       high nibble weight j + 16 (the GGUF's order); scales [N][K/32][2] float32,
 *       d then m;
 * Q8_0: codes [N][K] int8; scales [N][K/32] float32, d.
 *
 * Eight-float vectors (GCC's vector extension: AVX2 or AVX-512's lower half, NEON
 * pairs); threads split the rows of W, each prefetching the codes of the rows it
 * comes to next, and each row's groups are expanded once per pass of up to four
 * rows of x (CODES_F32_MAX_ROWS rows in all).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define CODES_OK 0
#define CODES_BAD_SHAPE -1
#define CODES_NO_MEMORY -3
#define CODES_F32_MAX_ROWS 16
#define GROUP 32
#define ROWS_PER_PASS 4 /* rows of x that share a group's expanded codes in registers */
/* Rows of W ahead whose codes and scales are prefetched: without it a one-row step
 * ran at a third of the codes' read bandwidth (bench/linear_forms.py, 30 layers'
 * projections: 14.0 ms a pass; with 2, 4, 8 or 16 rows ahead 5.5-7.1 ms). */
#define PREFETCH_ROWS 8

enum { Q4_1 = 0, Q8_0 = 1 };

typedef float v8sf __attribute__((vector_size(32)));
typedef uint8_t v8qu __attribute__((vector_size(8)));
typedef int8_t v8qs __attribute__((vector_size(8)));

static inline v8sf load8(const float *p) {
    v8sf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(v8sf v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* A group's 32 codes as four vectors of floats, weights 0-7, 8-15, 16-23, 24-31.
 * GCC widens short integer vectors element by element: where AVX2 is, its widening
 * loads do it in one instruction. */
static inline void expand(int format, const uint8_t *c, v8sf q[4]) {
#ifdef __AVX2__
    if (format == Q4_1) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)c);
        const __m128i nib = _mm_set1_epi8(0xF);
        const __m128i lo = _mm_and_si128(bytes, nib);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
        q[0] = (v8sf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = (v8sf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = (v8sf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = (v8sf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        for (int i = 0; i < 4; i++)
            q[i] = (v8sf)_mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * i))));
    }
    return;
#endif
    if (format == Q4_1) {
        v8qu lo, hi;
        memcpy(&lo, c, 8);
        memcpy(&hi, c + 8, 8);
        q[0] = __builtin_convertvector(lo & 0xF, v8sf);
        q[1] = __builtin_convertvector(hi & 0xF, v8sf);
        q[2] = __builtin_convertvector(lo >> 4, v8sf);
        q[3] = __builtin_convertvector(hi >> 4, v8sf);
    } else {
        for (int i = 0; i < 4; i++) {
            v8qs s;
            memcpy(&s, c + 8 * i, 8);
            q[i] = __builtin_convertvector(s, v8sf);
        }
    }
}

/* Rows r0 .. r0 + R of y's column n: R is a constant in each caller, so that the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void
row_pass(int format, const float *x, int K, int groups, const uint8_t *codes,
         const float *scales, float *y, int N, int n, int r0, const int R, float b) {
    v8sf acc[ROWS_PER_PASS] = {0};
    const int code_bytes = format == Q4_1 ? GROUP / 2 : GROUP;
    for (int g = 0; g < groups; g++) {
        v8sf w[4];
        expand(format, codes + (size_t)g * code_bytes, w);
        if (format == Q4_1) {
            const float d = scales[(size_t)g * 2], m = scales[(size_t)g * 2 + 1];
            for (int i = 0; i < 4; i++) w[i] = w[i] * d + m; /* d * q exact: one rounding */
        } else {
            const float d = scales[g];
            for (int i = 0; i < 4; i++) w[i] = w[i] * d;
        }
        for (int r = 0; r < R; r++) {
            const float *xg = x + (size_t)(r0 + r) * K + (size_t)g * GROUP;
            acc[r] += w[0] * load8(xg) + w[1] * load8(xg + 8) + w[2] * load8(xg + 16) +
                      w[3] * load8(xg + 24);
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)(r0 + r) * N + n] = hsum8(acc[r]) + b;
}

/* format Q4_1 or Q8_0; y [M, N] row-major; bias [N] or NULL; x [M, K] row-major. */
int tandem_codes_linear_f32(int format, const float *x, int M, int K, const uint8_t *codes,
                            const float *scales, const float *bias, float *y, int N,
                            int threads) {
    if ((format != Q4_1 && format != Q8_0) || M < 1 || M > CODES_F32_MAX_ROWS || K < GROUP ||
        K % GROUP || N < 1)
        return CODES_BAD_SHAPE;
    const int groups = K / GROUP;
    const size_t row_codes = (size_t)groups * (format == Q4_1 ? GROUP / 2 : GROUP);
    const size_t row_scales = (size_t)groups * (format == Q4_1 ? 2 : 1);
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *c = codes + (size_t)n * row_codes;
        const float *s = scales + (size_t)n * row_scales;
        const float b = bias ? bias[n] : 0.0f;
        if (n + PREFETCH_ROWS < N) {
            const uint8_t *pc = c + PREFETCH_ROWS * row_codes;
            const uint8_t *ps = (const uint8_t *)(s + PREFETCH_ROWS * row_scales);
            for (size_t off = 0; off < row_codes; off += 64) __builtin_prefetch(pc + off);
            for (size_t off = 0; off < row_scales * sizeof(float); off += 64)
                __builtin_prefetch(ps + off);
        }
        int r0 = 0;
        for (; r0 + ROWS_PER_PASS <= M; r0 += ROWS_PER_PASS)
            row_pass(format, x, K, groups, c, s, y, N, n, r0, ROWS_PER_PASS, b);
        switch (M - r0) {
        case 3: row_pass(format, x, K, groups, c, s, y, N, n, r0, 3, b); break;
        case 2: row_pass(format, x, K, groups, c, s, y, N, n, r0, 2, b); break;
        case 1: row_pass(format, x, K, groups, c, s, y, N, n, r0, 1, b); break;
        default: break;
        }
    }
    return CODES_OK;
}

/* W [N, K] float32 as the engine's loader makes it: d * q + m (Q4_1) or d * q (Q8_0),
 * each weight rounded once. */
int tandem_codes_dequant_f32(int format, const uint8_t *codes, const float *scales, int N,
                             int K, float *w) {
    if ((format != Q4_1 && format != Q8_0) || K < GROUP || K % GROUP || N < 1)
        return CODES_BAD_SHAPE;
    const int groups = K / GROUP;
    for (int n = 0; n < N; n++)
        for (int g = 0; g < groups; g++) {
            float *out = w + (size_t)n * K + (size_t)g * GROUP;
            if (format == Q4_1) {
                const uint8_t *c = codes + ((size_t)n * groups + g) * (GROUP / 2);
                const float d = scales[((size_t)n * groups + g) * 2];
                const float m = scales[((size_t)n * groups + g) * 2 + 1];
                for (int j = 0; j < GROUP / 2; j++) {
                    /* d * q is exact in float32 (float16 d, 4-bit q): one rounding */
                    out[j] = d * (float)(c[j] & 0xF) + m;
                    out[j + GROUP / 2] = d * (float)(c[j] >> 4) + m;
                }
            } else {
                const int8_t *c = (const int8_t *)codes + ((size_t)n * groups + g) * GROUP;
                const float d = scales[(size_t)n * groups + g];
                for (int j = 0; j < GROUP; j++) out[j] = d * (float)c[j];
            }
        }
    return CODES_OK;
}
