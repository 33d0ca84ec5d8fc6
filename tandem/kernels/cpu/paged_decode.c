/* Paged decode attention on the CPU: one query row per sequence over its cached
 * context, read in place from the paged KV cache through the block table.
 *
 * The torch backend gathers every sequence's blocks into a contiguous copy (and
 * copies them again into the layout its matmuls want) before two small batched
 * matmuls per layer; here each (sequence, KV head) is one task that walks its
 * blocks once for the scores and once for the values, in float32, with the group
 * of query heads that share the KV head computed together so that every K/V row
 * is loaded once. Tasks are spread over OpenMP threads (torch's own runtime: the
 * library is loaded after torch, whose libgomp.so.1 it then shares).
 *
 * Layouts (all contiguous unless a stride is passed):
 *   q            [batch, heads, dim], row stride q_stride elements
 *   k/v cache    [num_blocks, block_size, kv_heads, dim] (one layer's)
 *   tables       [batch, table_stride] int64 block ids
 *   lens         [batch] int64 context lengths (the new token included, >= 1)
 *   out          [batch, heads, dim], row stride out_stride elements
 * Built by tandem/kernels/cpu/build.py; the caller checks shapes and limits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                   \
    int NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,               \
             const int64_t* tables, int64_t table_stride, const int64_t* lens, int64_t batch, \
             int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,   \
             T* out, int64_t out_stride, int threads) {                                       \
        const int64_t group = heads / kv_heads;                                               \
        if (group > MAX_GROUP || dim > MAX_DIM || group * kv_heads != heads) return -1;       \
        const int64_t row = kv_heads * dim; /* elements between a block's tokens */           \
        int failed = 0;                                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t task = 0; task < batch * kv_heads; task++) {                             \
            const int64_t b = task / kv_heads, h = task % kv_heads, len = lens[b];            \
            const int64_t* table = tables + b * table_stride;                                 \
            float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], top[MAX_GROUP];            \
            float* scores = malloc(sizeof(float) * group * len); /* [group][len] */           \
            if (scores == NULL) {                                                             \
                failed = 1;                                                                   \
                continue;                                                                     \
            }                                                                                 \
            for (int64_t j = 0; j < group; j++) {                                             \
                const T* qj = q + b * q_stride + (h * group + j) * dim;                       \
                for (int64_t d = 0; d < dim; d++) qf[j][d] = LOAD(qj[d]) * scale;             \
                for (int64_t d = 0; d < dim; d++) acc[j][d] = 0.f;                            \
                top[j] = -INFINITY;                                                           \
            }                                                                                 \
            /* Scores, block by block: t is the token's position in the sequence. */          \
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                \
                const T* kb = k_cache + table[t0 / block_size] * block_size * row + h * dim;  \
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;              \
                for (int64_t i = 0; i < n; i++) {                                             \
                    float kf[MAX_DIM];                                                        \
                    for (int64_t d = 0; d < dim; d++) kf[d] = LOAD(kb[i * row + d]);          \
                    for (int64_t j = 0; j < group; j++) {                                     \
                        float dot = 0.f;                                                      \
                        _Pragma("omp simd reduction(+ : dot)")                                \
                        for (int64_t d = 0; d < dim; d++) dot += qf[j][d] * kf[d];            \
                        scores[j * len + t0 + i] = dot;                                       \
                        top[j] = dot > top[j] ? dot : top[j];                                 \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            float total[MAX_GROUP];                                                           \
            for (int64_t j = 0; j < group; j++) {                                             \
                float sum = 0.f;                                                              \
                for (int64_t t = 0; t < len; t++) {                                           \
                    const float p = expf(scores[j * len + t] - top[j]);                       \
                    scores[j * len + t] = p;                                                  \
                    sum += p;                                                                 \
                }                                                                             \
                total[j] = sum;                                                               \
            }                                                                                 \
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                \
                const T* vb = v_cache + table[t0 / block_size] * block_size * row + h * dim;  \
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;              \
                for (int64_t i = 0; i < n; i++) {                                             \
                    float vf[MAX_DIM];                                                        \
                    for (int64_t d = 0; d < dim; d++) vf[d] = LOAD(vb[i * row + d]);          \
                    for (int64_t j = 0; j < group; j++) {                                     \
                        const float p = scores[j * len + t0 + i];                             \
                        _Pragma("omp simd")                                                   \
                        for (int64_t d = 0; d < dim; d++) acc[j][d] += p * vf[d];             \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            for (int64_t j = 0; j < group; j++) {                                             \
                T* oj = out + b * out_stride + (h * group + j) * dim;                         \
                const float inv = 1.f / total[j];                                             \
                for (int64_t d = 0; d < dim; d++) oj[d] = STORE(acc[j][d] * inv);             \
            }                                                                                 \
            free(scores);                                                                     \
        }                                                                                     \
        return failed ? -2 : 0;                                                               \
    }

DEFINE_DECODE(tandem_decode_attention_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_DECODE(tandem_decode_attention_f16, _Float16, f16_load, f16_store)
DEFINE_DECODE(tandem_decode_attention_f32, float, f32_load, f32_store)
