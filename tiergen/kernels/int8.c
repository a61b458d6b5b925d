/* Integer products on packed (GGML block) weights, for the CPU.
 *
 * The activation rows are quantised once per product: to int8 in blocks of qa values (4, 8
 * or 16), each with a float scale s = max|x| / 127, or to 16 bits as two int8 halves
 * (255 hi + lo, s = max|x| / 32512); the float sums s * sum(q) over every 16 values go with
 * them (what a weight block's minimum multiplies). A weight block decodes to small integers
 * q and, per sub-block, a scale a and an offset c (value = a * q + c, blocks.h), so each
 * activation block contributes
 *
 *     a * s * (q . xq)  +  c * (s * sum(xq))
 *
 * with q . xq an integer dot product: AVX2 `maddubs` + `madd`, or AVX-VNNI / AVX-512 VNNI
 * `dpbusd`, and a portable C loop elsewhere.
 *
 * One or two rows (decode): each weight block is decoded to bytes once and dotted with every
 * activation row, 32 values per instruction; its 32-bit lanes hold 4 values each, so each
 * lane takes its own scale from a vector load: a scale per 4 values costs nothing more than
 * one per 32. More rows (batches, prompts): TR weight rows (16 with AVX-512, 8 otherwise) are
 * decoded and interleaved four bytes at a time, so one vector holds four values of each and
 * each 32-bit lane accumulates its own output; the activation rows, packed into panels of MI
 * interleaved the same way, each broadcast four of their bytes against that tile, and each
 * activation block's sum is scaled as it ends, read as a float without a conversion
 * instruction (MAGIC, tile_rows). Each weight block is decoded once per product (once per MB
 * rows of a prompt), whatever the number of rows, or once for good where the caller keeps the
 * tiles (tg_build_tiles: weights that stay in memory, multiplied by a batch at every step).
 *
 * What differs between instruction sets is in int8/, one header each (portable.h, avx2.h,
 * avx512.h), of which "the instruction set" below includes the build's; this file holds what
 * every build shares: the activations' quantisation in C, the decoding, the panels, the loops
 * over blocks and tiles, and the library's functions.
 */
#include <math.h>

#include "blocks.h"
#include "tiergen.h"

#define SB 16     /* values per activation block sum, and per weight scale in a tile */
#define IKC 1024  /* weight values decoded at a time (a multiple of every block size) */
#define MB 256    /* activation rows per pass of the tiles over a matrix (a multiple of MI) */
/* 1.5 * 2^23, as a float and as its bits: the float whose bits are MAGIC_BITS + d is exactly
 * MAGIC + d for |d| < 2^22, so an integer sum started at MAGIC_BITS is read as a float with
 * no conversion instruction (see tile_rows) */
#define MAGIC 12582912.0f
#define MAGIC_BITS 0x4B400000
#define FEWI 2    /* up to this many rows: the row-by-row kernel (more: the tiles) */

/* ---- activation panels -----------------------------------------------------------
 * The tiles take MI activation rows at a time, interleaved four values at a time as the
 * weights are, so that a pass reads its rows' next values from one place: panel p holds
 * q[(g MI + i) 4 + l] = value 4 g + l of row p MI + i (l likewise for 16 bits) and
 * sum[t MI + i] row i's sum over values 16 t .. 16 t + 15, s[g MI + i] the scale of value
 * 4 g, and start[t MI + i] = -MAGIC * (the sum of the scales of row i's activation blocks
 * in values 16 t .. 16 t + 15) for the 8-bit tiles (see tile_rows). Rows past m are zero. */
typedef struct {
    int8_t *q, *l;
    float *s, *sum, *start;
    int64_t k;
} Panels;

/* ---- a tile of TR weight rows, interleaved -------------------------------------------
 * tile[g * 4 TR + r * 4 + l] = value 4 g + l of row r; as[t * TR + r], cs[t * TR + r]: the
 * scale and offset of row r's values 16 t .. 16 t + 15. Rows past the matrix are zero.
 * tile_rows: y[i, r] (+)= the products for a panel's activation rows i < rows (q, l, s, sum,
 * start at the chunk's start) and r < ncols; QA: the activations' block size; NR (a
 * constant, MI or 1, at least rows): the rows it computes. part, each row's sum over a block
 * of 16 values, takes the weight scale as the block ends.
 *
 * 8 bits: each activation block's integer sum D starts at MAGIC_BITS instead of 0 and is
 * read as the float MAGIC + D (exact: |D| <= 16 * 255 * 127 < 2^22), multiply-added with
 * the block's scale into part, which starts at the panel's start to take MAGIC back out.
 * So a block costs its products and one multiply-add, with no conversion instruction (on
 * AVX-512 that would share a port with the products; docs/BENCHMARKS.md). The floats
 * carry MAGIC's magnitude, so each multiply-add rounds at about one unit of the block's
 * scale, a small fraction of the activations' own rounding (bench_kld.py measures the
 * path). 16 bits (sums up to 255 times larger) convert each block's sum. */

/* ---- the instruction set -------------------------------------------------------------
 * One header per instruction set defines, for the code below:
 *   TILE512, TR, MI   the tiles' layout: TR weight rows to a tile, MI activation rows to a
 *                     pass; TILE512: sixteen rows, signed weights offset by 128 (TILE_OFFSET),
 *                     and interleave16 and tile_rows2 (two tiles at a time) besides
 *   INT8_ISA          what tg_int8_isa says
 *   quantize_blocks   8-bit activations, where it has a faster way than tg_quantize_act's
 *                     loop (1 if it made them)
 *   ACC_T, ACC_ZERO, ACC_SUM, dot32
 *                     block_dot's accumulators, and its products of 32 values
 *   panel_vectors     a panel's values and scales, where it has a faster way than
 *                     make_panels' loop (1 if it made them)
 *   tile_rows         a tile's products (above)
 *   in_registers, few_in_registers
 *                     which products of few rows take the blocks into registers, and those
 *                     products
 * An AVX-512 build takes avx2.h's 32-byte vectors too, and its tiles or kernels in registers
 * where it lacks VNNI or VL (avx512.h). */
/* tile_rows' parameters, which every instruction set's header takes alike */
#define TILE_ROWS_PARAMS                                                                      \
    const int NR, const int QA, const int SIGNED, const int WIDE,                             \
        const uint8_t *restrict tile, const float *restrict as, const float *restrict cs,     \
        int64_t len,                                                                          \
        const int8_t *restrict q, const int8_t *restrict l, const float *restrict s,          \
        const float *restrict sum, const float *restrict start, float *restrict y,            \
        int64_t ldy, int rows, int ncols, int add
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "int8/avx512.h"
#elif defined(__AVX2__)
#include "int8/avx2.h"
#else
#include "int8/portable.h"
#endif
#if !TILE512
/* The per-type kernels name these under `if (TILE512)`, which is then never true: declared so
 * that compilers that refuse implicit declarations (GCC 14) build them. */
static inline void interleave16(const int8_t *rows, int64_t len, int flip, uint8_t *tile) {
    (void)rows, (void)len, (void)flip, (void)tile;
}

static inline int regs_type(int type) {
    (void)type;
    return 0;
}
#endif

/* Whether a product of m rows that takes the tiles' arithmetic decodes its blocks into
 * registers (regs_rows) rather than reading tiles in memory: up to MI 8-bit rows scaled per 8
 * values, where the build and type have such a decoder (faster than kept tiles there). */
static int regs_take(int type, int64_t m, int qa, int wide) {
    return TILE512 && !wide && m <= MI && qa == 8 && regs_type(type);
}

/* y (m rows, ldy apart) = m rows (panel 0 of P) by the matrix through regs_rows where
 * regs_take says so: 1, else 0. */
static int in_tile_registers(int type, const uint8_t *w, int64_t n, int64_t k, const Panels *P,
                             int qa, int wide, int64_t m, float *y, int64_t ldy) {
    if (!regs_take(type, m, qa, wide)) return 0;
#if TILE512
#define REGS(NR, T)                                                                           \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int64_t r0 = 0; r0 < n; r0 += 16) regs_rows(NR, 8, T, w, n, k, P, (int)m, y, ldy, r0)
#define TYPES(NR)                                                                             \
    switch (type) {                                                                           \
    case 2: REGS(NR, 2); break;                                                               \
    case 3: REGS(NR, 3); break;                                                               \
    case 6: REGS(NR, 6); break;                                                               \
    case 7: REGS(NR, 7); break;                                                               \
    case 8: REGS(NR, 8); break;                                                               \
    case 12: REGS(NR, 12); break;                                                             \
    case 13: REGS(NR, 13); break;                                                             \
    case 14: REGS(NR, 14); break;                                                             \
    default: REGS(NR, 39);                                                                    \
    }
    if (m == 1) TYPES(1)
    else if (m == 2) TYPES(2)
    else TYPES(MI)
#undef TYPES
#undef REGS
#else
    (void)w, (void)n, (void)k, (void)P, (void)y, (void)ldy;
#endif
    return 1;
}

/* Whether the calling thread's products all go through the tiles, so that a row's numbers do
 * not depend on how many rows share its product. The row kernels add the same exact integer
 * sums' scaled values in another order than the tiles, so a row alone and the same row in a
 * batch differ in their last bits; through the tiles alone they are identical, at a cost for
 * one or two rows (docs/BENCHMARKS.md). Per thread: the engine's compute thread sets it. */
static __thread int batch_invariant;

void tg_set_batch_invariant(int on) { batch_invariant = on; }

/* Whether m rows (8 bits scaled per qa values, or 16 with xl) by a matrix of this type go row
 * by row: up to FEWI rows, or as many as in_registers takes where the tiles in registers do
 * not (they are as fast from three rows on). */
static int row_by_row(int type, int64_t k, int64_t m, int qa, const int8_t *xl) {
    return !batch_invariant &&
           (m <= FEWI || (in_registers(type, k, m, xl) && !regs_take(type, m, qa, xl != NULL)));
}

/* ---- activations ---------------------------------------------------------------------
 * Row i of x (k values, k a multiple of 32) becomes xq[i k + j] (int8) in blocks of qa
 * values (4, 8 or 16) with scale s = max |x| / 127; xs4[i k / 4 + l] is the scale of the
 * block holding values 4 l .. 4 l + 3 (one per 32-bit lane of the products), and
 * xsum[i k / 16 + t] the sum over values 16 t .. 16 t + 15 of s * q (what a weight block's
 * minimum multiplies).
 * With xl (wide): 16 bits instead, q = 255 xq + xl with s = max |x| / 32512 and xq, xl in
 * [-127, 127], so that both halves multiply as int8. */
void tg_quantize_act(const float *x, int64_t m, int64_t k, int qa, int8_t *xq, int8_t *xl,
                     float *xs4, float *xsum) {
    const int64_t blocks = m * (k / SB);
    const float top = xl ? 32512.0f : 127.0f;
    if (!xl && quantize_blocks(x, blocks, qa, xq, xs4, xsum)) return;
    _Pragma("omp parallel for schedule(static) if (blocks > 256)")
    for (int64_t t = 0; t < blocks; t++) {
        double total = 0.0;  /* exact products, so the sum does not depend on contraction */
        for (int o = 0; o < SB; o += qa) {
            const float *v = x + t * SB + o;
            float amax = 0.0f;
            for (int j = 0; j < qa; j++) amax = fmaxf(amax, fabsf(v[j]));
            const float id = amax > 0.0f ? top / amax : 0.0f, s = amax / top;
            int sum = 0;
            for (int j = 0; j < qa; j++) {
                const int q = (int)rintf(v[j] * id);
                if (xl) {
                    const int hi = q >= 0 ? (q + 127) / 255 : -((127 - q) / 255);
                    xq[t * SB + o + j] = (int8_t)hi;
                    xl[t * SB + o + j] = (int8_t)(q - 255 * hi);
                } else {
                    xq[t * SB + o + j] = (int8_t)q;
                }
                sum += q;
            }
            for (int l = 0; l < qa / 4; l++) xs4[(t * SB + o) / 4 + l] = s;
            total += (double)s * sum;
        }
        xsum[t] = (float)total;
    }
}

/* ---- one chunk of a weight row, decoded ------------------------------------------------
 * q: len bytes; a16, c16: each block of 16's weight scale and offset, st floats apart.
 * TILE_OFFSET: signed values in an AVX-512 tile are read as q + 128 (unsigned), so their
 * offset becomes -128 a (the bytes are flipped where the tile is interleaved). */
#define DECODE_CHUNK(UNPACK, QK, L, BYTES, src, nblk, q, a16, c16, st)                        \
    for (int64_t b_ = 0; b_ < (nblk); b_++) {                                                 \
        float a_[QK / L], c_[QK / L];                                                         \
        PREFETCH((src) + b_ * BYTES);                                                         \
        UNPACK((src) + b_ * BYTES, (q) + b_ * QK, a_, c_);                                    \
        for (int s_ = 0; s_ < QK / SB; s_++) {                                                \
            (a16)[(b_ * (QK / SB) + s_) * (st)] = a_[s_ * SB / L];                            \
            (c16)[(b_ * (QK / SB) + s_) * (st)] = c_[s_ * SB / L];                            \
        }                                                                                     \
    }
#define TILE_OFFSET(SIGNED, n, a16, c16, st)                                                  \
    if (TILE512 && (SIGNED))                                                                  \
        for (int64_t t_ = 0; t_ < (n); t_++) (c16)[t_ * (st)] = -128.0f * (a16)[t_ * (st)];

/* acc[i] += the products of one decoded weight block (QK values: q, and a, c per sub-block
 * of L) with activation rows i < ROWS (xq, xl, xs4, xsum at the block's start, rows k
 * apart). SIGNED: q is signed (Q8_0), else unsigned; WIDE: 16-bit activations (xl). */
static inline __attribute__((always_inline)) void
block_dot(const int ROWS, const int SIGNED, const int WIDE, const int QK, const int L,
          const int8_t *restrict q, const float *restrict a, const float *restrict c,
          const int8_t *restrict xq, const int8_t *restrict xl, const float *restrict xs4, const float *restrict xsum, int64_t k, float *restrict mins,
          ACC_T *restrict acc) {
    for (int j = 0; j < QK; j += 32) dot32(ROWS, SIGNED, WIDE, L, j, q, a, xq, xl, xs4, k, acc);
    if (!SIGNED)
        for (int s = 0; s < QK / L; s++)
            for (int i = 0; i < ROWS; i++) {
                const float *xs = xsum + (i * k + s * L) / SB;
                /* fmaf, not a contraction the compiler may make or not as it unrolls (one
                 * row or two): a row's numbers the same in either */
                mins[i] = fmaf(c[s], L == 32 ? xs[0] + xs[1] : xs[0], mins[i]);
            }
}

/* ---- activation panels (Panels, above) ------------------------------------------- */

/* One buffer per thread for its panels, kept for the next product: a fresh allocation of
 * this size would be mapped, faulted in and zeroed every time. One larger than PANEL_KEEP
 * (a long prompt in a large batch) is freed after its product instead: beside the product's
 * own cost, mapping it again is small, and holding it would not be. */
#define PANEL_KEEP ((size_t)64 << 20)
static __thread void *panel_buf;
static __thread size_t panel_cap;

/* Row r's (row i of panel p) sums and, for 8 bits, the tiles' starting values. */
static inline void panel_sums(int64_t r, int64_t p, int64_t i, int64_t m, int64_t k,
                              const float *xs4, const float *xsum, int qa, int wide,
                              Panels *P) {
    for (int64_t t = 0; t < k / SB; t++) {
        const int64_t at = (p * (k / SB) + t) * MI + i;
        P->sum[at] = r < m ? xsum[r * (k / SB) + t] : 0.0f;
        if (wide) continue;
        double total = 0.0;  /* what the tiles' integer sums start from, in sum */
        for (int b = 0; b < SB / qa; b++)
            total += r < m ? xs4[r * (k / 4) + (SB * t + qa * b) / 4] : 0.0f;
        P->start[at] = (float)(-(double)MAGIC * total);
    }
}

static int make_panels(int64_t m, int64_t k, const int8_t *xq, const int8_t *xl,
                       const float *xs4, const float *xsum, int qa, Panels *P) {
    const int64_t rows = (m + MI - 1) / MI * MI;
    const size_t qb = (size_t)(rows * k), sb = sizeof(float) * (size_t)(rows * (k / 4)),
                 tb = sizeof(float) * (size_t)(rows * (k / SB)),
                 need = qb * (xl ? 2 : 1) + sb + 2 * tb;
    if (need > panel_cap) {
        free(panel_buf);
        panel_cap = 0;
        if (!(panel_buf = malloc(need))) return 0;
        panel_cap = need;
    }
    P->k = k;
    P->s = panel_buf, P->sum = (float *)((char *)panel_buf + sb), P->start = P->sum + tb / sizeof(float);
    P->q = (int8_t *)((char *)panel_buf + sb + 2 * tb), P->l = xl ? P->q + qb : NULL;
    _Pragma("omp parallel for schedule(static) if (m * k > 65536)")
    for (int64_t p = 0; p < rows / MI; p++) {
        if (panel_vectors(p, m, k, xq, xl, xs4, P)) {  /* four whole rows, by vectors */
            for (int64_t i = 0; i < MI; i++)
                panel_sums(p * MI + i, p, i, m, k, xs4, xsum, qa, 0, P);
            continue;
        }
        for (int64_t i = 0; i < MI; i++) {
            const int64_t r = p * MI + i;
            for (int64_t g = 0; g < k / 4; g++) {
                const int64_t at = (p * (k / 4) + g) * MI + i;
                int32_t four = 0, low = 0;
                if (r < m) {
                    memcpy(&four, xq + r * k + 4 * g, 4);
                    if (xl) memcpy(&low, xl + r * k + 4 * g, 4);
                }
                memcpy(P->q + 4 * at, &four, 4);
                if (xl) memcpy(P->l + 4 * at, &low, 4);
                P->s[at] = r < m ? xs4[r * (k / 4) + g] : 0.0f;
            }
            panel_sums(r, p, i, m, k, xs4, xsum, qa, xl != NULL, P);
        }
    }
    return 1;
}

/* tile_rows over every panel, with the block size as a constant; with AVX-512, two tiles at
 * a time where tile1 is not NULL (8 bits; ncols: the last tile's rows). */
static inline __attribute__((always_inline)) void
tile_pass(const int SIGNED, int qa, int64_t m, const uint8_t *restrict tile,
          const float *restrict as, const float *restrict cs, const uint8_t *restrict tile1,
          const float *restrict as1, const float *restrict cs1, int64_t k0, int64_t len,
          const Panels *P, float *restrict y, int64_t ldy, int ncols) {
    const int64_t k = P->k;
    for (int64_t p = 0; p < (m + MI - 1) / MI; p++) {
        const int64_t g = p * (k / 4) + k0 / 4;
        const int8_t *q = P->q + g * MI * 4, *l = P->l ? P->l + g * MI * 4 : NULL;
        const float *s = P->s + g * MI, *sum = P->sum + (p * (k / SB) + k0 / SB) * MI,
                    *start = P->start + (p * (k / SB) + k0 / SB) * MI;
        float *yp = y + p * MI * ldy;
        const int rows = m - p * MI < MI ? (int)(m - p * MI) : MI;
        /* a row alone (as a batch-invariant decode step of one sequence) takes a pass of its
         * own (NR = 1) rather than MI rows' work */
#if TILE512
        if (tile1) {
#define TILE2(N, Q) tile_rows2(N, Q, tile, tile1, as, cs, as1, cs1, len, q, s, sum, start, yp, ldy, rows, ncols, k0 > 0)
            if (rows == 1) {
                if (qa == 4) TILE2(1, 4);
                else if (qa == 8) TILE2(1, 8);
                else TILE2(1, 16);
            } else if (qa == 4) TILE2(MI, 4);
            else if (qa == 8) TILE2(MI, 8);
            else TILE2(MI, 16);
#undef TILE2
            continue;
        }
#endif
#define TILE(N, Q, W) tile_rows(N, Q, SIGNED, W, tile, as, cs, len, q, l, s, sum, start, yp, ldy, rows, ncols, k0 > 0)
        if (rows == 1 && !l) {
            if (qa == 4) TILE(1, 4, 0);
            else if (qa == 8) TILE(1, 8, 0);
            else TILE(1, 16, 0);
        } else if (l) TILE(MI, 16, 1);
        else if (qa == 4) TILE(MI, 4, 0);
        else if (qa == 8) TILE(MI, 8, 0);
        else TILE(MI, 16, 0);
#undef TILE
    }
}

/* Kept tiles: a matrix's tiles one after another, TR rows by IKC values (fewer at the end of
 * a row), each its interleaved bytes then its scales and offsets (tile_rows' as, cs): 3/2
 * bytes a value. tile_at: where the tile of rows r0.. and values k0.. starts (a multiple of
 * 64 bytes for k a multiple of 32). */
static inline int64_t tile_at(int64_t r0, int64_t k0, int64_t k) { return (r0 * k + k0 * TR) / 2 * 3; }

/* The bytes of an n x k matrix's kept tiles. */
int64_t tg_tile_bytes(int64_t n, int64_t k) { return tile_at((n + TR - 1) / TR * TR, 0, k); }

#define IKERNELS(NAME, QK, L, BYTES, UNPACK, SIGNED)                                          \
    static inline __attribute__((always_inline)) void                                      \
    NAME##_row(const int ROWS, const int WIDE, const uint8_t *wr, int64_t nb,                 \
               const int8_t *xq, const int8_t *xl, const float *xs4, const float *xsum,       \
               int64_t k, float *y, int64_t ldy) {                                            \
        int8_t q[QK] __attribute__((aligned(32)));                                            \
        float a[QK / L], c[QK / L], mins[FEWI] = {0};                                         \
        ACC_T acc[FEWI];                                                                      \
        for (int i = 0; i < ROWS; i++) acc[i] = ACC_ZERO;                                     \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            PREFETCH(wr + b * BYTES);                                                         \
            UNPACK(wr + b * BYTES, q, a, c);                                                  \
            block_dot(ROWS, SIGNED, WIDE, QK, L, q, a, c, xq + b * QK, xl + b * QK,           \
                      xs4 + b * QK / 4, xsum + b * QK / SB, k, mins, acc);                    \
        }                                                                                     \
        for (int i = 0; i < ROWS; i++) y[i * ldy] = ACC_SUM(acc[i]) + mins[i];                \
    }                                                                                         \
    static void NAME##_few(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,          \
                           const int8_t *xl, const float *xs4, const float *xsum, int64_t m,  \
                           float *y, int64_t ldy) {                                           \
        const int64_t nb = k / QK;                                                            \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r = 0; r < n; r++) {                                                     \
            const uint8_t *wr = w + r * nb * BYTES;                                           \
            if (xl && m == 1) NAME##_row(1, 1, wr, nb, xq, xl, xs4, xsum, k, y + r, ldy);     \
            else if (xl) NAME##_row(2, 1, wr, nb, xq, xl, xs4, xsum, k, y + r, ldy);          \
            else if (m == 1) NAME##_row(1, 0, wr, nb, xq, xq, xs4, xsum, k, y + r, ldy);      \
            else NAME##_row(2, 0, wr, nb, xq, xq, xs4, xsum, k, y + r, ldy);                  \
        }                                                                                     \
    }                                                                                         \
    /* the tile of weight rows r0 .. r0 + TR - 1 and values k0 .. k0 + len - 1 (rows: the  \
     * decoded rows' scratch, TILE512 ? IKC * TR : IKC values) */                            \
    static inline __attribute__((always_inline)) void                                      \
    NAME##_tile(const uint8_t *w, int64_t n, int64_t nb, int64_t r0, int64_t k0, int64_t len, \
                uint8_t *restrict tile, float *restrict as, float *restrict cs,               \
                int8_t *restrict rows) {                                                      \
        const int ncols = n - r0 < TR ? (int)(n - r0) : TR;                                   \
        for (int r = 0; r < TR; r++) {                                                        \
            int8_t *q = TILE512 ? rows + r * IKC : rows;                                      \
            if (r < ncols) {                                                                  \
                DECODE_CHUNK(UNPACK, QK, L, BYTES, w + ((r0 + r) * nb + k0 / QK) * BYTES,     \
                             len / QK, q, as + r, cs + r, TR)                                 \
            } else {                                                                          \
                memset(q, 0, len);                                                            \
                for (int64_t t = 0; t < len / SB; t++) as[t * TR + r] = cs[t * TR + r] = 0.0f; \
            }                                                                                 \
            TILE_OFFSET(SIGNED, len / SB, as + r, cs + r, TR)                                 \
            for (int64_t g = 0; g < len / 4 && !TILE512; g++) {                               \
                uint32_t four;                                                                \
                memcpy(&four, q + 4 * g, 4);                                                  \
                memcpy(tile + g * 4 * TR + r * 4, &four, 4);                                  \
            }                                                                                 \
        }                                                                                     \
        if (TILE512) interleave16(rows, len, SIGNED, tile);                                   \
    }                                                                                         \
    /* the tiles built as they are used, or read from kept (NAME##_build's) where not NULL */ \
    static void NAME##_tiled(const uint8_t *w, const uint8_t *kept, int64_t n, int64_t k,     \
                             const Panels *P, int64_t m, float *y, int64_t ldy, int qa) {     \
        const int NT = TILE512 && !P->l ? 2 : 1; /* tiles side by side (tile_rows2) */      \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r0 = 0; r0 < n; r0 += NT * TR) {                                         \
            uint8_t built[2][IKC * TR] __attribute__((aligned(64)));                          \
            float bas[2][IKC / SB * TR], bcs[2][IKC / SB * TR];                               \
            int8_t rows[TILE512 ? IKC * TR : IKC] __attribute__((aligned(64)));               \
            const int nt = NT == 2 && n - r0 > TR ? 2 : 1;                                    \
            const int ncols = n - r0 - (nt - 1) * TR < TR ? (int)(n - r0 - (nt - 1) * TR) : TR; \
            for (int64_t k0 = 0; k0 < k; k0 += IKC) {                                         \
                const int64_t len = k - k0 < IKC ? k - k0 : IKC;                              \
                const uint8_t *tile[2] = {NULL, NULL};                                        \
                const float *as[2] = {NULL, NULL}, *cs[2] = {NULL, NULL};                     \
                for (int j = 0; j < nt; j++) {                                                \
                    const int64_t rj = r0 + j * TR;                                           \
                    if (kept) {                                                               \
                        tile[j] = kept + tile_at(rj, k0, k);                                  \
                        as[j] = (const float *)(tile[j] + len * TR), cs[j] = as[j] + len / SB * TR; \
                    } else {                                                                  \
                        NAME##_tile(w, n, k / QK, rj, k0, len, built[j], bas[j], bcs[j], rows); \
                        tile[j] = built[j], as[j] = bas[j], cs[j] = bcs[j];                   \
                    }                                                                         \
                }                                                                             \
                tile_pass(SIGNED && !TILE512, qa, m, tile[0], as[0], cs[0], tile[1], as[1],   \
                          cs[1], k0, len, P, y + r0, ldy, ncols);                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    /* every tile of the matrix, kept (tile_at) */                                            \
    static void NAME##_build(const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {          \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r0 = 0; r0 < n; r0 += TR) {                                              \
            int8_t rows[TILE512 ? IKC * TR : IKC] __attribute__((aligned(64)));               \
            for (int64_t k0 = 0; k0 < k; k0 += IKC) {                                         \
                const int64_t len = k - k0 < IKC ? k - k0 : IKC;                              \
                uint8_t *tile = out + tile_at(r0, k0, k);                                     \
                float *as = (float *)(tile + len * TR), *cs = as + len / SB * TR;             \
                NAME##_tile(w, n, k / QK, r0, k0, len, tile, as, cs, rows);                   \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    /* nb blocks as a tile holds them (tg_tile_view) */                                       \
    static void NAME##_view(const uint8_t *w, int64_t nb, uint8_t *q, float *a16, float *c16, \
                            int *is_signed) {                                                 \
        *is_signed = SIGNED && !TILE512;                                                      \
        DECODE_CHUNK(UNPACK, QK, L, BYTES, w, nb, (int8_t *)q, a16, c16, 1)                   \
        TILE_OFFSET(SIGNED, nb * QK / SB, a16, c16, 1)                                        \
        for (int64_t j = 0; j < nb * QK && TILE512 && SIGNED; j++) q[j] ^= 0x80;               \
    }

IKERNELS(im_q4_0, 32, 32, 18, un_q4_0, 0)
IKERNELS(im_q4_1, 32, 32, 20, un_q4_1, 0)
IKERNELS(im_q5_0, 32, 32, 22, un_q5_0, 0)
IKERNELS(im_q5_1, 32, 32, 24, un_q5_1, 0)
IKERNELS(im_q8_0, 32, 32, 34, un_q8_0, 1)
IKERNELS(im_q4_k, 256, 32, 144, un_q4_k, 0)
IKERNELS(im_q5_k, 256, 32, 176, un_q5_k, 0)
IKERNELS(im_q6_k, 256, 16, 210, un_q6_k, 0)
IKERNELS(im_mxfp4, 32, 32, 17, un_mxfp4, 1)

/* y (m rows, row stride ldy) = the quantised activations (m, k) @ W(n, k)^T. */
static int tiled(int type, const uint8_t *w, const uint8_t *kept, int64_t n, int64_t k,
                 const Panels *P, int qa, int64_t m, float *y, int64_t ldy) {
    DISPATCH(im, type, _tiled, (w, kept, n, k, P, m, y, ldy, qa))
}

/* nb blocks of a type as a tile holds them, for tests of the tiles' arithmetic: each block's
 * values q (signed ones offset by 128 with AVX-512, and then unsigned) and, per 16 values,
 * the scale and offset. *is_signed: 1 where q is to be read as int8. -1 for a type without
 * a kernel. */
int tg_tile_view(int type, const uint8_t *w, int64_t nb, uint8_t *q, float *a16, float *c16,
                 int *is_signed) {
    DISPATCH(im, type, _view, (w, nb, q, a16, c16, is_signed))
}

/* Up to FEWI activation rows, or as many as in_registers takes, row by row (y: m rows, ldy
 * apart). */
static int few(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
               const int8_t *xl, const float *xs4, const float *xsum, int64_t m, float *y,
               int64_t ldy) {
    if (in_registers(type, k, m, xl)) {
        few_in_registers(type, w, n, k, xq, xs4, xsum, m, y, ldy);
        return 0;
    }
    DISPATCH(im, type, _few, (w, n, k, xq, xl, xs4, xsum, m, y, ldy))
}

static int build(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    DISPATCH(im, type, _build, (w, n, k, out))
}

/* y (m rows, row stride n) = the quantised activations (m, k) @ W(n, k)^T for a packed matrix
 * whose rows come in parts of one GGML type each, described as {n, k, parts, then (type,
 * rows, address, kept tiles' address or 0) for each part} (layer.c's matrix). The activations
 * are packed into panels once for every part. -1 for a type without a kernel, -2 out of
 * memory. */
int tg_qmatmul(const int64_t *w, const int8_t *xq, const int8_t *xl, const float *xs4,
               const float *xsum, int qa, int64_t m, float *y) {
    const int64_t n = w[0], k = w[1], parts = w[2];
    if (m <= 0) return 0;
    Panels P;
    int tiles = 0;  /* whether any part takes the tiles, and so the panels */
    for (int64_t p = 0; p < parts; p++)
        tiles |= !row_by_row((int)w[3 + 4 * p], k, m, qa, xl);
    if (tiles && !make_panels(m, k, xq, xl, xs4, xsum, qa, &P)) return -2;
    int err = 0;
    int64_t row = 0;
    for (int64_t p = 0; p < parts && !err; p++) {
        const int type = (int)w[3 + 4 * p];
        const int64_t rows = w[4 + 4 * p];
        const uint8_t *data = (const uint8_t *)(intptr_t)w[5 + 4 * p],
                      *tiles = (const uint8_t *)(intptr_t)w[6 + 4 * p];
        if (row_by_row(type, k, m, qa, xl)) {
            err = few(type, data, rows, k, xq, xl, xs4, xsum, m, y + row, n);
        } else if (!in_tile_registers(type, data, rows, k, &P, qa, xl != NULL, m, y + row, n)) {
            /* MB rows at a time, so that their panels stay in cache while every tile passes
             * over them (each tile is decoded again for each MB rows, unless kept: a small
             * cost against MB rows) */
            for (int64_t m0 = 0; m0 < m && !err; m0 += MB) {
                const Panels B = {P.q + m0 * k, P.l ? P.l + m0 * k : NULL, P.s + m0 * (k / 4),
                                  P.sum + m0 * (k / SB), P.start + m0 * (k / SB), k};
                const int64_t mb = m - m0 < MB ? m - m0 : MB;
                err = tiled(type, data, tiles, rows, k, &B, qa, mb, y + row + m0 * n, n);
            }
        }
        row += rows;
    }
    if (panel_cap > PANEL_KEEP) {
        free(panel_buf);
        panel_buf = NULL, panel_cap = 0;
    }
    return err;
}

/* Products of a packed matrix's consecutive row blocks, each with its own activations, as
 * tg_qmatmul computes each: group g multiplies activation rows g * m .. (g + 1) * m - 1
 * by weight rows g * n .. (g + 1) * n - 1 (one GGML type, ``stride`` bytes from one block of
 * rows to the next, no kept tiles) into y[g] (m rows of n). DeepSeek's absorbed attention:
 * one query or output row per head. Few rows: the groups shared among the threads; more:
 * one group after another, each product parallel (their panels share one buffer). */
int tg_qmatmul_grouped(int type, const uint8_t *w, int64_t groups, int64_t n, int64_t k,
                       int64_t stride, const int8_t *xq, const int8_t *xl, const float *xs4,
                       const float *xsum, int qa, int64_t m, float *y) {
    int err = 0;
    if (row_by_row(type, k, m, qa, xl)) {
        _Pragma("omp parallel for schedule(static) reduction(|:err)")
        for (int64_t g = 0; g < groups; g++)
            err |= few(type, w + g * stride, n, k, xq + g * m * k, xl ? xl + g * m * k : NULL,
                       xs4 + g * m * (k / 4), xsum + g * m * (k / SB), m, y + g * m * n, n);
        return err ? -1 : 0;
    }
    for (int64_t g = 0; g < groups && !err; g++) {
        const int64_t d[7] = {n, k, 1, type, n, (int64_t)(intptr_t)(w + g * stride), 0};
        err = tg_qmatmul(d, xq + g * m * k, xl ? xl + g * m * k : NULL, xs4 + g * m * (k / 4),
                         xsum + g * m * (k / SB), qa, m, y + g * m * n);
    }
    return err;
}

/* Every part's tiles (as a descriptor of tg_qmatmul gives them, its kept tiles' addresses
 * ignored) into out, one part after another, tg_tile_bytes(rows, k) each: what a product of
 * many rows otherwise decodes at every call. -1 for a type without a kernel. */
int tg_build_tiles(const int64_t *w, uint8_t *out) {
    const int64_t k = w[1];
    for (int64_t p = 0; p < w[2]; p++) {
        const int64_t rows = w[4 + 4 * p];
        if (build((int)w[3 + 4 * p], (const uint8_t *)(intptr_t)w[5 + 4 * p], rows, k, out))
            return -1;
        out += tg_tile_bytes(rows, k);
    }
    return 0;
}

/* Whether a product of m activation rows (8 bits scaled per qa values, or wide: 16 bits) by
 * a matrix of this GGML type and row length takes the tiles' arithmetic (1: in memory or in
 * registers) or goes row by row (0). */
int tg_takes_tiles(int type, int64_t k, int64_t m, int qa, int wide) {
    static const int8_t some = 0;  /* (only whether the 16-bit halves are there counts) */
    return !row_by_row(type, k, m, qa, wide ? &some : NULL);
}

/* Whether such a product (qa: the 8-bit activations' values per scale) reads tiles in memory,
 * built at each product or kept (tg_build_tiles): the tiles' arithmetic, not in registers. */
int tg_reads_tiles(int type, int64_t k, int64_t m, int qa, int wide) {
    return tg_takes_tiles(type, k, m, qa, wide) && !regs_take(type, m, qa, wide);
}

/* Which integer instructions this build uses: 2 VNNI, 1 AVX2, 0 portable C. */
int tg_int8_isa(void) { return INT8_ISA; }
