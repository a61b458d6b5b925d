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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__F16C__)
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#elif defined(__aarch64__)
static inline float half(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}
#else
static inline float half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* zero or subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* ---- one block -> small integers q and per-sub-block (a, b): value = a * q + b ---------
 * A block of QK values has QK / L sub-blocks of L values. Every q fits an int8. */

#define R restrict

/* 16 bytes at a time with the compiler's vector extensions (SSE2, NEON, ...): the byte loops
 * below are too short for the auto-vectoriser to take on its own. */
typedef uint8_t u8x16 __attribute__((vector_size(16)));

static inline u8x16 load16(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

static inline void store16(int8_t *p, u8x16 v) { memcpy(p, &v, 16); }

/* lo[j] = low nibble of src[j], hi[j] = high nibble, for j < 16. */
static inline void nibbles16(const uint8_t *R src, int8_t *R lo, int8_t *R hi) {
    const u8x16 v = load16(src);
    store16(lo, v & 15);
    store16(hi, v >> 4);
}

static inline void un_q4_0(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    const float d = half(b);
    nibbles16(b + 2, q, q + 16);
    a[0] = d, c[0] = -8.0f * d;
}

static inline void un_q4_1(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    nibbles16(b + 4, q, q + 16);
    a[0] = half(b), c[0] = half(b + 2);
}

static inline void un_q5(const uint8_t *R qs, uint32_t qh, int8_t *R q) {
    /* value j's fifth bit is bit j of qh: spread qh's bytes over lanes, test one bit each */
    static const u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8_t b0 = qh & 255, b1 = (qh >> 8) & 255, b2 = (qh >> 16) & 255, b3 = qh >> 24;
    const u8x16 lo = {b0, b0, b0, b0, b0, b0, b0, b0, b1, b1, b1, b1, b1, b1, b1, b1};
    const u8x16 hi = {b2, b2, b2, b2, b2, b2, b2, b2, b3, b3, b3, b3, b3, b3, b3, b3};
    const u8x16 v = load16(qs);
    store16(q, (v & 15) | ((u8x16)((lo & bit) != 0) & 16));
    store16(q + 16, (v >> 4) | ((u8x16)((hi & bit) != 0) & 16));
}

static inline void un_q5_0(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    un_q5(b + 6, qh, q);
    const float d = half(b);
    a[0] = d, c[0] = -16.0f * d;
}

static inline void un_q5_1(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    un_q5(b + 8, qh, q);
    a[0] = half(b), c[0] = half(b + 2);
}

static inline void un_q8_0(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    memcpy(q, b + 2, 32);
    a[0] = half(b), c[0] = 0.0f;
}

/* Q4_K / Q5_K: eight sub-blocks of 32, each with a 6-bit scale and min packed in 12 bytes. */
static inline void k_scales(const uint8_t *R b, float *R a, float *R c) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *s = b + 4;
    for (int j = 0; j < 4; j++) {
        a[j] = d * (float)(s[j] & 63);
        c[j] = -(dmin * (float)(s[j + 4] & 63));
        a[j + 4] = d * (float)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        c[j + 4] = -(dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4)));
    }
}

static inline void un_q4_k(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    k_scales(b, a, c);
    const uint8_t *qs = b + 16;
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < 32; i += 16) nibbles16(qs + 32 * s + i, q + 64 * s + i, q + 64 * s + 32 + i);
}

static inline void un_q5_k(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    k_scales(b, a, c);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < 32; i++) {
            q[64 * s + i] = (int8_t)((qs[32 * s + i] & 15) | (((qh[i] >> (2 * s)) & 1) << 4));
            q[64 * s + 32 + i] = (int8_t)((qs[32 * s + i] >> 4) | (((qh[i] >> (2 * s + 1)) & 1) << 4));
        }
}

/* Q6_K: sixteen sub-blocks of 16 with int8 scales; q = low 4 bits | high 2 bits << 4, minus 32. */
static inline void un_q6_k(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half(b + 208);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 32; i += 16) {
            const u8x16 l0 = load16(ql + 64 * h + i), l1 = load16(ql + 64 * h + 32 + i);
            const u8x16 hh = load16(qh + 32 * h + i);
            int8_t *o = q + 128 * h + i;
            store16(o, (l0 & 15) | ((hh & 3) << 4));
            store16(o + 32, (l1 & 15) | (((hh >> 2) & 3) << 4));
            store16(o + 64, (l0 >> 4) | (((hh >> 4) & 3) << 4));
            store16(o + 96, (l1 >> 4) | (((hh >> 6) & 3) << 4));
        }
    for (int s = 0; s < 16; s++) {
        a[s] = d * (float)sc[s];
        c[s] = -32.0f * a[s];
    }
}

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

#define KERNELS(NAME, QK, L, BYTES, UNPACK)                                                   \
    static inline __attribute__((always_inline)) void                                      \
    NAME##_row(const int ROWS, const uint8_t *wr, int64_t nb, const float *x, int64_t k,      \
               float *y, int64_t ldy) {                                                       \
        int8_t q[QK] __attribute__((aligned(32)));                                            \
        float a[QK / L], c[QK / L];                                                           \
        vf acc[FEW][CH] = {{{0}}};                                                            \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            UNPACK(wr + b * BYTES, q, a, c);                                                  \
            few(ROWS, QK, L, q, a, c, x + b * QK, k, acc);                                    \
        }                                                                                     \
        for (int i = 0; i < ROWS; i++)                                                        \
            y[i * ldy] = hsum(acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3]);                 \
    }                                                                                         \
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
            int8_t q[QK] __attribute__((aligned(32)));                                        \
            float a[QK / L], c[QK / L];                                                       \
            const int ncols = n - r0 < NR ? (int)(n - r0) : NR;                               \
            for (int64_t k0 = 0; k0 < k; k0 += KC) {                                          \
                const int64_t len = k - k0 < KC ? k - k0 : KC;                                \
                for (int col = 0; col < ncols; col++)                                         \
                    for (int64_t b = 0; b < len / QK; b++) {                                  \
                        UNPACK(w + ((r0 + col) * nb + k0 / QK + b) * BYTES, q, a, c);         \
                        widen_block(QK, L, q, a, c, wf[col] + b * QK);                        \
                    }                                                                         \
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
        for (int64_t b = 0; b < nblocks; b++) {                                               \
            int8_t q[QK] __attribute__((aligned(32)));                                        \
            float a[QK / L], c[QK / L];                                                       \
            UNPACK(w + b * BYTES, q, a, c);                                                   \
            widen_block(QK, L, q, a, c, out + b * QK);                                        \
        }                                                                                     \
    }

KERNELS(mm_q4_0, 32, 32, 18, un_q4_0)
KERNELS(mm_q4_1, 32, 32, 20, un_q4_1)
KERNELS(mm_q5_0, 32, 32, 22, un_q5_0)
KERNELS(mm_q5_1, 32, 32, 24, un_q5_1)
KERNELS(mm_q8_0, 32, 32, 34, un_q8_0)
KERNELS(mm_q4_k, 256, 32, 144, un_q4_k)
KERNELS(mm_q5_k, 256, 32, 176, un_q5_k)
KERNELS(mm_q6_k, 256, 16, 210, un_q6_k)

/* GGML type ids (ggml.h): Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14. */
#define DISPATCH(TYPE, SUFFIX, ARGS)                                                          \
    switch (TYPE) {                                                                           \
    case 2: mm_q4_0##SUFFIX ARGS; return 0;                                                   \
    case 3: mm_q4_1##SUFFIX ARGS; return 0;                                                   \
    case 6: mm_q5_0##SUFFIX ARGS; return 0;                                                   \
    case 7: mm_q5_1##SUFFIX ARGS; return 0;                                                   \
    case 8: mm_q8_0##SUFFIX ARGS; return 0;                                                   \
    case 12: mm_q4_k##SUFFIX ARGS; return 0;                                                  \
    case 13: mm_q5_k##SUFFIX ARGS; return 0;                                                  \
    case 14: mm_q6_k##SUFFIX ARGS; return 0;                                                  \
    default: return -1;                                                                       \
    }

/* y (m rows, row stride ldy) = x (m, k) @ W(n, k)^T; W's rows are k / QK blocks each. */
int tg_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
              float *y, int64_t ldy) {
    if (m <= 0) return 0;
    if (m <= FEW) DISPATCH(type, _few, (w, n, k, x, m, y, ldy))
    DISPATCH(type, _tiled, (w, n, k, x, m, y, ldy))
}

/* out (nblocks * QK floats) = the values of nblocks consecutive blocks. */
int tg_dequant(int type, const uint8_t *w, int64_t nblocks, float *out) {
    DISPATCH(type, _dequant, (w, nblocks, out))
}
