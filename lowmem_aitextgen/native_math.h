/* The vector arithmetic lowmem_aitextgen's kernels share (int8_linear.c, one_token_attention.c, bf16_linear.c). */
#ifndef LOWMEM_NATIVE_MATH_H
#define LOWMEM_NATIVE_MATH_H

#include <immintrin.h>

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

/* call(r) with r the constant `rows` (1 to 8; more: 8), so that each kernel is a copy with its rows known and only
 * their registers are used */
#define WITH_ROWS_KNOWN(rows, call)                                                                             \
    switch (rows) {                                                                                             \
    case 1: call(1); break;                                                                                     \
    case 2: call(2); break;                                                                                     \
    case 3: call(3); break;                                                                                     \
    case 4: call(4); break;                                                                                     \
    case 5: call(5); break;                                                                                     \
    case 6: call(6); break;                                                                                     \
    case 7: call(7); break;                                                                                     \
    default: call(8); break;                                                                                    \
    }

#endif
