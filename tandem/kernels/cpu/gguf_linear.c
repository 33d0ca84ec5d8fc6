/* A projection whose weights are a GGUF's codes, for the few rows of a decode step, on
 * Intel AMX: y[M, N] = x[M, K] @ W^T (+ bias), bfloat16 in and out.
 *
 * W is read as stored: along each row, groups of 32 weights, Q4_1 (q * d + m, q in
 * 0..15, d and m float16: a quarter of the bytes of bfloat16 weights) or Q8_0 (q * d,
 * q in -128..127: about half). Each group of 16 rows is expanded in turn to bfloat16
 * in a 1 KiB tile (in float32, then rounded to nearest even: the very weights the
 * engine's loader makes, checked by the caller through tandem_q*_dequant_bf16), and
 * one AMX instruction multiplies it with up to 16 rows of x, accumulating in float32.
 * A step of up to 64 rows expands each weight once; oneDNN's dense kernel reads
 * 2-4x the bytes, and torch's int4 kernel expands the weights again for every row
 * (tandem/engine/gguf_int4.py).
 *
 * Layout (gguf_int4.pack and pack_q8_0), per group of 16 rows and 32 columns:
 * Q4_1: codes [16 rows][16 bytes], the low nibble of byte j being weight j of the
 *       group and the high nibble weight j + 16; scales [32] float16, the rows' d
 *       then their m;
 * Q8_0: codes [16 rows][32 bytes]; scales [16] float16, the rows' d;
 * both in [N/16][K/32] order.
 *
 * Built only where the compiler targets AMX-BF16 and AVX512-BF16 (-march=native on
 * such a CPU); elsewhere every entry point returns CODES_NO_AMX and the engine keeps its
 * other forms.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CODES_OK 0
#define CODES_BAD_SHAPE -1
#define CODES_NO_AMX -2
#define CODES_NO_MEMORY -3
#define CODES_MAX_ROWS 64

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The process asks Linux once for the AMX register state; 1 if granted. */
int tandem_codes_amx_ready(void) {
    static int ready = -1; /* asking twice is harmless: racing callers may */
    int known = __atomic_load_n(&ready, __ATOMIC_RELAXED);
    if (known < 0) {
        known = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&ready, known, __ATOMIC_RELAXED);
    }
    return known;
}

enum { Q4_1 = 0, Q8_0 = 1 };
static const int code_bytes[] = {256, 512}, scale_halves[] = {32, 16}; /* per tile */

/* 16 rows x 32 weights of one group, as bfloat16, row-major (64 bytes a row). d * q is
 * exact in float32 (an 11-bit significand times 4 or 8 bits), so the fused
 * multiply-add rounds once, as the loader's product and then sum do. */
static inline void expand_q4_1(const uint8_t *codes, const uint16_t *dm, uint16_t *out) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + 16)));
    const __m512i nibble = _mm512_set1_epi32(0xF);
    for (int r = 0; r < 16; r++) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * r)));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(c, nibble));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
        __m512 dr = _mm512_permutexvar_ps(_mm512_set1_epi32(r), d);
        __m512 mr = _mm512_permutexvar_ps(_mm512_set1_epi32(r), m);
        lo = _mm512_fmadd_ps(lo, dr, mr);
        hi = _mm512_fmadd_ps(hi, dr, mr);
        _mm512_storeu_si512((void *)(out + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

static inline void expand_q8_0(const uint8_t *codes, const uint16_t *scales, uint16_t *out) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
    for (int r = 0; r < 16; r++) {
        const __m128i *row = (const __m128i *)(codes + 32 * r);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1)));
        __m512 dr = _mm512_permutexvar_ps(_mm512_set1_epi32(r), d);
        lo = _mm512_mul_ps(lo, dr);
        hi = _mm512_mul_ps(hi, dr);
        _mm512_storeu_si512((void *)(out + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

static inline void expand(int kind, const uint8_t *codes, const uint16_t *scales, uint16_t *out) {
    if (kind == Q4_1)
        expand_q4_1(codes, scales, out);
    else
        expand_q8_0(codes, scales, out);
}

/* x's rows as AMX B tiles, one per (16 rows, group): dword [p][j] holds x[j][2p, 2p+1]
 * of the group; rows past M are zero. The buffer is the calling thread's, kept. */
static uint32_t *x_tiles(const uint16_t *x, int M, int K) {
    static _Thread_local uint32_t *buf;
    static _Thread_local size_t capacity;
    const int KB = K / 32, MB = (M + 15) / 16;
    size_t need = (size_t)MB * KB * 256;
    if (need > capacity) {
        free(buf);
        buf = aligned_alloc(64, need * 4);
        capacity = buf ? need : 0;
        if (!buf) return NULL;
    }
    const uint32_t *x32 = (const uint32_t *)x;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(K / 2));
    for (int mb = 0; mb < MB; mb++) {
        int left = M - mb * 16;
        __mmask16 live = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        const uint32_t *base = x32 + (size_t)mb * 16 * (K / 2);
        for (int kb = 0; kb < KB; kb++) {
            uint32_t *t = buf + ((size_t)mb * KB + kb) * 256;
            for (int p = 0; p < 16; p++) {
                __m512i v = _mm512_mask_i32gather_epi32(
                    _mm512_setzero_si512(), live, rows, base + kb * 16 + p, 4);
                _mm512_store_si512((void *)(t + 16 * p), v);
            }
        }
    }
    return buf;
}

#define TILE_DOT(c, row_block)                                                           \
    do {                                                                                 \
        _tile_loadd(5, xt + ((size_t)(row_block) * KB + kb) * 256, 64);                  \
        _tile_dpbf16ps(c, 4, 5);                                                         \
    } while (0)

static inline __attribute__((always_inline)) int linear(
    int kind, const uint16_t *x, int M, int K, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *bias, uint16_t *y, int N, int threads) {
    if (M < 1 || M > CODES_MAX_ROWS || K < 32 || K % 32 || N < 16 || N % 16)
        return CODES_BAD_SHAPE;
    if (!tandem_codes_amx_ready()) return CODES_NO_AMX;
    const uint32_t *xt = x_tiles(x, M, K);
    if (!xt) return CODES_NO_MEMORY;
    const int KB = K / 32, NB = N / 16, MB = (M + 15) / 16;
    _Pragma("omp parallel num_threads(threads)") {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int t = 0; t < 6; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
        _tile_loadconfig(&cfg);
        uint16_t w[2][16 * 32] __attribute__((aligned(64)));
        float acc[16 * 16] __attribute__((aligned(64)));
        const __m512i column = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(16));
        _Pragma("omp for schedule(static)") for (int nb = 0; nb < NB; nb++) {
            /* tiles 0-3: y's row blocks (float32); 4: the weights; 5: x */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const int cb = code_bytes[kind], sh = scale_halves[kind];
            const uint8_t *cp = codes + (size_t)nb * KB * cb;
            const uint16_t *dp = scales + (size_t)nb * KB * sh;
            for (int kb = 0; kb < KB; kb++) {
                /* Ask for the group four ahead (it may be the next block's, or past the
                 * end: a prefetch never faults). */
                const char *ahead = (const char *)(cp + (size_t)(kb + 4) * cb);
                for (int line = 0; line < cb; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
                _mm_prefetch((const char *)(dp + (size_t)(kb + 4) * sh), _MM_HINT_T0);
                uint16_t *tile = w[kb & 1]; /* two, so a tile load never waits on the next expansion */
                expand(kind, cp + (size_t)kb * cb, dp + (size_t)kb * sh, tile);
                _tile_loadd(4, tile, 64);
                TILE_DOT(0, 0);
                if (MB > 1) TILE_DOT(1, 1);
                if (MB > 2) TILE_DOT(2, 2);
                if (MB > 3) TILE_DOT(3, 3);
            }
            __m512 b = bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                                  (const __m256i *)(bias + (size_t)nb * 16)))
                            : _mm512_setzero_ps();
            for (int mb = 0; mb < MB; mb++) {
                switch (mb) { /* a tile register is named by a constant */
                case 0: _tile_stored(0, acc, 64); break;
                case 1: _tile_stored(1, acc, 64); break;
                case 2: _tile_stored(2, acc, 64); break;
                default: _tile_stored(3, acc, 64); break;
                }
                /* acc[n][j]: y's row mb * 16 + j, column nb * 16 + n; the bias is added
                 * in float32 before the one rounding, as oneDNN does. */
                for (int j = 0; j < 16 && mb * 16 + j < M; j++) {
                    __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, acc + j, 4), b);
                    _mm256_storeu_si256((__m256i *)(y + (size_t)(mb * 16 + j) * N + nb * 16),
                                        (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
        _tile_release();
    }
    return CODES_OK;
}

/* The weights the kernel computes with: [N, K] bfloat16, row-major. */
static int dequant(int kind, const uint8_t *codes, const uint16_t *scales, int N, int K,
                   uint16_t *w) {
    if (K < 32 || K % 32 || N < 16 || N % 16) return CODES_BAD_SHAPE;
    const int KB = K / 32, cb = code_bytes[kind], sh = scale_halves[kind];
    uint16_t tile[16 * 32] __attribute__((aligned(64)));
    for (int nb = 0; nb < N / 16; nb++)
        for (int kb = 0; kb < KB; kb++) {
            size_t at = (size_t)nb * KB + kb;
            expand(kind, codes + at * cb, scales + at * sh, tile);
            for (int r = 0; r < 16; r++)
                memcpy(w + (size_t)(nb * 16 + r) * K + (size_t)kb * 32, tile + 32 * r, 64);
        }
    return CODES_OK;
}

#define ENTRY_POINTS(name, kind)                                                           \
    int tandem_##name##_linear_bf16(const uint16_t *x, int M, int K, const uint8_t *codes,  \
                                    const uint16_t *scales, const uint16_t *bias,          \
                                    uint16_t *y, int N, int threads) {                     \
        return linear(kind, x, M, K, codes, scales, bias, y, N, threads);                  \
    }                                                                                      \
    int tandem_##name##_dequant_bf16(const uint8_t *codes, const uint16_t *scales, int N,  \
                                     int K, uint16_t *w) {                                 \
        return dequant(kind, codes, scales, N, K, w);                                      \
    }

#else /* no AMX on the CPU this was built for */

int tandem_codes_amx_ready(void) { return 0; }

#define ENTRY_POINTS(name, kind)                                                           \
    int tandem_##name##_linear_bf16(const uint16_t *x, int M, int K, const uint8_t *codes,  \
                                    const uint16_t *scales, const uint16_t *bias,          \
                                    uint16_t *y, int N, int threads) {                     \
        (void)x, (void)M, (void)K, (void)codes, (void)scales, (void)bias, (void)y, (void)N; \
        (void)threads;                                                                     \
        return CODES_NO_AMX;                                                                  \
    }                                                                                      \
    int tandem_##name##_dequant_bf16(const uint8_t *codes, const uint16_t *scales, int N,  \
                                     int K, uint16_t *w) {                                 \
        (void)codes, (void)scales, (void)N, (void)K, (void)w;                              \
        return CODES_NO_AMX;                                                                  \
    }

#endif

ENTRY_POINTS(q4, Q4_1)
ENTRY_POINTS(q8, Q8_0)
