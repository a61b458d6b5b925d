/* The C kernels' interface: every function the library exports, and the structures they
 * take. Declared here once: each .c file includes this header, so the compiler holds the
 * definitions to these prototypes, and tiergen/kernels/__init__.py reads the prototypes to
 * give ctypes its argument and return types (tests/test_kernels_interface.py checks both
 * ends). Each function is described where it is defined.
 *
 * Kept to what that reader parses: one prototype per declaration, ending in ");", the
 * types built of the names below, pointers, const, void, int, float, int8_t .. int64_t and
 * uint8_t .. uint16_t; structures with one type per line of fields.
 */
#ifndef TG_TIERGEN_H
#define TG_TIERGEN_H

#include <stdint.h>

/* A packed matrix (n rows of k values): {n, k, parts, then (ggml type, rows, address, kept
 * tiles' address or 0: tg_build_tiles) for each part, its rows in order}. */
typedef const int64_t *tg_matrix;

/* A decode layer (layer.c; kernels/layer.py's _Layer). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t rotary;      /* the rotated numbers of a head (partial rotary: fewer than head_dim) */
    float eps, shift, q_scale;
    int32_t gelu;        /* the MLP's activation: 0 SiLU, 1 GELU (tanh) */
    int32_t qa, wide;    /* activations: qa = 0 float32, else int8 scale groups of qa (wide: 16-bit) */
    int32_t pairs;       /* rotary pairs adjacent (tg_rope) */
    const float *attn_norm, *q_norm, *k_norm, *attn_out_norm, *ffn_norm, *ffn_out_norm;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    tg_matrix qkv, o, gate_up, down;
} tg_layer;

/* One layer of a decode step (tg_decode_layers; kernels/layer.py's Step): tg_decode_layer's
 * arguments but h and B. strides: k's (B, KVH, S) strides, then v's. */
typedef struct {
    const tg_layer *layer;
    const float *cos, *sin;
    void *kc, *vc;
    const int64_t *strides;
    const uint8_t *mask;
    int64_t slot, slots;
    int32_t kv16;
    int64_t tokens;      /* new tokens per cache row (a speculative step's checks: 1 + k) */
} tg_step;

/* DeepSeek's latent attention (layer.c's tg_mla_attention; kernels/layer.py's _Mla). */
typedef struct {
    int64_t hidden, heads, q_rank, kv_rank, nope, rope, v_dim;
    float eps, scale;
    int32_t qa, wide;
    int32_t kb_type, vb_type;      /* GGML types of k_b and v_b */
    int64_t kb_stride, vb_stride;  /* bytes from one head's block of k_b (v_b) to the next */
    const float *attn_norm, *q_norm, *kv_norm;
    tg_matrix qkv_a, q_b, o;
    const uint8_t *k_b, *v_b;
} tg_mla;

/* A router (tg_route's arguments, for tg_moe_row; kernels/layer.py's _Router). */
typedef struct {
    int64_t hidden, experts, groups, topk_groups, k;
    int32_t scoring, method, norm;
    float scale;
    const float *W, *bias;
} tg_router;

/* packed.c: float products on packed blocks */
int tg_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
              float *y, int64_t ldy);
int tg_dequant(int type, const uint8_t *w, int64_t nblocks, float *out);
int tg_amx_linear(int type, const uint8_t *w, int64_t n, int64_t k, const uint16_t *x,
                  int64_t m, float *y, int64_t ldy);
int tg_amx_glu(int gate_type, const uint8_t *gate, int up_type, const uint8_t *up, int64_t n,
               int64_t k, const uint16_t *x, int64_t m, int gelu, uint16_t *h);

/* amx.c: bfloat16 products on AMX tiles (for tg_amx_linear) */
int tg_amx_bf16(void);
/* y (m rows, row stride ldy; float32, or bfloat16 where bf16) = x (m, k) @ W (n, k)^T + bias
 * (n float32 values, or NULL), x and W bfloat16, W row-major as stored; k a multiple of 32.
 * -1: no AMX in this build or k; -2: out of memory. */
int tg_amx_dense(const uint16_t *w, int64_t n, int64_t k, const uint16_t *x, int64_t m,
                 const float *bias, void *y, int64_t ldy, int bf16);
/* Causal attention of T queries (B, H, T, D) over S keys and values (B, KVH, S, D), the last T
 * of which are the queries' own (query t at place p = S-T+t sees keys 0..p, or p-window+1..p
 * where window > 0), scores scaled by `scale`, on AMX tiles: out (B, H, T, D) float32.
 * Strides in elements (a row's values contiguous; K and V rows D apart, K and V alike); types
 * 0 float32, 1 float16, 2 bfloat16, rounded to bfloat16. -1: no AMX in this build, or D not a
 * multiple of 32 up to 256; -2: out of memory. */
int tg_amx_attention(const void *q, int q_type, int64_t qsb, int64_t qsh, int64_t qst,
                     const void *k, const void *v, int kv_type, int64_t kvsb, int64_t kvsh,
                     int64_t B, int64_t H, int64_t KVH, int64_t T, int64_t S, int64_t D,
                     int64_t window, float scale, float *out, int64_t osb, int64_t osh,
                     int64_t ost);
/* dst (rows, n) = src's rows (float32, or float16 where f16; row stride `stride` values)
 * rounded to bfloat16 as torch rounds */
void tg_bf16(const void *src, int f16, int64_t rows, int64_t n, int64_t stride, uint16_t *dst);

/* int8.c: integer products on packed blocks */
void tg_quantize_act(const float *x, int64_t m, int64_t k, int qa, int8_t *xq, int8_t *xl,
                     float *xs4, float *xsum);
int tg_qmatmul(const int64_t *w, const int8_t *xq, const int8_t *xl, const float *xs4,
               const float *xsum, int qa, int64_t m, float *y);
int tg_qmatmul_grouped(int type, const uint8_t *w, int64_t groups, int64_t n, int64_t k,
                       int64_t stride, const int8_t *xq, const int8_t *xl, const float *xs4,
                       const float *xsum, int qa, int64_t m, float *y);
int64_t tg_tile_bytes(int64_t n, int64_t k);
int tg_build_tiles(const int64_t *w, uint8_t *out);
int tg_takes_tiles(int type, int64_t k, int64_t m, int qa, int wide);
int tg_reads_tiles(int type, int64_t k, int64_t m, int qa, int wide);
int tg_tile_view(int type, const uint8_t *w, int64_t nb, uint8_t *q, float *a16, float *c16,
                 int *is_signed);
int tg_int8_isa(void);
void tg_set_batch_invariant(int on);

/* decode.c: a decode step's small operations */
void tg_rms_norm(const float *x, const float *w, float shift, int64_t m, int64_t n, float eps,
                 float *out);
void tg_rope(const float *x, const int64_t *xs, int64_t B, int64_t H, int64_t T, int64_t D,
             int64_t rotary, const float *cos, const float *sin, int pairs, float *out);
int tg_decode_attention(const float *q, const void *k, const void *v, const uint8_t *mask,
                        int64_t B, int64_t H, int64_t KVH, int64_t S, int64_t D, int64_t Dv,
                        const int64_t *ks, const int64_t *vs, float scale, int kv, int64_t T,
                        float *out);
void tg_delta_step(float *S, const int64_t *ss, const float *q, const float *k, const float *v,
                   const float *g, int64_t gw, const float *beta, int64_t B, int64_t H,
                   int64_t dk, int64_t dv, float *out);
void tg_to_half(const float *x, int64_t n, uint16_t *out);
void tg_argmax(const float *x, int64_t rows, int64_t n, int64_t *out);
void tg_glu(const float *gu, int64_t rows, int64_t I, int gelu, void *out, int bf16);
/* One row of tg_glu: gate and up I values each (amx.c's prompt MLP calls it too). */
void tg_glu_row(const float *gate, const float *up, int64_t I, int gelu, void *out, int bf16);

/* layer.c: a whole layer, or most of one, in one call */
int tg_decode_layer(const tg_layer *L, float *h, int64_t B, const float *cos, const float *sin,
                    void *kc, void *vc, const int64_t *ks, const int64_t *vs, int64_t slot,
                    int64_t S, const uint8_t *mask, int kv16, int64_t T);
int tg_decode_layers(const tg_step *steps, int64_t n, float *h, int64_t B);
int tg_experts_row(const tg_layer *L, const int64_t *const *mats, int64_t E, const float *mix,
                   const float *x, float *out);
int tg_route(const float *x, int64_t N, int64_t H, const float *W, int64_t E, const float *bias,
             int scoring, int method, int64_t groups, int64_t topk_groups, int64_t k, int norm,
             float scale, int64_t *ids, float *weights);
int tg_mla_attention(const tg_mla *L, float *h, int64_t B, const float *cos, const float *sin,
                     void *cache, const int64_t *cs, int64_t slot, int64_t S,
                     const uint8_t *mask, int kv16);
int tg_moe_row(const tg_layer *L, const tg_router *R, const float *x,
               const int64_t *const *table, const int64_t *const *shared, float shared_mix,
               int64_t *ids, float *weights, float *out);

#endif
