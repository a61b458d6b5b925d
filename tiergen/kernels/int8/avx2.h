/* The AVX2 kernels of int8.c (included by it, once, where there is AVX2 and no AVX-512;
 * or by avx512.h, whose builds take these 32-byte vectors too). int8.c lists what each
 * instruction set's header defines.
 *
 * q . xq, four products to each 32-bit lane: `maddubs` + `madd` (unsigned weights times
 * signed activations; Q8_0's signed weights go through abs and sign), or with AVX-VNNI (or
 * AVX-512 VNNI on 256-bit vectors) one `dpbusd`. One or two rows (decode): 32 values of a
 * block a vector (dot32), each lane with its own scale from a vector load. More rows: tiles
 * of eight weight rows, one vector for four values of each, against a panel's rows each
 * broadcasting four of its bytes. One or two rows of most types take their blocks' values
 * into registers (rows_q4, rows_q4k, rows_q6k).
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

/* k_scales' eight scales and offsets of a Q4_K or Q5_K block as vectors, from the 12 bytes as
 * three 32-bit words: no stores for a vector load to wait on. */
static inline void k_scales8(const uint8_t *b, __m256 *a, __m256 *c) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    const uint64_t sc = (uint64_t)(u[0] & m6) | (uint64_t)((u[2] & m4) | (((u[0] >> 6) & m2) << 4)) << 32,
                   mn = (uint64_t)(u[1] & m6) | (uint64_t)(((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4)) << 32;
    *a = _mm256_mul_ps(_mm256_set1_ps(half(b)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc))));
    *c = _mm256_mul_ps(_mm256_set1_ps(-half(b + 2)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn))));
}

#if !ROW2
#define RIR 2  /* up to this many activation rows: the kernels in registers (more: the tiles) */

/* 0xFF in byte j where bit j of h is set. */
static inline __m256i bit_bytes(uint32_t h) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303),
                  bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)h), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* NR activation rows (8 bits) against one weight row of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or
 * MXFP4 blocks, each block's values taken into a register rather than decoded to a copy:
 * the nibbles of its 16 bytes spread over the two halves of a vector (values 0-15, then
 * 16-31, the order of the activations in memory), Q5's fifth bits joined to them, MXFP4's
 * values looked up (plus 12), Q8_0's bytes as they lie (signed, through abs and sign). The
 * offset of Q4_0 (-8), Q5_0 (-16) and MXFP4 (-12) enters each lane's integer sum from the
 * start (nn: by times the lane's four activations, made once per product); the minimums of
 * Q4_1 and Q5_1 multiply the activations' sums over each block (xb, made once per product),
 * added apart. A row's arithmetic does not depend on NR. */
static inline __attribute__((always_inline)) void
rows_q4(const int TYPE, const int64_t BYTES, const uint8_t *restrict w, int64_t nb,
        const int8_t *restrict xq, const float *restrict xs4, const int32_t *restrict nn,
        const float *restrict xb, const int NR, int64_t k, float *restrict y, int64_t ldy) {
    /* where the values start; Q5's high bits lie just before them */
    const int at = TYPE == 39 ? 1 : TYPE == 2 || TYPE == 8 ? 2 : TYPE == 3 ? 4 : TYPE == 6 ? 6 : 8,
              five = TYPE == 6 || TYPE == 7, mx = TYPE == 39, q8 = TYPE == 8,
              offset = TYPE == 2 || TYPE == 6 || mx, minimum = TYPE == 3 || TYPE == 7;
    const __m128i low = _mm_set1_epi8(15);
    const __m256i bit4 = _mm256_set1_epi8(16),
                  table = _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                                                    12, 11, 10, 9, 8, 6, 4, 0));
    __m256 acc[RIR];
    float mins[RIR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * BYTES;
        PREFETCH(p);
        __m256i q;
        if (q8) {
            q = load32(p + at);
        } else {
            const __m128i v = _mm_loadu_si128((const __m128i *)(p + at));
            q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, low)),
                                        _mm_and_si128(_mm_srli_epi16(v, 4), low), 1);
        }
        if (five) {
            uint32_t h;
            memcpy(&h, p + at - 4, 4);
            q = _mm256_or_si256(q, _mm256_and_si256(bit_bytes(h), bit4));
        }
        if (mx) q = _mm256_shuffle_epi8(table, q);
        const __m256i qa = q8 ? _mm256_abs_epi8(q) : q;
        const __m256 sc = _mm256_set1_ps(mx ? e8m0_half(p[0]) : half(p));
        const float mn = minimum ? half(p + 2) : 0.0f;
        for (int r = 0; r < NR; r++) {
            __m256i x = load32(xq + r * k + 32 * b);
            if (q8) x = _mm256_sign_epi8(x, q);
            const __m256i d = dot4(offset ? load32(nn + r * (k / 4) + 8 * b) : _mm256_setzero_si256(),
                                   qa, x);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                     _mm256_mul_ps(sc, _mm256_loadu_ps(xs4 + r * (k / 4) + 8 * b)), acc[r]);
            if (minimum) mins[r] = fmaf(mn, xb[r * nb + b], mins[r]);
        }
    }
    for (int r = 0; r < NR; r++) y[r * ldy] = hsum8(acc[r]) + mins[r];
}

/* NR activation rows against one weight row of Q4_K blocks (or Q5_K: FIVE), as rows_q4: a
 * quarter's 32 bytes hold its first sub-block of 32 values in their low nibbles and its
 * second in their high ones, each a vector in the activations' order. Q5_K's fifth bits:
 * bit 2h (2h + 1) of qh's byte l for value l of quarter h's first (second) sub-block. The
 * minimums multiply the activations' sums over each sub-block (xb, made once per product). */
static inline __attribute__((always_inline)) void
rows_q4k(const int FIVE, const uint8_t *restrict w, int64_t nb, const int8_t *restrict xq,
         const float *restrict xs4, const float *restrict xb, const int NR, int64_t k,
         float *restrict y, int64_t ldy) {
    const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
    const int64_t BYTES = FIVE ? 176 : 144, QS = FIVE ? 48 : 16;
    __m256 acc[RIR], mins[RIR];
    for (int r = 0; r < NR; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * BYTES;
        PREFETCH(p);
        PREFETCH(p + 64);
        PREFETCH(p + 128);
        __m256 a8, c8;
        k_scales8(p, &a8, &c8);
        const __m256i qh = FIVE ? load32(p + 16) : _mm256_setzero_si256();
        for (int h = 0; h < 4; h++) {
            const __m256i v = load32(p + QS + 32 * h);
            for (int half_ = 0; half_ < 2; half_++) {
                const int sub = 2 * h + half_;
                __m256i q = _mm256_and_si256(half_ ? _mm256_srli_epi16(v, 4) : v, low);
                if (FIVE) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << sub));
                    q = _mm256_or_si256(q, _mm256_and_si256(
                                               _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), sixteen));
                }
                const __m256 sc = _mm256_permutevar8x32_ps(a8, _mm256_set1_epi32(sub));
                for (int r = 0; r < NR; r++) {
                    const int64_t j = r * k + 256 * b + 32 * sub;
                    const __m256i d = dot4(_mm256_setzero_si256(), q, load32(xq + j));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                             _mm256_mul_ps(sc, _mm256_loadu_ps(xs4 + j / 4)), acc[r]);
                }
            }
        }
        for (int r = 0; r < NR; r++)
            mins[r] = _mm256_fmadd_ps(c8, _mm256_loadu_ps(xb + r * (k / 32) + 8 * b), mins[r]);
    }
    for (int r = 0; r < NR; r++) y[r * ldy] = hsum8(acc[r]) + hsum8(mins[r]);
}

/* NR activation rows against one weight row of Q6_K blocks, as rows_q4k. A half block (128
 * values) is 64 bytes of low four bits (values 0-31 and 32-63 in their low nibbles, 64-95
 * and 96-127 in their high ones) and 32 bytes of high two bits (values l, l + 32, l + 64,
 * l + 96 in bits 0-1, 2-3, 4-5, 6-7 of byte l). Values are stored plus 32; the -32 enters
 * each lane's integer sum from the start (nn). Sub-blocks of 16 values: four lanes each. */
static inline __attribute__((always_inline)) void
rows_q6k(const uint8_t *restrict w, int64_t nb, const int8_t *restrict xq,
         const float *restrict xs4, const int32_t *restrict nn, const int NR, int64_t k,
         float *restrict y, int64_t ldy) {
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30);
    __m256 acc[RIR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 210;
        PREFETCH(p);
        PREFETCH(p + 64);
        PREFETCH(p + 128);
        PREFETCH(p + 192);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(p + 192));
        const __m256 d = _mm256_set1_ps(half(p + 208));
        const __m256 sv[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))),
                              _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_srli_si128(sc8, 8))))};
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = load32(p + 64 * h), l1 = load32(p + 64 * h + 32),
                          hb = load32(p + 128 + 32 * h);
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two)),
                _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, two)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), two))};
            for (int g = 0; g < 4; g++) {
                /* values 128 h + 32 g ..: sub-blocks 8 h + 2 g and 8 h + 2 g + 1, i.e. scales
                 * 2 g and 2 g + 1 of this half's eight */
                const __m256 sc = _mm256_permutevar8x32_ps(
                    sv[h], _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1));
                for (int r = 0; r < NR; r++) {
                    const int64_t j = r * k + 256 * b + 128 * h + 32 * g;
                    const __m256i dd = dot4(load32(nn + j / 4), q[g], load32(xq + j));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dd),
                                             _mm256_mul_ps(sc, _mm256_loadu_ps(xs4 + j / 4)), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < NR; r++) y[r * ldy] = hsum8(acc[r]);
}

/* A matrix's rows by CALL(w_row, NR, out), against the caller's m <= RIR activation rows; NR
 * a constant in each case, so that the kernels' loops over the rows unroll. The caller names
 * w, n, m, y and row (a weight row's bytes). */
#define ROWS_R(CALL, NR)                                                                          \
    do {                                                                                          \
        _Pragma("omp parallel for schedule(static)")                                              \
        for (int64_t r_ = 0; r_ < n; r_++) CALL(w + r_ * row, NR, y + r_);                         \
    } while (0)
#define ROWS(CALL)                                                                               \
    if (m == 1) ROWS_R(CALL, 1);                                                                  \
    else ROWS_R(CALL, 2);

/* Whether m activation rows (8 bits) go through a kernel that takes the blocks into
 * registers: up to RIR rows of most types. */
static int in_registers(int type, int64_t k, int64_t m, const int8_t *xl) {
    return !xl && k / 32 <= ROW1_BLOCKS && m <= RIR &&
           (type == 2 || type == 3 || type == 6 || type == 7 || type == 8 || type == 39 ||
            type == 12 || type == 13 || type == 14);
}

/* m rows where in_registers takes them; y: m rows, ldy apart. */
static void few_in_registers(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
                             const float *xs4, const float *xsum, int64_t m, float *y,
                             int64_t ldy) {
    if (type == 12 || type == 13) {
        const int64_t nb = k / 256, row = nb * (type == 13 ? 176 : 144);
        float xb[m * (k / 32)];
        for (int64_t s = 0; s < m * (k / 32); s++) xb[s] = xsum[2 * s] + xsum[2 * s + 1];
#define C4(wr, NR, out) rows_q4k(0, wr, nb, xq, xs4, xb, NR, k, out, ldy)
#define C5(wr, NR, out) rows_q4k(1, wr, nb, xq, xs4, xb, NR, k, out, ldy)
        if (type == 13) {
            ROWS(C5)
        } else {
            ROWS(C4)
        }
#undef C4
#undef C5
        return;
    }
    const int64_t nb = k / (type == 14 ? 256 : 32), row = nb * block_bytes(type);
    int32_t nn[m * (k / 4)];
    float xb[type == 3 || type == 7 ? m * (k / 32) : 1];
    if (type == 3 || type == 7) {  /* the minimum against each block's sum */
        for (int64_t s = 0; s < m * (k / 32); s++) xb[s] = xsum[2 * s] + xsum[2 * s + 1];
    } else if (type != 8) {
        lane_offsets(xq, m * (k / 4), type == 2 ? -8 : type == 39 ? -12 : type == 14 ? -32 : -16, nn);
    }
#define C2(wr, NR, out) rows_q4(2, 18, wr, nb, xq, xs4, nn, xb, NR, k, out, ldy)
#define C3(wr, NR, out) rows_q4(3, 20, wr, nb, xq, xs4, nn, xb, NR, k, out, ldy)
#define C6(wr, NR, out) rows_q4(6, 22, wr, nb, xq, xs4, nn, xb, NR, k, out, ldy)
#define C7(wr, NR, out) rows_q4(7, 24, wr, nb, xq, xs4, nn, xb, NR, k, out, ldy)
#define C8(wr, NR, out) rows_q4(8, 34, wr, nb, xq, xs4, nn, xb, NR, k, out, ldy)
#define C39(wr, NR, out) rows_q4(39, 17, wr, nb, xq, xs4, nn, xb, NR, k, out, ldy)
#define C14(wr, NR, out) rows_q6k(wr, nb, xq, xs4, nn, NR, k, out, ldy)
    switch (type) {
    case 2: ROWS(C2); break;
    case 3: ROWS(C3); break;
    case 6: ROWS(C6); break;
    case 7: ROWS(C7); break;
    case 8: ROWS(C8); break;
    case 14: ROWS(C14); break;
    default: ROWS(C39);
    }
#undef C2
#undef C3
#undef C6
#undef C7
#undef C8
#undef C39
#undef C14
}
#undef ROWS
#undef ROWS_R
#endif
