/* Intel AMX bfloat16 tiles (amx.c), for packed.c's products: the engine that multiplies a
 * packed matrix (amx_matrix). */
#ifndef TG_AMX_H
#define TG_AMX_H

#include <stdint.h>

/* Decodes one block (bytes) into its qk values. */
typedef void (*block_decoder)(const uint8_t *block, float *out);

/* One packed matrix as amx.c decodes it: its GGML type (the types of blocks.h's list amx.c
 * decodes itself), the decoder of one of its blocks (for the others), values and bytes a
 * block, and its first row's bytes (rows k / qk blocks each). */
typedef struct {
    int type;
    block_decoder decode;
    int qk, bytes;
    const uint8_t *w;
} amx_matrix;

/* y (m rows, row stride ldy) = x (m, k) bfloat16 @ W(n, k)^T; m a multiple of AMX_ROWS_STEP,
 * k of 32 and of W's blocks. */
void amx_bf16_linear(const amx_matrix *W, int64_t n, int64_t k, const uint16_t *x, int64_t m,
                     float *y, int64_t ldy);

/* h (m, n) bfloat16 = act(x @ G^T) * (x @ U^T) for x (m, k) bfloat16, as tg_glu makes it from
 * the two products that amx_bf16_linear makes (bit for bit), the products never written out;
 * m a multiple of AMX_ROWS_STEP, n of 32, k of 32 and at most one panel. -1: not taken. */
int amx_bf16_glu(const amx_matrix *gate, const amx_matrix *up, int64_t n, int64_t k,
                 const uint16_t *x, int64_t m, int gelu, uint16_t *h);

#define AMX_ROWS_STEP 32

#endif
