/* Matrix products on packed (GGML block) weights, for the CPU.
 *
 * Each block of a weight row is decoded into float32 registers (a small stack buffer) and
 * multiplied with up to MAX_ROWS activation rows at once, so the weights are read once per
 * call and never inflated in memory. Plain C written for the compiler's auto-vectoriser:
 * built on the user's machine with -march=native, it uses AVX2, AVX-512 or NEON, whatever
 * the CPU has. Block layouts follow tiergen/weights/quant.py (and so llama.cpp's files).
 * Rows are shared among threads with OpenMP; linked against the OpenMP runtime torch has
 * already loaded, it shares torch's thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 4

#if defined(__F16C__)
#include <immintrin.h>
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

/* ---- y[i, r] = sum_k W[r, k] x[i, k] -------------------------------------------------- */

#define LANES 16 /* accumulators per activation row: one AVX-512 or two AVX2 registers */

/* acc[t] += a * q[j] * x[j] for j = t (mod LANES): no horizontal sum inside the row. */
static inline void axpy_q(float *R acc, float a, const int8_t *R q, const float *R x, int n) {
    for (int j0 = 0; j0 < n; j0 += LANES)
        for (int t = 0; t < LANES; t++) acc[t] += a * (float)q[j0 + t] * x[j0 + t];
}

/* sums[i * (k / L) + s]: the sum of x row i over sub-block s (the "b" term's factor). */
static void sub_sums(const float *x, int64_t m, int64_t k, int L, float *sums) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t s = 0; s < k / L; s++) {
            float t = 0.0f;
            for (int j = 0; j < L; j++) t += x[i * k + s * L + j];
            sums[i * (k / L) + s] = t;
        }
}

/* Blocks are unpacked G at a time (up to 256 values), so that short blocks (32 values)
 * share the per-block loop overhead the way one 256-value K-quant block does. */
#define MATMUL(NAME, QK, L, BYTES, UNPACK)                                                    \
    static void NAME(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,      \
                     float *y, int64_t ldy) {                                                 \
        enum { G = 256 / QK, S = QK / L };                                                    \
        const int64_t nb = k / QK, row_bytes = nb * BYTES, ns = k / L;                        \
        float *sums = malloc(sizeof(float) * (size_t)(m * ns));                               \
        sub_sums(x, m, k, L, sums);                                                           \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r = 0; r < n; r++) {                                                     \
            int8_t q[G * QK] __attribute__((aligned(64)));                                    \
            float a[G * S], c[G * S];                                                         \
            const uint8_t *wr = w + r * row_bytes;                                            \
            for (int64_t i0 = 0; i0 < m; i0 += MAX_ROWS) {                                    \
                const int rows = m - i0 < MAX_ROWS ? (int)(m - i0) : MAX_ROWS;                \
                float acc[MAX_ROWS][LANES] __attribute__((aligned(64))) = {{0}};              \
                float bias[MAX_ROWS] = {0};                                                   \
                for (int64_t bl = 0; bl < nb;) {                                              \
                    const int g = nb - bl >= G ? G : 1;                                       \
                    for (int u = 0; u < g; u++)                                               \
                        UNPACK(wr + (bl + u) * BYTES, q + u * QK, a + u * S, c + u * S);      \
                    for (int i = 0; i < rows; i++) {                                          \
                        const float *xb = x + (i0 + i) * k + bl * QK;                         \
                        const float *sb = sums + (i0 + i) * ns + bl * S;                      \
                        for (int s = 0; s < g * S; s++) {                                     \
                            axpy_q(acc[i], a[s], q + s * L, xb + s * L, L);                   \
                            bias[i] += c[s] * sb[s];                                          \
                        }                                                                     \
                    }                                                                         \
                    bl += g;                                                                  \
                }                                                                             \
                for (int i = 0; i < rows; i++) {                                              \
                    float t = bias[i];                                                        \
                    for (int l = 0; l < LANES; l++) t += acc[i][l];                           \
                    y[(i0 + i) * ldy + r] = t;                                                \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        free(sums);                                                                           \
    }                                                                                         \
    static void NAME##_dequant(const uint8_t *w, int64_t nblocks, float *out) {               \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t bl = 0; bl < nblocks; bl++) {                                            \
            int8_t q[QK];                                                                     \
            float a[QK / L], c[QK / L], *o = out + bl * QK;                                   \
            UNPACK(w + bl * BYTES, q, a, c);                                                  \
            for (int j = 0; j < QK; j++) o[j] = a[j / L] * (float)q[j] + c[j / L];            \
        }                                                                                     \
    }

MATMUL(mm_q4_0, 32, 32, 18, un_q4_0)
MATMUL(mm_q4_1, 32, 32, 20, un_q4_1)
MATMUL(mm_q5_0, 32, 32, 22, un_q5_0)
MATMUL(mm_q5_1, 32, 32, 24, un_q5_1)
MATMUL(mm_q8_0, 32, 32, 34, un_q8_0)
MATMUL(mm_q4_k, 256, 32, 144, un_q4_k)
MATMUL(mm_q5_k, 256, 32, 176, un_q5_k)
MATMUL(mm_q6_k, 256, 16, 210, un_q6_k)

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
    DISPATCH(type, , (w, n, k, x, m, y, ldy))
}

/* out (nblocks * QK floats) = the values of nblocks consecutive blocks. */
int tg_dequant(int type, const uint8_t *w, int64_t nblocks, float *out) {
    DISPATCH(type, _dequant, (w, nblocks, out))
}
