/* bfloat16 products on Intel AMX tiles, over packed (GGML block) weights.
 *
 * The weights are decoded once per call, a panel of 32 weight rows by up to KC values at a
 * time, straight into the tiles' bfloat16 pair layout (no float32 copy of the matrix, no
 * second pass to round it), and every activation row then multiplies the panel: 32 rows at
 * a time in four 16 x 16 float32 accumulator tiles, which are written out as float32. Sums
 * are float32, as oneDNN's are; only the inputs are rounded (to nearest even), once.
 *
 * Built where the compiler targets AMX (-march=native on such a CPU); a process must also
 * have asked the kernel for the tile state (tiergen._platform.amx_usable) before calling.
 * tg_amx_bf16 says whether this build has the engine. tg_bf16, built everywhere, rounds
 * float32 or float16 to bfloat16 as torch does, for the tiles' inputs (a long prompt's
 * activations, its attention's queries and cache). */
#include "amx.h"
#include "blocks.h"
#include "tiergen.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* ---- Rounding to bfloat16 -------------------------------------------------------------
 * As bf16_of (blocks.h) does, sixteen at a time. */

#if defined(__AVX512F__)
static inline __m256i bf16_16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* out[0..n) = v[0..n) (float32, or float16 where f16) rounded to bfloat16. */
static inline void round_bf16(const void *v, int f16, int64_t n, uint16_t *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (f16)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(out + i), bf16_16(_mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i)))));
    else
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(out + i), bf16_16(_mm512_loadu_ps((const float *)v + i)));
#endif
    for (; i < n; i++) {
        uint32_t u;
        const float f = f16 ? half((const uint8_t *)v + 2 * i) : ((const float *)v)[i];
        memcpy(&u, &f, 4);
        out[i] = bf16_of(u);
    }
}

#define BF16_PIECE 4096 /* values a thread rounds at a time */

void tg_bf16(const void *src, int f16, int64_t rows, int64_t n, int64_t stride, uint16_t *dst) {
    const int64_t pieces = (n + BF16_PIECE - 1) / BF16_PIECE, size = f16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * n >= (1 << 15))
    for (int64_t t = 0; t < rows * pieces; t++) {
        const int64_t r = t / pieces, i = t % pieces * BF16_PIECE;
        const int64_t len = n - i < BF16_PIECE ? n - i : BF16_PIECE;
        round_bf16((const char *)src + (r * stride + i) * size, f16, len, dst + r * n + i);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#define KC 2048 /* values of a panel decoded at a time: 128 KB of bfloat16, in L2 */


typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-3: accumulators (rows i..i+15 / i+16..i+31 by columns 0-15 / 16-31); 4-5: the two
 * row halves of x; 6-7: the panel's two column halves. All 16 rows of 64 bytes. */
static void load_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* panel[s][h][p][c] = the bfloat16 pair (k = 2p, 2p + 1 of step s) of column 16h + c: what a
 * B tile of step s holds for columns 16h..16h+15. Columns past ncols are zero. */
typedef uint32_t panel_t[KC / 32][2][16][16];

/* r[j] lane i := r[i] lane j, for 16 x 16 32-bit values */
static inline void turn16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
        r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
    }
}

/* (a, b) rounded to bfloat16 as bf16_16 rounds them, in order: lane p the pair of values 2p
 * and 2p + 1 of the 32. By the instruction where the CPU has it, which differs from torch's
 * rounding only on subnormals (it reads them as zero) and NaN: values that a weight's
 * decoding does not give, but which take bf16_16 if they come. */
static inline __m512i bf16_32(__m512 a, __m512 b) {
#if defined(__AVX512BF16__)
    const int odd = 0x01 | 0x20 | 0x80; /* quiet NaN, subnormal, signalling NaN */
    if (!(_mm512_fpclass_ps_mask(a, odd) | _mm512_fpclass_ps_mask(b, odd)))
        return (__m512i)_mm512_cvtne2ps_pbh(b, a);
#endif
    return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_16(a)), bf16_16(b), 1);
}

/* out[j][i] = in[i * ld + j] for 16 x 16 32-bit values (out's rows contiguous). */
static inline void transpose16(const uint32_t *in, int64_t ld, uint32_t *out) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(in + i * ld);
    turn16(r);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(out + 16 * i, r[i]);
}

/* A panel's decoding: for each half (16 columns) and block, each column's block decoded,
 * its values rounded to bfloat16 pairs 32 at a time in a register (to nearest even), and the
 * 16 columns' registers turned across into a step's 16 rows of the panel. Every line of the
 * panel's columns is asked for first: a column's run of blocks is too short for the hardware
 * to see a stream in it, and waiting on one block at a time bounded a product of few rows. */
static inline void prefetch_panel(const uint8_t *w, int64_t row, int64_t r0, int ncols,
                                  int64_t first, int64_t span) {
    for (int c = 0; c < ncols; c++)
        for (int64_t o = 0; o < span; o += 64) __builtin_prefetch(w + (r0 + c) * row + first + o);
}

static inline int half_columns(int ncols, int h) {
    const int cols = ncols - 16 * h;
    return cols < 0 ? 0 : cols > 16 ? 16 : cols;
}

static inline void store_step(__m512i r[16], uint32_t *rows) {
    turn16(r);
    for (int p = 0; p < 16; p++) _mm512_store_si512(rows + 16 * p, r[p]);
}

/* a * q[0..16) + c, as packed.c's widen computes it */
static inline __m512 widen16(const int8_t *q, float a, float c) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)q))),
                           _mm512_set1_ps(a), _mm512_set1_ps(c));
}

/* A panel of a type of blocks.h's list, its blocks unpacked by UNPACK inline. */
static inline __attribute__((always_inline)) void
unpacked_panel(const int QK, const int L, const int BYTES,
               void (*unpack)(const uint8_t *, int8_t *, float *, float *), const uint8_t *w,
               int64_t nb, int64_t r0, int ncols, int64_t k0, int64_t len, panel_t panel) {
    prefetch_panel(w, nb * BYTES, r0, ncols, k0 / QK * BYTES, len / QK * BYTES);
    for (int h = 0; h < 2; h++) {
        const int cols = half_columns(ncols, h);
        for (int64_t b = 0; b < len / QK; b++) {
            int8_t q[16][QK] __attribute__((aligned(64)));
            float a[16][QK / L], c[16][QK / L];
            for (int j = 0; j < cols; j++)
                unpack(w + ((r0 + 16 * h + j) * nb + k0 / QK + b) * BYTES, q[j], a[j], c[j]);
            for (int g = 0; g < QK / 32; g++) { /* a step's 16 pairs of each column */
                const int lo = 32 * g / L, hi = (32 * g + 16) / L;
                __m512i r[16];
                for (int j = 0; j < 16; j++)
                    r[j] = j < cols ? bf16_32(widen16(q[j] + 32 * g, a[j][lo], c[j][lo]),
                                              widen16(q[j] + 32 * g + 16, a[j][hi], c[j][hi]))
                                    : _mm512_setzero_si512();
                store_step(r, panel[b * QK / 32 + g][h][0]);
            }
        }
    }
}

#define TYPE_PANEL(name, QK, L, BYTES)                                                        \
    static void panel_##name(const uint8_t *w, int64_t nb, int64_t r0, int ncols, int64_t k0, \
                             int64_t len, panel_t panel) {                                    \
        unpacked_panel(QK, L, BYTES, un_##name, w, nb, r0, ncols, k0, len, panel);            \
    }
BLOCK_TYPES(TYPE_PANEL)

static int typed_panel(int type, const uint8_t *w, int64_t nb, int64_t r0, int ncols,
                       int64_t k0, int64_t len, panel_t panel) {
    DISPATCH(panel, type, , (w, nb, r0, ncols, k0, len, panel))
}

/* The panel of W's columns r0..r0+ncols-1 (rows of nb blocks), values k0..k0+len-1. */
static void decode_panel(const amx_matrix *W, int64_t nb, int64_t r0, int ncols, int64_t k0,
                         int64_t len, panel_t panel) {
    if (typed_panel(W->type, W->w, nb, r0, ncols, k0, len, panel) == 0) return;
    const int qk = W->qk, bytes = W->bytes; /* another type (FP8): by its block decoder */
    float v[16][256] __attribute__((aligned(64)));
    prefetch_panel(W->w, nb * bytes, r0, ncols, k0 / qk * bytes, len / qk * bytes);
    for (int h = 0; h < 2; h++) {
        const int cols = half_columns(ncols, h);
        for (int64_t b = 0; b < len / qk; b++) {
            for (int j = 0; j < cols; j++)
                W->decode(W->w + ((r0 + 16 * h + j) * nb + k0 / qk + b) * bytes, v[j]);
            for (int g = 0; g < qk / 32; g++) {
                __m512i r[16];
                for (int j = 0; j < 16; j++)
                    r[j] = j < cols ? bf16_32(_mm512_load_ps(v[j] + 32 * g),
                                              _mm512_load_ps(v[j] + 32 * g + 16))
                                    : _mm512_setzero_si512();
                store_step(r, panel[b * qk / 32 + g][h][0]);
            }
        }
    }
}

/* The accumulators of rows i..i+31 by the panel's 32 columns at c (row stride ld floats). */
static inline void load_acc(const float *c, int64_t ld) {
    _tile_loadd(0, c, ld * 4);
    _tile_loadd(1, c + 16, ld * 4);
    _tile_loadd(2, c + 16 * ld, ld * 4);
    _tile_loadd(3, c + 16 * ld + 16, ld * 4);
}

static inline void store_acc(float *c, int64_t ld) {
    _tile_stored(0, c, ld * 4);
    _tile_stored(1, c + 16, ld * 4);
    _tile_stored(2, c + 16 * ld, ld * 4);
    _tile_stored(3, c + 16 * ld + 16, ld * 4);
}

/* Rows i..i+31 of x's values k0..k0+len against the panel, into the accumulators. */
static inline void multiply(const uint16_t *x, int64_t k, int64_t i, int64_t k0, int64_t len,
                            panel_t panel) {
    for (int64_t s = 0; s < len / 32; s++) {
        _tile_loadd(4, x + i * k + k0 + 32 * s, k * 2);
        _tile_loadd(6, panel[s][0], 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, panel[s][1], 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, x + (i + 16) * k + k0 + 32 * s, k * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* Decoded panels a thread keeps at a time (a group), multiplying each 32-row block of x by all
 * of them: x is then read once a group from memory, not once a panel, which a long prompt's
 * rows (megabytes, past L2) made the bound. */
#define GROUP_BYTES (1 << 20)

/* Panels in a thread's group: as many as fit GROUP_BYTES (one at least), in groups whose number
 * is a multiple of the threads (even work). */
static int64_t panel_group(int64_t panels, int64_t panel_bytes) {
    const int64_t threads = omp_get_max_threads();
    const int64_t most = GROUP_BYTES / panel_bytes > 1 ? GROUP_BYTES / panel_bytes : 1;
    const int64_t rounds = (panels + threads * most - 1) / (threads * most);
    return (panels + threads * rounds - 1) / (threads * rounds);
}

void amx_bf16_linear(const amx_matrix *W, int64_t n, int64_t k, const uint16_t *x, int64_t m,
                     float *y, int64_t ldy) {
    const int qk = W->qk;
    const int64_t nb = k / qk, panels = (n + 31) / 32, chunks = (k + KC - 1) / KC;
    int64_t step = (k + chunks - 1) / chunks; /* even chunks of at most KC, whole blocks */
    step = (step + qk - 1) / qk * qk;
    /* each thread's group: panels of step / 32 steps (64 bytes a value pair row) each */
    const int64_t threads = omp_get_max_threads(), size = step * 64;
    int64_t group = panel_group(panels, size);
    char *groups_at = group > 1 ? aligned_alloc(64, threads * group * size) : NULL;
    if (groups_at == NULL) group = 1; /* (then the one panel each thread keeps anyway) */
    const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel
    {
        static __thread panel_t one __attribute__((aligned(64)));
        char *own = groups_at ? groups_at + omp_get_thread_num() * group * size : (char *)one;
#define PANEL(j) (*(panel_t *)(own + (j) * size))
        float edge[32][32] __attribute__((aligned(64)));
        load_tiles();
        for (int64_t k0 = 0; k0 < k; k0 += step) {
            const int64_t len = k - k0 < step ? k - k0 : step;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t j0 = g * group, j1 = j0 + group < panels ? j0 + group : panels;
                for (int64_t j = j0; j < j1; j++) {
                    const int64_t r0 = 32 * j;
                    const int ncols = n - r0 < 32 ? (int)(n - r0) : 32;
                    decode_panel(W, nb, r0, ncols, k0, len, PANEL(j - j0));
                }
                for (int64_t i = 0; i < m; i += 32)
                    for (int64_t j = j0; j < j1; j++) {
                        const int64_t r0 = 32 * j;
                        const int ncols = n - r0 < 32 ? (int)(n - r0) : 32;
                        float *c = y + i * ldy + r0;
                        if (ncols == 32) {
                            if (k0 == 0) {
                                _tile_zero(0);
                                _tile_zero(1);
                                _tile_zero(2);
                                _tile_zero(3);
                            } else {
                                load_acc(c, ldy);
                            }
                            multiply(x, k, i, k0, len, PANEL(j - j0));
                            store_acc(c, ldy);
                            continue;
                        }
                        /* the last, narrower panel: through a 32 x 32 buffer */
                        memset(edge, 0, sizeof edge);
                        if (k0 > 0)
                            for (int r = 0; r < 32; r++) memcpy(edge[r], c + r * ldy, ncols * 4);
                        load_acc(edge[0], 32);
                        multiply(x, k, i, k0, len, PANEL(j - j0));
                        store_acc(edge[0], 32);
                        for (int r = 0; r < 32; r++) memcpy(c + r * ldy, edge[r], ncols * 4);
                    }
            }
        }
#undef PANEL
        _tile_release();
    }
    free(groups_at);
}

/* Each thread keeps the decoded panels of a group of column pairs (the gate's 32 columns and
 * the up's same 32); a block of 32 rows by the group's pairs is summed on the tiles into a
 * buffer of the gate's columns and one of the up's, and leaves as act(gate) * up in bfloat16,
 * by tg_glu's own code. The float32
 * products (m x 2n) would go out to memory and back; this writes m x n bfloat16. */
int amx_bf16_glu(const amx_matrix *gate, const amx_matrix *up, int64_t n, int64_t k,
                 const uint16_t *x, int64_t m, int gelu, uint16_t *h) {
    if (k > KC || k % gate->qk || k % up->qk || n % 32 || m % 32) return -1;
    const int64_t pairs = n / 32, size = k * 64; /* a panel: k / 32 steps of 2 KB */
    const int64_t threads = omp_get_max_threads(), group = panel_group(pairs, 2 * size);
    const int64_t groups = (pairs + group - 1) / group;
    const int64_t width = group * 32; /* a group's columns of the gate (and of the up) */
    const int64_t own_bytes = group * 2 * size + 2 * 32 * width * 4; /* panels, then sums */
    char *groups_at = aligned_alloc(64, threads * own_bytes);
    if (groups_at == NULL) return -2;
#pragma omp parallel
    {
        char *own = groups_at + omp_get_thread_num() * own_bytes;
#define PANEL(j) (*(panel_t *)(own + (j) * size))
        float *sums = (float *)(own + group * 2 * size); /* 32 rows of the gate's, the up's */
        load_tiles();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t j0 = g * group, j1 = j0 + group < pairs ? j0 + group : pairs;
            for (int64_t j = j0; j < j1; j++) {
                decode_panel(gate, k / gate->qk, 32 * j, 32, 0, k, PANEL(2 * (j - j0)));
                decode_panel(up, k / up->qk, 32 * j, 32, 0, k, PANEL(2 * (j - j0) + 1));
            }
            for (int64_t i = 0; i < m; i += 32) {
                for (int64_t j = j0; j < j1; j++)
                    for (int half = 0; half < 2; half++) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        multiply(x, k, i, 0, k, PANEL(2 * (j - j0) + half));
                        store_acc(sums + half * 32 * width + 32 * (j - j0), width);
                    }
                for (int r = 0; r < 32; r++)
                    tg_glu_row(sums + r * width, sums + 32 * width + r * width,
                               32 * (j1 - j0), gelu, h + (i + r) * n + 32 * j0, 1);
            }
        }
#undef PANEL
        _tile_release();
    }
    free(groups_at);
    return 0;
}

/* ---- bfloat16 weights as a checkpoint stores them -----------------------------------------
 * y (m, n) = x (m, k) @ W (n, k)^T for a bfloat16 W in its own row-major layout: the tiles
 * take W as their A operand, 16 of its rows by 32 values loaded straight from the matrix, and
 * x as B, turned into the pair layout once per call (x is small beside W). Each accumulator
 * (16 weight rows by 16 tokens) is turned across on its way out. No copy of W, no reorder:
 * a decode step streams each weight once for all its rows. A token's sums do not depend on
 * the others in its tile, so each row's numbers are the same in any batch. */

#define DENSE_TOKENS 256 /* tokens whose pair layout (DENSE_TOKENS x k bfloat16) stays in L2 */

/* xt[b][s] (16 pairs by 16 tokens, 32-bit) = the B tile of token block b, step s, for
 * tokens t0.. of x (m rows of k values; tokens past m zero). */
static void pair_layout(const uint16_t *x, int64_t m, int64_t k, int64_t t0, int64_t blocks,
                        uint32_t *xt) {
    const int64_t steps = k / 32, ld = k / 2;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = t0 + 16 * b, valid = m - first < 16 ? m - first : 16;
        uint32_t edge[16][16] __attribute__((aligned(64)));
        for (int64_t s = 0; s < steps; s++) {
            uint32_t *out = xt + (b * steps + s) * 256;
            if (valid == 16) {
                transpose16((const uint32_t *)x + first * ld + 16 * s, ld, out);
                continue;
            }
            memset(edge, 0, sizeof edge);
            for (int64_t i = 0; i < valid; i++)
                memcpy(edge[i], (const uint32_t *)x + (first + i) * ld + 16 * s, 64);
            transpose16(edge[0], 16, out);
        }
    }
}

/* Accumulator tile t (weight rows r.. by tokens t..) out to y, turned across, plus bias (its
 * `rows` values, or NULL): rows of y are tokens; `rows` weight rows and `tokens` tokens of it
 * are real. */
static inline void store_across(int t, float *y, int64_t ldy, int rows, int64_t tokens,
                                const float *bias, int bf16) {
    uint32_t acc[16][16] __attribute__((aligned(64)));
    float across[16][16] __attribute__((aligned(64)));
    switch (t) {
    case 0: _tile_stored(0, acc, 64); break;
    case 1: _tile_stored(1, acc, 64); break;
    case 2: _tile_stored(2, acc, 64); break;
    default: _tile_stored(3, acc, 64); break;
    }
    transpose16(acc[0], 16, (uint32_t *)across[0]);
    for (int64_t i = 0; i < tokens; i++) {
        if (bias != NULL)
            for (int j = 0; j < rows; j++) across[i][j] += bias[j];
        if (bf16)
            round_bf16(across[i], 0, rows, (uint16_t *)y + i * ldy);
        else
            memcpy(y + i * ldy, across[i], 4 * rows);
    }
}

int tg_amx_dense(const uint16_t *w, int64_t n, int64_t k, const uint16_t *x, int64_t m,
                 const float *bias, void *y, int64_t ldy, int bf16) {
    if (k % 32) return -1;
    if (m <= 0) return 0;
    const int64_t steps = k / 32, panels = (n + 31) / 32, size = bf16 ? 2 : 4;
    const int64_t most = m < DENSE_TOKENS ? (m + 31) / 32 * 32 : DENSE_TOKENS;
    uint32_t *xt = aligned_alloc(64, (size_t)most * k * 2);
    if (xt == NULL) return -2;
    int failed = 0;
#pragma omp parallel
    {
        load_tiles();
        uint16_t *own = NULL; /* the last panel's rows and zeros (where n is not 32's multiple) */
        for (int64_t t0 = 0; t0 < m; t0 += DENSE_TOKENS) {
            const int64_t tokens = m - t0 < DENSE_TOKENS ? m - t0 : DENSE_TOKENS;
            const int64_t blocks = (tokens + 31) / 32 * 2;
            pair_layout(x, m, k, t0, blocks, xt); /* (its omp for ends in a barrier) */
#pragma omp for schedule(static)
            for (int64_t j = 0; j < panels; j++) {
                const int64_t r0 = 32 * j;
                const int rows = n - r0 < 32 ? (int)(n - r0) : 32;
                const uint16_t *a = w + r0 * k;
                if (rows < 32) { /* the last, narrower panel: its rows, then zeros */
                    if (own == NULL && (own = aligned_alloc(64, (size_t)32 * k * 2)) == NULL) {
                        failed = 1;
                        continue;
                    }
                    memset(own, 0, (size_t)32 * k * 2);
                    memcpy(own, a, (size_t)rows * k * 2);
                    a = own;
                }
                for (int64_t b = 0; b < blocks; b += 2) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    const uint32_t *b0 = xt + b * steps * 256, *b1 = b0 + steps * 256;
                    for (int64_t s = 0; s < steps; s++) {
                        _tile_loadd(4, a + 32 * s, k * 2);
                        _tile_loadd(6, b0 + 256 * s, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_loadd(7, b1 + 256 * s, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(5, a + 16 * k + 32 * s, k * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    /* tile 2a + h: weight rows r0 + 16a.., tokens t0 + 16(b + h).. */
                    for (int t = 0; t < 4; t++) {
                        const int64_t first = t0 + 16 * (b + t % 2), col = r0 + 16 * (t / 2);
                        const int64_t valid = m - first < 16 ? m - first : 16;
                        const int wide = rows - 16 * (t / 2) < 16 ? rows - 16 * (t / 2) : 16;
                        if (valid > 0 && wide > 0)
                            store_across(t, (float *)((char *)y + (first * ldy + col) * size),
                                         ldy, wide, valid, bias ? bias + col : NULL, bf16);
                    }
                }
            }
        }
        _tile_release();
        free(own);
    }
    free(xt);
    return failed ? -2 : 0;
}

/* ---- A prompt's attention ---------------------------------------------------------------
 * Causal flash attention on the tiles (within a sliding window or not), turned across: a
 * block of 32 queries of one head against its keys, ATT_KB at a time, as k.q (keys by
 * queries) and v^T p^T (dimensions by queries), so that each query is a lane of the softmax's
 * vectors and the online softmax runs down the keys without a sum or maximum across a vector.
 * Inputs rounded to bfloat16, float32 sums, the probabilities rounded to bfloat16 for p.v; the
 * output (float32) stays in L1/L2 until the block's last keys. The tiles' products of the keys
 * before and after a step's keys are spread through its softmax, both passes of it, in units
 * of a few tile operations, so that both run at once (1.14x at SmolLM2's heads; its 64 wide
 * heads keep q^T in four tiles through a step's scores, which halves their loads). K and V are
 * first laid out for the tiles, each row once per call (in place of a copy to bfloat16). */

#define ATT_KB 128  /* keys of one online-softmax step */
#define ATT_DMAX 256 /* the widest head */

/* 2^y for y <= 0 (huge negatives give 0), to about 1e-4 relative, a twentieth of the
 * bfloat16 rounding that the probabilities then take: y = n + f, 2^f by a polynomial of
 * degree 3 (Chebyshev's fit on |f| <= 1/2), 2^n by scalef */
static inline __m512 exp2_16(__m512 y) {
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(5.592203513e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.426400781e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931210160e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999244809e-1f));
    return _mm512_scalef_ps(p, n);
}

/* lane i = the bfloat16 pair (a[i], b[i]), each rounded to nearest even (no NaN comes here) */
static inline __m512i bf16_pairs(__m512 a, __m512 b) {
#if defined(__AVX512BF16__)
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
#else
    return _mm512_or_si512(_mm512_cvtepu16_epi32(bf16_16(a)),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_16(b)), 16));
#endif
}

/* dst[r][0..D) (row-major, D values a row) = the first `rows` of src's rows (element type
 * 0 float32, 1 float16, 2 bfloat16; `stride` elements apart) in bfloat16; rows..n zero. */
static void rows_bf16(const char *src, int type, int64_t stride, int rows, int n, int64_t D,
                      uint16_t *dst) {
    const int size = type == 0 ? 4 : 2;
    for (int r = 0; r < rows; r++) {
        const char *row = src + r * stride * size;
        if (type == 2)
            memcpy(dst + r * D, row, D * 2);
        else
            round_bf16(row, type == 1, D, dst + r * D);
    }
    if (rows < n) memset(dst + rows * D, 0, (size_t)(n - rows) * D * 2);
}

/* Keys j0..j0+31 of one head (rows D values apart): kb = their rows in bfloat16 (A tiles of
 * k.q); vt = their values turned across, D rows of 32 keys (A tiles of v^T p^T). */
static void pack_keys(const char *k, const char *v, int type, int64_t S, int64_t D, int64_t j0,
                      uint16_t *kb, uint16_t *vt) {
    uint16_t t[32 * ATT_DMAX] __attribute__((aligned(64)));
    uint32_t pairs[16][16] __attribute__((aligned(64)));
    const int size = type == 0 ? 4 : 2, rows = S - j0 < 32 ? (int)(S - j0) : 32;
    rows_bf16(k + j0 * D * size, type, D, rows, 32, D, kb);
    rows_bf16(v + j0 * D * size, type, D, rows, 32, D, t);
    for (int64_t d = 0; d < D; d += 16) { /* pairs[p][c] = (v[2p][d + c], v[2p + 1][d + c]) */
        for (int p = 0; p < 16; p++) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i *)(t + 2 * p * D + d)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i *)(t + (2 * p + 1) * D + d)));
            _mm512_store_si512(pairs[p], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        transpose16(pairs[0], 16, (uint32_t *)(vt + d * 32));
    }
}

/* The tiles' buffers of one block of 32 queries (columns: the queries) */
typedef struct {
    uint32_t q[2][ATT_DMAX / 32][16][16]; /* q^T: B tiles by query half and step */
    float s[2][ATT_KB][32];               /* scores, a row a key (two blocks) */
    uint32_t p[2][ATT_KB / 2][32];        /* probabilities, a row a pair of keys (two blocks) */
    float o[ATT_DMAX][32];                /* output, a row a dimension */
} att_block;

/* The tiles' share of one softmax step, in units that att_pace spreads over the step's
 * vector work, so that the tiles and the vectors run at once: the next block's scores
 * (a unit: 32 keys) and the previous block's values (a unit: 32 dimensions by 32 keys). */
typedef struct {
    att_block *a;
    const uint16_t *kb, *vt; /* the next block's keys, the previous block's values */
    int64_t D;
    int next, prev;          /* their buffers in a.s and a.p */
    int ns, nv, units, done; /* units: ns of scores (32 keys, 16 where D is 64), then D/32 x
                              * nv of values */
} att_work;

/* Keys of one unit of scores: 64 wide heads keep q^T in tiles and take 16 keys a unit. */
static inline int att_score_keys(int64_t D) { return D == 64 ? 16 : 32; }

/* The units of scores of `keys` keys (whole blocks of 32) */
static inline int att_score_units(int64_t keys, int64_t D) {
    return (int)((keys + 31) / 32) * (32 / att_score_keys(D));
}

static inline void att_unit(att_work *w) {
    att_block *a = w->a;
    const int64_t D = w->D;
    const int i = w->done++;
    if (i < w->ns && att_score_keys(D) == 16) { /* a.s[next][js..js+16) = keys js.. */
        const int64_t js = 16 * i;
        float(*s)[32] = a->s[w->next];
        if (i == 0) { /* q^T stays in tiles 4-7 through the step's scores */
            _tile_loadd(4, a->q[0][0], 64);
            _tile_loadd(5, a->q[0][1], 64);
            _tile_loadd(6, a->q[1][0], 64);
            _tile_loadd(7, a->q[1][1], 64);
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, w->kb + js * D, D * 2);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 2, 6);
        _tile_loadd(3, w->kb + js * D + 32, D * 2);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(1, 3, 7);
        _tile_stored(0, &s[js][0], 128);
        _tile_stored(1, &s[js][16], 128);
        return;
    }
    if (i < w->ns) { /* a.s[next][js..js+32) = keys js.. by the queries */
        const int64_t js = 32 * i;
        float(*s)[32] = a->s[w->next];
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < D / 32; t++) {
            _tile_loadd(4, w->kb + js * D + 32 * t, D * 2);
            _tile_loadd(6, a->q[0][t], 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, a->q[1][t], 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, w->kb + (js + 16) * D + 32 * t, D * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, &s[js][0], 128);
        _tile_stored(1, &s[js][16], 128);
        _tile_stored(2, &s[js + 16][0], 128);
        _tile_stored(3, &s[js + 16][16], 128);
        return;
    }
    /* a.o[d..d+32) += v^T p^T over keys js..js+32, the output held in tiles 0-3 across js */
    const int u = i - w->ns, jb = u % w->nv;
    const int64_t d = u / w->nv * 32, js = 32 * jb;
    if (jb == 0) {
        _tile_loadd(0, &a->o[d][0], 128);
        _tile_loadd(1, &a->o[d][16], 128);
        _tile_loadd(2, &a->o[d + 16][0], 128);
        _tile_loadd(3, &a->o[d + 16][16], 128);
    }
    const uint16_t *at = w->vt + js * D + d * 32;
    _tile_loadd(4, at, 64);
    _tile_loadd(6, &a->p[w->prev][js / 2][0], 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, &a->p[w->prev][js / 2][16], 128);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, at + 16 * 32, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (jb == w->nv - 1) {
        _tile_stored(0, &a->o[d][0], 128);
        _tile_stored(1, &a->o[d][16], 128);
        _tile_stored(2, &a->o[d + 16][0], 128);
        _tile_stored(3, &a->o[d + 16][16], 128);
    }
}

/* the units due after `piece` of `pieces` pieces of vector work */
static inline void att_pace(att_work *w, int piece, int pieces) {
    while (w->done < w->units && (int64_t)w->done * pieces < (int64_t)piece * w->units)
        att_unit(w);
}

/* the lanes that see key j: low < j <= place */
static inline __mmask16 att_sees(__m512i low, __m512i place, int64_t j) {
    const __m512i key = _mm512_set1_epi32((int)j);
    return _mm512_cmpge_epi32_mask(place, key) & _mm512_cmplt_epi32_mask(low, key);
}

/* One step of the online softmax (base 2: scale2 = the scores' scale times log2 e) for the 16
 * queries of half h, which see the keys j with low < j <= place (lane by lane), over `width`
 * keys from k0 (scores in a.s[n]): the running max *m (scaled) and
 * sum *l updated, the probabilities into a.p[n] as bfloat16 pairs of keys; the output's
 * factor returned. Pieces 16 keys each, the tiles' units paced between them. */
static inline __m512 att_softmax(att_block *a, att_work *w, int n, int h, __m512i low,
                                 __m512i place, int64_t k0, int64_t width, float scale2,
                                 __m512 *m, __m512 *l) {
    const int whole = (att_sees(low, place, k0) & att_sees(low, place, k0 + width - 1)) == 0xffff;
    const float(*s)[32] = a->s[n];
    /* pieces: 64 keys of the maximum's pass, 16 of the exponentials' (both halves) */
    const int per_half = (int)(width / 64 + width / 16), pieces = 2 * per_half;
    int piece = h * per_half;
    __m512 mx[8]; /* eight running maxima: one would wait on its own latency each key */
    for (int r = 0; r < 8; r++) mx[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < width; j += 8) {
        for (int r = 0; r < 8; r++) {
            const __mmask16 in = whole ? 0xffff : att_sees(low, place, k0 + j + r);
            mx[r] = _mm512_mask_max_ps(mx[r], in, mx[r], _mm512_load_ps(&s[j + r][16 * h]));
        }
        if ((j & 63) == 56) att_pace(w, ++piece, pieces);
    }
    for (int r = 0; r < 4; r++) mx[r] = _mm512_max_ps(mx[r], mx[r + 4]);
    const __m512 top = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    const __m512 sv = _mm512_set1_ps(scale2);
    const __m512 mnew = _mm512_max_ps(*m, _mm512_mul_ps(top, sv));
    const __m512 alpha = exp2_16(_mm512_sub_ps(*m, mnew));
    __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
    for (int64_t j = 0; j < width; j += 2) {
        __m512 e0 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(&s[j][16 * h]), sv, mnew));
        __m512 e1 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(&s[j + 1][16 * h]), sv, mnew));
        if (!whole) {
            e0 = _mm512_maskz_mov_ps(att_sees(low, place, k0 + j), e0);
            e1 = _mm512_maskz_mov_ps(att_sees(low, place, k0 + j + 1), e1);
        }
        sum0 = _mm512_add_ps(sum0, e0);
        sum1 = _mm512_add_ps(sum1, e1);
        _mm512_store_si512(&a->p[n][j / 2][16 * h], bf16_pairs(e0, e1));
        if ((j & 15) == 14) att_pace(w, ++piece, pieces);
    }
    *l = _mm512_fmadd_ps(*l, alpha, _mm512_add_ps(sum0, sum1));
    *m = mnew;
    return alpha;
}

int tg_amx_attention(const void *q, int q_type, int64_t qsb, int64_t qsh, int64_t qst,
                     const void *k, const void *v, int kv_type, int64_t kvsb, int64_t kvsh,
                     int64_t B, int64_t H, int64_t KVH, int64_t T, int64_t S, int64_t D,
                     int64_t window, float scale, float *out, int64_t osb, int64_t osh,
                     int64_t ost) {
    if (D % 32 || D > ATT_DMAX || H % KVH || T > S || T < 1) return -1;
    const int64_t nkb = (S + 31) / 32, nqb = (T + 31) / 32, group = H / KVH;
    const int qsize = q_type == 0 ? 4 : 2, kvsize = kv_type == 0 ? 4 : 2;
    const float scale2 = scale * 1.44269504088896341f; /* the softmax in base 2 */
    const size_t per_head = (size_t)nkb * 32 * D; /* bfloat16 values of K (or V) a head */
    uint16_t *kb = aligned_alloc(64, B * KVH * per_head * 2);
    uint16_t *vt = aligned_alloc(64, B * KVH * per_head * 2);
    if (kb == NULL || vt == NULL) {
        free(kb);
        free(vt);
        return -2;
    }
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < B * KVH * nkb; it++) {
            const int64_t bk = it / nkb, j0 = it % nkb * 32;
            const int64_t at = (bk / KVH * kvsb + bk % KVH * kvsh) * kvsize;
            pack_keys((const char *)k + at, (const char *)v + at, kv_type, S, D, j0,
                      kb + it * 32 * D, vt + it * 32 * D);
        }
        att_block *a = aligned_alloc(64, sizeof(att_block));
        uint16_t qb[32 * ATT_DMAX] __attribute__((aligned(64)));
        if (a == NULL) failed = 1;
        load_tiles();
        /* the longest query blocks first: causal work grows with the block's place */
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < B * H * nqb; it++) {
            if (a == NULL) continue;
            const int64_t bh = it / nqb, t0 = (nqb - 1 - it % nqb) * 32;
            const int64_t b = bh / H, h = bh % H, bk = b * KVH + h / group;
            const int nq = T - t0 < 32 ? (int)(T - t0) : 32;
            /* query i's place: first + i; its keys: (place - window, place] */
            const int64_t first = S - T + t0, keys = first + nq;
            const int64_t lo = window && first >= window ? (first - window + 1) / 32 * 32 : 0;
            rows_bf16((const char *)q + (b * qsb + h * qsh + t0 * qst) * qsize, q_type, qst, nq,
                      32, D, qb);
            for (int half = 0; half < 2; half++)
                for (int64_t s = 0; s < D / 32; s++)
                    transpose16((const uint32_t *)(qb + 16 * half * D) + 16 * s, D / 2, a->q[half][s][0]);
            __m512i place[2], low[2];
            __m512 m[2], l[2];
            for (int half = 0; half < 2; half++) { /* queries past nq: as the last one */
                const __m512i i = _mm512_add_epi32(_mm512_set1_epi32(16 * half), _mm512_set_epi32(
                    15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
                place[half] = _mm512_add_epi32(_mm512_set1_epi32((int)first),
                                               _mm512_min_epi32(i, _mm512_set1_epi32(nq - 1)));
                low[half] = _mm512_sub_epi32(place[half], _mm512_set1_epi32(
                    window ? (int)window : (int)S + 1));
                m[half] = _mm512_set1_ps(-1e30f); /* (finite: 2^(m - m') is then 0, not NaN) */
                l[half] = _mm512_setzero_ps();
            }
            memset(a->o, 0, sizeof(float) * 32 * D);
            const uint16_t *kh = kb + bk * per_head, *vh = vt + bk * per_head;
            /* block n's softmax on the vectors while the tiles work out block n+1's scores
             * and add block n-1's values to the output; then the output's rescaling */
            att_work w = {.a = a, .kb = kh + lo * D, .D = D}; /* the first block's scores */
            w.ns = w.units = att_score_units(keys - lo < ATT_KB ? keys - lo : ATT_KB, D);
            att_pace(&w, 1, 1);
            for (int64_t k0 = lo; k0 < keys; k0 += ATT_KB) {
                const int64_t width = (keys - k0 < ATT_KB ? keys - k0 : ATT_KB) + 31 & ~31;
                const int64_t k1 = k0 + ATT_KB, next = keys - k1 < ATT_KB ? keys - k1 : ATT_KB;
                const int n = (int)((k0 - lo) / ATT_KB) & 1;
                w.ns = next > 0 ? att_score_units(next, D) : 0;
                w.next = !n, w.kb = kh + k1 * D;
                w.units = w.ns + (int)(D / 32) * w.nv, w.done = 0;
                __m512 alpha[2];
                for (int half = 0; half < 2; half++)
                    alpha[half] = att_softmax(a, &w, n, half, low[half], place[half], k0,
                                              width, scale2, &m[half], &l[half]);
                att_pace(&w, 1, 1);
                for (int half = 0; half < 2; half++)
                    if (_mm512_cmp_ps_mask(alpha[half], _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
                        for (int64_t d = 0; d < D; d++)
                            _mm512_store_ps(&a->o[d][16 * half], _mm512_mul_ps(
                                _mm512_load_ps(&a->o[d][16 * half]), alpha[half]));
                w.nv = (int)(width / 32), w.prev = n, w.vt = vh + k0 * D;
            }
            w.ns = 0, w.units = (int)(D / 32) * w.nv, w.done = 0;
            att_pace(&w, 1, 1);
            for (int half = 0; half < 2; half++) { /* out = o^T / l, 16 x 16 at a time */
                const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l[half]);
                float rows[16][16] __attribute__((aligned(64)));
                for (int64_t d = 0; d < D; d += 16) {
                    for (int j = 0; j < 16; j++)
                        _mm512_store_ps(&a->o[d + j][16 * half],
                                        _mm512_mul_ps(_mm512_load_ps(&a->o[d + j][16 * half]), inv));
                    transpose16((const uint32_t *)&a->o[d][16 * half], 32, (uint32_t *)rows[0]);
                    for (int i = 0; i < 16 && 16 * half + i < nq; i++)
                        memcpy(out + b * osb + h * osh + (t0 + 16 * half + i) * ost + d, rows[i], 64);
                }
            }
        }
        _tile_release();
        free(a);
    }
    free(kb);
    free(vt);
    return failed ? -2 : 0;
}

int tg_amx_bf16(void) { return 1; }

#else

void amx_bf16_linear(const amx_matrix *W, int64_t n, int64_t k, const uint16_t *x, int64_t m,
                     float *y, int64_t ldy) {
    (void)W, (void)n, (void)k, (void)x, (void)m, (void)y, (void)ldy;
}

int tg_amx_dense(const uint16_t *w, int64_t n, int64_t k, const uint16_t *x, int64_t m,
                 const float *bias, void *y, int64_t ldy, int bf16) {
    (void)w, (void)n, (void)k, (void)x, (void)m, (void)bias, (void)y, (void)ldy, (void)bf16;
    return -1;
}

int tg_amx_attention(const void *q, int q_type, int64_t qsb, int64_t qsh, int64_t qst,
                     const void *k, const void *v, int kv_type, int64_t kvsb, int64_t kvsh,
                     int64_t B, int64_t H, int64_t KVH, int64_t T, int64_t S, int64_t D,
                     int64_t window, float scale, float *out, int64_t osb, int64_t osh,
                     int64_t ost) {
    (void)q, (void)q_type, (void)qsb, (void)qsh, (void)qst, (void)k, (void)v, (void)kv_type,
        (void)kvsb, (void)kvsh, (void)B, (void)H, (void)KVH, (void)T, (void)S, (void)D,
        (void)window, (void)scale, (void)out, (void)osb, (void)osh, (void)ost;
    return -1;
}

int amx_bf16_glu(const amx_matrix *gate, const amx_matrix *up, int64_t n, int64_t k,
                 const uint16_t *x, int64_t m, int gelu, uint16_t *h) {
    (void)gate, (void)up, (void)n, (void)k, (void)x, (void)m, (void)gelu, (void)h;
    return -1;
}

int tg_amx_bf16(void) { return 0; }

#endif
