/* The small operations of a decode step, for the CPU, in float32: RMSNorm, the rotary
 * embedding and one new token's attention over the cache (held in float32, float16 or
 * bfloat16). Each is a few microseconds of arithmetic, where the
 * several torch operations they otherwise take cost tens (each dispatch is microseconds);
 * at batch 1 that dispatch is most of a step outside the matrix products. Built into the
 * same library as packed.c.
 */
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "blocks.h"
#include "tiergen.h"

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Two accumulators and a pairwise sum of the lanes: short dependency chains. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    v8 u = {0}, w = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        u += load8(a + i) * load8(b + i);
        w += load8(a + i + 8) * load8(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) u += load8(a + i) * load8(b + i);
    u += w;
    float t = ((u[0] + u[4]) + (u[1] + u[5])) + ((u[2] + u[6]) + (u[3] + u[7]));
    for (; i < n; i++) t = fmaf(a[i], b[i], t);
    return t;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * (w + shift) for m rows of n values (w NULL: no
 * weight). shift is 1 for Gemma's x * (1 + w). */
void tg_rms_norm(const float *x, const float *w, float shift, int64_t m, int64_t n, float eps,
                 float *out) {
#pragma omp parallel for schedule(static) if (m * n >= (1 << 16))
    for (int64_t r = 0; r < m; r++) {
        const float *restrict xr = x + r * n;
        float *restrict o = out + r * n;
        const float s = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        if (w == NULL)
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * s;
        else
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * s * (w[i] + shift);
    }
}

/* Rotary embedding of the first `rotary` of D numbers of each row (all of them, or fewer:
 * partial rotary, GLM-4.5 and MiniMax-M2), the rest passed through, in the half-split
 * layout: with R = rotary, out[b, h, t, :R] = x * cos + rot(x) * sin, rot(x) = (-x[R/2:R],
 * x[:R/2]); cos, sin (B, T, R) contiguous (cos[i] = cos[i + R/2]), out (B, H, T, D)
 * contiguous, and x's row (b, h, t) at x + b * xs[0] + h * xs[1] + t * xs[2] (floats).
 * pairs: each rotated pair is adjacent instead, (x[2i], x[2i + 1]) turned by the angle of i,
 * as llama.cpp stores Llama's Q/K rows; the same operations on the same values, so the
 * numbers are those of the half-split layout, in the pairs' order. */
void tg_rope(const float *x, const int64_t *xs, int64_t B, int64_t H, int64_t T, int64_t D,
             int64_t rotary, const float *cos, const float *sin, int pairs, float *out) {
    const int64_t half = rotary / 2;
#pragma omp parallel for schedule(static) if (B * H * T * D >= (1 << 16))
    for (int64_t r = 0; r < B * H * T; r++) {
        const int64_t b = r / (H * T), h = r / T % H, t = r % T;
        const float *restrict xr = x + b * xs[0] + h * xs[1] + t * xs[2];
        const float *restrict c = cos + (b * T + t) * rotary;
        const float *restrict sn = sin + (b * T + t) * rotary;
        float *restrict o = out + r * D;
        if (pairs) {
            for (int64_t i = 0; i < half; i++) {
                o[2 * i] = xr[2 * i] * c[i] + -xr[2 * i + 1] * sn[i];
                o[2 * i + 1] = xr[2 * i + 1] * c[i] + xr[2 * i] * sn[i];
            }
        } else {
            for (int64_t i = 0; i < half; i++) o[i] = xr[i] * c[i] + -xr[i + half] * sn[i];
            for (int64_t i = half; i < rotary; i++) o[i] = xr[i] * c[i] + xr[i - half] * sn[i];
        }
        for (int64_t i = rotary; i < D; i++) o[i] = xr[i];
    }
}

/* One token of the gated delta rule for B x H (row, head) states S (dk x dv, float32) in
 * place, row b's head h at S + b * ss[0] + h * ss[1], its rows ss[2] apart (q, k, v, g,
 * beta and out contiguous, head after head): S <- S * exp(g); kv = S^T k;
 * S += k ((v - kv) beta)^T; out = S^T q. g holds gw numbers per head: one (a decay per
 * head) or dk (a decay per key channel). Two passes over each state, the second from cache. */
void tg_delta_step(float *S, const int64_t *ss, const float *q, const float *k, const float *v,
                   const float *g, int64_t gw, const float *beta, int64_t B, int64_t H,
                   int64_t dk, int64_t dv, float *out) {
#pragma omp parallel for schedule(static) if (B * H * dk * dv >= (1 << 16))
    for (int64_t i = 0; i < B * H; i++) {
        float *restrict st = S + i / H * ss[0] + i % H * ss[1];
        const float *restrict qi = q + i * dk, *restrict ki = k + i * dk;
        const float *restrict gi = g + i * gw;
        float delta[dv], o[dv];
        for (int64_t c = 0; c < dv; c++) delta[c] = 0.0f, o[c] = 0.0f;
        for (int64_t r = 0; r < dk; r++) {
            const float w = expf(gi[gw == 1 ? 0 : r]) * ki[r];
            const float *restrict row = st + r * ss[2];
            for (int64_t c = 0; c < dv; c++) delta[c] += row[c] * w;
        }
        for (int64_t c = 0; c < dv; c++) delta[c] = (v[i * dv + c] - delta[c]) * beta[i];
        for (int64_t r = 0; r < dk; r++) {
            const float d = expf(gi[gw == 1 ? 0 : r]), kr = ki[r], qr = qi[r];
            float *restrict row = st + r * ss[2];
            for (int64_t c = 0; c < dv; c++) {
                const float x = row[c] * d + kr * delta[c];
                row[c] = x;
                o[c] += x * qr;
            }
        }
        for (int64_t c = 0; c < dv; c++) out[i * dv + c] = o[c];
    }
}

/* VW floats at a time: a 512-bit vector with AVX-512, 256 bits otherwise */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* exp(x) for x <= 0, VW at a time, within a few units in the last place of expf (Cephes'
 * polynomial on x - n ln 2); below -87 (and for -inf: a masked slot's score) it gives 0,
 * where expf gives a denormal: a difference beside the softmax's largest term, 1, that
 * float32 cannot hold. */
static inline vf expv(vf x) {
    const vf zero = {0}, big = zero + 12582912.0f;  /* 1.5 x 2^23: adding it rounds */
    const vi low = x < -87.0f;
    x = (vf)((low & (vi)(zero - 87.0f)) | (~low & (vi)x));
    const vf n = (x * 1.44269504088896341f + big) - big;
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf y = zero + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return (vf)(~low & (vi)(y * two_n));
}

/* Lane i all ones where m[i] is nonzero (a slot the mask allows). */
static inline vi seen_lanes(const uint8_t *m) {
    vi r;
    for (int i = 0; i < VW; i++) r[i] = -(int32_t)(m[i] != 0);
    return r;
}

static inline vf pick(vi c, vf a, vf b) { return (vf)((c & (vi)a) | (~c & (vi)b)); }

static inline float lanes_max(vf a) {
    float m = a[0];
    for (int i = 1; i < VW; i++) m = a[i] > m ? a[i] : m;
    return m;
}

static inline float lanes_sum(vf a) {
    float t = 0.0f;
    for (int i = 0; i < VW; i++) t += a[i];
    return t;
}

/* r[i] = the sum of a[i]'s lanes, for VW vectors: each level adds pairs of vectors' lanes
 * g apart, halving the vectors and keeping their order (a transpose and sum in log2(VW)
 * levels). a is overwritten. */
#define SUM_LEVEL(g, ...)                                                                  \
    for (int m = 0; m < n / 2; m++)                                                        \
        a[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], __VA_ARGS__) +              \
               __builtin_shufflevector(a[2 * m], a[2 * m + 1], PLUS##g(__VA_ARGS__));         \
    n /= 2;
static inline vf lane_sums(vf a[VW]) {
    int n = VW;
#if VW == 16
#define PLUS1(...) 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define PLUS2(...) 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define PLUS4(...) 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define PLUS8(...) 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
    SUM_LEVEL(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
    SUM_LEVEL(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
    SUM_LEVEL(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
    SUM_LEVEL(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#else
#define PLUS1(...) 1, 9, 3, 11, 5, 13, 7, 15
#define PLUS2(...) 2, 3, 10, 11, 6, 7, 14, 15
#define PLUS4(...) 4, 5, 6, 7, 12, 13, 14, 15
    SUM_LEVEL(1, 0, 8, 2, 10, 4, 12, 6, 14)
    SUM_LEVEL(2, 0, 1, 8, 9, 4, 5, 12, 13)
    SUM_LEVEL(4, 0, 1, 2, 3, 8, 9, 10, 11)
#endif
    return a[0];
}

/* Whether the mask hides all of VW slots. */
static inline int hidden(const uint8_t *mask) {
    uint64_t any = 0, w;
    for (int i = 0; i < VW; i += 8) {
        memcpy(&w, mask + i, 8);
        any |= w;
    }
    return any == 0;
}

/* The cache's number formats (tg_decode_attention's kv). */
enum { KV_F32, KV_F16, KV_BF16 };

/* Cache number i at p, in format KV */
static inline float kv_at(const int KV, const void *p, int64_t i) {
    if (KV == KV_F16) return half((const uint8_t *)p + 2 * i);
    if (KV == KV_BF16) {
        const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

static inline vf load_kv(const int KV, const void *p, int64_t i) {
    if (KV == KV_F32) return loadv((const float *)p + i);
    const uint16_t *h = (const uint16_t *)p + i;
#if VW == 16
    if (KV == KV_BF16)
        return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__AVX2__)
    if (KV == KV_BF16)
        return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
#if defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#endif
#endif
    vf x;
    for (int j = 0; j < VW; j++) x[j] = kv_at(KV, p, i + j);
    return x;
}

static inline float dot_kv(const int KV, const float *restrict a, const void *b, int64_t i, int64_t n) {
    if (KV == KV_F32) return dot(a, (const float *)b + i, n);
    float t = 0.0f;
    for (int64_t j = 0; j < n; j++) t = fmaf(a[j], kv_at(KV, b, i + j), t);
    return t;
}

/* Heads whose sums of V rows run together: their 4 x VHEADS accumulators and a row's 4
 * vectors fill most of the vector registers (32 with AVX-512, 16 below it). */
#define VHEADS (VW == 16 ? 4 : 3)

/* Ask for the cache lines of `bytes` bytes at base + at (a K or V row, read soon). */
static inline void prefetch_row(const void *base, int64_t at, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)base + at + i);
}

/* One query token per row: out[b, h] = softmax_s(scale * q[b, h] . k[b, g, s]) v[b, g, s]
 * over the slots s < S that mask[b, s] allows (every slot when mask is NULL), where the query
 * heads h of a group share the K/V head g = h / (H / KVH). q (B, H, D) and out (B, H, Dv) are
 * contiguous; a K (V) row starts at k + (b / T) * ks[0] + g * ks[1] + s * ks[2] (numbers in
 * format kv: KV_F32, KV_F16 or KV_BF16; T query rows per cache row, each with its own mask
 * row: a speculative step's checks). The heads
 * of a group are scored together, so every K and V row is read once per group. A row with no
 * allowed slot gets zeros. Returns nonzero when out of memory.
 *
 * Scores come VW slots at a time, each slot's products in a vector and the VW vectors summed
 * lane-wise together (lane_sums), and their exponentials VW at a time (expv): a dot product's
 * horizontal sum, or an exponential, one at a time would cost more than the products.
 *
 * A row's numbers do not depend on where its tokens sit in the cache (the padding before them
 * in a batch, the slots after them): its slots are taken in groups of VW from its first
 * allowed one, so each of its tokens falls in the same lane of the same sums as when it runs
 * alone; the products of an incomplete last group likewise; V is summed slot by slot, in
 * order. */
static inline __attribute__((always_inline)) int
attend(const int KV, const float *q, const void *k, const void *v, const uint8_t *mask,
       int64_t B, int64_t H, int64_t KVH, int64_t S, int64_t D, int64_t Dv, const int64_t *ks,
       const int64_t *vs, float scale, int64_t T, float *out) {
    const int64_t G = H / KVH;
    /* fewer groups than threads (one row of a model with one K/V head): each group's heads
     * split over tasks; a head's numbers are the same in any of them */
    const int64_t threads = omp_get_max_threads(), groups = B * KVH;
    const int64_t parts = groups >= threads ? 1 : (threads / groups < G ? threads / groups : G);
    const int64_t per = (G + parts - 1) / parts;  /* heads of a task */
    int failed = 0;
#pragma omp parallel for schedule(static) if (B * H * S * (D + Dv) >= (1 << 18))
    for (int64_t task = 0; task < groups * parts; task++) {
        const int64_t b = task / parts / KVH, g = task / parts % KVH, h0 = task % parts * per;
        const int64_t GL = G - h0 < per ? G - h0 : per;
        if (GL <= 0) continue;
        const int64_t kb = b / T * ks[0] + g * ks[1], vb = b / T * vs[0] + g * vs[1];
        const float *qg = q + (b * H + g * G + h0) * D;
        float *og = out + (b * H + g * G + h0) * Dv;
        const uint8_t *mb = mask ? mask + b * S : NULL;
        const int64_t next = task / parts + 1, size = KV == KV_F32 ? 4 : 2;
        const int64_t next_k = next / KVH / T * ks[0] + next % KVH * ks[1];
        int64_t o = 0;  /* the row's first allowed slot: p[j * SP + i] is slot o + i's */
        while (mb && o < S && !mb[o]) o++;
        const int64_t SP = (S - o + VW - 1) / VW * VW;
        float *p = malloc(sizeof(float) * (GL * SP + 1));
        if (p == NULL) {
            failed = 1;
            continue;
        }
        /* scores, -inf where the mask hides the slot and past S */
        const vf none = (vf){0} - INFINITY;
        for (int64_t s0 = o; D % VW == 0 && s0 < S; s0 += VW) {
            const int n = S - s0 < VW ? (int)(S - s0) : VW;  /* slots of this group */
            if (mb && n == VW && hidden(mb + s0)) {  /* (slots past a row's tokens: not read) */
                for (int64_t j = 0; j < GL; j++) memcpy(p + j * SP + s0 - o, &none, sizeof none);
                continue;
            }
            vi seen = mb && n == VW ? seen_lanes(mb + s0) : (vi){0} - (n == VW);
            if (n < VW)
                for (int u = 0; u < n; u++) seen[u] = !mb || mb[s0 + u] ? -1 : 0;
            for (int64_t j = 0; j < GL; j++) {
                vf acc[VW] = {{0}};
                const float *qj = qg + j * D;
                if (n == VW)
                    for (int64_t c = 0; c < D; c += VW) {  /* VW independent sums: no chain waits */
                        const vf x = loadv(qj + c);
                        int64_t at = kb + s0 * ks[2] + c;
                        for (int u = 0; u < VW; u++, at += ks[2]) acc[u] += x * load_kv(KV, k, at);
                    }
                else  /* the same products (lanes past S repeat the last slot, unseen) */
                    for (int64_t c = 0; c < D; c += VW) {
                        const vf x = loadv(qj + c);
                        const int64_t at = kb + s0 * ks[2] + c;
                        for (int u = 0; u < VW; u++)
                            acc[u] += x * load_kv(KV, k, at + (u < n ? u : n - 1) * ks[2]);
                    }
                const vf e = pick(seen, lane_sums(acc) * scale, none);
                memcpy(p + j * SP + s0 - o, &e, sizeof e);
            }
        }
        for (int64_t s0 = o; D % VW != 0 && s0 < o + SP; s0++)
            for (int64_t j = 0; j < GL; j++)
                p[j * SP + s0 - o] = s0 < S && (!mb || mb[s0])
                                         ? dot_kv(KV, qg + j * D, k, kb + s0 * ks[2], D) * scale
                                         : -INFINITY;
        /* their exponentials (0 where -inf) against the largest, and their sum */
        float total[GL];
        for (int64_t j = 0; j < GL; j++) {
            float *pj = p + j * SP;
            vf top = none, sum = {0};
            for (int64_t i = 0; i < SP; i += VW) {
                const vf x = loadv(pj + i);
                top = pick(x > top, x, top);
            }
            const float best = lanes_max(top);
            for (int64_t i = 0; i < SP && best > -INFINITY; i += VW) {
                if (mb && o + i + VW <= S && hidden(mb + o + i)) continue;  /* (not read below) */
                const vf e = expv(loadv(pj + i) - best);
                memcpy(pj + i, &e, sizeof e);
                sum += e;
            }
            total[j] = lanes_sum(sum);
        }
        /* out = sum_s p[s] v[s] / total, in registers: 4 VW outputs of up to VHEADS heads at
         * a time, so that a V row is read once per VHEADS heads */
        for (int64_t j0 = 0; j0 < GL; j0 += VHEADS) {
            const int64_t n = GL - j0 < VHEADS ? GL - j0 : VHEADS;
            int64_t c = 0;
            for (; c + 4 * VW <= Dv; c += 4 * VW) {
                vf acc[VHEADS][4] = {{{0}}};
                /* the next task's K rows as this one's V rows go by (once): a batch's cache
                 * lies past L2, and the hardware's prefetchers start late on a new row */
                const int ahead = c == 0 && j0 == 0 && h0 == 0 && next < groups;
                for (int64_t s = o; s < S; s++) {
                    prefetch_row(v, (vb + (s + 8) * vs[2] + c) * size, 4 * VW * size);
                    if (ahead) prefetch_row(k, (next_k + s * ks[2]) * size, D * size);
                    if (mb && !mb[s]) continue;
                    const int64_t vr = vb + s * vs[2] + c;
                    const vf x0 = load_kv(KV, v, vr), x1 = load_kv(KV, v, vr + VW),
                             x2 = load_kv(KV, v, vr + 2 * VW), x3 = load_kv(KV, v, vr + 3 * VW);
                    for (int64_t j = 0; j < n; j++) {
                        const float e = p[(j0 + j) * SP + s - o];
                        acc[j][0] += e * x0, acc[j][1] += e * x1;
                        acc[j][2] += e * x2, acc[j][3] += e * x3;
                    }
                }
                for (int64_t j = 0; j < n; j++) {
                    const float inv = total[j0 + j] > 0.0f ? 1.0f / total[j0 + j] : 0.0f;
                    for (int u = 0; u < 4; u++) {
                        const vf r = acc[j][u] * inv;
                        memcpy(og + (j0 + j) * Dv + c + VW * u, &r, sizeof r);
                    }
                }
            }
            for (; c < Dv; c++)
                for (int64_t j = j0; j < j0 + n; j++) {
                    float t = 0.0f;
                    for (int64_t s = o; s < S; s++)
                        if (!mb || mb[s]) t = fmaf(p[j * SP + s - o], kv_at(KV, v, vb + s * vs[2] + c), t);
                    og[j * Dv + c] = t * (total[j] > 0.0f ? 1.0f / total[j] : 0.0f);
                }
        }
        free(p);
    }
    return failed;
}

int tg_decode_attention(const float *q, const void *k, const void *v, const uint8_t *mask,
                        int64_t B, int64_t H, int64_t KVH, int64_t S, int64_t D, int64_t Dv,
                        const int64_t *ks, const int64_t *vs, float scale, int kv, int64_t T,
                        float *out) {
    if (kv == KV_F16) return attend(KV_F16, q, k, v, mask, B, H, KVH, S, D, Dv, ks, vs, scale, T, out);
    if (kv == KV_BF16) return attend(KV_BF16, q, k, v, mask, B, H, KVH, S, D, Dv, ks, vs, scale, T, out);
    return attend(KV_F32, q, k, v, mask, B, H, KVH, S, D, Dv, ks, vs, scale, T, out);
}

/* n float32 values as float16, rounded to nearest even as torch's .half() rounds: how the
 * decode layer writes a float16 cache's rows. */
void tg_to_half(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = to_half(x[i]);
}

/* out[r] = the first index of row r's largest value (x: rows of n floats); a row holding a
 * NaN gets its first NaN, as torch.argmax gives. Two passes over each row, both of which
 * vectorise: its maximum, then where that maximum first is. */
void tg_argmax(const float *x, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= (1 << 20))
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict v = x + r * n;
        float best = v[0];
        int nan = 0;
        int64_t i = 0;
#if defined(__AVX2__)
        __m256 b = _mm256_set1_ps(best), odd = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 e = _mm256_loadu_ps(v + i);
            b = _mm256_max_ps(b, e);
            odd = _mm256_or_ps(odd, _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, b);
        for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
        nan = _mm256_movemask_ps(odd) != 0;
#endif
        for (; i < n; i++) {
            best = v[i] > best ? v[i] : best;
            nan |= v[i] != v[i];
        }
        int64_t at = 0;
        if (nan)
            while (v[at] == v[at]) at++;
        else
            while (v[at] != best) at++;
        out[r] = at;
    }
}

/* e^x within about 2 ulp (Cephes' expf), written so that a loop over it vectorises: libm's
 * expf and tanhf are calls the compiler does not vectorise without -ffast-math. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

static inline float glu_one(float g, float u, int gelu) {
    if (!gelu) return g / (1.0f + exp_poly(-g)) * u;
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (2.0f - 2.0f / (exp_poly(2.0f * z) + 1.0f)) * u;
}

#define GLU_PIECE 256 /* values of a row made at a time (rounded to bfloat16 from a buffer) */

/* out (rows, I) = act(gate) * up for gu (rows, 2 I) = [gate | up] per row: act SiLU, or with
 * gelu GELU's tanh form, tanh(z) = 1 - 2 / (e^2z + 1). out is float32, or with bf16 the same
 * values rounded to bfloat16 (bf16_of), for a product on AMX tiles that takes them so. */
void tg_glu(const float *gu, int64_t rows, int64_t I, int gelu, void *out, int bf16) {
#pragma omp parallel for schedule(static) if (rows * I >= 16384)
    for (int64_t b = 0; b < rows; b++)
        tg_glu_row(gu + b * 2 * I, gu + b * 2 * I + I, I, gelu,
                   bf16 ? (void *)((uint16_t *)out + b * I) : (void *)((float *)out + b * I), bf16);
}

/* Not inlined: amx.c calls the same code as tg_glu runs, so that both round alike. */
__attribute__((noinline)) void tg_glu_row(const float *gate, const float *up, int64_t I,
                                          int gelu, void *out, int bf16) {
    const float *restrict gr = gate, *restrict ur = up;
    float piece[GLU_PIECE];
    for (int64_t j0 = 0; j0 < I; j0 += GLU_PIECE) {
        const int64_t n = I - j0 < GLU_PIECE ? I - j0 : GLU_PIECE;
        float *restrict a = bf16 ? piece : (float *)out + j0;
        if (gelu)
            for (int64_t j = 0; j < n; j++) a[j] = glu_one(gr[j0 + j], ur[j0 + j], 1);
        else
            for (int64_t j = 0; j < n; j++) a[j] = glu_one(gr[j0 + j], ur[j0 + j], 0);
        if (!bf16) continue;
        uint16_t *restrict hr = (uint16_t *)out + j0;
        for (int64_t j = 0; j < n; j++) {
            uint32_t u;
            memcpy(&u, &a[j], 4);
            hr[j] = bf16_of(u);
        }
    }
}
