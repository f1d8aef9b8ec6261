/* lowmem_aitextgen's attention of one new token a row over the key-value cache (native_attention.py calls it):
 * each (row, head) computed by one thread, start to end, from its own query and places alone, so a row's output
 * is the same bits alone, beside any rows and at any number of threads, with no padding read or masked.
 *
 * For a row's query q and its n places: scores s_p = (q . k_p) x scale (each dot product summed in 16 lanes of
 * fused multiply-adds, then across them), then e_p = e^(s_p - max s) (native_math.h's exp_of), and the output
 * (sum of e_p v_p) / (sum of e_p): fp32 arithmetic throughout; a bf16 query, key or value is widened exactly.
 * Its bits are not torch's scaled_dot_product_attention's (which sums in other orders, and rounds a bf16 cache's
 * probabilities to bf16): it is as near the exact attention as torch's in fp32, to a small factor (its exponential
 * within 2 ulp; tests/test_native_attention.py).
 *
 * Where given the row's new key and value (a step's), the thread writes them first at the row's last place of the
 * cache, as torch's copy converts them (fp32 to bf16 rounded to nearest even, NaN as 0x7fc0; bf16 to fp32 exact):
 * a step's cache append and attention in one call, with the bits of the append torch would have made.
 *
 * AVX512F only: one path, where the cache's reads are the cost (a bf16 cache widened 16 lanes at a time).  In a
 * step the cache comes from memory (the weights read since pushed it out of the caches); the keys' pass asks for
 * the values it is followed by (prefetch), which made an 8-row 355M step's attention ~1.05x quicker against
 * torch's than reading them cold (HISTORY.md, twenty-third session; the keys' own prefetch ahead added nothing).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lowmem_kernels.h"
#include "native_math.h"

#define MOST_HEAD 256 /* the largest head size taken (native_attention.py checks it, and a multiple of 16) */

__attribute__((target("avx512f"))) static inline __m512 load16(const void *base, long i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i))), 16));
    return _mm512_loadu_ps((const float *)base + i);
}

/* The scores s (n) of query q (hs/16 vectors) over keys k (places `step` elements apart); returns their largest.
 * The values v of the same places are asked of memory meanwhile (the next pass reads them). */
__attribute__((target("avx512f"))) static float scores(const __m512 *q, const void *k, const void *v, int bf16,
                                                      long step, int n, int hs, float scale, float *s) {
    float most = -INFINITY;
    const long size = bf16 ? 2 : 4, bytes = (long)hs * size;
    for (int p = 0; p < n; p++) {
        for (long line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)v + p * step * size + line, _MM_HINT_T0);
        __m512 sum = _mm512_mul_ps(q[0], load16(k, p * step, bf16));
        for (int j = 1; j < hs / 16; j++) sum = _mm512_fmadd_ps(q[j], load16(k, p * step + j * 16, bf16), sum);
        float x = _mm512_reduce_add_ps(sum) * scale;
        s[p] = x;
        most = x > most ? x : most;
    }
    return most;
}

/* s_p = e^(s_p - most) in place; returns their sum (8 lanes' sums, then across them) */
__attribute__((target("avx512f"))) static float exponentials(float *s, int n, float most) {
    const __m256 by = _mm256_set1_ps(most), least = _mm256_set1_ps(-87.f);
    __m256 sum = _mm256_setzero_ps();
    int p = 0;
    for (; p + 8 <= n; p += 8) {
        __m256 e = exp_of(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + p), by), least));
        _mm256_storeu_ps(s + p, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (p < n) {
        __m256i left = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - p), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 e = exp_of(_mm256_max_ps(_mm256_sub_ps(_mm256_maskload_ps(s + p, left), by), least));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(left));
        _mm256_maskstore_ps(s + p, left, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* out (hs) = the attention of one row's query over its n places (module comment) */
__attribute__((target("avx512f"))) static void attend(const void *q, int q_bf16, const void *k, const void *v,
                                                      int kv_bf16, long step, int n, int hs, float scale,
                                                      float *out, float *s) {
    __m512 query[MOST_HEAD / 16], sum[MOST_HEAD / 16];
    for (int j = 0; j < hs / 16; j++) query[j] = load16(q, j * 16, q_bf16);
    float total = exponentials(s, n, scores(query, k, v, kv_bf16, step, n, hs, scale, s));
    for (int j = 0; j < hs / 16; j++) sum[j] = _mm512_setzero_ps();
    for (int p = 0; p < n; p++) {
        __m512 e = _mm512_set1_ps(s[p]);
        for (int j = 0; j < hs / 16; j++) sum[j] = _mm512_fmadd_ps(e, load16(v, p * step + j * 16, kv_bf16), sum[j]);
    }
    for (int j = 0; j < hs / 16; j++) _mm512_storeu_ps(out + j * 16, _mm512_div_ps(sum[j], _mm512_set1_ps(total)));
}

/* One head's new key or value (hs elements, a multiple of 16; bf16 where from_bf16) into its place of the cache
 * (bf16 where to_bf16), converted as torch's copy converts (module comment): the same dtype copied as it is. */
__attribute__((target("avx512f"))) static void write_place(const void *from, int from_bf16, void *to, int to_bf16,
                                                           int hs) {
    if (from_bf16 == to_bf16) {
        memcpy(to, from, (size_t)hs * (to_bf16 ? 2 : 4));
        return;
    }
    for (int j = 0; j < hs; j += 16) {
        __m512 v = load16(from, j, from_bf16);
        if (to_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)to + j), bf16_of(v));
        else _mm512_storeu_ps((float *)to + j, v);
    }
}

/* out (rows x heads*hs, fp32) = each row's attention over its places: the last min(places[r], window) (window 0:
 * no window) of the `width` the views k and v hold; rows of 0 places are zeros (the caller's to compute).
 * q: (rows, heads, hs) at element strides q_row, q_head; k, v: (rows, heads, width, hs) at element strides c_row,
 * c_head, c_place (hs contiguous); *_bf16: bf16, else fp32.  new_k, new_v (NULL: none): each row's new key and
 * value, in q's dtype at q's strides, written first at place width - 1 of k and v (every row's, whatever its
 * places).  Returns 0; -2, before any work, where a row's places are more than `width` or fewer than 0 (or `width`
 * is 0 where there are new keys); -1 where scratch memory cannot be had. */
int lowmem_one_token_attention(const void *q, int q_bf16, long q_row, long q_head, const void *k, const void *v,
                               int kv_bf16, long c_row, long c_head, long c_place, int rows, int heads, int hs,
                               const int32_t *places, int width, int window, float scale, float *out, int threads,
                               const void *new_k, const void *new_v) {
    int most = 1, failed = 0;
    if (new_k && width < 1) return -2;
    for (int r = 0; r < rows; r++) {
        if (places[r] < 0 || places[r] > width) return -2;
        most = places[r] > most ? places[r] : most;
    }
    const long q_size = q_bf16 ? 2 : 4, c_size = kv_bf16 ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * (size_t)most);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < rows * heads; t++) {
            int r = t / heads, h = t % heads, n = places[r];
            float *o = out + ((long)r * heads + h) * hs;
            if (new_k) {
                long from = ((long)r * q_row + (long)h * q_head) * q_size;
                long to = ((long)r * c_row + (long)h * c_head + (long)(width - 1) * c_place) * c_size;
                write_place((const char *)new_k + from, q_bf16, (char *)k + to, kv_bf16, hs);
                write_place((const char *)new_v + from, q_bf16, (char *)v + to, kv_bf16, hs);
            }
            if (!s || n == 0) {
                for (int j = 0; j < hs; j++) o[j] = 0.f;
                continue;
            }
            if (window > 0 && n > window) n = window;
            long at = ((long)r * c_row + (long)h * c_head + (long)(width - n) * c_place) * c_size;
            attend((const char *)q + ((long)r * q_row + (long)h * q_head) * q_size, q_bf16, (const char *)k + at,
                   (const char *)v + at, kv_bf16, c_place, n, hs, scale, o, s);
        }
        free(s);
    }
    return failed ? -1 : 0;
}
