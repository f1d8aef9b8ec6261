/* The boundary between lowmem_aitextgen's kernels and Python: every function the library exports and every struct
 * Python fills, declared once.  Every C file includes it, so a definition that strays from its declaration does not
 * compile; each Python wrapper declares the ctypes signature of the functions it calls beside it (SIGNATURES in
 * native_int8.py, native_attention.py, native_block.py, native_bf16.py, native_top_k.py), and
 * tests/test_native_boundary.py reads this file to check every one, and lowmem_layout to check the structs. */
#ifndef LOWMEM_KERNELS_H
#define LOWMEM_KERNELS_H

#include <stdint.h>

/* one projection of a block as its kernel takes it (native_block._Product): int8_linear.c's (native_int8.Packed's
 * fields, its bias in fp32) or bf16_linear.c's (native_bf16.Packed's weights, n, k; its bias in bf16; no zero_sums,
 * scale) */
typedef struct {
    const void *weights;
    const int32_t *zero_sums;
    int n, k, kp;
    float scale;
    const void *bias;
} lowmem_product;

/* a block's parts, read once (native_block._Block); bf16: a bf16 view's (its norms' weights, the
 * projections and the residual stream in bf16), else an int8 view's (fp32 norms and residual stream) */
typedef struct {
    const void *norm1_weight, *norm1_bias, *norm2_weight, *norm2_bias;
    float norm1_eps, norm2_eps;
    lowmem_product qkv, out, fc, proj;
    int heads, hs;
    float scale;         /* the attention scores' */
    float inverse, zero; /* the activations' quantization (int8_kernels.TOKEN_INVERSE, TOKEN_ZERO) */
    int bf16;
} lowmem_gpt2_block;

/* int8_linear.c (native_int8.py) */
int lowmem_int8_linear(int path, const float *x, int m, int k, int kp, const int8_t *w, const int32_t *zero_sums,
                       int n, float scale, const float *bias, int gelu, float inverse, float zero, float *y,
                       int threads, const float *residual);
int lowmem_amx_request(void);

/* one_token_attention.c (native_attention.py) */
int lowmem_one_token_attention(const void *q, int q_bf16, long q_row, long q_head, const void *k, const void *v,
                               int kv_bf16, long c_row, long c_head, long c_place, int rows, int heads, int hs,
                               const int32_t *places, int width, int window, float scale, float *out, int threads,
                               const void *new_k, const void *new_v);

/* bf16_linear.c (native_bf16.py) */
void lowmem_bf16_linear(const uint16_t *x, int m, int k, long lda, const uint16_t *w, int n, const uint16_t *bias,
                        int gelu, const uint16_t *residual, uint16_t *y, int threads);

/* gpt2_block.c (native_block.py) */
void lowmem_layer_norm(const void *x, int bf16, int rows, int n, const void *weight, const void *bias, float eps,
                       void *y, int threads);
int lowmem_gpt2_blocks_step(const lowmem_gpt2_block *const *blocks, int count, void *x, int rows, void *const *keys,
                            void *const *values, int kv_bf16, const long *strides, const int *widths,
                            const int32_t *places, float *scratch, int path, int threads);
int lowmem_layout(long *out, int room);

/* top_k.c (native_top_k.py) */
int lowmem_top_k(const float *x, long stride, int rows, int n, int k, float *values, int64_t *ids, int threads);
int lowmem_top_k_draw(const float *x, long stride, int rows, int n, int k, const int64_t *barred, int nb,
                      const float *temperatures, const double *uniforms, int64_t *tokens, int threads);
int lowmem_mass_cut(const float *key, int descending, const float *weight, long stride, int rows, int n,
                    const double *masses, float *cuts, float *afters, int threads);

#endif
