/* Paged decode attention on the CPU: one query row per sequence over its cached
 * context, read in place from the paged KV cache through the block table.
 *
 * The torch backend gathers every sequence's blocks into a contiguous copy (and
 * copies them again into the layout its matmuls want) before two small batched
 * matmuls per layer; here each (sequence, KV head) is one task that walks its
 * blocks once for the scores and once for the values, in float32, with the group
 * of query heads that share the KV head computed together so that every K/V row
 * is loaded once, and the next block's rows asked for while one block is computed
 * (fetching them from memory, not the arithmetic, bounds it). Tasks are spread over
 * OpenMP threads (torch's own runtime: the library is loaded after torch, whose
 * libgomp.so.1 it then shares).
 *
 * Layouts (all contiguous unless a stride is passed):
 *   q            [batch, heads, dim], row stride q_stride elements
 *   k/v cache    [num_blocks, block_size, kv_heads, dim] (one layer's); an int8
 *                cache's rows are dim + 2 bytes: the values, then their float16
 *                scale (tandem/kernels/torch_ref.py), applied to each score and to
 *                each probability rather than to every element
 *   tables       [batch, table_stride] int64 block ids
 *   lens         [batch] int64 context lengths (the new token included, >= 1)
 *   out          [batch, heads, dim], row stride out_stride elements
 * Built by tandem/kernels/cpu/build.py; the caller checks shapes and limits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__)
/* The v8sf helpers are static and inlined: no call crosses an ABI with them. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define MAX_GROUP 16
#define MAX_DIM 256

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t bf16_store(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(v.u >> 16);
}

static inline float f16_load(_Float16 x) { return (float)x; }
static inline _Float16 f16_store(float f) { return (_Float16)f; }
static inline float f32_load(float x) { return x; }
static inline float f32_store(float f) { return f; }

/* The scale of a cache row of `dim` values: 1 for float caches, the float16 after
 * the values for int8 ones (2-byte aligned: dim and the row width are even). */
#define NO_SCALE(row, dim) 1.f
static inline float int8_scale(const int8_t* row, int64_t dim) {
    _Float16 s;
    memcpy(&s, row + dim, sizeof s);
    return (float)s;
}
#define INT8_SCALE(row, dim) int8_scale(row, dim)

/* x @ H in place for the Hadamard matrix of torch_ref.rotate: per block of a power
 * of two in dim (largest first), log2(n) stages of a + b, a - b, then a multiply by
 * 1 / sqrt(n): the operations of torch_ref._walsh_hadamard in the same order, so the
 * same float32 results. */
static void walsh_hadamard(float* x, int64_t dim) {
    int64_t start = 0;
    for (int bit = 62; bit >= 0; bit--) {
        const int64_t n = (int64_t)1 << bit;
        if (!(dim & n)) continue;
        float* y = x + start;
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        const float norm = (float)(1.0 / sqrt((double)n));
        for (int64_t j = 0; j < n; j++) y[j] *= norm;
        start += n;
    }
}
#define ROTATE(x, dim) walsh_hadamard(x, dim)
#define NO_ROTATE(x, dim) ((void)0)

/* Eight floats: the unit of the decode kernel's arithmetic, in GCC's vector extension
 * (clang has it too), which compiles to one AVX register, two SSE or NEON ones, or
 * scalar code where there are none. Rows are loaded eight values at a time and
 * widened to float32 in registers; dim must be a multiple of 8. */
typedef float v8sf __attribute__((vector_size(32)));
typedef uint32_t v8su __attribute__((vector_size(32)));
typedef uint16_t v8hu __attribute__((vector_size(16)));
typedef int8_t v8qi __attribute__((vector_size(8)));
typedef int32_t v8si __attribute__((vector_size(32)));

/* GCC widens short vectors of 8- and 16-bit integers element by element: where AVX2
 * is, its one-instruction widening loads do it. */
static inline v8sf load8_bf16(const uint16_t* p) {
#ifdef __AVX2__
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return (v8sf)_mm256_slli_epi32(wide, 16);
#else
    v8hu raw;
    memcpy(&raw, p, sizeof raw);
    return (v8sf)(__builtin_convertvector(raw, v8su) << 16);
#endif
}

static inline v8sf load8_f16(const _Float16* p) {
    float f[8];
    for (int d = 0; d < 8; d++) f[d] = (float)p[d];
    v8sf v;
    memcpy(&v, f, sizeof v);
    return v;
}

static inline v8sf load8_f32(const float* p) {
    v8sf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8sf load8_i8(const int8_t* p) {
#ifdef __AVX2__
    return (v8sf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
    v8qi raw;
    memcpy(&raw, p, sizeof raw);
    return __builtin_convertvector(__builtin_convertvector(raw, v8si), v8sf);
#endif
}

/* Asks for a block's rows of one head (n rows `row` elements apart, `bytes` long each)
 * ahead of use: the blocks lie anywhere in the cache and a head's row is a short run
 * within each token's row, so the hardware's own prefetcher does not see them coming. */
static inline void prefetch_rows(const void* first, int64_t n, int64_t row_bytes, int64_t bytes) {
    const uintptr_t start = (uintptr_t)first;
    for (int64_t i = 0; i < n; i++) {
        const uintptr_t row = start + i * row_bytes; /* every 64-byte line it touches */
        for (uintptr_t line = row & ~(uintptr_t)63; line < row + bytes; line += 64)
            __builtin_prefetch((const void*)line);
    }
}

/* e^x for eight floats: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial in r, times 2^n built in the exponent bits). Over [-90, 0], the range
 * softmax feeds it, 90% of its values equal glibc's expf and the rest are one unit
 * off; e^x below 2^-126 (x < -87.3) is taken as 0, where libm gives a subnormal.
 * libm's expf is scalar (GCC vectorizes it only under -ffast-math): one call per score
 * was 15-20% of a decode attention. */
static inline v8sf exp8(v8sf x) {
    const v8sf zero = {0}, lo = zero - 87.33654f, hi = zero + 88.3762626647949f;
    const v8si tiny = x < lo, huge = x > hi;
    x = (v8sf)(((v8si)lo & tiny) | ((v8si)hi & huge) | ((v8si)x & ~(tiny | huge)));
    const v8sf n = (x * 1.44269504088896341f + 0x1.8p23f) - 0x1.8p23f; /* round(x / ln2) */
    const v8sf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v8sf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v8si e = (__builtin_convertvector(n, v8si) + 127) << 23;
    return (v8sf)((v8si)(p * (v8sf)e) & ~tiny);
}

static inline float hsum8(v8sf v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* T: q and out; C: the cache, CLOAD8 eight of its values as floats, EXTRA the
 * elements after a row's values, SCALE the row's scale, ROT the rotation of an int8
 * cache's rows (applied to the queries, and to the outputs to rotate them back).
 * Per token, the scores of the group's query heads are dots of registers (two
 * accumulators each, so consecutive FMAs do not wait on each other), and the value
 * pass adds the token's row into the group's accumulators, two tokens at a time. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, C, CLOAD8, EXTRA, SCALE, ROT)                     \
    int NAME(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,               \
             const int64_t* tables, int64_t table_stride, const int64_t* lens, int64_t batch, \
             int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,   \
             T* out, int64_t out_stride, int threads) {                                       \
        const int64_t group = heads / kv_heads;                                               \
        if (group > MAX_GROUP || dim > MAX_DIM || dim % 8 || group * kv_heads != heads)       \
            return -1;                                                                        \
        const int64_t width = dim + EXTRA, nv = dim / 8;                                      \
        const int64_t row = kv_heads * width; /* elements between a block's tokens */         \
        int failed = 0;                                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t task = 0; task < batch * kv_heads; task++) {                             \
            const int64_t b = task / kv_heads, h = task % kv_heads, len = lens[b];            \
            const int64_t* table = tables + b * table_stride;                                 \
            v8sf qv[MAX_GROUP][MAX_DIM / 8], acc[MAX_GROUP][MAX_DIM / 8];                     \
            float top[MAX_GROUP];                                                             \
            float* scores = malloc(sizeof(float) * group * len); /* [group][len] */           \
            if (scores == NULL) {                                                             \
                failed = 1;                                                                   \
                continue;                                                                     \
            }                                                                                 \
            for (int64_t j = 0; j < group; j++) {                                             \
                const T* qj = q + b * q_stride + (h * group + j) * dim;                       \
                float qf[MAX_DIM];                                                            \
                for (int64_t d = 0; d < dim; d++) qf[d] = LOAD(qj[d]);                        \
                ROT(qf, dim);                                                                 \
                for (int64_t d = 0; d < dim; d++) qf[d] *= scale;                             \
                memcpy(qv[j], qf, sizeof(float) * dim);                                       \
                memset(acc[j], 0, sizeof(float) * dim);                                       \
                top[j] = -INFINITY;                                                           \
            }                                                                                 \
            /* Scores, block by block: t is the token's position in the sequence. */          \
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                \
                const C* kb = k_cache + table[t0 / block_size] * block_size * row + h * width; \
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;              \
                if (t0 + block_size < len)                                                    \
                    prefetch_rows(k_cache + table[t0 / block_size + 1] * block_size * row + h * width, \
                                  block_size, row * sizeof(C), width * sizeof(C));            \
                else                                                                          \
                    prefetch_rows(v_cache + table[0] * block_size * row + h * width,          \
                                  block_size, row * sizeof(C), width * sizeof(C));            \
                for (int64_t i = 0; i < n; i++) {                                             \
                    const C* kr = kb + i * row;                                               \
                    v8sf kv[MAX_DIM / 8];                                                     \
                    for (int64_t c = 0; c < nv; c++) kv[c] = CLOAD8(kr + 8 * c);              \
                    const float ks = SCALE(kr, dim);                                          \
                    for (int64_t j = 0; j < group; j++) {                                     \
                        v8sf a0 = {0}, a1 = {0};                                              \
                        int64_t c = 0;                                                        \
                        for (; c + 1 < nv; c += 2) {                                          \
                            a0 += qv[j][c] * kv[c];                                           \
                            a1 += qv[j][c + 1] * kv[c + 1];                                   \
                        }                                                                     \
                        if (c < nv) a0 += qv[j][c] * kv[c];                                   \
                        const float dot = hsum8(a0 + a1) * ks;                                \
                        scores[j * len + t0 + i] = dot;                                       \
                        top[j] = dot > top[j] ? dot : top[j];                                 \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            float total[MAX_GROUP];                                                           \
            for (int64_t j = 0; j < group; j++) {                                             \
                float* sj = scores + j * len;                                                 \
                v8sf sum8 = {0};                                                              \
                int64_t t = 0;                                                                \
                for (; t + 8 <= len; t += 8) {                                                \
                    const v8sf p = exp8(load8_f32(sj + t) - top[j]);                          \
                    memcpy(sj + t, &p, sizeof p);                                             \
                    sum8 += p;                                                                \
                }                                                                             \
                float sum = hsum8(sum8);                                                      \
                if (t < len) { /* the last few, through the same exp */                       \
                    v8sf x = {0};                                                             \
                    for (int64_t u = t; u < len; u++) x[u - t] = sj[u] - top[j];              \
                    const v8sf p = exp8(x);                                                   \
                    for (int64_t u = t; u < len; u++) {                                       \
                        sj[u] = p[u - t];                                                     \
                        sum += p[u - t];                                                      \
                    }                                                                         \
                }                                                                             \
                total[j] = sum;                                                               \
            }                                                                                 \
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                \
                const C* vb = v_cache + table[t0 / block_size] * block_size * row + h * width; \
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;              \
                if (t0 + block_size < len)                                                    \
                    prefetch_rows(v_cache + table[t0 / block_size + 1] * block_size * row + h * width, \
                                  block_size, row * sizeof(C), width * sizeof(C));            \
                int64_t i = 0;                                                                \
                for (; i + 1 < n; i += 2) {                                                   \
                    const C* v0 = vb + i * row;                                               \
                    const C* v1 = v0 + row;                                                   \
                    const float s0 = SCALE(v0, dim), s1 = SCALE(v1, dim);                     \
                    for (int64_t c = 0; c < nv; c++) {                                        \
                        const v8sf x0 = CLOAD8(v0 + 8 * c), x1 = CLOAD8(v1 + 8 * c);          \
                        for (int64_t j = 0; j < group; j++) {                                 \
                            const float* p = scores + j * len + t0 + i;                       \
                            acc[j][c] += (p[0] * s0) * x0 + (p[1] * s1) * x1;                 \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
                if (i < n) {                                                                  \
                    const C* v0 = vb + i * row;                                               \
                    const float s0 = SCALE(v0, dim);                                          \
                    for (int64_t c = 0; c < nv; c++) {                                        \
                        const v8sf x0 = CLOAD8(v0 + 8 * c);                                   \
                        for (int64_t j = 0; j < group; j++)                                   \
                            acc[j][c] += (scores[j * len + t0 + i] * s0) * x0;                \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            for (int64_t j = 0; j < group; j++) {                                             \
                T* oj = out + b * out_stride + (h * group + j) * dim;                         \
                const float inv = 1.f / total[j];                                             \
                float o[MAX_DIM];                                                             \
                memcpy(o, acc[j], sizeof(float) * dim);                                       \
                ROT(o, dim);                                                                  \
                for (int64_t d = 0; d < dim; d++) oj[d] = STORE(o[d] * inv);                  \
            }                                                                                 \
            free(scores);                                                                     \
        }                                                                                     \
        return failed ? -2 : 0;                                                               \
    }

DEFINE_DECODE(tandem_decode_attention_bf16, uint16_t, bf16_load, bf16_store,
              uint16_t, load8_bf16, 0, NO_SCALE, NO_ROTATE)
DEFINE_DECODE(tandem_decode_attention_f16, _Float16, f16_load, f16_store,
              _Float16, load8_f16, 0, NO_SCALE, NO_ROTATE)
DEFINE_DECODE(tandem_decode_attention_f32, float, f32_load, f32_store,
              float, load8_f32, 0, NO_SCALE, NO_ROTATE)
/* An int8 cache, queries and output in the model's dtype. */
DEFINE_DECODE(tandem_decode_attention_bf16_i8, uint16_t, bf16_load, bf16_store,
              int8_t, load8_i8, 2, INT8_SCALE, ROTATE)
DEFINE_DECODE(tandem_decode_attention_f16_i8, _Float16, f16_load, f16_store,
              int8_t, load8_i8, 2, INT8_SCALE, ROTATE)
DEFINE_DECODE(tandem_decode_attention_f32_i8, float, f32_load, f32_store,
              int8_t, load8_i8, 2, INT8_SCALE, ROTATE)

/* KV store into an int8 cache: each (token, KV head) row of k and v rotated, then
 * quantized as torch_ref.quantize_int8 does it (float16 scale absmax / 127, values
 * floor(x / scale + 0.5) clamped to +-127), into its slot.
 *   k, v    [tokens, kv_heads, dim], row strides (token, head) in elements
 *   caches  [num_blocks * block_size (slots), kv_heads, dim + 2] int8 (one layer's)
 *   slots   [tokens] int64 */
static void quantize_row(const float* x, int64_t dim, int8_t* out) {
    float absmax = 0.f;
    int nan = 0; /* as torch's amax and clamp: a NaN in the row makes the scale NaN */
    for (int64_t d = 0; d < dim; d++) {
        nan |= isnan(x[d]);
        absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
    }
    float limit = absmax / 127.f;
    limit = nan ? NAN : (limit < 65504.f ? limit : 65504.f);
    const _Float16 scale = (_Float16)limit;
    const float s = (float)scale;
    for (int64_t d = 0; d < dim; d++) {
        float v = s > 0.f ? floorf(x[d] / s + 0.5f) : 0.f;
        v = v < -127.f ? -127.f : (v > 127.f ? 127.f : v);
        out[d] = (int8_t)v;
    }
    memcpy(out + dim, &scale, sizeof scale);
}

#define DEFINE_STORE(NAME, T, LOAD)                                                           \
    int NAME(const T* k, int64_t k_st, int64_t k_sh, const T* v, int64_t v_st, int64_t v_sh, \
             int8_t* k_cache, int8_t* v_cache, const int64_t* slots, int64_t tokens,          \
             int64_t kv_heads, int64_t dim, int threads) {                                    \
        if (dim > MAX_DIM) return -1;                                                         \
        const int64_t width = dim + 2;                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t task = 0; task < tokens * kv_heads; task++) {                            \
            const int64_t t = task / kv_heads, h = task % kv_heads;                           \
            const int64_t at = (slots[t] * kv_heads + h) * width;                             \
            const T* rows[2] = {k + t * k_st + h * k_sh, v + t * v_st + h * v_sh};            \
            int8_t* caches[2] = {k_cache, v_cache};                                           \
            for (int kv = 0; kv < 2; kv++) {                                                  \
                float x[MAX_DIM];                                                             \
                for (int64_t d = 0; d < dim; d++) x[d] = LOAD(rows[kv][d]);                   \
                walsh_hadamard(x, dim);                                                       \
                quantize_row(x, dim, caches[kv] + at);                                        \
            }                                                                                 \
        }                                                                                     \
        return 0;                                                                             \
    }

DEFINE_STORE(tandem_store_kv_i8_bf16, uint16_t, bf16_load)
DEFINE_STORE(tandem_store_kv_i8_f16, _Float16, f16_load)
DEFINE_STORE(tandem_store_kv_i8_f32, float, f32_load)
