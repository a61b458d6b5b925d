/* Integer products on packed (GGML block) weights, for the CPU.
 *
 * The activation rows are quantised once per product to int8 in blocks of QA = 16 values,
 * each with a float scale s = max|x| / 127 and the float block sum s * sum(q) (what a weight
 * block's minimum multiplies). A weight block decodes to small integers q and, per sub-block,
 * a scale a and an offset c (value = a * q + c, blocks.h), so one block of 16 contributes
 *
 *     a * s * (q . xq)  +  c * (s * sum(xq))
 *
 * with q . xq an integer dot product: AVX2 `maddubs` + `madd`, or AVX-VNNI / AVX-512 VNNI
 * `dpbusd` (unsigned weights times signed activations; Q8_0's signed weights go through
 * abs and sign), and a portable C loop elsewhere. Activation blocks of 16 are finer than
 * llama.cpp's (32, and 256 for K-quants): the per-lane scales cost no more than a broadcast.
 *
 * Few rows (decode): each weight row's chunk is decoded to bytes once, then dotted with every
 * activation row. More rows (prefill, large batches): eight weight rows are decoded and
 * interleaved four bytes at a time, so one 32-byte vector holds four values of each of the
 * eight rows and each 32-bit lane accumulates its own output; every activation row then
 * broadcasts four of its bytes against that tile. Either way each weight block is decoded once
 * per product, whatever the number of rows.
 */
#include <math.h>

#include "blocks.h"

#define QA 16     /* activation values per scale */
#define IKC 1024  /* weight values decoded at a time (a multiple of every block size) */
#define FEWI 4    /* up to this many rows: the row-by-row kernel */
#define TR 8      /* weight rows per interleaved tile */
#define MI 4      /* activation rows per pass over a tile */

/* ---- activations ---------------------------------------------------------------------
 * Row i of x (k values, k a multiple of 32) becomes xq[i k + j] (int8), the scale of each
 * block of 16 written four times over in xs4[i k / 4 + 4 b ...] (one per 32-bit lane of the
 * block's products), and xsum[i k / 16 + b] = scale * sum of the block's q. */
void tg_quantize_act(const float *x, int64_t m, int64_t k, int8_t *xq, float *xs4,
                     float *xsum) {
    const int64_t blocks = m * (k / QA);
    _Pragma("omp parallel for schedule(static) if (blocks > 256)")
    for (int64_t t = 0; t < blocks; t++) {
        const float *v = x + t * QA;
        float amax = 0.0f;
        for (int j = 0; j < QA; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f, s = amax / 127.0f;
        int sum = 0;
        for (int j = 0; j < QA; j++) {
            const int q = (int)rintf(v[j] * id);
            xq[t * QA + j] = (int8_t)q;
            sum += q;
        }
        for (int l = 0; l < 4; l++) xs4[4 * t + l] = s;
        xsum[t] = s * (float)sum;
    }
}

/* ---- one chunk of a weight row, decoded ------------------------------------------------
 * q: len bytes; a4: each block of 16's weight scale four times over (as xs4); c16: its
 * offset. */
#define DECODE_CHUNK(UNPACK, QK, L, BYTES, src, nblk, q, a4, c16)                             \
    for (int64_t b_ = 0; b_ < (nblk); b_++) {                                                 \
        float a_[QK / L], c_[QK / L];                                                         \
        UNPACK((src) + b_ * BYTES, (q) + b_ * QK, a_, c_);                                    \
        for (int s_ = 0; s_ < QK / QA; s_++) {                                                \
            const int64_t t_ = b_ * (QK / QA) + s_;                                           \
            for (int l_ = 0; l_ < 4; l_++) (a4)[4 * t_ + l_] = a_[s_ * QA / L];               \
            (c16)[t_] = c_[s_ * QA / L];                                                      \
        }                                                                                     \
    }

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

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* sum over len values of (a q + c) x for one activation row (its xq, xs4, xsum at the
 * chunk's start). SIGNED: q is signed (Q8_0), else unsigned. */
static inline __attribute__((always_inline)) float
dot_chunk(const int SIGNED, const int8_t *restrict q, const float *restrict a4,
          const float *restrict c16, const int8_t *restrict xq, const float *restrict xs4,
          const float *restrict xsum, int64_t len) {
#if defined(__AVX2__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j += 64) {  /* len is a multiple of 256 or of 32 ... */
        for (int h = 0; h < 2; h++) {
            const int64_t o = j + 32 * h;
            if (o >= len) break;
            __m256i w = load32(q + o), v = load32(xq + o);
            if (SIGNED) {
                v = _mm256_sign_epi8(v, w);
                w = _mm256_abs_epi8(w);
            }
            const __m256 p = _mm256_cvtepi32_ps(dot4(_mm256_setzero_si256(), w, v));
            const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(a4 + o / 4), _mm256_loadu_ps(xs4 + o / 4));
            if (h) acc1 = _mm256_fmadd_ps(p, s, acc1);
            else acc0 = _mm256_fmadd_ps(p, s, acc0);
        }
    }
    for (int64_t b = 0; b < len / QA; b += 8)  /* len / 16 is even; a multiple of 8 or 2 */
        if (b + 8 <= len / QA)
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(c16 + b), _mm256_loadu_ps(xsum + b), acc0);
        else
            for (int64_t t = b; t < len / QA; t++) acc1[0] += c16[t] * xsum[t];
    return hsum8(_mm256_add_ps(acc0, acc1));
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < len / QA; b++) {
        int32_t d = 0;
        for (int j = 0; j < QA; j++)
            d += (int32_t)(SIGNED ? q[b * QA + j] : (uint8_t)q[b * QA + j]) * xq[b * QA + j];
        acc += (float)d * (a4[4 * b] * xs4[4 * b]) + c16[b] * xsum[b];
    }
    return acc;
#endif
}

/* ---- a tile of TR weight rows, interleaved -------------------------------------------
 * tile[g * 4 TR + r * 4 + l] = value 4 g + l of row r; as[t * TR + r], cs[t * TR + r]: the
 * scale and offset of row r's block of 16 t. Rows past the matrix are zero. */
static inline __attribute__((always_inline)) void
tile_rows(const int SIGNED, const uint8_t *restrict tile, const float *restrict as,
          const float *restrict cs, int64_t len, const int8_t *restrict xq,
          const float *restrict xs4, const float *restrict xsum, int64_t k, int rows,
          float *restrict y, int64_t ldy, int ncols, int add) {
    /* rows <= MI activation rows, each xq row k apart, xs4 row k / 4, xsum row k / 16 */
#if defined(__AVX2__)
    __m256 acc[MI];
    for (int i = 0; i < rows; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len / QA; t++) {
        __m256i isum[MI];
        for (int i = 0; i < rows; i++) isum[i] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i w = load32(tile + (4 * t + g) * 4 * TR);
            const __m256i wa = SIGNED ? _mm256_abs_epi8(w) : w;
            for (int i = 0; i < rows; i++) {
                int32_t four;
                memcpy(&four, xq + i * k + 16 * t + 4 * g, 4);
                __m256i v = _mm256_set1_epi32(four);
                if (SIGNED) v = _mm256_sign_epi8(v, w);
                isum[i] = dot4(isum[i], wa, v);
            }
        }
        const __m256 a = _mm256_loadu_ps(as + t * TR), c = _mm256_loadu_ps(cs + t * TR);
        for (int i = 0; i < rows; i++) {
            const __m256 s = _mm256_mul_ps(a, _mm256_set1_ps(xs4[i * (k / 4) + 4 * t]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), s, acc[i]);
            acc[i] = _mm256_fmadd_ps(c, _mm256_set1_ps(xsum[i * (k / QA) + t]), acc[i]);
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
            for (int64_t t = 0; t < len / QA; t++) {
                int32_t d = 0;
                for (int j = 0; j < QA; j++) {
                    const int g = (int)(16 * t + j) / 4, l = j % 4;
                    const uint8_t wb = tile[g * 4 * TR + r * 4 + l];
                    d += (SIGNED ? (int32_t)(int8_t)wb : (int32_t)wb) * xq[i * k + 16 * t + j];
                }
                acc += (float)d * (as[t * TR + r] * xs4[i * (k / 4) + 4 * t])
                       + cs[t * TR + r] * xsum[i * (k / QA) + t];
            }
            y[i * ldy + r] = add ? y[i * ldy + r] + acc : acc;
        }
#endif
}

#define IKERNELS(NAME, QK, L, BYTES, UNPACK, SIGNED)                                          \
    static void NAME##_few(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,          \
                           const float *xs4, const float *xsum, int64_t m, float *y,          \
                           int64_t ldy) {                                                     \
        const int64_t nb = k / QK;                                                            \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r = 0; r < n; r++) {                                                     \
            int8_t q[IKC] __attribute__((aligned(32)));                                       \
            float a4[IKC / 4], c16[IKC / QA];                                                 \
            float acc[FEWI] = {0};                                                            \
            for (int64_t k0 = 0; k0 < k; k0 += IKC) {                                         \
                const int64_t len = k - k0 < IKC ? k - k0 : IKC;                              \
                DECODE_CHUNK(UNPACK, QK, L, BYTES, w + (r * nb + k0 / QK) * BYTES, len / QK,  \
                             q, a4, c16)                                                      \
                for (int64_t i = 0; i < m; i++)                                               \
                    acc[i] += dot_chunk(SIGNED, q, a4, c16, xq + i * k + k0,                  \
                                        xs4 + (i * k + k0) / 4, xsum + (i * k + k0) / QA,     \
                                        len);                                                 \
            }                                                                                 \
            for (int64_t i = 0; i < m; i++) y[i * ldy + r] = acc[i];                          \
        }                                                                                     \
    }                                                                                         \
    static void NAME##_tiled(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,        \
                             const float *xs4, const float *xsum, int64_t m, float *y,        \
                             int64_t ldy) {                                                   \
        const int64_t nb = k / QK;                                                            \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r0 = 0; r0 < n; r0 += TR) {                                              \
            uint8_t tile[IKC * TR] __attribute__((aligned(32)));                              \
            float as[IKC / QA * TR], cs[IKC / QA * TR];                                       \
            int8_t q[IKC] __attribute__((aligned(32)));                                       \
            float a4[IKC / 4], c16[IKC / QA];                                                 \
            const int ncols = n - r0 < TR ? (int)(n - r0) : TR;                               \
            for (int64_t k0 = 0; k0 < k; k0 += IKC) {                                         \
                const int64_t len = k - k0 < IKC ? k - k0 : IKC;                              \
                for (int r = 0; r < TR; r++) {                                                \
                    if (r < ncols) {                                                          \
                        DECODE_CHUNK(UNPACK, QK, L, BYTES, w + ((r0 + r) * nb + k0 / QK) * BYTES, \
                                     len / QK, q, a4, c16)                                    \
                    } else {                                                                  \
                        memset(q, 0, len);                                                    \
                        memset(a4, 0, sizeof(float) * (len / 4));                             \
                        memset(c16, 0, sizeof(float) * (len / QA));                           \
                    }                                                                         \
                    for (int64_t g = 0; g < len / 4; g++)                                     \
                        memcpy(tile + g * 4 * TR + r * 4, q + 4 * g, 4);                      \
                    for (int64_t t = 0; t < len / QA; t++) {                                  \
                        as[t * TR + r] = a4[4 * t];                                           \
                        cs[t * TR + r] = c16[t];                                              \
                    }                                                                         \
                }                                                                             \
                int64_t i = 0;                                                                \
                for (; i + MI <= m; i += MI)                                                  \
                    tile_rows(SIGNED, tile, as, cs, len, xq + i * k + k0,                     \
                              xs4 + (i * k + k0) / 4, xsum + (i * k + k0) / QA, k, MI,        \
                              y + i * ldy + r0, ldy, ncols, k0 > 0);                          \
                for (; i < m; i++)                                                            \
                    tile_rows(SIGNED, tile, as, cs, len, xq + i * k + k0,                     \
                              xs4 + (i * k + k0) / 4, xsum + (i * k + k0) / QA, k, 1,         \
                              y + i * ldy + r0, ldy, ncols, k0 > 0);                          \
            }                                                                                 \
        }                                                                                     \
    }

IKERNELS(im_q4_0, 32, 32, 18, un_q4_0, 0)
IKERNELS(im_q4_1, 32, 32, 20, un_q4_1, 0)
IKERNELS(im_q5_0, 32, 32, 22, un_q5_0, 0)
IKERNELS(im_q5_1, 32, 32, 24, un_q5_1, 0)
IKERNELS(im_q8_0, 32, 32, 34, un_q8_0, 1)
IKERNELS(im_q4_k, 256, 32, 144, un_q4_k, 0)
IKERNELS(im_q5_k, 256, 32, 176, un_q5_k, 0)
IKERNELS(im_q6_k, 256, 16, 210, un_q6_k, 0)

#define IDISPATCH(TYPE, SUFFIX, ARGS)                                                         \
    switch (TYPE) {                                                                           \
    case 2: im_q4_0##SUFFIX ARGS; return 0;                                                   \
    case 3: im_q4_1##SUFFIX ARGS; return 0;                                                   \
    case 6: im_q5_0##SUFFIX ARGS; return 0;                                                   \
    case 7: im_q5_1##SUFFIX ARGS; return 0;                                                   \
    case 8: im_q8_0##SUFFIX ARGS; return 0;                                                   \
    case 12: im_q4_k##SUFFIX ARGS; return 0;                                                  \
    case 13: im_q5_k##SUFFIX ARGS; return 0;                                                  \
    case 14: im_q6_k##SUFFIX ARGS; return 0;                                                  \
    default: return -1;                                                                       \
    }

/* y (m rows, row stride ldy) = the quantised activations (m, k) @ W(n, k)^T. */
int tg_qmatmul(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
               const float *xs4, const float *xsum, int64_t m, float *y, int64_t ldy) {
    if (m <= 0) return 0;
    if (m <= FEWI) IDISPATCH(type, _few, (w, n, k, xq, xs4, xsum, m, y, ldy))
    IDISPATCH(type, _tiled, (w, n, k, xq, xs4, xsum, m, y, ldy))
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
