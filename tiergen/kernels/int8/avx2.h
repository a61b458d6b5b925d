/* The AVX2 kernels of int8.c (included by it, once, where there is AVX2 and no AVX-512;
 * or by avx512.h, whose builds take these 32-byte vectors too). int8.c lists what each
 * instruction set's header defines.
 *
 * q . xq, four products to each 32-bit lane: `maddubs` + `madd` (unsigned weights times
 * signed activations; Q8_0's signed weights go through abs and sign), or with AVX-VNNI (or
 * AVX-512 VNNI on 256-bit vectors) one `dpbusd`. One or two rows (decode): 32 values of a
 * block a vector (dot32), each lane with its own scale from a vector load. More rows: tiles
 * of eight weight rows, one vector for four values of each, against a panel's rows each
 * broadcasting four of its bytes. One row of Q4_0 or Q4_1 takes its blocks' nibbles into
 * registers (row1_q4).
 *
 * In an AVX-512 build, avx512.h defines TILE512 (with VNNI: its tiles of sixteen rows),
 * ROW2 (with VNNI and VL: its kernels in registers) and QUANTIZE512 before it includes this
 * file; what it has of its own takes the place of this file's. */

#ifndef TILE512
#define TILE512 0
#define TR 8      /* weight rows per interleaved tile */
#define MI 4      /* activation rows per pass over a tile */
#endif
#ifndef ROW2
#define ROW2 0
#endif
#ifndef QUANTIZE512
#define QUANTIZE512 0
#endif

/* Sixteen values at x as int8 at q in blocks of QA, 8 bits: each block's max |x| into amax
 * (one per value) and its values into v. The same operations, in the same order, as the
 * scalar loop below: a true division, a product, rounding half to even. */
static inline __attribute__((always_inline)) void
quantize16(const int QA, const float *restrict x, int8_t *restrict q, float *restrict amax,
           int32_t *restrict v) {
    const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(127.0f), zero = _mm256_setzero_ps();
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
    __m256 m0 = _mm256_andnot_ps(sign, x0), m1 = _mm256_andnot_ps(sign, x1);
    if (QA == 16) m0 = m1 = _mm256_max_ps(m0, m1);
    m0 = _mm256_max_ps(m0, _mm256_permute_ps(m0, 0xB1)), m1 = _mm256_max_ps(m1, _mm256_permute_ps(m1, 0xB1));
    m0 = _mm256_max_ps(m0, _mm256_permute_ps(m0, 0x4E)), m1 = _mm256_max_ps(m1, _mm256_permute_ps(m1, 0x4E));
    if (QA >= 8) {
        m0 = _mm256_max_ps(m0, _mm256_permute2f128_ps(m0, m0, 1));
        m1 = _mm256_max_ps(m1, _mm256_permute2f128_ps(m1, m1, 1));
    }
    const __m256 i0 = _mm256_and_ps(_mm256_div_ps(top, m0), _mm256_cmp_ps(m0, zero, _CMP_GT_OQ));
    const __m256 i1 = _mm256_and_ps(_mm256_div_ps(top, m1), _mm256_cmp_ps(m1, zero, _CMP_GT_OQ));
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, i0)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, i1));
    const __m256i h = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
    const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(h, h), 0x08);
    _mm_storeu_si128((__m128i *)q, _mm256_castsi256_si128(b));
    _mm256_storeu_ps(amax, m0), _mm256_storeu_ps(amax + 8, m1);
    _mm256_storeu_si256((__m256i *)v, q0), _mm256_storeu_si256((__m256i *)(v + 8), q1);
}

#if !QUANTIZE512
/* tg_quantize_act's 8-bit activations (blocks of SB values) by quantize16, then each block's
 * scales and sum as the scalar loop makes them. */
static inline __attribute__((always_inline)) int
quantize_blocks(const float *x, int64_t blocks, int qa, int8_t *xq, float *xs4, float *xsum) {
    _Pragma("omp parallel for schedule(static) if (blocks > 256)")
    for (int64_t t = 0; t < blocks; t++) {
        float amax[SB];
        int32_t v[SB];
        if (qa == 4) quantize16(4, x + t * SB, xq + t * SB, amax, v);
        else if (qa == 8) quantize16(8, x + t * SB, xq + t * SB, amax, v);
        else quantize16(16, x + t * SB, xq + t * SB, amax, v);
        double total = 0.0;
        for (int o = 0; o < SB; o += qa) {
            const float s = amax[o] / 127.0f;
            int sum = 0;
            for (int j = 0; j < qa; j++) sum += v[o + j];
            for (int l = 0; l < qa / 4; l++) xs4[(t * SB + o) / 4 + l] = s;
            total += (double)s * sum;
        }
        xsum[t] = (float)total;
    }
    return 1;
}
#endif

/* Four products of each 32-bit lane summed, added to acc: w unsigned, x signed. */
static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, p);
#endif
}
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define INT8_ISA 2  /* dot4 by VNNI */
#else
#define INT8_ISA 1
#endif

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* by times the sum of each lane's four activations (lanes of them): a block type's constant
 * offset, entered into the lane's integer sum from the start. */
static inline void lane_offsets(const int8_t *xq, int64_t lanes, int32_t by, int32_t *nn) {
    for (int64_t g = 0; g < lanes; g++)
        nn[g] = by * (xq[4 * g] + xq[4 * g + 1] + xq[4 * g + 2] + xq[4 * g + 3]);
}

/* 255 * hi + lo, per 32-bit lane */
static inline __m256i join_wide(__m256i hi, __m256i lo) {
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define ACC_T __m256
#define ACC_ZERO _mm256_setzero_ps()
#define ACC_SUM hsum8

/* block_dot's products of values j .. j + 31: a vector of the block's bytes against each
 * row's, each lane's sum scaled by its own scale (four values a lane). */
static inline __attribute__((always_inline)) void
dot32(const int ROWS, const int SIGNED, const int WIDE, const int L, int j,
      const int8_t *restrict q, const float *restrict a, const int8_t *restrict xq,
      const int8_t *restrict xl, const float *restrict xs4, int64_t k, __m256 *restrict acc) {
    __m256i w = load32(q + j);
    const __m256i wa = SIGNED ? _mm256_abs_epi8(w) : w;
    const __m256 av = L == 32 ? _mm256_set1_ps(a[j / 32])
                              : _mm256_set_m128(_mm_set1_ps(a[j / 16 + 1]), _mm_set1_ps(a[j / 16]));
    for (int i = 0; i < ROWS; i++) {
        __m256i v = load32(xq + i * k + j);
        if (SIGNED) v = _mm256_sign_epi8(v, w);
        __m256i d = dot4(_mm256_setzero_si256(), wa, v);
        if (WIDE) {
            __m256i u = load32(xl + i * k + j);
            if (SIGNED) u = _mm256_sign_epi8(u, w);
            d = join_wide(d, dot4(_mm256_setzero_si256(), wa, u));
        }
        const __m256 p = _mm256_cvtepi32_ps(d);
        acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(av, _mm256_loadu_ps(xs4 + (i * k + j) / 4)), acc[i]);
    }
}

/* make_panels' panel p where it holds four whole rows of 8 bits: their values and scales by
 * 4 x 4 transposes of 32-bit words (1; else 0, and make_panels' loop makes it). */
static inline __attribute__((always_inline)) int
panel_vectors(int64_t p, int64_t m, int64_t k, const int8_t *xq, const int8_t *xl,
              const float *xs4, Panels *P) {
    if (!(MI == 4 && !xl && (p + 1) * MI <= m)) return 0;
    const int64_t r = p * MI;
    for (int64_t g = 0; g < k / 4; g += 4) {
        const int64_t at = (p * (k / 4) + g) * MI;
        __m128i v[4];
        __m128 f[4];
        for (int i = 0; i < 4; i++) {
            v[i] = _mm_loadu_si128((const __m128i *)(xq + (r + i) * k + 4 * g));
            f[i] = _mm_loadu_ps(xs4 + (r + i) * (k / 4) + g);
        }
        _MM_TRANSPOSE4_PS(f[0], f[1], f[2], f[3]);
        const __m128i a = _mm_unpacklo_epi32(v[0], v[1]), b = _mm_unpacklo_epi32(v[2], v[3]),
                      c = _mm_unpackhi_epi32(v[0], v[1]), d = _mm_unpackhi_epi32(v[2], v[3]);
        v[0] = _mm_unpacklo_epi64(a, b), v[1] = _mm_unpackhi_epi64(a, b);
        v[2] = _mm_unpacklo_epi64(c, d), v[3] = _mm_unpackhi_epi64(c, d);
        for (int j = 0; j < 4; j++) {
            _mm_storeu_si128((__m128i *)(P->q + 4 * (at + j * MI)), v[j]);
            _mm_storeu_ps(P->s + at + j * MI, f[j]);
        }
    }
    return 1;
}

#if !TILE512
/* A tile's products: per sixteen values, four vectors of eight rows' bytes, each multiplied
 * by four bytes of an activation row broadcast to every lane; Q8_0's signed weights through
 * abs and sign. */
static inline __attribute__((always_inline)) void
tile_rows(TILE_ROWS_PARAMS) {
    __m256 acc[MI];
    for (int i = 0; i < NR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len / SB; t++) {
        const int64_t g0 = SB / 4 * t;
        __m256i w[SB / 4], wa[SB / 4];
        for (int g = 0; g < SB / 4; g++) {
            w[g] = load32(tile + (g0 + g) * 4 * TR);
            wa[g] = SIGNED ? _mm256_abs_epi8(w[g]) : w[g];
        }
        const __m256 a = _mm256_loadu_ps(as + t * TR), c = _mm256_loadu_ps(cs + t * TR);
        for (int i = 0; i < NR; i++) {
            __m256 part;
            if (WIDE) {
                part = _mm256_setzero_ps();
                for (int b = 0; b < SB / QA; b++) {
                    __m256i d = _mm256_setzero_si256(), e = _mm256_setzero_si256();
                    for (int g = QA / 4 * b; g < QA / 4 * (b + 1); g++) {
                        int32_t four;
                        memcpy(&four, q + ((g0 + g) * MI + i) * 4, 4);
                        __m256i v = _mm256_set1_epi32(four);
                        d = dot4(d, wa[g], SIGNED ? _mm256_sign_epi8(v, w[g]) : v);
                        memcpy(&four, l + ((g0 + g) * MI + i) * 4, 4);
                        v = _mm256_set1_epi32(four);
                        e = dot4(e, wa[g], SIGNED ? _mm256_sign_epi8(v, w[g]) : v);
                    }
                    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(join_wide(d, e)),
                                           _mm256_set1_ps(s[(g0 + QA / 4 * b) * MI + i]), part);
                }
            } else {
                __m256i d = _mm256_setzero_si256();
                part = _mm256_set1_ps(start[t * MI + i]);
                for (int g = 0; g < SB / 4; g++) {
                    int32_t four;
                    memcpy(&four, q + ((g0 + g) * MI + i) * 4, 4);
                    const __m256i v = _mm256_set1_epi32(four);
                    if (g % (QA / 4) == 0) d = _mm256_set1_epi32(MAGIC_BITS);
                    d = dot4(d, wa[g], SIGNED ? _mm256_sign_epi8(v, w[g]) : v);
                    if (g % (QA / 4) == QA / 4 - 1)
                        part = _mm256_fmadd_ps(_mm256_castsi256_ps(d),
                                               _mm256_set1_ps(s[(g0 + g) * MI + i]), part);
                }
            }
            acc[i] = _mm256_fmadd_ps(part, a, acc[i]);
            if (!SIGNED) acc[i] = _mm256_fmadd_ps(c, _mm256_set1_ps(sum[t * MI + i]), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) {
        float out[TR];
        _mm256_storeu_ps(out, acc[i]);
        for (int r = 0; r < ncols; r++) y[i * ldy + r] = add ? y[i * ldy + r] + out[r] : out[r];
    }
}
#endif

#define ROW1_BLOCKS 1024  /* rows of up to this many blocks (32,768 values) */

#if !ROW2
/* One activation row (8 bits) against weight rows of Q4_0 or Q4_1 blocks, each block's
 * nibbles spread into a register rather than decoded to a copy. Q4_0's offset of -8 enters
 * each lane's integer sum from the start (nn: -8 times the lane's four activations, made once
 * per product), so it costs no instruction per block; Q4_1's minimum multiplies the
 * activations' per-block sums (xb), likewise made once per product. */
static inline __attribute__((always_inline)) float
row1_q4(const int TYPE, const int64_t BYTES, const uint8_t *restrict wr, int64_t nb,
        const int8_t *restrict xq, const float *restrict xs4, const int32_t *restrict nn,
        const float *restrict xb) {
    const int at = TYPE == 2 ? 2 : 4;
    const __m128i low = _mm_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = wr + b * BYTES;
        PREFETCH(p);
        const __m128i v = _mm_loadu_si128((const __m128i *)(p + at));
        const __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, low)),
                                                  _mm_and_si128(_mm_srli_epi16(v, 4), low), 1);
        const __m256i d = dot4(TYPE == 2 ? load32(nn + 8 * b) : _mm256_setzero_si256(), w,
                               load32(xq + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                              _mm256_mul_ps(_mm256_set1_ps(half(p)), _mm256_loadu_ps(xs4 + 8 * b)), acc);
        if (TYPE == 3) mins += half(p + 2) * xb[b];
    }
    return hsum8(acc) + mins;
}

#define ROW1(NAME, TYPE, BYTES)                                                               \
    static void NAME##_few1(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,         \
                            const float *xs4, const float *xsum, float *y) {                  \
        const int64_t nb = k / 32;                                                            \
        float xb[TYPE == 3 ? ROW1_BLOCKS : 1];                                                \
        int32_t nn[TYPE == 2 ? ROW1_BLOCKS * 8 : 1];                                          \
        if (TYPE == 2) lane_offsets(xq, k / 4, -8, nn);                                       \
        for (int64_t b = 0; b < nb && TYPE == 3; b++) xb[b] = xsum[2 * b] + xsum[2 * b + 1]; \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r = 0; r < n; r++)                                                       \
            y[r] = row1_q4(TYPE, BYTES, w + r * nb * BYTES, nb, xq, xs4, nn, xb);             \
    }
ROW1(im_q4_0, 2, 18)
ROW1(im_q4_1, 3, 20)

/* Whether m activation rows (8 bits) go through a kernel that takes the blocks into
 * registers: one row of Q4_0 or Q4_1. */
static int in_registers(int type, int64_t k, int64_t m, const int8_t *xl) {
    return !xl && k / 32 <= ROW1_BLOCKS && m == 1 && (type == 2 || type == 3);
}

/* m rows (one) where in_registers takes them; y: m rows, ldy apart. */
static void few_in_registers(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
                             const float *xs4, const float *xsum, int64_t m, float *y,
                             int64_t ldy) {
    (void)m, (void)ldy;
    (type == 2 ? im_q4_0_few1 : im_q4_1_few1)(w, n, k, xq, xs4, xsum, y);
}
#endif
