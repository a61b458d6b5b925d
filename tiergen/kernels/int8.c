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
 * `dpbusd` (unsigned weights times signed activations; Q8_0's signed weights go through
 * abs and sign), and a portable C loop elsewhere.
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
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TILE512 1 /* tiles of sixteen rows, one 64-byte vector per four values */
#define TR 16     /* weight rows per interleaved tile */
#define MI 4      /* activation rows per pass over a tile */
#else
#define TILE512 0
#define TR 8
#define MI 4
#endif

/* ---- activations ---------------------------------------------------------------------
 * Row i of x (k values, k a multiple of 32) becomes xq[i k + j] (int8) in blocks of qa
 * values (4, 8 or 16) with scale s = max |x| / 127; xs4[i k / 4 + l] is the scale of the
 * block holding values 4 l .. 4 l + 3 (one per 32-bit lane of the products), and
 * xsum[i k / 16 + t] the sum over values 16 t .. 16 t + 15 of s * q (what a weight block's
 * minimum multiplies).
 * With xl (wide): 16 bits instead, q = 255 xq + xl with s = max |x| / 32512 and xq, xl in
 * [-127, 127], so that both halves multiply as int8. */
#if defined(__AVX2__)
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
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
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
#endif

void tg_quantize_act(const float *x, int64_t m, int64_t k, int qa, int8_t *xq, int8_t *xl,
                     float *xs4, float *xsum) {
    const int64_t blocks = m * (k / SB);
    const float top = xl ? 32512.0f : 127.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (!xl) {
        _Pragma("omp parallel for schedule(static) if (blocks > 256)")
        for (int64_t t = 0; t < blocks; t++) {
            if (qa == 4) quantize16_512(4, x + t * SB, xq + t * SB, xs4 + t * SB / 4, xsum + t);
            else if (qa == 8) quantize16_512(8, x + t * SB, xq + t * SB, xs4 + t * SB / 4, xsum + t);
            else quantize16_512(16, x + t * SB, xq + t * SB, xs4 + t * SB / 4, xsum + t);
        }
        return;
    }
#endif
#if defined(__AVX2__)
    if (!xl) {
        _Pragma("omp parallel for schedule(static) if (blocks > 256)")
        for (int64_t t = 0; t < blocks; t++) {
            float amax[SB];
            int32_t v[SB];
            if (qa == 4) quantize16(4, x + t * SB, xq + t * SB, amax, v);
            else if (qa == 8) quantize16(8, x + t * SB, xq + t * SB, amax, v);
            else quantize16(16, x + t * SB, xq + t * SB, amax, v);
            double total = 0.0;
            for (int o = 0; o < SB; o += qa) {
                const float s = amax[o] / top;
                int sum = 0;
                for (int j = 0; j < qa; j++) sum += v[o + j];
                for (int l = 0; l < qa / 4; l++) xs4[(t * SB + o) / 4 + l] = s;
                total += (double)s * sum;
            }
            xsum[t] = (float)total;
        }
        return;
    }
#endif
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

#if defined(__AVX2__)
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
#endif

/* acc[i] += the products of one decoded weight block (QK values: q, and a, c per sub-block
 * of L) with activation rows i < ROWS (xq, xl, xs4, xsum at the block's start, rows k
 * apart). SIGNED: q is signed (Q8_0), else unsigned; WIDE: 16-bit activations (xl). */
static inline __attribute__((always_inline)) void
block_dot(const int ROWS, const int SIGNED, const int WIDE, const int QK, const int L,
          const int8_t *restrict q, const float *restrict a, const float *restrict c,
          const int8_t *restrict xq, const int8_t *restrict xl, const float *restrict xs4, const float *restrict xsum, int64_t k, float *restrict mins,
#if defined(__AVX2__)
          __m256 *restrict acc
#else
          float *restrict acc
#endif
) {
    for (int j = 0; j < QK; j += 32) {
#if defined(__AVX2__)
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
#else
        for (int i = 0; i < ROWS; i++)
            for (int h = 0; h < 32; h += 4) {
                int32_t d = 0, e = 0;
                for (int l = 0; l < 4; l++) {
                    const int32_t wv = SIGNED ? q[j + h + l] : (uint8_t)q[j + h + l];
                    d += wv * xq[i * k + j + h + l];
                    if (WIDE) e += wv * xl[i * k + j + h + l];
                }
                if (WIDE) d = 255 * d + e;
                acc[i] = fmaf((float)d, a[(j + h) / L] * xs4[(i * k + j + h) / 4], acc[i]);
            }
#endif
    }
    if (!SIGNED)
        for (int s = 0; s < QK / L; s++)
            for (int i = 0; i < ROWS; i++) {
                const float *xs = xsum + (i * k + s * L) / SB;
                /* fmaf, not a contraction the compiler may make or not as it unrolls (one
                 * row or two): a row's numbers the same in either */
                mins[i] = fmaf(c[s], L == 32 ? xs[0] + xs[1] : xs[0], mins[i]);
            }
}

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
#if defined(__AVX2__)
        if (MI == 4 && !xl && (p + 1) * MI <= m) {  /* four whole rows: their values and scales by 4 x 4
                                            transposes of 32-bit words */
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
            for (int64_t i = 0; i < MI; i++)
                panel_sums(r + i, p, i, m, k, xs4, xsum, qa, 0, P);
            continue;
        }
#endif
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

/* ---- a tile of TR weight rows, interleaved -------------------------------------------
 * tile[g * 4 TR + r * 4 + l] = value 4 g + l of row r; as[t * TR + r], cs[t * TR + r]: the
 * scale and offset of row r's values 16 t .. 16 t + 15. Rows past the matrix are zero.
 * y[i, r] (+)= the products for a panel's activation rows i < rows (q, l, s, sum, start at
 * the chunk's start) and r < ncols; QA: the activations' block size. part, each row's sum
 * over a block of 16 values, takes the weight scale as the block ends.
 *
 * 8 bits: each activation block's integer sum D starts at MAGIC_BITS instead of 0 and is
 * read as the float MAGIC + D (exact: |D| <= 16 * 255 * 127 < 2^22), multiply-added with
 * the block's scale into part, which starts at the panel's start to take MAGIC back out.
 * So a block costs its products and one multiply-add, with no conversion instruction (on
 * AVX-512 that would share a port with the products; docs/BENCHMARKS.md). The floats
 * carry MAGIC's magnitude, so each multiply-add rounds at about one unit of the block's
 * scale, a small fraction of the activations' own rounding (bench_kld.py measures the
 * path). 16 bits (sums up to 255 times larger) convert each block's sum. */
static inline __attribute__((always_inline)) void
tile_rows(const int QA, const int SIGNED, const int WIDE, const uint8_t *restrict tile,
          const float *restrict as, const float *restrict cs, int64_t len,
          const int8_t *restrict q, const int8_t *restrict l, const float *restrict s,
          const float *restrict sum, const float *restrict start, float *restrict y,
          int64_t ldy, int rows, int ncols, int add) {
#if TILE512
    /* unsigned weights only: signed ones are offset by 128 when the tile is built */
    (void)SIGNED;
    __m512 acc[MI];
    for (int i = 0; i < MI; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len / SB; t++) {
        const int64_t g0 = SB / 4 * t;
        const __m512 a = _mm512_loadu_ps(as + t * TR), c = _mm512_loadu_ps(cs + t * TR);
        if (!WIDE) {  /* the rows side by side: few registers, and their chains overlap */
            __m512i d[MI];
            __m512 part[MI];
            for (int i = 0; i < MI; i++) part[i] = _mm512_set1_ps(start[t * MI + i]);
            for (int g = 0; g < SB / 4; g++) {
                const __m512i w = _mm512_loadu_si512(tile + (g0 + g) * 4 * TR);
                for (int i = 0; i < MI; i++) {
                    int32_t four;
                    memcpy(&four, q + ((g0 + g) * MI + i) * 4, 4);
                    if (g % (QA / 4) == 0) d[i] = _mm512_set1_epi32(MAGIC_BITS);
                    d[i] = _mm512_dpbusd_epi32(d[i], w, _mm512_set1_epi32(four));
                    if (g % (QA / 4) == QA / 4 - 1)
                        part[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(d[i]),
                                                  _mm512_set1_ps(s[(g0 + g) * MI + i]), part[i]);
                }
            }
            for (int i = 0; i < MI; i++)
                acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(sum[t * MI + i]), _mm512_fmadd_ps(part[i], a, acc[i]));
            continue;
        }
        __m512i w[SB / 4];  /* 16 bits */
        for (int g = 0; g < SB / 4; g++) w[g] = _mm512_loadu_si512(tile + (g0 + g) * 4 * TR);
        for (int i = 0; i < MI; i++) {
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
#elif defined(__AVX2__)
    __m256 acc[MI];
    for (int i = 0; i < MI; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len / SB; t++) {
        const int64_t g0 = SB / 4 * t;
        __m256i w[SB / 4], wa[SB / 4];
        for (int g = 0; g < SB / 4; g++) {
            w[g] = load32(tile + (g0 + g) * 4 * TR);
            wa[g] = SIGNED ? _mm256_abs_epi8(w[g]) : w[g];
        }
        const __m256 a = _mm256_loadu_ps(as + t * TR), c = _mm256_loadu_ps(cs + t * TR);
        for (int i = 0; i < MI; i++) {
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
#else
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < ncols; r++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < len / SB; t++) {
                float part = WIDE ? 0.0f : start[t * MI + i];
                int32_t d = 0, e = 0;
                for (int64_t g = SB / 4 * t; g < SB / 4 * (t + 1); g++) {
                    if (g % (QA / 4) == 0) d = WIDE ? 0 : MAGIC_BITS, e = 0;
                    for (int j = 0; j < 4; j++) {
                        const uint8_t wb = tile[g * 4 * TR + r * 4 + j];
                        const int32_t wv = SIGNED ? (int32_t)(int8_t)wb : (int32_t)wb;
                        d += wv * q[(g * MI + i) * 4 + j];
                        if (WIDE) e += wv * l[(g * MI + i) * 4 + j];
                    }
                    if (g % (QA / 4) != QA / 4 - 1) continue;
                    if (WIDE) {
                        part = fmaf((float)(255 * d + e), s[(g + 1 - QA / 4) * MI + i], part);
                    } else {
                        float f;
                        memcpy(&f, &d, 4);
                        part = fmaf(f, s[g * MI + i], part);
                    }
                }
                acc = fmaf(part, as[t * TR + r], acc);
                acc = fmaf(cs[t * TR + r], sum[t * MI + i], acc);
            }
            y[i * ldy + r] = add ? y[i * ldy + r] + acc : acc;
        }
#endif
}

#if TILE512
/* tile_rows' 8-bit path over two tiles side by side (32 weight rows, the second with ncols of
 * them): each four activation bytes and each scale are loaded once for both tiles, so the
 * products need about half the loads. */
static inline __attribute__((always_inline)) void
tile_rows2(const int QA, const uint8_t *restrict t0, const uint8_t *restrict t1,
           const float *restrict as0, const float *restrict cs0, const float *restrict as1,
           const float *restrict cs1, int64_t len, const int8_t *restrict q,
           const float *restrict s, const float *restrict sum, const float *restrict start,
           float *restrict y, int64_t ldy, int rows, int ncols, int add) {
    __m512 acc0[MI], acc1[MI];
    for (int i = 0; i < MI; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len / SB; t++) {
        const int64_t g0 = SB / 4 * t;
        __m512i d0[MI], d1[MI];
        __m512 p0[MI], p1[MI];
        for (int i = 0; i < MI; i++) p0[i] = p1[i] = _mm512_set1_ps(start[t * MI + i]);
        for (int g = 0; g < SB / 4; g++) {
            const __m512i w0 = _mm512_loadu_si512(t0 + (g0 + g) * 4 * TR),
                          w1 = _mm512_loadu_si512(t1 + (g0 + g) * 4 * TR);
            for (int i = 0; i < MI; i++) {
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
        for (int i = 0; i < MI; i++) {
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
#endif

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
#if TILE512
        if (tile1) {
#define TILE2(Q) tile_rows2(Q, tile, tile1, as, cs, as1, cs1, len, q, s, sum, start, yp, ldy, rows, ncols, k0 > 0)
            if (qa == 4) TILE2(4);
            else if (qa == 8) TILE2(8);
            else TILE2(16);
#undef TILE2
            continue;
        }
#endif
#define TILE(Q, W) tile_rows(Q, SIGNED, W, tile, as, cs, len, q, l, s, sum, start, yp, ldy, rows, ncols, k0 > 0)
        if (l) TILE(16, 1);
        else if (qa == 4) TILE(4, 0);
        else if (qa == 8) TILE(8, 0);
        else TILE(16, 0);
#undef TILE
    }
}

#if defined(__AVX2__)
#define ACC_T __m256
#define ACC_ZERO _mm256_setzero_ps()
#define ACC_SUM hsum8
#else
#define ACC_T float
#define ACC_ZERO 0.0f
#define ACC_SUM(x) (x)
#endif

#if defined(__AVX2__)
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

#if TILE512 && defined(__AVX512VL__)
#define ROW2 1
#define RIR 4  /* up to this many activation rows: the kernels in registers (more: the tiles) */
/* row1_q4 for two weight rows at once against NR activation rows (up to RIR, each block
 * decoded once for all of them), and for Q5_0 and Q5_1 (their fifth bits joined to the
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
#else
#define ROW2 0
#endif

#define ROW1_BLOCKS 1024  /* rows of up to this many blocks (32,768 values) */
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
#if !ROW2
ROW1(im_q4_0, 2, 18)
ROW1(im_q4_1, 3, 20)
#endif
#endif

#if ROW2
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

/* k_scales' eight scales and offsets as vectors, from the 12 bytes as three 32-bit words:
 * no stores for a vector load to wait on. */
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
    const int64_t bytes = type == 2 ? 18 : type == 3 ? 20 : type == 6 ? 22 : type == 7 ? 24 : 17,
                  nb = k / 32, row = nb * bytes, ahead = pair_ahead(row);
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
#endif

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

/* Whether m activation rows (8 bits) go through a kernel that takes the blocks into
 * registers: with AVX-512 up to RIR rows of most types, with AVX2 one row of Q4_0 or Q4_1. */
static int in_registers(int type, int64_t k, int64_t m, const int8_t *xl) {
#if ROW2
    return !xl && k / 32 <= ROW1_BLOCKS && m <= RIR && (type == 2 || type == 3 || type == 6 || type == 7 || type == 39 ||
                        type == 12 || type == 13 || type == 14);
#elif defined(__AVX2__)
    return !xl && k / 32 <= ROW1_BLOCKS && m == 1 && (type == 2 || type == 3);
#else
    (void)type, (void)k, (void)m, (void)xl;
    return 0;
#endif
}

/* Up to FEWI activation rows, or as many as in_registers takes, row by row (y: m rows, ldy
 * apart). */
static int few(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
               const int8_t *xl, const float *xs4, const float *xsum, int64_t m, float *y,
               int64_t ldy) {
    if (in_registers(type, k, m, xl)) {
#if ROW2
        if (type == 12 || type == 13) k4_rows(type == 13, w, n, k, m, xq, xs4, xsum, y, ldy);
        else if (type == 14) q6k_rows(w, n, k, m, xq, xs4, y, ldy);
        else q4_rows(type, w, n, k, m, xq, xs4, y, ldy);
#elif defined(__AVX2__)
        (type == 2 ? im_q4_0_few1 : im_q4_1_few1)(w, n, k, xq, xs4, xsum, y);
#endif
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
        tiles |= m > FEWI && !in_registers((int)w[3 + 4 * p], k, m, xl);
    if (tiles && !make_panels(m, k, xq, xl, xs4, xsum, qa, &P)) return -2;
    int err = 0;
    int64_t row = 0;
    for (int64_t p = 0; p < parts && !err; p++) {
        const int type = (int)w[3 + 4 * p];
        const int64_t rows = w[4 + 4 * p];
        const uint8_t *data = (const uint8_t *)(intptr_t)w[5 + 4 * p],
                      *tiles = (const uint8_t *)(intptr_t)w[6 + 4 * p];
        if (m <= FEWI || in_registers(type, k, m, xl)) {
            err = few(type, data, rows, k, xq, xl, xs4, xsum, m, y + row, n);
        } else {
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
    if (m <= FEWI) {
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

/* Whether a product of m activation rows (wide: 16 bits) by a matrix of this GGML type and
 * row length reads the tiles (1) or goes row by row (0). */
int tg_takes_tiles(int type, int64_t k, int64_t m, int wide) {
    static const int8_t some = 0;  /* (only whether the 16-bit halves are there counts) */
    return m > FEWI && !in_registers(type, k, m, wide ? &some : NULL);
}

/* Which integer instructions this build uses: 2 VNNI, 1 AVX2, 0 portable C. */
int tg_int8_isa(void) {
#if defined(__AVX2__) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
