/* The portable C of int8.c (included by it, once, where there is no AVX2): the integer
 * products as plain loops that the compiler vectorises as it can, and nothing that takes
 * the blocks into registers. int8.c lists what each instruction set's header defines. */

#define TILE512 0
#define TR 8      /* weight rows per interleaved tile */
#define MI 4      /* activation rows per pass over a tile */
#define INT8_ISA 0

/* No quantiser of 8-bit activations here: tg_quantize_act's loop does them. */
static inline int quantize_blocks(const float *x, int64_t blocks, int qa, int8_t *xq, float *xs4,
                                  float *xsum) {
    (void)x, (void)blocks, (void)qa, (void)xq, (void)xs4, (void)xsum;
    return 0;
}

#define ACC_T float
#define ACC_ZERO 0.0f
#define ACC_SUM(x) (x)

/* block_dot's products of values j .. j + 31, four at a time. */
static inline __attribute__((always_inline)) void
dot32(const int ROWS, const int SIGNED, const int WIDE, const int L, int j,
      const int8_t *restrict q, const float *restrict a, const int8_t *restrict xq,
      const int8_t *restrict xl, const float *restrict xs4, int64_t k, float *restrict acc) {
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
}

/* No panel by vectors here: make_panels' loop makes them all. */
static inline int panel_vectors(int64_t p, int64_t m, int64_t k, const int8_t *xq, const int8_t *xl,
                                const float *xs4, Panels *P) {
    (void)p, (void)m, (void)k, (void)xq, (void)xl, (void)xs4, (void)P;
    return 0;
}

/* A tile's products, one output at a time, with the 8-bit tiles' arithmetic (sums started at
 * MAGIC_BITS and read as floats) done as they do it. */
static inline __attribute__((always_inline)) void
tile_rows(TILE_ROWS_PARAMS) {
    (void)NR;
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
}

/* No kernel here takes the blocks into registers. */
static int in_registers(int type, int64_t k, int64_t m, const int8_t *xl) {
    (void)type, (void)k, (void)m, (void)xl;
    return 0;
}

static void few_in_registers(int type, const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
                             const float *xs4, const float *xsum, int64_t m, float *y,
                             int64_t ldy) {
    (void)type, (void)w, (void)n, (void)k, (void)xq, (void)xs4, (void)xsum, (void)m, (void)y,
        (void)ldy;
}
