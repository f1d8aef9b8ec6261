/* A GPT-2 block's step of one new token a row in one call (native_block.py calls it), for an int8 view on our
 * kernels: layer norm, the query-key-value product (int8_linear.c), the new key and value written to the cache and
 * the attention over it (one_token_attention.c), the output product added to the residual, layer norm, the MLP's
 * products with GPT-2's GELU, added to the residual.  The same kernels a step calls one by one from Python, so the
 * same bits: one call into C a block in place of a dozen, and none of the Python between them; a step's blocks one
 * after the other in one call (lowmem_gpt2_blocks_step).
 *
 * The layer norm is this file's (lowmem_layer_norm, which the stepping decoder calls for such a view's norms
 * outside this call too, so that a row's bits are the same whichever way its step goes): per row, the mean and the
 * mean square deviation from it summed in double (16 lanes, then across), 1/sqrt(variance + eps) in float, then
 * ((x - mean) * rstd) * weight + bias, each operation rounded alone (AVX2: the library needs it anyway).  Not
 * torch's bits (its sums are in float, in a vectorized order of its own): as near the exact norm, or nearer.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

int lowmem_int8_linear(int path, const float *x, int m, int k, int kp, const int8_t *w, const int32_t *zero_sums,
                       int n, float scale, const float *bias, int gelu, float inverse, float zero, float *y,
                       int threads, const float *residual);
int lowmem_one_token_attention(const void *q, int q_bf16, long q_row, long q_head, const void *k, const void *v,
                               int kv_bf16, long c_row, long c_head, long c_place, int rows, int heads, int hs,
                               const int32_t *places, int width, int window, float scale, float *out, int threads,
                               const void *new_k, const void *new_v);

/* The sum of f(row[i]) over i < n in double: 16 lanes of partial sums, then across them in a fixed order (the same
 * bits for a row wherever it is); f: the value itself, or (where `centre` is given) its square deviation from it. */
__attribute__((target("avx2"))) static double lanes_sum(const float *row, int n, const float *centre) {
    __m256d lanes[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    const __m256d by = _mm256_set1_pd(centre ? (double)*centre : 0.0);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 4; j++) {
            __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(row + i + 4 * j));
            if (centre) {
                v = _mm256_sub_pd(v, by);
                v = _mm256_mul_pd(v, v);
            }
            lanes[j] = _mm256_add_pd(lanes[j], v);
        }
    double parts[16], sum = 0.0;
    for (int j = 0; j < 4; j++) _mm256_storeu_pd(parts + 4 * j, lanes[j]);
    for (int j = 0; j < 16; j++) sum += parts[j];
    for (; i < n; i++) {
        double v = centre ? (double)row[i] - (double)*centre : (double)row[i];
        sum += centre ? v * v : v;
    }
    return sum;
}

/* y (rows x n) = the layer norm of each row of x (module comment), the rows on `threads` threads where there are
 * several (a row's bits its own); y may be x */
__attribute__((target("avx2"))) void lowmem_layer_norm(const float *x, int rows, int n, const float *weight,
                                                       const float *bias, float eps, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) {
        const float *row = x + (long)r * n;
        const float mean = (float)(lanes_sum(row, n, 0) / n);
        const float rstd = 1.f / sqrtf((float)(lanes_sum(row, n, &mean) / n) + eps);
        const __m256 m = _mm256_set1_ps(mean), s = _mm256_set1_ps(rstd);
        float *out = y + (long)r * n;
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), m), s);
            v = _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(weight + i)), _mm256_loadu_ps(bias + i));
            _mm256_storeu_ps(out + i, v);
        }
        for (; i < n; i++) out[i] = ((row[i] - mean) * rstd) * weight[i] + bias[i];
    }
}

/* an int8 projection as int8_linear.c takes it (native_int8.Packed's fields and its bias) */
typedef struct {
    const int8_t *weights;
    const int32_t *zero_sums;
    int n, k, kp;
    float scale;
    const float *bias;
} lowmem_product;

/* a block's parts, read once (native_block.py makes it) */
typedef struct {
    const float *norm1_weight, *norm1_bias, *norm2_weight, *norm2_bias;
    float norm1_eps, norm2_eps;
    lowmem_product qkv, out, fc, proj;
    int heads, hs;
    float scale;            /* the attention scores' */
    float inverse, zero;    /* the activations' quantization (int8_kernels.TOKEN_INVERSE, TOKEN_ZERO) */
} lowmem_gpt2_block;

static int product(const lowmem_product *p, int path, const float *x, int rows, int gelu, float inverse, float zero,
                   const float *residual, float *y, int threads) {
    return lowmem_int8_linear(path, x, rows, p->k, p->kp, p->weights, p->zero_sums, p->n, p->scale, p->bias, gelu,
                              inverse, zero, y, threads, residual);
}

/* x (rows x width, fp32; the residual stream) = the block's output for each row's one new token, in place; its key
 * and value written at place width_places - 1 of keys and values (one_token_attention.c's layout and strides) and
 * attended over each row's last places[r].  scratch: rows x (width + qkv's n + fc's n) floats.  Returns 0, or an
 * error of the kernels called (-1: no scratch memory; -2: places out of the cache). */
static int gpt2_block_step(const lowmem_gpt2_block *b, float *x, int rows, void *keys, void *values, int kv_bf16,
                           long c_row, long c_head, long c_place, int width_places, const int32_t *places,
                           float *scratch, int path, int threads) {
    const int width = b->qkv.k;
    float *h = scratch, *qkv = h + (long)rows * width, *f = qkv + (long)rows * b->qkv.n;
    int done;
    lowmem_layer_norm(x, rows, width, b->norm1_weight, b->norm1_bias, b->norm1_eps, h, threads);
    if ((done = product(&b->qkv, path, h, rows, 0, b->inverse, b->zero, 0, qkv, threads))) return done;
    done = lowmem_one_token_attention(qkv, 0, b->qkv.n, b->hs, keys, values, kv_bf16, c_row, c_head, c_place, rows,
                                      b->heads, b->hs, places, width_places, 0, b->scale, h, threads, qkv + width,
                                      qkv + 2 * width);
    if (done) return done;
    if ((done = product(&b->out, path, h, rows, 0, b->inverse, b->zero, x, x, threads))) return done;
    lowmem_layer_norm(x, rows, width, b->norm2_weight, b->norm2_bias, b->norm2_eps, h, threads);
    if ((done = product(&b->fc, path, h, rows, 1, b->inverse, b->zero, 0, f, threads))) return done;
    return product(&b->proj, path, f, rows, 0, b->inverse, b->zero, x, x, threads);
}

/* Every block of a step in turn (`count`; gpt2_block_step's arguments, block i's cache at keys[i], values[i],
 * its strides strides[3i..3i+2], its places' width widths[i]): one call a step, none of the Python between blocks
 * (~0.1 ms of a 355M token: RESULTS.md, twenty-sixth session).  Returns 0, or the first block's error. */
int lowmem_gpt2_blocks_step(const lowmem_gpt2_block *const *blocks, int count, float *x, int rows, void *const *keys,
                            void *const *values, int kv_bf16, const long *strides, const int *widths,
                            const int32_t *places, float *scratch, int path, int threads) {
    for (int i = 0; i < count; i++) {
        const long *s = strides + 3L * i;
        int done = gpt2_block_step(blocks[i], x, rows, keys[i], values[i], kv_bf16, s[0], s[1], s[2], widths[i],
                                   places, scratch, path, threads);
        if (done) return done;
    }
    return 0;
}
