/* A whole decode layer in one call, for the CPU: one new token per row, packed (GGML block)
 * matrices, float32 activations between them, the KV cache in float32 or float16.
 *
 * At batch 1 the products of a small model take a few milliseconds a step; the same step
 * run as a layer of torch operations and kernel calls per matrix spends as long again in
 * dispatch between them. Here the layer's operations follow each other in C, with the same
 * kernels as the layer-by-operation path (tg_rms_norm, tg_rope, tg_decode_attention,
 * tg_quantize_act with tg_qmatmul, or tg_matmul, tg_glu), so the two paths compute the same
 * numbers.
 *
 * The layer is the pre-norm block of the Llama family and Gemma 3:
 *   x = norm(h); q, k, v = x Wqkv (+ b); q, k = norm_q(q), norm_k(k) (optional);
 *   q, k = rope(q), rope(k); q *= q_scale; cache[slot] = k, v;
 *   o = attention(q, cache); y = o Wo (+ b); y = norm(y) (optional, Gemma); h += y
 *   x = norm(h); g, u = x Wgate_up (+ b); y = (act(g) * u) Wdown (+ b);
 *   y = norm(y) (optional, Gemma); h += y
 * with every norm x / rms(x) * (w + shift) (shift 1: Gemma's).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiergen.h"

typedef struct {  /* the quantised activations' buffers, sized for the widest product */
    int8_t *q, *low;
    float *s4, *sum;
} act_buffers;

/* y (m, n) = x (m, k) W^T (+ bias): nonzero for a type without a kernel. */
static int product(const tg_layer *L, tg_matrix w, const float *x, int64_t m, float *y,
                   const float *bias, act_buffers *a) {
    const int64_t n = w[0], k = w[1], parts = w[2];
    if (L->qa) {
        tg_quantize_act(x, m, k, L->qa, a->q, L->wide ? a->low : NULL, a->s4, a->sum);
        const int err = tg_qmatmul(w, a->q, L->wide ? a->low : NULL, a->s4, a->sum, L->qa, m, y);
        if (err) return err;
    } else {
        int64_t row = 0;
        for (int64_t p = 0; p < parts; p++) {
            const int err = tg_matmul((int)w[3 + 4 * p], (const uint8_t *)(intptr_t)w[5 + 4 * p],
                                      w[4 + 4 * p], k, x, m, y + row, n);
            if (err) return err;
            row += w[4 + 4 * p];
        }
    }
    if (bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) y[i * n + j] += bias[j];
    return 0;
}

static void norm_rows(const tg_layer *L, const float *w, float *x, int64_t m, int64_t n) {
    if (w) tg_rms_norm(x, w, L->shift, m, n, L->eps, x);
}

/* n numbers of src into the cache at dst + at (numbers): float32, or float16 (kv16) */
static void put_kv(int kv16, void *dst, int64_t at, const float *src, int64_t n) {
    if (kv16) tg_to_half(src, n, (uint16_t *)dst + at);
    else memcpy((float *)dst + at, src, sizeof(float) * n);
}

/* h (B, hidden) advances through the layer in place. cos, sin (B, rotary): this token's
 * rotation per row. The cache (float32, or float16 where kv16 is set): k (v) row of batch
 * row b, head g, slot s at kc + b ks[0] + g ks[1] + s ks[2] (numbers); the new token goes to
 * slot `slot`, attention reads slots [0, S) where mask (B, S) allows. With T > 1 the rows are
 * T new tokens of each cache row (a speculative step's checks): row b is the token of cache
 * row b / T at slot `slot` + b % T, every row's K/V written before any row attends, so each
 * row takes the numbers of a decode step of its token. Returns 0, 1 for a weight type without
 * a kernel, 2 when out of memory. */
int tg_decode_layer(const tg_layer *L, float *h, int64_t B, const float *cos, const float *sin,
                    void *kc, void *vc, const int64_t *ks, const int64_t *vs, int64_t slot,
                    int64_t S, const uint8_t *mask, int kv16, int64_t T) {
    const int64_t H = L->hidden, D = L->head_dim, NQ = L->heads * D, NKV = L->kv_heads * D;
    const int64_t NQKV = NQ + 2 * NKV, I = L->inter;
    int64_t widest = H > NQ ? H : NQ;
    if (I > widest) widest = I;
    const int64_t floats = B * (H + NQKV + NQ + NKV + NQ + H + 2 * I + I) + B * widest / 4
                           + B * widest / 16;
    float *buf = malloc(sizeof(float) * floats + 2 * B * widest + 64);
    if (buf == NULL) return 2;
    float *x = buf, *qkv = x + B * H, *q = qkv + B * NQKV, *kr = q + B * NQ, *o = kr + B * NKV,
          *y = o + B * NQ, *gu = y + B * H, *act = gu + B * 2 * I;
    act_buffers a = {.s4 = act + B * I};
    a.sum = a.s4 + B * widest / 4;
    a.q = (int8_t *)(a.sum + B * widest / 16);
    a.low = a.q + B * widest;
    int err = 0;

    /* attention */
    memcpy(x, h, sizeof(float) * B * H);
    tg_rms_norm(x, L->attn_norm, L->shift, B, H, L->eps, x);
    if ((err = product(L, L->qkv, x, B, qkv, L->qkv_bias, &a))) goto done;
    for (int64_t b = 0; b < B; b++) {
        norm_rows(L, L->q_norm, qkv + b * NQKV, L->heads, D);
        norm_rows(L, L->k_norm, qkv + b * NQKV + NQ, L->kv_heads, D);
    }
    const int64_t strides[3] = {NQKV, D, 0};
    tg_rope(qkv, strides, B, L->heads, 1, D, L->rotary, cos, sin, L->pairs, q);
    tg_rope(qkv + NQ, strides, B, L->kv_heads, 1, D, L->rotary, cos, sin, L->pairs, kr);
    if (L->q_scale != 1.0f)
        for (int64_t i = 0; i < B * NQ; i++) q[i] *= L->q_scale;
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < L->kv_heads; g++) {
            const int64_t c = b / T, at = slot + b % T;  /* its cache row and slot */
            put_kv(kv16, kc, c * ks[0] + g * ks[1] + at * ks[2], kr + (b * L->kv_heads + g) * D, D);
            put_kv(kv16, vc, c * vs[0] + g * vs[1] + at * vs[2], qkv + b * NQKV + NQ + NKV + g * D, D);
        }
    if (tg_decode_attention(q, kc, vc, mask, B, L->heads, L->kv_heads, S, D, D, ks, vs,
                            1.0f / sqrtf((float)D), kv16, T, o)) {
        err = 2;
        goto done;
    }
    if ((err = product(L, L->o, o, B, y, L->o_bias, &a))) goto done;
    norm_rows(L, L->attn_out_norm, y, B, H);
    for (int64_t i = 0; i < B * H; i++) h[i] += y[i];

    /* MLP */
    tg_rms_norm(h, L->ffn_norm, L->shift, B, H, L->eps, x);
    if ((err = product(L, L->gate_up, x, B, gu, L->gate_up_bias, &a))) goto done;
    tg_glu(gu, B, I, L->gelu, act, 0);
    if ((err = product(L, L->down, act, B, y, L->down_bias, &a))) goto done;
    norm_rows(L, L->ffn_out_norm, y, B, H);
    for (int64_t i = 0; i < B * H; i++) h[i] += y[i];
done:
    free(buf);
    return err;
}

/* The n layers of a decode step, in order, on h in place (a step's Python then crosses into C
 * once, not once a layer). */
int tg_decode_layers(const tg_step *steps, int64_t n, float *h, int64_t B) {
    for (int64_t i = 0; i < n; i++) {
        const tg_step *s = steps + i;
        int err = tg_decode_layer(s->layer, h, B, s->cos, s->sin, s->kc, s->vc, s->strides,
                                  s->strides + 3, s->slot, s->slots, s->mask, s->kv16, s->tokens);
        if (err) return err;
    }
    return 0;
}

/* One token's experts in one call: out (hidden) = the sum over e < E, in order, of
 * mix[e] * down_e(act(gate_up_e(x))) for the row x (hidden), with the products and the GLU of
 * the layer above (L gives hidden, gelu, qa and wide; mats holds gate_up_0, down_0,
 * gate_up_1, down_1, ...; each expert's intermediate size is its down matrix's width, so a
 * wider shared expert can come last). At batch 1 a mixture of experts runs two products per
 * chosen expert, and calling them one by one from Python costs about as much as the products
 * of a small expert. Returns as tg_decode_layer. */
__attribute__((optimize("fp-contract=off")))  /* each term rounded before it is added */
int tg_experts_row(const tg_layer *L, const int64_t *const *mats, int64_t E, const float *mix,
                   const float *x, float *out) {
    int64_t I = 0;
    for (int64_t e = 0; e < E; e++)
        if (mats[2 * e + 1][1] > I) I = mats[2 * e + 1][1];
    const int64_t H = L->hidden, widest = H > I ? H : I;
    float *buf = malloc(sizeof(float) * (3 * I + H + widest / 4 + widest / 16) + 2 * widest + 64);
    if (buf == NULL) return 2;
    float *gu = buf, *act = gu + 2 * I, *y = act + I;
    act_buffers a = {.s4 = y + H};
    a.sum = a.s4 + widest / 4;
    a.q = (int8_t *)(a.sum + widest / 16);
    a.low = a.q + widest;
    int err = 0;
    memset(out, 0, sizeof(float) * H);
    for (int64_t e = 0; e < E; e++) {
        if ((err = product(L, mats[2 * e], x, 1, gu, NULL, &a))) break;
        tg_glu(gu, 1, mats[2 * e + 1][1], L->gelu, act, 0);
        if ((err = product(L, mats[2 * e + 1], act, 1, y, NULL, &a))) break;
        for (int64_t i = 0; i < H; i++) {
            out[i] += mix[e] * y[i];
        }
    }
    free(buf);
    return err;
}

/* DeepSeek's routing of rows x (N, H) over E experts (moe.py's route, for a float32 router
 * W (E, H)): scores are the softmax (scoring 0) or the sigmoid (1) of the router's logits;
 * choice = scores + bias (bias: NULL or E values, added only to choose); with groups
 * (method 1: a group scores its best expert, DeepSeek-V2; 2: the sum of its best two, V3)
 * only the topk_groups best groups' experts can be chosen (the others' choice is 0, V2, or
 * -inf, V3); the k best are chosen, best first (the lower id first among equals), weighed
 * by their scores (by their choice where there is no bias), over their sum where norm is
 * set, times scale. ids (N, k), weights (N, k). At batch 1 this replaces a dozen small
 * tensor operations per layer, and the router's product runs on every thread. Returns 2
 * when out of memory. */
int tg_route(const float *x, int64_t N, int64_t H, const float *W, int64_t E, const float *bias,
             int scoring, int method, int64_t groups, int64_t topk_groups, int64_t k, int norm,
             float scale, int64_t *ids, float *weights) {
    float *logits = malloc(sizeof(float) * N * (2 * E + groups) + E + groups);
    if (logits == NULL) return 2;
    uint8_t *taken = (uint8_t *)(logits + N * (2 * E + groups)), *kept = taken + E;
    _Pragma("omp parallel for schedule(static) collapse(2) if (N * E * H > 65536)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < E; e++) {
            const float *xr = x + n * H, *wr = W + e * H;
            float s = 0.0f;
            _Pragma("omp simd reduction(+:s)")
            for (int64_t i = 0; i < H; i++) s += xr[i] * wr[i];
            logits[n * E + e] = s;
        }
    for (int64_t n = 0; n < N; n++) {
        float *score = logits + n * E, *choice = logits + N * E + n * E;
        float *group = logits + 2 * N * E + n * groups;
        if (scoring == 1) {
            for (int64_t e = 0; e < E; e++) score[e] = 1.0f / (1.0f + expf(-score[e]));
        } else {
            float top = score[0], sum = 0.0f;
            for (int64_t e = 1; e < E; e++) top = score[e] > top ? score[e] : top;
            for (int64_t e = 0; e < E; e++) sum += score[e] = expf(score[e] - top);
            for (int64_t e = 0; e < E; e++) score[e] /= sum;
        }
        for (int64_t e = 0; e < E; e++) choice[e] = bias ? score[e] + bias[e] : score[e];
        if (method) {
            const int64_t per = E / groups;
            for (int64_t g = 0; g < groups; g++) {  /* its best, or its best two's sum */
                float a = -INFINITY, b = -INFINITY;
                for (int64_t e = g * per; e < (g + 1) * per; e++) {
                    const float v = choice[e];
                    if (v > a) b = a, a = v;
                    else if (v > b) b = v;
                }
                group[g] = method == 1 ? a : a + b;
                kept[g] = 0;
            }
            for (int64_t j = 0; j < topk_groups; j++) {
                int64_t best = -1;
                for (int64_t g = 0; g < groups; g++)
                    if (!kept[g] && (best < 0 || group[g] > group[best])) best = g;
                kept[best] = 1;
            }
            for (int64_t g = 0; g < groups; g++)
                if (!kept[g])
                    for (int64_t e = g * per; e < (g + 1) * per; e++)
                        choice[e] = method == 1 ? 0.0f : -INFINITY;
        }
        memset(taken, 0, E);
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) {  /* the k best, best first */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
            taken[best] = 1;
            ids[n * k + j] = best;
            weights[n * k + j] = bias ? score[best] : choice[best];
            total += weights[n * k + j];
        }
        for (int64_t j = 0; j < k; j++)
            weights[n * k + j] = (norm ? weights[n * k + j] / total : weights[n * k + j]) * scale;
    }
    free(logits);
    return 0;
}

/* y (G, m, n) = each head g's block of w (n rows of k, ``stride`` bytes apart) times x[g]
 * (m, k): as kernels.grouped_linear computes it. */
static int grouped(const tg_mla *L, int type, const uint8_t *w, int64_t stride, int64_t G,
                   int64_t n, int64_t k, const float *x, int64_t m, float *y, act_buffers *a) {
    if (L->qa) {
        tg_quantize_act(x, G * m, k, L->qa, a->q, L->wide ? a->low : NULL, a->s4, a->sum);
        return tg_qmatmul_grouped(type, w, G, n, k, stride, a->q, L->wide ? a->low : NULL,
                                  a->s4, a->sum, L->qa, m, y) ? 1 : 0;
    }
    for (int64_t g = 0; g < G; g++)
        if (tg_matmul(type, w + g * stride, n, k, x + g * m * k, m, y + g * m * n, n)) return 1;
    return 0;
}

/* DeepSeek's multi-head latent attention (models/deepseek_v2.py, absorbed) for a decode step,
 * packed matrices, one new token per row. The half of DeepSeek's layer before its MoE, which
 * as a layer of torch operations and kernel calls spends more time in dispatch than in
 * its products at batch 1:
 *   x = norm(h); [q_a | c_kv | k_pe] = x Wqkv_a; q = norm_q(q_a) Wq_b (without q_rank: q_a);
 *   per head: q = [q_nope | q_pe]; row = [norm_kv(c_kv) | rope(k_pe)] into the cache;
 *   q_lat = k_b_head q_nope; o_lat = attention([q_lat | rope(q_pe)], rows) (values: the
 *   rows' first kv_rank numbers); o = v_b_head o_lat; h += [o per head] Wo
 * with RoPE pairs adjacent (DeepSeek's rope_interleave), k_b (heads * kv_rank, nope) and v_b
 * (heads * v_dim, kv_rank) llama.cpp's per-head blocks.
 *
 * h (B, hidden) advances through the attention in place; cos, sin (B, rope): this token's
 * rotation per row (halves equal); the cache's row of batch row b, slot s at cache + b cs[0]
 * + s cs[2] (numbers; float32, or float16 where kv16 is set), the new token's at `slot`;
 * attention reads slots [0, S) where mask (B, S) allows. Returns as tg_decode_layer. */
int tg_mla_attention(const tg_mla *L, float *h, int64_t B, const float *cos, const float *sin,
                     void *cache, const int64_t *cs, int64_t slot, int64_t S,
                     const uint8_t *mask, int kv16) {
    const int64_t H = L->hidden, NH = L->heads, R = L->kv_rank, P = L->rope, QK = L->nope + P;
    const int64_t QO = L->q_rank ? L->q_rank : NH * QK, A = QO + R + P, D = R + P;
    const int64_t V = L->v_dim, NV = NH * V;
    int64_t widest = H > QO ? H : QO;
    if (NV > widest) widest = NV;
    if (D > widest) widest = D;
    if (L->nope > widest) widest = L->nope;
    const int64_t rows = B * NH;  /* the grouped products' activation rows */
    const int64_t X = H > L->q_rank ? H : L->q_rank;  /* x: norm(h), then norm_q(q_a) */
    const int64_t floats = B * (X + A + NH * QK + NV + H + D)
                           + rows * (L->nope + 2 * D + 2 * R + V) + rows * widest / 4
                           + rows * widest / 16;
    float *buf = malloc(sizeof(float) * floats + 2 * rows * widest + 64);
    if (buf == NULL) return 2;
    float *x = buf, *a = x + B * X, *q = a + B * A, *ov = q + B * NH * QK, *y = ov + B * NV;
    float *row = y + B * H, *xn = row + B * D, *qa = xn + rows * L->nope, *lat = qa + rows * D,
          *ol = lat + rows * R, *og = ol + rows * D, *vo = og + rows * R;
    act_buffers ab = {.s4 = vo + rows * V};
    ab.sum = ab.s4 + rows * widest / 4;
    ab.q = (int8_t *)(ab.sum + rows * widest / 16);
    ab.low = ab.q + rows * widest;
    const tg_layer prod = {.hidden = H, .qa = L->qa, .wide = L->wide};
    int err = 0;

    tg_rms_norm(h, L->attn_norm, 0.0f, B, H, L->eps, x);
    if ((err = product(&prod, L->qkv_a, x, B, a, NULL, &ab))) goto done;
    const float *qsrc = a;
    int64_t qstride = A;
    if (L->q_rank) {
        for (int64_t b = 0; b < B; b++)  /* norm_q(q_a) into x, then q_b */
            tg_rms_norm(a + b * A, L->q_norm, 0.0f, 1, L->q_rank, L->eps, x + b * L->q_rank);
        if ((err = product(&prod, L->q_b, x, B, q, NULL, &ab))) goto done;
        qsrc = q, qstride = NH * QK;
    }
    /* the new row: [norm_kv(c_kv) | rope(k_pe)], into the cache at slot */
    for (int64_t b = 0; b < B; b++)
        tg_rms_norm(a + b * A + QO, L->kv_norm, 0.0f, 1, R, L->eps, row + b * D);
    const int64_t kstrides[3] = {A, 0, 0}, qstrides[3] = {qstride, QK, 0};
    float *kpe = og;  /* (B, P) scratch */
    tg_rope(a + QO + R, kstrides, B, 1, 1, P, P, cos, sin, 1, kpe);
    for (int64_t b = 0; b < B; b++) {
        memcpy(row + b * D + R, kpe + b * P, sizeof(float) * P);
        put_kv(kv16, cache, b * cs[0] + slot * cs[2], row + b * D, D);
    }
    /* queries (B, NH, D): [k_b q_nope | rope(q_pe)] */
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < NH; g++)
            memcpy(xn + (g * B + b) * L->nope, qsrc + b * qstride + g * QK,
                   sizeof(float) * L->nope);
    if ((err = grouped(L, L->kb_type, L->k_b, L->kb_stride, NH, R, L->nope, xn, B, lat, &ab)))
        goto done;
    tg_rope(qsrc + L->nope, qstrides, B, NH, 1, P, P, cos, sin, 1, ol);  /* (B, NH, P) scratch */
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < NH; g++) {
            memcpy(qa + (b * NH + g) * D, lat + (g * B + b) * R, sizeof(float) * R);
            memcpy(qa + (b * NH + g) * D + R, ol + (b * NH + g) * P, sizeof(float) * P);
        }
    if (tg_decode_attention(qa, cache, cache, mask, B, NH, 1, S, D, R, cs, cs, L->scale, kv16, 1,
                            ol)) {
        err = 2;
        goto done;
    }
    for (int64_t b = 0; b < B; b++)  /* (B, NH, R) to (NH, B, R) */
        for (int64_t g = 0; g < NH; g++)
            memcpy(og + (g * B + b) * R, ol + (b * NH + g) * R, sizeof(float) * R);
    if ((err = grouped(L, L->vb_type, L->v_b, L->vb_stride, NH, V, R, og, B, vo, &ab)))
        goto done;
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < NH; g++)
            memcpy(ov + b * NV + g * V, vo + (g * B + b) * V, sizeof(float) * V);
    if ((err = product(&prod, L->o, ov, B, y, NULL, &ab))) goto done;
    for (int64_t i = 0; i < B * H; i++) h[i] += y[i];
done:
    free(buf);
    return err;
}

/* One token's mixture of experts in one call, where its experts are at hand: x (hidden)
 * routed as tg_route does (ids, weights: k each); then, if table (two matrices per expert:
 * gate_up, down; NULL: not in memory) holds every chosen expert, out = the chosen experts in
 * ascending id order, then the shared expert (shared: its two matrices, or NULL) weighed by
 * shared_mix, as tg_experts_row sums them; returns 0. Returns 3 where a chosen expert is not
 * in the table (ids and weights are written: the caller brings it and runs the experts),
 * else as tg_experts_row. At batch 1 this is most of a MoE layer without a return to Python
 * between the routing and the experts. */
int tg_moe_row(const tg_layer *L, const tg_router *R, const float *x,
               const int64_t *const *table, const int64_t *const *shared, float shared_mix,
               int64_t *ids, float *weights, float *out) {
    int err = tg_route(x, 1, R->hidden, R->W, R->experts, R->bias, R->scoring, R->method,
                       R->groups, R->topk_groups, R->k, R->norm, R->scale, ids, weights);
    if (err) return err;
    const int64_t k = R->k;
    const int64_t *mats[2 * k + 2];
    float mix[k + 1];
    int64_t order[k];
    for (int64_t j = 0; j < k; j++) {  /* by ascending id (the ids are distinct) */
        int64_t i = j;
        for (; i > 0 && ids[order[i - 1]] > ids[j]; i--) order[i] = order[i - 1];
        order[i] = j;
    }
    for (int64_t j = 0; j < k; j++) {
        const int64_t e = ids[order[j]];
        if (table[2 * e] == NULL || table[2 * e + 1] == NULL) return 3;
        mats[2 * j] = table[2 * e], mats[2 * j + 1] = table[2 * e + 1];
        mix[j] = weights[order[j]];
    }
    int64_t n = k;
    if (shared) mats[2 * n] = shared[0], mats[2 * n + 1] = shared[1], mix[n++] = shared_mix;
    return tg_experts_row(L, mats, n, mix, x, out);
}
