/* A GPT-2 block's step of one new token a row in one call (native_block.py calls it), for an int8 view on our
 * kernels or a bf16 view on ours: layer norm, the query-key-value product (int8_linear.c or bf16_linear.c), the new
 * key and value written to the cache and the attention over it (one_token_attention.c), the output product added to
 * the residual, layer norm, the MLP's products with GPT-2's GELU, added to the residual.  The same kernels a step
 * calls one by one from Python, so the same bits: one call into C a block in place of a dozen, and none of the
 * Python between them; a step's blocks one after the other in one call (lowmem_gpt2_blocks_step).
 *
 * The layer norm is this file's (lowmem_layer_norm, which the stepping decoder calls for such a view's norms
 * outside this call too, so that a row's bits are the same whichever way its step goes): per row, the mean and the
 * mean square deviation from it summed in double (16 lanes, then across), 1/sqrt(variance + eps) in float, then
 * ((x - mean) * rstd) * weight + bias, each operation rounded alone (AVX2: the library needs it anyway); a bf16
 * view's the same over its values widened, rounded to bf16 once.  Not torch's bits (its sums are in float, in a
 * vectorized order of its own): as near the exact norm, or nearer.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "lowmem_kernels.h"
#include "native_math.h"

/* 4 values of a row from place i, as floats: the row's floats, or its bf16 widened exactly */
__attribute__((target("avx2"))) static inline __m128 four(const void *row, int i, int bf16) {
    if (!bf16) return _mm_loadu_ps((const float *)row + i);
    __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)row + i));
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

/* the same for 8 values */
__attribute__((target("avx2"))) static inline __m256 eight(const void *row, int i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float one(const void *row, int i, int bf16) {
    return bf16 ? float_of(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* The sum of f(row[i]) over i < n in double: 16 lanes of partial sums, then across them in a fixed order (the same
 * bits for a row wherever it is); f: the value itself, or (where `centre` is given) its square deviation from it. */
__attribute__((target("avx2"))) static double lanes_sum(const void *row, int bf16, int n, const float *centre) {
    __m256d lanes[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    const __m256d by = _mm256_set1_pd(centre ? (double)*centre : 0.0);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 4; j++) {
            __m256d v = _mm256_cvtps_pd(four(row, i + 4 * j, bf16));
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
        double v = centre ? (double)one(row, i, bf16) - (double)*centre : (double)one(row, i, bf16);
        sum += centre ? v * v : v;
    }
    return sum;
}

/* y (rows x n) = the layer norm of each row of x (module comment), the rows on `threads` threads where there are
 * several (a row's bits its own); y may be x.  bf16: x, weight, bias and y in bf16 (a bf16 view's norms: read
 * widened, computed as for floats, y rounded to bf16 once), else floats. */
__attribute__((target("avx2"))) void lowmem_layer_norm(const void *x, int bf16, int rows, int n, const void *weight,
                                                       const void *bias, float eps, void *y, int threads) {
    const long size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) {
        const char *row = (const char *)x + (long)r * n * size;
        char *out = (char *)y + (long)r * n * size;
        const float mean = (float)(lanes_sum(row, bf16, n, 0) / n);
        const float rstd = 1.f / sqrtf((float)(lanes_sum(row, bf16, n, &mean) / n) + eps);
        const __m256 m = _mm256_set1_ps(mean), s = _mm256_set1_ps(rstd);
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_sub_ps(eight(row, i, bf16), m), s);
            v = _mm256_add_ps(_mm256_mul_ps(v, eight(weight, i, bf16)), eight(bias, i, bf16));
            if (bf16)
                _mm_storeu_si128((__m128i *)((uint16_t *)out + i), bf16_of8(v));
            else
                _mm256_storeu_ps((float *)out + i, v);
        }
        for (; i < n; i++) {
            float v = ((one(row, i, bf16) - mean) * rstd) * one(weight, i, bf16) + one(bias, i, bf16);
            if (bf16)
                ((uint16_t *)out)[i] = bf16_bits(v);
            else
                ((float *)out)[i] = v;
        }
    }
}

/* y (n bf16) = x (n floats) rounded (native_math.h's rule) */
__attribute__((target("avx2"))) static void bf16_rounded(const float *x, long n, uint16_t *y) {
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(y + i), bf16_of8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = bf16_bits(x[i]);
}

/* y (rows x p's n) = x (rows x p's k) by projection p, then GPT-2's GELU where `gelu`, then plus `residual` (NULL:
 * none; it may be y), on p's kernel: the residual stream's type (the block's bf16) */
static int product(const lowmem_gpt2_block *b, const lowmem_product *p, int path, const void *x, int rows, int gelu,
                   const void *residual, void *y, int threads) {
    if (b->bf16) {
        lowmem_bf16_linear(x, rows, p->k, p->k, p->weights, p->n, p->bias, gelu, residual, y, threads);
        return 0;
    }
    return lowmem_int8_linear(path, x, rows, p->k, p->kp, p->weights, p->zero_sums, p->n, p->scale, p->bias, gelu,
                              b->inverse, b->zero, y, threads, residual);
}

/* x (rows x width, the block's type: the residual stream) = the block's output for each row's one new token, in
 * place; its key and value written at place width_places - 1 of keys and values (one_token_attention.c's layout and
 * strides) and attended over each row's last places[r].  scratch: rows x (width + qkv's n + fc's n) floats (a
 * bf16 block uses half).
 * Returns 0, or an error of the kernels called (-1: no scratch memory; -2: places out of the cache). */
static int gpt2_block_step(const lowmem_gpt2_block *b, void *x, int rows, void *keys, void *values, int kv_bf16,
                           long c_row, long c_head, long c_place, int width_places, const int32_t *places,
                           float *scratch, int path, int threads) {
    const int width = b->qkv.k;
    const long size = b->bf16 ? 2 : 4;
    /* the norms' output (then, int8, the attention's), the query-key-value and the MLP's inner activations, in the
     * block's type; a bf16 block's attention output (floats) where the MLP's go later, then rounded into the first */
    char *start = (char *)scratch;
    void *h = start, *qkv = start + rows * width * size, *f = start + rows * (width + b->qkv.n) * size;
    float *attended = b->bf16 ? f : h;
    int done;
    lowmem_layer_norm(x, b->bf16, rows, width, b->norm1_weight, b->norm1_bias, b->norm1_eps, h, threads);
    if ((done = product(b, &b->qkv, path, h, rows, 0, 0, qkv, threads))) return done;
    done = lowmem_one_token_attention(qkv, b->bf16, b->qkv.n, b->hs, keys, values, kv_bf16, c_row, c_head, c_place,
                                      rows, b->heads, b->hs, places, width_places, 0, b->scale, attended, threads,
                                      (char *)qkv + width * size, (char *)qkv + 2 * width * size);
    if (done) return done;
    if (b->bf16) bf16_rounded(attended, (long)rows * width, h);
    if ((done = product(b, &b->out, path, h, rows, 0, x, x, threads))) return done;
    lowmem_layer_norm(x, b->bf16, rows, width, b->norm2_weight, b->norm2_bias, b->norm2_eps, h, threads);
    if ((done = product(b, &b->fc, path, h, rows, 1, 0, f, threads))) return done;
    return product(b, &b->proj, path, f, rows, 0, x, x, threads);
}

/* Every block of a step in turn (`count`; gpt2_block_step's arguments, block i's cache at keys[i], values[i],
 * its strides strides[3i..3i+2], its places' width widths[i]): one call a step, none of the Python between blocks
 * (~0.1 ms of a 355M token: HISTORY.md, twenty-sixth session).  Returns 0, or the first block's error. */
int lowmem_gpt2_blocks_step(const lowmem_gpt2_block *const *blocks, int count, void *x, int rows, void *const *keys,
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

/* The layout of the structs Python fills (tests/test_native_boundary.py checks native_block.py's against it): into
 * out, lowmem_product's size and its fields' offsets in their order, then lowmem_gpt2_block's the same.  Returns the
 * count, or -1 where `room` is short. */
int lowmem_layout(long *out, int room) {
    const long layout[] = {
        sizeof(lowmem_product), offsetof(lowmem_product, weights), offsetof(lowmem_product, zero_sums),
        offsetof(lowmem_product, n), offsetof(lowmem_product, k), offsetof(lowmem_product, kp),
        offsetof(lowmem_product, scale), offsetof(lowmem_product, bias),
        sizeof(lowmem_gpt2_block), offsetof(lowmem_gpt2_block, norm1_weight), offsetof(lowmem_gpt2_block, norm1_bias),
        offsetof(lowmem_gpt2_block, norm2_weight), offsetof(lowmem_gpt2_block, norm2_bias),
        offsetof(lowmem_gpt2_block, norm1_eps), offsetof(lowmem_gpt2_block, norm2_eps),
        offsetof(lowmem_gpt2_block, qkv), offsetof(lowmem_gpt2_block, out), offsetof(lowmem_gpt2_block, fc),
        offsetof(lowmem_gpt2_block, proj), offsetof(lowmem_gpt2_block, heads), offsetof(lowmem_gpt2_block, hs),
        offsetof(lowmem_gpt2_block, scale), offsetof(lowmem_gpt2_block, inverse), offsetof(lowmem_gpt2_block, zero),
        offsetof(lowmem_gpt2_block, bf16)};
    const int count = sizeof(layout) / sizeof(layout[0]);
    if (room < count) return -1;
    for (int i = 0; i < count; i++) out[i] = layout[i];
    return count;
}
