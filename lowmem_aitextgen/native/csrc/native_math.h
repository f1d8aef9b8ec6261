/* The vector arithmetic lowmem_aitextgen's kernels share (int8_linear.c, one_token_attention.c, bf16_linear.c). */
#ifndef LOWMEM_NATIVE_MATH_H
#define LOWMEM_NATIVE_MATH_H

#include <immintrin.h>
#include <stdint.h>

/* e^x for x within [-87, 88], where 2^n is a normal float (Cephes' expf: 2^n times a polynomial of the rest; within
 * 2 ulp) */
__attribute__((target("avx2"))) static inline __m256 exp_of(__m256 x) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.f));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

/* GPT-2's GELU, the tanh approximation: v/2 (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), tanh(u) = 1 - 2/(e^2u + 1)
 * (u within [-9, 9], where tanh is 1 to float precision); within ~1e-7 of |v| of torch's (the c_fc outputs of
 * int8_linear.c and bf16_linear.c) */
__attribute__((target("avx2"))) static inline __m256 tanh_gelu(__m256 v) {
    __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                             _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
    u = _mm256_min_ps(_mm256_max_ps(u, _mm256_set1_ps(-9.f)), _mm256_set1_ps(9.f));
    __m256 e = exp_of(_mm256_add_ps(u, u));
    __m256 tanh = _mm256_sub_ps(_mm256_set1_ps(1.f),
                                _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(_mm256_set1_ps(1.f), tanh));
}

/* 16 floats as bf16, to nearest even, NaN as 0x7fc0: as torch converts them (one_token_attention.c's cache
 * writes, bf16_linear.c's outputs) */
__attribute__((target("avx512f"))) static inline __m256i bf16_of(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i up = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    up = _mm512_mask_mov_epi32(up, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(up);
}

/* 8 floats as bf16 (bf16_of's rule) */
__attribute__((target("avx2"))) static inline __m128i bf16_of8(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i up = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    up = _mm256_blendv_epi8(up, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(up, up), 0x08));
}

/* a float as bf16 (bf16_of's rule), and a bf16 as a float (exactly) */
static inline uint16_t bf16_bits(float v) {
    uint32_t bits;
    __builtin_memcpy(&bits, &v, sizeof bits);
    return v != v ? 0x7fc0 : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float float_of(uint16_t bf16) {
    uint32_t bits = (uint32_t)bf16 << 16;
    float v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

/* A panel's kernel for up to 8 rows (int8_linear.c's VNNI path, bf16_linear.c's): `name`_panel(a, lda, rows, w, kp,
 * sums) sums rows [0, rows) of a over one panel w into sums (rows x PANEL), by `name`_rows, a copy for each number of
 * rows (1 to 8; more: 8; `rows` a constant in each, so that only its rows' registers are used), whose two 16-lane
 * accumulators a row over the panel's 32 columns stay in registers (named, not an array: gcc keeps an array in
 * memory).  Each group of `step` k (4 int8 to a lane, 2 bf16) reads the panel's
 * next 64 bytes twice over, w0 and w1; `row(r)` adds them to row r's accumulators (a, lda, g and rows in its
 * scope); `store` writes an accumulator to memory (a void * first). */
#define PANEL_KERNEL(target, name, A, W, S, zero, step, row, store)                                             \
    target static inline __attribute__((always_inline)) void name##_rows(const A *a, long lda, const int rows,  \
                                                                         const W *w, int kp, S *sums) {         \
        __typeof__(zero) c00 = zero, c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,          \
                         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00,          \
                         c70 = c00, c71 = c00;                                                                  \
        for (int g = 0; g < kp / (step); g++) {                                                                 \
            __m512i w0 = _mm512_loadu_si512((const void *)(w + (long)g * PANEL * (step)));                     \
            __m512i w1 = _mm512_loadu_si512((const void *)(w + (long)g * PANEL * (step) + 16 * (step)));       \
            row(0) row(1) row(2) row(3) row(4) row(5) row(6) row(7)                                             \
        }                                                                                                       \
        PANEL_STORE(store, 0) PANEL_STORE(store, 1) PANEL_STORE(store, 2) PANEL_STORE(store, 3)                 \
        PANEL_STORE(store, 4) PANEL_STORE(store, 5) PANEL_STORE(store, 6) PANEL_STORE(store, 7)                 \
    }                                                                                                           \
    target static void name##_panel(const A *a, long lda, int rows, const W *w, int kp, S *sums) {             \
        switch (rows) {                                                                                         \
        case 1: name##_rows(a, lda, 1, w, kp, sums); break;                                                     \
        case 2: name##_rows(a, lda, 2, w, kp, sums); break;                                                     \
        case 3: name##_rows(a, lda, 3, w, kp, sums); break;                                                     \
        case 4: name##_rows(a, lda, 4, w, kp, sums); break;                                                     \
        case 5: name##_rows(a, lda, 5, w, kp, sums); break;                                                     \
        case 6: name##_rows(a, lda, 6, w, kp, sums); break;                                                     \
        case 7: name##_rows(a, lda, 7, w, kp, sums); break;                                                     \
        default: name##_rows(a, lda, 8, w, kp, sums); break;                                                    \
        }                                                                                                       \
    }
#define PANEL_STORE(store, r)                                                                                   \
    if (rows > r) {                                                                                             \
        store((void *)(sums + r * PANEL), c##r##0);                                                             \
        store((void *)(sums + r * PANEL + 16), c##r##1);                                                        \
    }

#endif
