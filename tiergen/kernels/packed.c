/* Matrix products on packed (GGML block) weights, for the CPU.
 *
 * The weights are read in their blocks and decoded to float32 vectors on the fly, never
 * written out whole; the products are float32 (within rounding of decode-then-multiply).
 * Plain C with the compiler's vector extensions: built on the user's machine with
 * -march=native, it uses AVX2, AVX-512 or NEON, whatever the CPU has (sign extension by
 * x86 intrinsics where present). Block layouts follow tiergen/weights/quant.py (and so
 * llama.cpp's files). Rows are shared among threads with OpenMP; linked against the OpenMP
 * runtime torch has already loaded, it shares torch's thread pool.
 */
#include "amx.h"
#include "blocks.h"
#include "tiergen.h"

/* ---- y[i, r] = sum_k W[r, k] x[i, k] --------------------------------------------------
 * Blocks are decoded to float32 vectors (a * q + c) by widen(). Few activation rows (decode):
 * each decoded vector is multiplied at once with every row, in registers, so the weights
 * are read packed and never written out. More rows: a chunk of KC values of NR weight rows
 * is decoded once into a stack buffer (L1), then every activation row multiplies it, MR rows
 * at a time with MR x NR vector accumulators (MR fused multiply-adds per weight vector
 * loaded). Either way the weights are decoded once per call, whatever the number of rows. */

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
#define FEW 3   /* up to this many rows the in-register kernel (at 4 both are as fast) */
#define MR 4
#define NR 2
#define KC 1024 /* a multiple of every block size (32, 256) */

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(vf v) {
    float t = 0.0f;
    for (int l = 0; l < VL; l++) t += v[l];
    return t;
}

/* a * q[0..VL) + c. Sign extension by intrinsics where there are some: GCC's generic vector
 * conversion extracts the bytes one at a time. */
static inline vf widen(const int8_t *R q, float a, float c) {
#if defined(__AVX512F__)
    const vf v = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)q)));
#elif defined(__AVX2__)
    const vf v = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)q)));
#else
    vf v;
    for (int l = 0; l < VL; l++) v[l] = (float)q[l];
#endif
    return v * a + c;
}

/* out[0..QK) = a block's values, decoded (q, a, c as UNPACK gives them). */
static inline __attribute__((always_inline)) void
widen_block(const int QK, const int L, const int8_t *R q, const float *R a, const float *R c,
            float *R out) {
    for (int j = 0; j < QK; j += VL) {
        const vf v = widen(q + j, a[j / L], c[j / L]);
        memcpy(out + j, &v, sizeof v);
    }
}

/* acc[i][*] += block * x[i * k + j] over one decoded block (QK values in sub-blocks of L),
 * spread over CH accumulators per row: one chain of dependent additions would wait on the
 * FMA latency at every vector. */
#define CH 4
static inline __attribute__((always_inline)) void
few(const int ROWS, const int QK, const int L, const int8_t *R q, const float *R a,
    const float *R c, const float *R x, int64_t k, vf acc[][CH]) {
    _Pragma("GCC unroll 32")
    for (int v = 0; v < QK / VL; v++) {
        const vf wv = widen(q + v * VL, a[v * VL / L], c[v * VL / L]);
        for (int i = 0; i < ROWS; i++) acc[i][v % CH] += wv * loadv(x + i * k + v * VL);
    }
}

/* y[i, c] (+)= sum_j w_c[j] x[i, j] for i < ROWS, c < ncols <= NR, j < len. */
static inline __attribute__((always_inline)) void
micro(const int ROWS, const float *R w0, const float *R w1, const float *R x, int64_t k,
      int64_t len, float *R y, int64_t ldy, int ncols, int add) {
    vf acc[MR][NR];
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = (vf){0};
    for (int64_t j = 0; j < len; j += VL) {
        const vf a = loadv(w0 + j), b = loadv(w1 + j);
        for (int i = 0; i < ROWS; i++) {
            const vf xv = loadv(x + i * k + j);
            acc[i][0] += a * xv;
            acc[i][1] += b * xv;
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int c = 0; c < ncols; c++) {
            const float t = hsum(acc[i][c]);
            y[i * ldy + c] = add ? y[i * ldy + c] + t : t;
        }
}

/* NAME_row (ROWS <= FEW activation rows against one weight row of nb blocks) and NAME_decode
 * (one block's QK values as floats) for a type whose blocks UNPACK decodes to small
 * integers; PRODUCTS then builds the rest on them. */
#define KERNELS(NAME, QK, L, BYTES, UNPACK)                                                   \
    static inline __attribute__((always_inline)) void                                      \
    NAME##_row(const int ROWS, const uint8_t *wr, int64_t nb, const float *x, int64_t k,      \
               float *y, int64_t ldy) {                                                       \
        int8_t q[QK] __attribute__((aligned(32)));                                            \
        float a[QK / L], c[QK / L];                                                           \
        vf acc[FEW][CH] = {{{0}}};                                                            \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            PREFETCH(wr + b * BYTES);                                                         \
            UNPACK(wr + b * BYTES, q, a, c);                                                  \
            few(ROWS, QK, L, q, a, c, x + b * QK, k, acc);                                    \
        }                                                                                     \
        for (int i = 0; i < ROWS; i++)                                                        \
            y[i * ldy] = hsum(acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3]);                 \
    }                                                                                         \
    static inline __attribute__((always_inline)) void NAME##_decode(const uint8_t *w,         \
                                                                    float *out) {             \
        int8_t q[QK] __attribute__((aligned(32)));                                            \
        float a[QK / L], c[QK / L];                                                           \
        UNPACK(w, q, a, c);                                                                   \
        widen_block(QK, L, q, a, c, out);                                                     \
    }                                                                                         \
    PRODUCTS(NAME, QK, BYTES)

/* NAME_few, NAME_tiled and NAME_dequant from NAME_row and NAME_decode. */
#define PRODUCTS(NAME, QK, BYTES)                                                             \
    static void NAME##_few(const uint8_t *w, int64_t n, int64_t k, const float *x,            \
                           int64_t m, float *y, int64_t ldy) {                                \
        const int64_t nb = k / QK;                                                            \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r = 0; r < n; r++) {                                                     \
            const uint8_t *wr = w + r * nb * BYTES;                                           \
            if (m == 1) NAME##_row(1, wr, nb, x, k, y + r, ldy);                              \
            else if (m == 2) NAME##_row(2, wr, nb, x, k, y + r, ldy);                         \
            else NAME##_row(3, wr, nb, x, k, y + r, ldy);                                     \
        }                                                                                     \
    }                                                                                         \
    static void NAME##_tiled(const uint8_t *w, int64_t n, int64_t k, const float *x,          \
                             int64_t m, float *y, int64_t ldy) {                              \
        const int64_t nb = k / QK;                                                            \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r0 = 0; r0 < n; r0 += NR) {                                              \
            float wf[NR][KC] __attribute__((aligned(64)));                                    \
            const int ncols = n - r0 < NR ? (int)(n - r0) : NR;                               \
            for (int64_t k0 = 0; k0 < k; k0 += KC) {                                          \
                const int64_t len = k - k0 < KC ? k - k0 : KC;                                \
                for (int col = 0; col < ncols; col++)                                         \
                    for (int64_t b = 0; b < len / QK; b++)                                    \
                        NAME##_decode(w + ((r0 + col) * nb + k0 / QK + b) * BYTES,            \
                                      wf[col] + b * QK);                                      \
                const float *w1 = ncols > 1 ? wf[1] : wf[0];                                  \
                int64_t i = 0;                                                                \
                for (; i + MR <= m; i += MR)                                                  \
                    micro(MR, wf[0], w1, x + i * k + k0, k, len, y + i * ldy + r0, ldy,       \
                          ncols, k0 > 0);                                                     \
                for (; i < m; i++)                                                            \
                    micro(1, wf[0], w1, x + i * k + k0, k, len, y + i * ldy + r0, ldy, ncols, \
                          k0 > 0);                                                            \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    static void NAME##_dequant(const uint8_t *w, int64_t nblocks, float *out) {               \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t b = 0; b < nblocks; b++) NAME##_decode(w + b * BYTES, out + b * QK);     \
    }                                                                                         \
    static void NAME##_block(const uint8_t *w, float *out) { NAME##_decode(w, out); }         \
    static void NAME##_matrix(const uint8_t *w, int type, amx_matrix *out) {                  \
        *out = (amx_matrix){type, NAME##_block, QK, BYTES, w};                                \
    }

#define MM_KERNELS(name, QK, L, BYTES) KERNELS(mm_##name, QK, L, BYTES, un_##name)
BLOCK_TYPES(MM_KERNELS)

/* ---- FP8 (DeepSeek-V3's and Kimi K2's checkpoints): tiergen's own block of 128 e4m3 values
 * after a float32 scale (the checkpoint's block scale, repeated on each row of its block).
 * e4m3 values are no small integers times a shared scale, so they are decoded straight to
 * floats. With F16C: a value's 7 magnitude bits moved under float16's exponent, whose bias
 * is 8 more than e4m3's, make the float16 of value / 256 (subnormals too), which the
 * hardware widens; the scale takes the 256 (FP8_SCALE). Without: the same bits under a float
 * exponent (bias 120 more), a subnormal (exponent 0, m * 2^-9) read with exponent 1 less
 * 2^-6. Both exact. */
#define FP8 1024
#if defined(__F16C__) && (defined(__AVX512F__) || defined(__AVX2__))
#define FP8_SCALE 256.0f
static inline __m256i fp8_halves(__m256i b) { /* 16-bit lanes holding bytes */
    return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3f80)),
                           _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
}
#endif

static inline vf fp8_widen(const uint8_t *R p, float scale) {
#if defined(__AVX512F__) && defined(__F16C__)
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)p));
    return (vf)_mm512_cvtph_ps(fp8_halves(b)) * scale;
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadl_epi64((const void *)p)); /* 8 used */
    return (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(fp8_halves(b))) * scale;
#else
#define FP8_SCALE 1.0f
    typedef uint32_t vu __attribute__((vector_size(VL * 4)));
    vu b;
    for (int l = 0; l < VL; l++) b[l] = p[l];
    const vu mag = b & 0x7f, sign = (b & 0x80) << 24;
    const vu sub = (vu)(mag < 8); /* all ones where subnormal */
    const vu bits = (((mag | (sub & 8)) << 20) + (120u << 23)) | sign;
    const vu less = (sub & 0x3c800000u) | sign; /* 2^-6 */
    vf v, c;
    memcpy(&v, &bits, sizeof v);
    memcpy(&c, &less, sizeof c);
    return (v - c) * scale;
#endif
}

static inline __attribute__((always_inline)) void
mm_fp8_row(const int ROWS, const uint8_t *wr, int64_t nb, const float *x, int64_t k, float *y,
           int64_t ldy) {
    vf acc[FEW][CH] = {{{0}}};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wr + b * 132;
        float s;
        memcpy(&s, blk, 4);
        s *= FP8_SCALE;
        PREFETCH(blk);
        _Pragma("GCC unroll 16")
        for (int v = 0; v < 128 / VL; v++) {
            const vf wv = fp8_widen(blk + 4 + v * VL, s);
            for (int i = 0; i < ROWS; i++)
                acc[i][v % CH] += wv * loadv(x + i * k + b * 128 + v * VL);
        }
    }
    for (int i = 0; i < ROWS; i++)
        y[i * ldy] = hsum(acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3]);
}

static inline __attribute__((always_inline)) void mm_fp8_decode(const uint8_t *blk, float *out) {
    float s;
    memcpy(&s, blk, 4);
    s *= FP8_SCALE;
    for (int v = 0; v < 128 / VL; v++) {
        const vf w = fp8_widen(blk + 4 + v * VL, s);
        memcpy(out + v * VL, &w, sizeof w);
    }
}

PRODUCTS(mm_fp8, 128, 132)

/* y (m rows, row stride ldy) = x (m, k) @ W(n, k)^T; W's rows are k / QK blocks each. */
int tg_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
              float *y, int64_t ldy) {
    if (m <= 0) return 0;
    if (type == FP8) {
        if (m <= FEW) mm_fp8_few(w, n, k, x, m, y, ldy);
        else mm_fp8_tiled(w, n, k, x, m, y, ldy);
        return 0;
    }
    if (m <= FEW) DISPATCH(mm, type, _few, (w, n, k, x, m, y, ldy))
    DISPATCH(mm, type, _tiled, (w, n, k, x, m, y, ldy))
}

/* out (nblocks * QK floats) = the values of nblocks consecutive blocks. */
int tg_dequant(int type, const uint8_t *w, int64_t nblocks, float *out) {
    if (type == FP8) {
        mm_fp8_dequant(w, nblocks, out);
        return 0;
    }
    DISPATCH(mm, type, _dequant, (w, nblocks, out))
}

/* A matrix of a type amx.c decodes, as it takes it; -1 for another type. */
static int amx_matrix_of(int type, const uint8_t *w, amx_matrix *out) {
    if (type == FP8) {
        mm_fp8_matrix(w, type, out);
        return 0;
    }
    DISPATCH(mm, type, _matrix, (w, type, out))
}

/* y (m rows, row stride ldy) = x (m, k) bfloat16 @ W(n, k)^T on AMX tiles (amx.c); m a
 * multiple of 32. -1: no AMX in this build (tg_amx_bf16) or a type it does not take. */
int tg_amx_linear(int type, const uint8_t *w, int64_t n, int64_t k, const uint16_t *x,
                  int64_t m, float *y, int64_t ldy) {
    amx_matrix W;
    if (!tg_amx_bf16() || m % AMX_ROWS_STEP || k % 32 || amx_matrix_of(type, w, &W) || k % W.qk)
        return -1;
    amx_bf16_linear(&W, n, k, x, m, y, ldy);
    return 0;
}

/* h (m, n) bfloat16 = act(x @ G^T) * (x @ U^T): tg_amx_linear's two products and tg_glu's
 * activation, rounded to bfloat16, in one pass (amx_bf16_glu). -1 where not taken. */
int tg_amx_glu(int gate_type, const uint8_t *gate, int up_type, const uint8_t *up, int64_t n,
               int64_t k, const uint16_t *x, int64_t m, int gelu, uint16_t *h) {
    amx_matrix g, u;
    if (!tg_amx_bf16() || amx_matrix_of(gate_type, gate, &g) || amx_matrix_of(up_type, up, &u))
        return -1;
    return amx_bf16_glu(&g, &u, n, k, x, m, gelu, h);
}
