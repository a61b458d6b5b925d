/* GGML blocks decoded to small integers: shared by packed.c (float products) and
 * int8.c (integer products). Block layouts follow tiergen/weights/quant.py (and so
 * llama.cpp's files). */
#ifndef TG_BLOCKS_H
#define TG_BLOCKS_H

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

/* The bits u of a float32 rounded to bfloat16: to nearest even, subnormals kept, NaN to
 * 0xffff; torch's Tensor.bfloat16() to the bit. */
static inline uint16_t bf16_of(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float32 to float16, rounding to nearest even as torch's .half() does (overflow: inf). */
static inline uint16_t to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, e = (x >> 23) & 0xff, m = x & 0x7fffff;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00 | (m ? 0x200 : 0));
    const int32_t ne = (int32_t)e - 112;  /* the exponent, rebiased for 15 */
    if (ne >= 31) return (uint16_t)(sign | 0x7c00);
    uint32_t h, rest, halfway;
    if (ne <= 0) {  /* subnormal (or zero): the 24-bit significand shifted into 10 bits */
        if (ne < -10) return (uint16_t)sign;
        const int shift = 14 - ne;
        const uint32_t sig = m | 0x800000;
        h = sig >> shift, rest = sig & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    } else {
        h = ((uint32_t)ne << 10) | (m >> 13), rest = m & 0x1fff, halfway = 0x1000;
    }
    if (rest > halfway || (rest == halfway && (h & 1))) h++;  /* (a carry rounds up the exponent) */
    return (uint16_t)(sign | h);
#endif
}

/* Weights stream from memory once per product. The hardware prefetcher alone leaves a row
 * kernel waiting on memory (on a 2-core VM: 4-5 GB/s from a single thread instead of 12);
 * asking for the bytes AHEAD bytes on, once per block, keeps the stream in cache
 * (benchmarks/bench_int8.py --cold measures it). */
#define AHEAD 4096
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + AHEAD, 0, 3)

/* ---- one block -> small integers q and per-sub-block (a, b): value = a * q + b ---------
 * A block of QK values has QK / L sub-blocks of L values. Every q fits an int8. */

#define R restrict

/* 16 or 32 bytes at a time with the compiler's vector extensions (SSE2, AVX2, NEON, ...):
 * the byte loops below are too short for the auto-vectoriser to take on its own. Each
 * decoder writes whole 32-byte runs, so that a kernel reading 32 bytes back gets them
 * forwarded from its store. */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));

static inline u8x16 load16(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

static inline u8x32 load32b(const uint8_t *p) {
    u8x32 v;
    memcpy(&v, p, 32);
    return v;
}

static inline void store32b(int8_t *p, u8x32 v) { memcpy(p, &v, 32); }

static inline u8x32 join16(u8x16 lo, u8x16 hi) {
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                   16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* q[j] = low nibble of src[j], q[16 + j] = its high nibble, for j < 16. */
static inline void nibbles16(const uint8_t *R src, int8_t *R q) {
    const u8x16 v = load16(src);
    store32b(q, join16(v & 15, v >> 4));
}

static inline void un_q4_0(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    const float d = half(b);
    nibbles16(b + 2, q);
    a[0] = d, c[0] = -8.0f * d;
}

static inline void un_q4_1(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    nibbles16(b + 4, q);
    a[0] = half(b), c[0] = half(b + 2);
}

static inline void un_q5(const uint8_t *R qs, uint32_t qh, int8_t *R q) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* value j's fifth bit is bit j of qh: qh is a byte mask as it stands */
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(15);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low),
                                             _mm_and_si128(v, low));
    const __m256i fifth = _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16));
    _mm256_storeu_si256((__m256i *)q, _mm256_or_si256(nibbles, fifth));
#else
    /* value j's fifth bit is bit j of qh: spread qh's bytes over lanes, test one bit each */
    static const u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8_t b0 = qh & 255, b1 = (qh >> 8) & 255, b2 = (qh >> 16) & 255, b3 = qh >> 24;
    const u8x16 lo = {b0, b0, b0, b0, b0, b0, b0, b0, b1, b1, b1, b1, b1, b1, b1, b1};
    const u8x16 hi = {b2, b2, b2, b2, b2, b2, b2, b2, b3, b3, b3, b3, b3, b3, b3, b3};
    const u8x16 v = load16(qs);
    store32b(q, join16((v & 15) | ((u8x16)((lo & bit) != 0) & 16),
                       (v >> 4) | ((u8x16)((hi & bit) != 0) & 16)));
#endif
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
    for (int s = 0; s < 4; s++) {
        const u8x32 v = load32b(qs + 32 * s);
        store32b(q + 64 * s, v & 15);
        store32b(q + 64 * s + 32, v >> 4);
    }
}

static inline void un_q5_k(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    k_scales(b, a, c);
    const uint8_t *qh = b + 16, *qs = b + 48;
    const u8x32 h = load32b(qh);
    for (int s = 0; s < 4; s++) {
        const u8x32 v = load32b(qs + 32 * s);
        store32b(q + 64 * s, (v & 15) | (((h >> (2 * s)) & 1) << 4));
        store32b(q + 64 * s + 32, (v >> 4) | (((h >> (2 * s + 1)) & 1) << 4));
    }
}

/* Q6_K: sixteen sub-blocks of 16 with int8 scales; q = low 4 bits | high 2 bits << 4, minus 32. */
static inline void un_q6_k(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half(b + 208);
    for (int h = 0; h < 2; h++) {
        const u8x32 l0 = load32b(ql + 64 * h), l1 = load32b(ql + 64 * h + 32);
        const u8x32 hh = load32b(qh + 32 * h);
        int8_t *o = q + 128 * h;
        store32b(o, (l0 & 15) | ((hh & 3) << 4));
        store32b(o + 32, (l1 & 15) | (((hh >> 2) & 3) << 4));
        store32b(o + 64, (l0 >> 4) | (((hh >> 4) & 3) << 4));
        store32b(o + 96, (l1 >> 4) | (((hh >> 6) & 3) << 4));
    }
    for (int s = 0; s < 16; s++) {
        a[s] = d * (float)sc[s];
        c[s] = -32.0f * a[s];
    }
}

/* MXFP4 (gpt-oss's experts): 32 E2M1 values, low nibbles first, and one E8M0 exponent. The
 * values are read doubled, {0, 1, 2, 3, 4, 6, 8, 12} and their negatives (all integers), with
 * the scale halved: 2^(e - 128), made from its bits (e < 2 gives a subnormal), as ggml does. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void un_mxfp4(const uint8_t *R b, int8_t *R q, float *R a, float *R c) {
    static const int8_t kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#if defined(__AVX2__)
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 1)), low = _mm_set1_epi8(15);
    const __m128i t = _mm_loadu_si128((const __m128i *)kv);
    const __m128i lo = _mm_shuffle_epi8(t, _mm_and_si128(v, low));
    const __m128i hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), low));
    _mm256_storeu_si256((__m256i *)q, _mm256_set_m128i(hi, lo));
#else
    for (int j = 0; j < 16; j++) q[j] = kv[b[1 + j] & 15], q[16 + j] = kv[b[1 + j] >> 4];
#endif
    a[0] = e8m0_half(b[0]), c[0] = 0.0f;
}

/* Each type above as X(name, values a block, values a scale, bytes a block), decoded by
 * un_<name>: packed.c's and amx.c's kernels are made from this list. */
#define BLOCK_TYPES(X)                                                                        \
    X(q4_0, 32, 32, 18) X(q4_1, 32, 32, 20) X(q5_0, 32, 32, 22) X(q5_1, 32, 32, 24)          \
    X(q8_0, 32, 32, 34) X(q4_k, 256, 32, 144) X(q5_k, 256, 32, 176) X(q6_k, 256, 16, 210)    \
    X(mxfp4, 32, 32, 17)

/* The values and bytes of a block of each GGML type below (a constant where the type is). */
static inline int block_values(int type) { return type == 12 || type == 13 || type == 14 ? 256 : 32; }
static inline int block_bytes(int type) {
    return type == 2 ? 18 : type == 3 ? 20 : type == 6 ? 22 : type == 7 ? 24 : type == 8 ? 34
         : type == 12 ? 144 : type == 13 ? 176 : type == 14 ? 210 : 17;
}

/* PREFIX_<type>SUFFIX ARGS for a GGML type id (ggml.h: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8,
 * Q4_K 12, Q5_K 13, Q6_K 14, MXFP4 39), then return 0; -1 for a type without a kernel. */
#define DISPATCH(PREFIX, TYPE, SUFFIX, ARGS)                                                  \
    switch (TYPE) {                                                                           \
    case 2: PREFIX##_q4_0##SUFFIX ARGS; return 0;                                             \
    case 3: PREFIX##_q4_1##SUFFIX ARGS; return 0;                                             \
    case 6: PREFIX##_q5_0##SUFFIX ARGS; return 0;                                             \
    case 7: PREFIX##_q5_1##SUFFIX ARGS; return 0;                                             \
    case 8: PREFIX##_q8_0##SUFFIX ARGS; return 0;                                             \
    case 12: PREFIX##_q4_k##SUFFIX ARGS; return 0;                                            \
    case 13: PREFIX##_q5_k##SUFFIX ARGS; return 0;                                            \
    case 14: PREFIX##_q6_k##SUFFIX ARGS; return 0;                                            \
    case 39: PREFIX##_mxfp4##SUFFIX ARGS; return 0;                                           \
    default: return -1;                                                                       \
    }

#endif
