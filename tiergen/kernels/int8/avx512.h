/* The AVX-512 kernels of int8.c (included by it, once, where there are AVX-512 F and BW),
 * over avx2.h's 32-byte vectors. int8.c lists what each instruction set's header defines.
 *
 * Every such build quantises the activations sixteen values to a vector (quantize16_512).
 * With VNNI, the tiles hold sixteen weight rows, one 64-byte vector per four values of each,
 * multiplied by `dpbusd` on 512-bit vectors: unsigned weights only, so signed ones (Q8_0,
 * MXFP4) are read as q + 128 with an offset of -128 a (int8.c's TILE_OFFSET); the decoded
 * rows are interleaved sixteen at a time by transposes (interleave16), and the 8-bit products
 * take two tiles side by side (tile_rows2). With VL too, up to RIR rows of most types take
 * their blocks' values into registers (row2_q4, row2_q4k, row2_q6k) instead of decoding them
 * to a copy. Without VNNI (or VL), avx2.h's tiles (or kernels in registers) serve. */

#define QUANTIZE512 1  /* quantize_blocks below, not avx2.h's */
#if defined(__AVX512VNNI__)
#define TILE512 1 /* tiles of sixteen rows, one 64-byte vector per four values */
#define TR 16     /* weight rows per interleaved tile */
#define MI 4      /* activation rows per pass over a tile */
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ROW2 1
#define RIR 4  /* up to this many activation rows: the kernels in registers (more: the tiles) */
#endif

#include "avx2.h"

/* quantize16 and what tg_quantize_act makes of it (the scales and the block's sum), the same
 * operations on the same values: the maxima of the four groups of four gathered into one lane
 * each for the divisions (groups of a block share its maximum), the products in double and
 * added in order (exact, as the scalar loop's: a float times a sum of 16 int8 fits in 53
 * bits). */
static inline __attribute__((always_inline)) void
quantize16_512(const int QA, const float *restrict x, int8_t *restrict q, float *restrict xs4,
               float *restrict xsum) {
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12),
                  spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m128 top = _mm_set1_ps(127.0f);
    const __m512 v = _mm512_loadu_ps(x);
    __m512 m = _mm512_abs_ps(v);
    m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));
    m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E));
    if (QA >= 8) m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0xB1));
    if (QA >= 16) m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0x4E));
    const __m128 m4 = _mm512_castps512_ps128(_mm512_permutexvar_ps(first, m));
    const __m128 inv4 = _mm_and_ps(_mm_div_ps(top, m4), _mm_cmpgt_ps(m4, _mm_setzero_ps()));
    const __m128 s4 = _mm_div_ps(m4, top);
    const __m512 inv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(inv4));
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qi));
    _mm_storeu_ps(xs4, s4);
    __m512i t = _mm512_add_epi32(qi, _mm512_shuffle_epi32(qi, (_MM_PERM_ENUM)0xB1));
    t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, (_MM_PERM_ENUM)0x4E));
    const __m128i sums = _mm512_castsi512_si128(_mm512_permutexvar_epi32(first, t));
    double p[4];
    _mm256_storeu_pd(p, _mm256_mul_pd(_mm256_cvtps_pd(s4), _mm256_cvtepi32_pd(sums)));
    double total = 0.0;
    for (int o = 0; o < 4; o++) total += p[o];
    *xsum = (float)total;
}

/* tg_quantize_act's 8-bit activations (blocks of SB values), by quantize16_512. */
static inline __attribute__((always_inline)) int
quantize_blocks(const float *x, int64_t blocks, int qa, int8_t *xq, float *xs4, float *xsum) {
    _Pragma("omp parallel for schedule(static) if (blocks > 256)")
    for (int64_t t = 0; t < blocks; t++) {
        if (qa == 4) quantize16_512(4, x + t * SB, xq + t * SB, xs4 + t * SB / 4, xsum + t);
        else if (qa == 8) quantize16_512(8, x + t * SB, xq + t * SB, xs4 + t * SB / 4, xsum + t);
        else quantize16_512(16, x + t * SB, xq + t * SB, xs4 + t * SB / 4, xsum + t);
    }
    return 1;
}

#if TILE512
/* A tile's products: per four values, one vector of the sixteen rows' bytes, multiplied by
 * four bytes of an activation row broadcast to every lane; the 8-bit rows side by side. */
static inline __attribute__((always_inline)) void
tile_rows(TILE_ROWS_PARAMS) {
    /* unsigned weights only: signed ones are offset by 128 when the tile is built */
    (void)SIGNED;
    __m512 acc[MI];
    for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len / SB; t++) {
        const int64_t g0 = SB / 4 * t;
        const __m512 a = _mm512_loadu_ps(as + t * TR), c = _mm512_loadu_ps(cs + t * TR);
        if (!WIDE) {  /* the rows side by side: few registers, and their chains overlap */
            __m512i d[MI];
            __m512 part[MI];
            for (int i = 0; i < NR; i++) part[i] = _mm512_set1_ps(start[t * MI + i]);
            for (int g = 0; g < SB / 4; g++) {
                const __m512i w = _mm512_loadu_si512(tile + (g0 + g) * 4 * TR);
                for (int i = 0; i < NR; i++) {
                    int32_t four;
                    memcpy(&four, q + ((g0 + g) * MI + i) * 4, 4);
                    if (g % (QA / 4) == 0) d[i] = _mm512_set1_epi32(MAGIC_BITS);
                    d[i] = _mm512_dpbusd_epi32(d[i], w, _mm512_set1_epi32(four));
                    if (g % (QA / 4) == QA / 4 - 1)
                        part[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(d[i]),
                                                  _mm512_set1_ps(s[(g0 + g) * MI + i]), part[i]);
                }
            }
            for (int i = 0; i < NR; i++)
                acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(sum[t * MI + i]), _mm512_fmadd_ps(part[i], a, acc[i]));
            continue;
        }
        __m512i w[SB / 4];  /* 16 bits */
        for (int g = 0; g < SB / 4; g++) w[g] = _mm512_loadu_si512(tile + (g0 + g) * 4 * TR);
        for (int i = 0; i < NR; i++) {
            __m512 part = _mm512_setzero_ps();
            for (int b = 0; b < SB / QA; b++) {
                __m512i d = _mm512_setzero_si512(), e = _mm512_setzero_si512();
                for (int g = QA / 4 * b; g < QA / 4 * (b + 1); g++) {
                    int32_t four;
                    memcpy(&four, q + ((g0 + g) * MI + i) * 4, 4);
                    d = _mm512_dpbusd_epi32(d, w[g], _mm512_set1_epi32(four));
                    memcpy(&four, l + ((g0 + g) * MI + i) * 4, 4);
                    e = _mm512_dpbusd_epi32(e, w[g], _mm512_set1_epi32(four));
                }
                d = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(d, 8), d), e);
                part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d),
                                       _mm512_set1_ps(s[(g0 + QA / 4 * b) * MI + i]), part);
            }
            acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(sum[t * MI + i]), _mm512_fmadd_ps(part, a, acc[i]));
        }
    }
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
    for (int i = 0; i < rows; i++) {
        float *out = y + i * ldy;
        if (add) acc[i] = _mm512_add_ps(acc[i], _mm512_maskz_loadu_ps(keep, out));
        _mm512_mask_storeu_ps(out, keep, acc[i]);
    }
}

/* tile_rows' 8-bit path over two tiles side by side (32 weight rows, the second with ncols of
 * them): each four activation bytes and each scale are loaded once for both tiles, so the
 * products need about half the loads. */
static inline __attribute__((always_inline)) void
tile_rows2(const int NR, const int QA, const uint8_t *restrict t0, const uint8_t *restrict t1,
           const float *restrict as0, const float *restrict cs0, const float *restrict as1,
           const float *restrict cs1, int64_t len, const int8_t *restrict q,
           const float *restrict s, const float *restrict sum, const float *restrict start,
           float *restrict y, int64_t ldy, int rows, int ncols, int add) {
    __m512 acc0[MI], acc1[MI];
    for (int i = 0; i < NR; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len / SB; t++) {
        const int64_t g0 = SB / 4 * t;
        __m512i d0[MI], d1[MI];
        __m512 p0[MI], p1[MI];
        for (int i = 0; i < NR; i++) p0[i] = p1[i] = _mm512_set1_ps(start[t * MI + i]);
        for (int g = 0; g < SB / 4; g++) {
            const __m512i w0 = _mm512_loadu_si512(t0 + (g0 + g) * 4 * TR),
                          w1 = _mm512_loadu_si512(t1 + (g0 + g) * 4 * TR);
            for (int i = 0; i < NR; i++) {
                int32_t four;
                memcpy(&four, q + ((g0 + g) * MI + i) * 4, 4);
                const __m512i x = _mm512_set1_epi32(four);
                if (g % (QA / 4) == 0) d0[i] = d1[i] = _mm512_set1_epi32(MAGIC_BITS);
                d0[i] = _mm512_dpbusd_epi32(d0[i], w0, x);
                d1[i] = _mm512_dpbusd_epi32(d1[i], w1, x);
                if (g % (QA / 4) == QA / 4 - 1) {
                    const __m512 sv = _mm512_set1_ps(s[(g0 + g) * MI + i]);
                    p0[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(d0[i]), sv, p0[i]);
                    p1[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(d1[i]), sv, p1[i]);
                }
            }
        }
        const __m512 a0 = _mm512_loadu_ps(as0 + t * TR), c0 = _mm512_loadu_ps(cs0 + t * TR),
                     a1 = _mm512_loadu_ps(as1 + t * TR), c1 = _mm512_loadu_ps(cs1 + t * TR);
        for (int i = 0; i < NR; i++) {
            const __m512 si = _mm512_set1_ps(sum[t * MI + i]);
            acc0[i] = _mm512_fmadd_ps(c0, si, _mm512_fmadd_ps(p0[i], a0, acc0[i]));
            acc1[i] = _mm512_fmadd_ps(c1, si, _mm512_fmadd_ps(p1[i], a1, acc1[i]));
        }
    }
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
    for (int i = 0; i < rows; i++) {
        float *out = y + i * ldy;
        if (add) {
            acc0[i] = _mm512_add_ps(acc0[i], _mm512_loadu_ps(out));
            acc1[i] = _mm512_add_ps(acc1[i], _mm512_maskz_loadu_ps(keep, out + TR));
        }
        _mm512_storeu_ps(out, acc0[i]);
        _mm512_mask_storeu_ps(out + TR, keep, acc1[i]);
    }
}

/* r[j] lane i := r[i] lane j, for 16 x 16 32-bit values */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* each 128-bit lane now holds a 4 x 4 block, transposed */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) {  /* then the blocks change places */
        const __m512i v0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE),
                      w0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44), w1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
        t[e] = _mm512_shuffle_i32x4(v0, w0, 0x88), t[4 + e] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        t[8 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88), t[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* The tile (as tile_rows reads it) of TR = 16 decoded rows of len values, IKC apart; flip:
 * signed values, offset by 128 to be read as unsigned. */
static void interleave16(const int8_t *restrict rows, int64_t len, int flip, uint8_t *restrict tile) {
    const __m512i offset = _mm512_set1_epi8((char)(flip ? 0x80 : 0));
    for (int64_t j = 0; j < len; j += 64) {  /* 16 groups of four values per row at a time */
        const int groups = len - j < 64 ? (int)(len - j) / 4 : 16;
        const __mmask64 keep = groups == 16 ? ~(__mmask64)0 : ((__mmask64)1 << (4 * groups)) - 1;
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi8(keep, rows + i * IKC + j);
        transpose16(r);
        for (int g = 0; g < groups; g++)
            _mm512_store_si512(tile + (j / 4 + g) * 4 * TR, _mm512_xor_si512(r[g], offset));
    }
}

/* ---- tiles in registers ----------------------------------------------------------------
 * Up to MI activation rows through the tiles' arithmetic (tile_rows2's, to the bit) without a
 * tile in memory: sixteen weight rows' next 64 values are decoded straight into sixteen
 * registers (one row each, as the tile holds its bytes: unsigned, signed ones plus 128) and
 * turned across by transpose16 into the tile's sixteen vectors of four values; each 16
 * values' scale and offset come as vectors over the sixteen rows, by gathers. What the row
 * kernels do for few rows (the blocks into registers, no copy), in the tiles' order, so that
 * a row's numbers are those of any batch (tg_set_batch_invariant). Every type of the integer
 * kernels has such a decoder (regs_type). */

/* Sixteen rows' next 64 values (q: one register a row; n: how many 16-value sub-blocks of
 * them the matrix has, 2 or 4) and each sub-block's scale and offset over the rows (a, c). */
typedef struct {
    __m512i q[16];
    __m512 a[4], c[4];
    int n;
} Regs64;

static inline __m512 halves_lo(__m512i g) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)); }
static inline __m512 halves_hi(__m512i g) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
}
static inline __m512 negated(__m512 v) {  /* -v, as C's unary minus: the sign bit flipped */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

/* Blocks b and b + 1 (b alone where two is 0) of 32 values of the types of row2_q4 and Q8_0,
 * for rows at rows[r] (the bytes of their block b), idx: each row's offset from rows[0]. */
static inline __attribute__((always_inline)) void
regs_b32(const int TYPE, const uint8_t *const rows[16], __m512i idx, int two, Regs64 *rg) {
    const int bytes = block_bytes(TYPE);
    const int at = TYPE == 39 ? 1 : TYPE == 2 ? 2 : TYPE == 3 ? 4 : TYPE == 6 ? 6 : TYPE == 7 ? 8 : 2;
    const int five = TYPE == 6 || TYPE == 7, mx = TYPE == 39, q8 = TYPE == 8;
    const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16),
                  flip = _mm512_set1_epi8((char)0x80),
                  /* MXFP4's values plus 128, from the nibbles */
                  table = _mm512_broadcast_i32x4(_mm_setr_epi8(
                      (char)128, (char)129, (char)130, (char)131, (char)132, (char)134, (char)136, (char)140,
                      (char)128, 127, 126, 125, 124, 122, 120, 116));
    /* each block's first four bytes over the rows, asked for first: the loads the scales wait on */
    const __m512i g0 = _mm512_i32gather_epi32(idx, rows[0], 1),
                  g1 = two ? _mm512_i32gather_epi32(idx, rows[0] + bytes, 1) : g0;
    for (int r = 0; r < 16; r++) {
        const uint8_t *p = rows[r], *q = two ? p + bytes : p;
        __m512i v;
        if (q8) {
            v = _mm512_xor_si512(flip, _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + at))),
                _mm256_loadu_si256((const __m256i *)(q + at)), 1));
        } else {
            v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + at)))),
                _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + at))), 1);
            v = _mm512_and_si512(low, _mm512_mask_srli_epi16(v, 0xFF00FF00, v, 4));
            if (five) {
                uint32_t h0, h1;
                memcpy(&h0, p + at - 4, 4), memcpy(&h1, q + at - 4, 4);
                v = _mm512_or_si512(v, _mm512_maskz_mov_epi8((uint64_t)h0 | (uint64_t)h1 << 32, bit4));
            }
            if (mx) v = _mm512_shuffle_epi8(table, v);
        }
        rg->q[r] = v;
    }
    rg->n = two ? 4 : 2;
    for (int h = 0; h < 1 + two; h++) {
        const __m512i g = h ? g1 : g0;
        __m512 a, c;
        if (mx) {  /* e8m0_half of the first byte */
            const __m512i e = _mm512_and_si512(g, _mm512_set1_epi32(255));
            const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
            a = _mm512_castsi512_ps(_mm512_mask_mov_epi32(
                _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23), tiny,
                _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e)));
        } else {
            a = halves_lo(g);
        }
        if (TYPE == 3 || TYPE == 7) c = halves_hi(g);
        else c = _mm512_mul_ps(_mm512_set1_ps(TYPE == 2 ? -8.0f : TYPE == 6 ? -16.0f : -128.0f), a);
        rg->a[2 * h] = rg->a[2 * h + 1] = a;
        rg->c[2 * h] = rg->c[2 * h + 1] = c;
    }
}

/* Q4_K's and Q5_K's (FIVE) eight sub-blocks' scales and offsets (k_scales) over 16 rows,
 * from their blocks at rows[0] + idx. */
static inline void regs_k_scales(const uint8_t *row0, __m512i idx, __m512 a[8], __m512 c[8]) {
    const __m512i g0 = _mm512_i32gather_epi32(idx, row0, 1), g1 = _mm512_i32gather_epi32(idx, row0 + 4, 1),
                  g2 = _mm512_i32gather_epi32(idx, row0 + 8, 1), g3 = _mm512_i32gather_epi32(idx, row0 + 12, 1);
    const __m512 d = halves_lo(g0), dmin = halves_hi(g0);
    const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
    for (int j = 0; j < 4; j++) {
        const __m512i s1 = _mm512_srli_epi32(g1, 8 * j), s2 = _mm512_srli_epi32(g2, 8 * j),
                      s3 = _mm512_srli_epi32(g3, 8 * j);
        a[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(s1, m63)));
        c[j] = negated(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_and_si512(s2, m63))));
        const __m512i sc = _mm512_or_si512(_mm512_and_si512(s3, m15),
                                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, 6), m3), 4)),
                      mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s3, 4), m15),
                                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s2, 6), m3), 4));
        a[j + 4] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        c[j + 4] = negated(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
    }
}

/* Quarter h (values 64 h .. 64 h + 63) of 16 rows' Q4_K or Q5_K (FIVE) blocks at rows[r]. */
static inline __attribute__((always_inline)) void
regs_q4k(const int FIVE, const uint8_t *const rows[16], int h, const __m512 a8[8],
         const __m512 c8[8], Regs64 *rg) {
    const __m512i low = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16),
                  bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << 2 * h)),
                                            _mm256_set1_epi8((char)(1 << (2 * h + 1))), 1);
    const int qs = FIVE ? 48 : 16;
    for (int r = 0; r < 16; r++) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(rows[r] + qs + 32 * h)));
        __m512i q = _mm512_and_si512(low, _mm512_mask_srli_epi16(v, 0xFFFF0000, v, 4));
        if (FIVE) {
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(rows[r] + 16)));
            q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits), sixteen));
        }
        rg->q[r] = q;
    }
    rg->n = 4;
    rg->a[0] = rg->a[1] = a8[2 * h], rg->a[2] = rg->a[3] = a8[2 * h + 1];
    rg->c[0] = rg->c[1] = c8[2 * h], rg->c[2] = rg->c[3] = c8[2 * h + 1];
}

/* Values 64 e .. 64 e + 63 of 16 rows' Q6_K blocks at rows[r] (rows[0] + idx). */
static inline __attribute__((always_inline)) void
regs_q6k(const uint8_t *const rows[16], __m512i idx, int e, Regs64 *rg) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    const int h = e / 2;
    for (int r = 0; r < 16; r++) {
        const __m512i l = _mm512_loadu_si512(rows[r] + 64 * h),
                      hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(rows[r] + 128 + 32 * h)));
        rg->q[r] = e % 2 == 0
            ? _mm512_or_si512(_mm512_and_si512(l, low), _mm512_and_si512(_mm512_sllv_epi16(hb,
                  _mm512_setr_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                    0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002)), two))
            : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low), _mm512_and_si512(_mm512_srlv_epi16(hb,
                  _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002,
                                    0x0002000200020002)), two));
    }
    rg->n = 4;
    /* d: the high half of the word at 206 (a word at 208 would read past the block) */
    const __m512 d = halves_hi(_mm512_i32gather_epi32(idx, rows[0] + 206, 1));
    const __m512i sc = _mm512_i32gather_epi32(idx, rows[0] + 192 + 4 * e, 1);
    for (int t = 0; t < 4; t++) {
        rg->a[t] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 24 - 8 * t), 24)));
        rg->c[t] = _mm512_mul_ps(_mm512_set1_ps(-32.0f), rg->a[t]);
    }
}

/* Whether regs_rows has a decoder for this type. */
static inline int regs_type(int type) {
    return type == 2 || type == 3 || type == 6 || type == 7 || type == 8 || type == 39 ||
           type == 12 || type == 13 || type == 14;
}

/* tile_rows2's products of NR activation rows (a panel's first, at the chunk's start: q, s,
 * sum, start) with 64 values of the sixteen rows in rg, sub-block T0 on of the chunk. */
static inline __attribute__((always_inline)) void
regs_step(const int NR, const int QA, Regs64 *rg, int64_t T0, const int8_t *restrict q,
          const float *restrict s, const float *restrict sum, const float *restrict start,
          __m512 acc[MI]) {
    transpose16(rg->q);
    for (int t = 0; t < rg->n; t++) {
        const int64_t T = T0 + t;
        __m512i d[MI];
        __m512 part[MI];
        for (int i = 0; i < NR; i++) part[i] = _mm512_set1_ps(start[T * MI + i]);
        for (int g = 0; g < SB / 4; g++) {
            const int64_t G = SB / 4 * T + g;
            for (int i = 0; i < NR; i++) {
                int32_t four;
                memcpy(&four, q + (G * MI + i) * 4, 4);
                if (g % (QA / 4) == 0) d[i] = _mm512_set1_epi32(MAGIC_BITS);
                d[i] = _mm512_dpbusd_epi32(d[i], rg->q[4 * t + g], _mm512_set1_epi32(four));
                if (g % (QA / 4) == QA / 4 - 1)
                    part[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(d[i]), _mm512_set1_ps(s[G * MI + i]), part[i]);
            }
        }
        for (int i = 0; i < NR; i++)
            acc[i] = _mm512_fmadd_ps(rg->c[t], _mm512_set1_ps(sum[T * MI + i]), _mm512_fmadd_ps(part[i], rg->a[t], acc[i]));
    }
}

/* Columns r0 .. r0 + 15 of y (rows <= NR rows, ldy apart) = the activation rows of panel 0 of P
 * by the n x k matrix w of this type, as the tiles give them: in chunks of IKC values, each
 * chunk's sums added to the last's. (Called with constant NR, QA and TYPE inside the caller's
 * parallel loop, so that each is compiled for them.) */
static inline __attribute__((always_inline)) void
regs_rows(const int NR, const int QA, const int TYPE, const uint8_t *w, int64_t n, int64_t k,
          const Panels *P, int rows, float *y, int64_t ldy, int64_t r0) {
    const int64_t qk = block_values(TYPE), bytes = block_bytes(TYPE), row = k / qk * bytes;
    const int ncols = n - r0 < 16 ? (int)(n - r0) : 16;
    const uint8_t *base[16];
    int32_t off[16];
    for (int r = 0; r < 16; r++) {  /* rows past the matrix repeat its last (never stored) */
        const int64_t at = (r < ncols ? r : ncols - 1) * row;
        base[r] = w + r0 * row + at, off[r] = (int32_t)at;
    }
    const __m512i idx = _mm512_loadu_si512(off);
    for (int64_t k0 = 0; k0 < k; k0 += IKC) {
        const int64_t len = k - k0 < IKC ? k - k0 : IKC;
        const int8_t *q = P->q + k0 * MI;
        const float *s = P->s + k0 / 4 * MI, *sum = P->sum + k0 / SB * MI,
                    *start = P->start + k0 / SB * MI;
        __m512 acc[MI];
        for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();
        Regs64 rg;
        __m512 a8[8], c8[8];  /* (Q4_K, Q5_K: a block's, from its first quarter on) */
        for (int64_t j = 0; j < len; j += 64) {
            const int64_t b = (k0 + j) / qk;  /* the block holding value k0 + j */
            const uint8_t *at[16];
            for (int r = 0; r < 16; r++) {
                at[r] = base[r] + b * bytes;
                __builtin_prefetch((const char *)at[r] + 16 * row, 0, 3);
            }
            if (qk == 32) {
                regs_b32(TYPE, at, idx, len - j >= 64, &rg);
            } else if (TYPE == 14) {
                regs_q6k(at, idx, (int)((k0 + j) % 256 / 64), &rg);
            } else {
                if ((k0 + j) % 256 == 0) regs_k_scales(at[0], idx, a8, c8);
                regs_q4k(TYPE == 13, at, (int)((k0 + j) % 256 / 64), a8, c8, &rg);
            }
            regs_step(NR, QA, &rg, j / SB, q, s, sum, start, acc);
        }
        const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
        for (int i = 0; i < rows; i++) {
            float *out = y + i * ldy + r0;
            if (k0 > 0) acc[i] = _mm512_add_ps(acc[i], _mm512_maskz_loadu_ps(keep, out));
            _mm512_mask_storeu_ps(out, keep, acc[i]);
        }
    }
}
#endif

#if ROW2
/* avx2.h's rows_q4 with 512-bit vectors against NR activation rows (up to RIR, each
 * block decoded once for all of them), and for Q5_0 and Q5_1 (their fifth bits joined to the
 * nibbles) and MXFP4 (its values looked up, plus 12, from the nibbles; a power of two a
 * block). Each 512-bit vector holds two consecutive blocks of one row: its 128-bit lanes hold values 0-15 of block b, 16-31 of b, 0-15 of b + 1, 16-31
 * of b + 1, which is the order of the activations (xq), their lanes' offsets (nn), scales
 * (xs4) and Q4_1 sums (xm) in memory, so they are read as they lie, each read serving both
 * rows. A block's nibbles are broadcast to two lanes, and the high ones shifted down in the
 * second. An odd last block is read twice, against activations masked to zero. */
static inline __attribute__((always_inline)) void
row2_q4(const int TYPE, const int64_t BYTES, const uint8_t *restrict w0,
        const uint8_t *restrict w1, int64_t nb, int64_t ahead, const int8_t *restrict xq,
        const float *restrict xs4, const int32_t *restrict nn, const float *restrict xm,
        const int NR, int64_t k, float *restrict y, int64_t ldy) {
    /* where the nibbles start; Q5's high bits lie just before them */
    const int at = TYPE == 39 ? 1 : TYPE == 2 ? 2 : TYPE == 3 ? 4 : TYPE == 6 ? 6 : 8,
              five = TYPE == 6 || TYPE == 7, mx = TYPE == 39,
              offset = TYPE == 2 || TYPE == 6 || mx, minimum = TYPE == 3 || TYPE == 7;
    const __m512i bit4 = _mm512_set1_epi8(16),
                  table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                                               12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i low = _mm512_set1_epi8(15);
    const __mmask32 high = 0xFF00FF00;  /* the 16-bit elements of lanes 1 and 3 */
    /* from [a0, m0, a0, m0, a1, m1, a1, m1] (blocks b and b + 1's scale and minimum) */
    const __m512i scale_at = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4),
                  min_at = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 5, 5, 5, 5, 5, 5, 5, 5);
    __m512 acc0[RIR], acc1[RIR];
    for (int r = 0; r < NR; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
#define NIBBLES(p, q)                                                                            \
    (v_ = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(                   \
              _mm_loadu_si128((const __m128i *)((p) + at)))),                                       \
          _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((q) + at))), 1),            \
     _mm512_and_si512(low, _mm512_mask_srli_epi16(v_, high, v_, 4)))
/* (Q4_0: the block's scale, then two bytes of values that are not used) */
#define SCALES(p, q)                                                                             \
    (memcpy(&u0, (p), 4), memcpy(&u1, (q), 4),                                                    \
     _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_mask_set1_epi32(_mm_set1_epi32(u0), 0xC, u1))))
#define ROW(w, acc)                                                                              \
    do {                                                                                          \
        const uint8_t *p = (w) + b * BYTES, *q = last ? p : p + BYTES;                            \
        __builtin_prefetch((const char *)p + ahead, 0, 3);                                        \
        __m512i v_;                                                                               \
        __m512i w_ = NIBBLES(p, q);                                                               \
        if (five) {  /* the fifth bits, a bit a value, as bytes of 16 */                          \
            uint32_t h0, h1;                                                                      \
            memcpy(&h0, p + at - 4, 4), memcpy(&h1, q + at - 4, 4);                              \
            w_ = _mm512_or_si512(w_, _mm512_and_si512(bit4, _mm512_movm_epi8(                     \
                                         (uint64_t)h0 | (uint64_t)h1 << 32)));                      \
        }                                                                                         \
        if (mx) w_ = _mm512_shuffle_epi8(table, w_);  /* MXFP4's values, plus 12 */               \
        int32_t u0, u1;                                                                           \
        const __m512 am = mx ? _mm512_setzero_ps() : SCALES(p, q);                                \
        const __m512 sc = mx ? _mm512_mask_broadcastss_ps(_mm512_set1_ps(e8m0_half(p[0])), 0xFF00, \
                                                          _mm_set_ss(e8m0_half(q[0])))            \
                             : _mm512_permutexvar_ps(scale_at, am);                               \
        const __m512 mn = minimum ? _mm512_permutexvar_ps(min_at, am) : _mm512_setzero_ps();      \
        for (int r = 0; r < NR; r++) {  /* the block decoded once for every activation row */      \
            const __m512i d = _mm512_dpbusd_epi32(n_[r], w_, x_[r]);                              \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sc, s_[r]), acc[r]);    \
            if (minimum) acc[r] = _mm512_fmadd_ps(mn, m_[r], acc[r]);                             \
        }                                                                                         \
    } while (0)
    for (int64_t b = 0; b < nb; b += 2) {
        const int last = b + 1 == nb;
        const __mmask16 keep = last ? 0x00FF : 0xFFFF;
        __m512i x_[RIR], n_[RIR];
        __m512 s_[RIR], m_[RIR];
        for (int r = 0; r < NR; r++) {
            x_[r] = _mm512_maskz_loadu_epi32(keep, xq + r * k + 32 * b);
            n_[r] = offset ? _mm512_maskz_loadu_epi32(keep, nn + r * (k / 4) + 8 * b) : _mm512_setzero_si512();
            s_[r] = _mm512_maskz_loadu_ps(keep, xs4 + r * (k / 4) + 8 * b);
            m_[r] = minimum ? _mm512_maskz_loadu_ps(keep, xm + r * (k / 4) + 8 * b) : _mm512_setzero_ps();
        }
        ROW(w0, acc0);
        ROW(w1, acc1);
    }
#undef ROW
#undef SCALES
#undef NIBBLES
    for (int r = 0; r < NR; r++) {
        y[r * ldy] = _mm512_reduce_add_ps(acc0[r]);
        y[r * ldy + 1] = _mm512_reduce_add_ps(acc1[r]);
    }
}

/* Indices first + (lane >> shift): the scale each lane takes, where 1 << shift lanes share
 * one (a permutation's index vector; constant where first is). */
static inline __m512i lane_groups(int first, int shift) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_add_epi32(_mm512_set1_epi32(first), _mm512_srli_epi32(lane, shift));
}

/* The rows of pairs to come at the same place, at least AHEAD bytes on, for rows of
 * ``row`` bytes read two at a time. */
static inline int64_t pair_ahead(int64_t row) {
    return (AHEAD + 2 * row - 1) / (2 * row) * (2 * row);
}

/* NR activation rows against two weight rows of Q4_K blocks (or Q5_K: FIVE), the nibbles
 * spread into registers rather than decoded to a copy, as row2_q4 does. A block's 64 values of a
 * quarter are 32 bytes whose low nibbles are its first sub-block and high nibbles its second:
 * broadcast to both halves of a vector, the second half's shifted down, they face the
 * activations as these lie. Each lane takes its sub-block's scale; the minimums multiply the
 * activations' sums over each sub-block (xb, made once per product). Q5_K's fifth bits, one
 * bit of qh's byte l for each of values l and l + 32 of a quarter, are tested into bytes of
 * 16. */
static inline __attribute__((always_inline)) void
row2_q4k(const int FIVE, const uint8_t *restrict w0, const uint8_t *restrict w1, int64_t nb, int64_t ahead,
         const int8_t *restrict xq, const float *restrict xs4, const float *restrict xb,
         const int NR, int64_t k, float *restrict y, int64_t ldy) {
    const __m512i low = _mm512_set1_epi8(15);
    const __mmask32 high = 0xFFFF0000;  /* the 16-bit elements of the upper half */
    /* Q5_K: the bit of qh that is the fifth of a quarter's values, per half (1 << 2h, then
     * 1 << 2h + 1) */
    const __m512i bits[4] = {
        _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(2), 1),
        _mm512_inserti64x4(_mm512_set1_epi8(4), _mm256_set1_epi8(8), 1),
        _mm512_inserti64x4(_mm512_set1_epi8(16), _mm256_set1_epi8(32), 1),
        _mm512_inserti64x4(_mm512_set1_epi8(64), _mm256_set1_epi8((char)128), 1)};
    const __m512i sixteen = _mm512_set1_epi8(16);
    const int64_t BYTES = FIVE ? 176 : 144, QS = FIVE ? 48 : 16;
    __m512 acc0[RIR], acc1[RIR];
    __m256 min0[RIR], min1[RIR];
    for (int r = 0; r < NR; r++) {
        acc0[r] = acc1[r] = _mm512_setzero_ps();
        min0[r] = min1[r] = _mm256_setzero_ps();
    }
#define ROW(w, acc, mins)                                                                        \
    do {                                                                                          \
        const uint8_t *p = (w) + b * BYTES;                                                       \
        __builtin_prefetch((const char *)p + ahead, 0, 3);                                        \
        __builtin_prefetch((const char *)p + ahead + 64, 0, 3);                                   \
        __builtin_prefetch((const char *)p + ahead + 128, 0, 3);                                  \
        __m256 a8, c8;                                                                            \
        k_scales8(p, &a8, &c8);                                                                   \
        const __m512 av = _mm512_castps256_ps512(a8);                                             \
        const __m512i qh = FIVE ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16))) \
                                : _mm512_setzero_si512();                                         \
        for (int h = 0; h < 4; h++) {                                                             \
            const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + QS + 32 * h))); \
            __m512i q = _mm512_and_si512(low, _mm512_mask_srli_epi16(v, high, v, 4));             \
            if (FIVE)                                                                             \
                q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits[h]), sixteen)); \
            const __m512 sc = _mm512_permutexvar_ps(lane_groups(2 * h, 3), av);                   \
            for (int r = 0; r < NR; r++) {                                                         \
                const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x[r][h]);        \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sc, s[r][h]), acc[r]); \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < NR; r++) mins[r] = _mm256_fmadd_ps(c8, xbv[r], mins[r]);               \
    } while (0)
    for (int64_t b = 0; b < nb; b++) {
        __m512i x[RIR][4];
        __m512 s[RIR][4];
        __m256 xbv[RIR];
        for (int r = 0; r < NR; r++) {
            for (int h = 0; h < 4; h++) {
                x[r][h] = _mm512_loadu_si512(xq + r * k + 256 * b + 64 * h);
                s[r][h] = _mm512_loadu_ps(xs4 + r * (k / 4) + 64 * b + 16 * h);
            }
            xbv[r] = _mm256_loadu_ps(xb + r * (k / 32) + 8 * b);
        }
        ROW(w0, acc0, min0);
        ROW(w1, acc1, min1);
    }
#undef ROW
    for (int r = 0; r < NR; r++) {
        y[r * ldy] = _mm512_reduce_add_ps(acc0[r]) + hsum8(min0[r]);
        y[r * ldy + 1] = _mm512_reduce_add_ps(acc1[r]) + hsum8(min1[r]);
    }
}

/* NR activation rows against two weight rows of Q6_K blocks, as row2_q4k. A half block
 * (128 values) is 64 bytes of low four bits (values 0-63 in their low nibbles, 64-127 in
 * their high ones) and 32 bytes of high two bits (values l, l + 32, l + 64, l + 96 in bits
 * 0-1, 2-3, 4-5, 6-7 of byte l): each 64 values' high bits are shifted into place in both
 * halves of a vector at once. Values are stored plus 32; the -32 enters each lane's integer
 * sum from the start (nn: -32 times the lane's four activations, made once per product).
 * Sub-blocks of 16 values are in order, four lanes each. */
static inline __attribute__((always_inline)) void
row2_q6k(const uint8_t *restrict w0, const uint8_t *restrict w1, int64_t nb, int64_t ahead,
         const int8_t *restrict xq, const float *restrict xs4, const int32_t *restrict nn,
         const int NR, int64_t k, float *restrict y, int64_t ldy) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    /* 16-bit shifts putting bits 0-1 (2-3) of qh at bits 4-5, and bits 4-5 (6-7) there */
    const __m512i shl = _mm512_setr_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                          0x0004000400040004, 0x0002000200020002, 0x0002000200020002,
                                          0x0002000200020002, 0x0002000200020002),
                  shr = _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002, 0x0002000200020002,
                                          0x0002000200020002, 0x0002000200020002);
    __m512 acc0[RIR], acc1[RIR];
    for (int r = 0; r < NR; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
#define ROW(w, acc)                                                                              \
    do {                                                                                          \
        const uint8_t *p = (w) + b * 210;                                                         \
        __builtin_prefetch((const char *)p + ahead, 0, 3);                                        \
        __builtin_prefetch((const char *)p + ahead + 64, 0, 3);                                   \
        __builtin_prefetch((const char *)p + ahead + 128, 0, 3);                                  \
        __builtin_prefetch((const char *)p + ahead + 192, 0, 3);                                  \
        const __m512 sv = _mm512_mul_ps(_mm512_set1_ps(half(p + 208)), _mm512_cvtepi32_ps(         \
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))));                  \
        for (int h = 0; h < 2; h++) {                                                             \
            const __m512i l = _mm512_loadu_si512(p + 64 * h),                                     \
                          hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h))); \
            const __m512i qa = _mm512_or_si512(_mm512_and_si512(l, low),                          \
                                               _mm512_and_si512(_mm512_sllv_epi16(hb, shl), two)), \
                          qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),    \
                                               _mm512_and_si512(_mm512_srlv_epi16(hb, shr), two)); \
            const __m512 sa = _mm512_permutexvar_ps(lane_groups(8 * h, 2), sv),                   \
                         sb = _mm512_permutexvar_ps(lane_groups(8 * h + 4, 2), sv);               \
            for (int r = 0; r < NR; r++) {                                                         \
                const __m512i da = _mm512_dpbusd_epi32(n[r][2 * h], qa, x[r][2 * h]),              \
                              db = _mm512_dpbusd_epi32(n[r][2 * h + 1], qb, x[r][2 * h + 1]);      \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(da), _mm512_mul_ps(sa, s[r][2 * h]), acc[r]); \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), _mm512_mul_ps(sb, s[r][2 * h + 1]), acc[r]); \
            }                                                                                     \
        }                                                                                         \
    } while (0)
    for (int64_t b = 0; b < nb; b++) {
        __m512i x[RIR][4], n[RIR][4];
        __m512 s[RIR][4];
        for (int r = 0; r < NR; r++)
            for (int h = 0; h < 4; h++) {
                x[r][h] = _mm512_loadu_si512(xq + r * k + 256 * b + 64 * h);
                n[r][h] = _mm512_loadu_si512(nn + r * (k / 4) + 64 * b + 16 * h);
                s[r][h] = _mm512_loadu_ps(xs4 + r * (k / 4) + 64 * b + 16 * h);
            }
        ROW(w0, acc0);
        ROW(w1, acc1);
    }
#undef ROW
    for (int r = 0; r < NR; r++) {
        y[r * ldy] = _mm512_reduce_add_ps(acc0[r]);
        y[r * ldy + 1] = _mm512_reduce_add_ps(acc1[r]);
    }
}

/* A matrix's rows two at a time (the last of an odd count twice) by
 * CALL(w0, w1, NR, out, ldy), against the caller's m <= RIR activation rows; NR is a constant
 * in each case, so that the kernels' loops over the rows unroll. The caller names w, n, m,
 * y, ldy and row (a weight row's bytes). */
#define PAIRS_R(CALL, NR)                                                                         \
    do {                                                                                          \
        _Pragma("omp parallel for schedule(static)")                                              \
        for (int64_t r_ = 0; r_ < n / 2; r_++)                                                    \
            CALL(w + 2 * r_ * row, w + (2 * r_ + 1) * row, NR, y + 2 * r_, ldy);                   \
        if (n % 2) {                                                                              \
            float two_[2 * RIR];                                                                  \
            CALL(w + (n - 1) * row, w + (n - 1) * row, NR, two_, 2);                               \
            for (int i_ = 0; i_ < (NR); i_++) y[i_ * ldy + n - 1] = two_[2 * i_];                  \
        }                                                                                         \
    } while (0)
#define PAIRS(CALL)                                                                              \
    switch (m) {                                                                                  \
    case 1: PAIRS_R(CALL, 1); break;                                                              \
    case 2: PAIRS_R(CALL, 2); break;                                                              \
    case 3: PAIRS_R(CALL, 3); break;                                                              \
    default: PAIRS_R(CALL, 4);                                                                    \
    }

/* Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 rows through row2_q4: the offset of Q4_0 (-8), Q5_0 (-16)
 * and MXFP4 (-12, its values stored plus 12) in each lane's integer sum from the start, the
 * minimums of Q4_1 and Q5_1 against xm; m activation rows, k apart. */
static void q4_rows(const int type, const uint8_t *w, int64_t n, int64_t k, int64_t m,
                      const int8_t *xq, const float *xs4, float *y, int64_t ldy) {
    const int64_t bytes = block_bytes(type), nb = k / 32, row = nb * bytes, ahead = pair_ahead(row);
    const int32_t by = type == 2 ? -8 : type == 39 ? -12 : -16;
    int32_t nn[m * (k / 4)];
    float xm[type == 3 || type == 7 ? m * (k / 4) : 1];
    if (type == 3 || type == 7) {  /* the minimum against each lane's sum, scaled */
        lane_offsets(xq, m * (k / 4), 1, nn);
        for (int64_t g = 0; g < m * (k / 4); g++) xm[g] = xs4[g] * (float)nn[g];
    } else {
        lane_offsets(xq, m * (k / 4), by, nn);
    }
#define C2(w0, w1, NR, out, ld) row2_q4(2, 18, w0, w1, nb, ahead, xq, xs4, nn, xm, NR, k, out, ld)
#define C3(w0, w1, NR, out, ld) row2_q4(3, 20, w0, w1, nb, ahead, xq, xs4, nn, xm, NR, k, out, ld)
#define C6(w0, w1, NR, out, ld) row2_q4(6, 22, w0, w1, nb, ahead, xq, xs4, nn, xm, NR, k, out, ld)
#define C7(w0, w1, NR, out, ld) row2_q4(7, 24, w0, w1, nb, ahead, xq, xs4, nn, xm, NR, k, out, ld)
#define C39(w0, w1, NR, out, ld) row2_q4(39, 17, w0, w1, nb, ahead, xq, xs4, nn, xm, NR, k, out, ld)
    switch (type) {
    case 2: PAIRS(C2); break;
    case 3: PAIRS(C3); break;
    case 6: PAIRS(C6); break;
    case 7: PAIRS(C7); break;
    default: PAIRS(C39);
    }
#undef C2
#undef C3
#undef C6
#undef C7
#undef C39
}

/* Q4_K and Q5_K (five) rows through row2_q4k; m activation rows, k apart. */
static void k4_rows(const int five, const uint8_t *w, int64_t n, int64_t k, int64_t m,
                    const int8_t *xq, const float *xs4, const float *xsum, float *y, int64_t ldy) {
    const int64_t nb = k / 256, row = nb * (five ? 176 : 144),
                  ahead = pair_ahead(row);
    float xb[m * (k / 32)];
    for (int64_t s = 0; s < m * (k / 32); s++) xb[s] = xsum[2 * s] + xsum[2 * s + 1];
#define C4(w0, w1, NR, out, ld) row2_q4k(0, w0, w1, nb, ahead, xq, xs4, xb, NR, k, out, ld)
#define C5(w0, w1, NR, out, ld) row2_q4k(1, w0, w1, nb, ahead, xq, xs4, xb, NR, k, out, ld)
    if (five) {
        PAIRS(C5)
    } else {
        PAIRS(C4)
    }
#undef C4
#undef C5
}

/* Q6_K rows through row2_q6k; m activation rows, k apart. */
static void q6k_rows(const uint8_t *w, int64_t n, int64_t k, int64_t m, const int8_t *xq,
                     const float *xs4, float *y, int64_t ldy) {
    const int64_t nb = k / 256, row = nb * 210, ahead = pair_ahead(row);
    int32_t nn[m * (k / 4)];
    lane_offsets(xq, m * (k / 4), -32, nn);
#define C6K(w0, w1, NR, out, ld) row2_q6k(w0, w1, nb, ahead, xq, xs4, nn, NR, k, out, ld)
    PAIRS(C6K)
#undef C6K
}
#undef PAIRS
#undef PAIRS_R

/* Whether m activation rows (8 bits) go through a kernel that takes the blocks into
 * registers: up to RIR rows of most types. */
static int in_registers(int type, int64_t k, int64_t m, const int8_t *xl) {
    return !xl && k / 32 <= ROW1_BLOCKS && m <= RIR && (type == 2 || type == 3 || type == 6 || type == 7 || type == 39 ||
                        type == 12 || type == 13 || type == 14);
}

/* m rows where in_registers takes them; y: m rows, ldy apart. */
static void few_in_registers(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
                             const float *xs4, const float *xsum, int64_t m, float *y,
                             int64_t ldy) {
    if (type == 12 || type == 13) k4_rows(type == 13, w, n, k, m, xq, xs4, xsum, y, ldy);
    else if (type == 14) q6k_rows(w, n, k, m, xq, xs4, y, ldy);
    else q4_rows(type, w, n, k, m, xq, xs4, y, ldy);
}
#endif
