/* lowmem_aitextgen's bf16 Linear for decoding on x86 CPUs with AVX512-BF16 (native_bf16.py calls it, packed16.py's
 * NativeBf16Linear holds its weights): y = x W^T + b, bf16 in and out, fp32 sums; where asked, GPT-2's GELU of y and
 * a residual added to it in the same call (gpt2_block.c's bf16 block, the stepping decoder's c_fc).
 *
 * Each (row of x, column) is summed in one order at any number of rows or threads: one 16-lane fp32 accumulator
 * for 16 columns, vdpbf16ps over k two at a time in order (k even), the bias (bf16, widened
 * exactly) added, rounded to bf16 to nearest even (NaN as 0x7fc0).  So a row's output is its own alone or beside
 * any rows.  Its bits are not oneDNN's (which sums in an order of its own): the same function, rounded differently.
 *
 * The weights are packed once (native_bf16.pack): columns in panels of PANEL (the last padded with zeros), each panel
 * (k/2 pairs) x (PANEL columns) x (2 consecutive k): what vdpbf16ps reads, contiguous, so one pass over a panel
 * serves up to ROWS rows of the call (their accumulators in registers; more rows: another pass).
 */
#include <immintrin.h>
#include <stdint.h>

#include "lowmem_kernels.h"
#include "native_math.h"

#define PANEL 32
#define ROWS 8

#define BF16_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))

#define BF16_ROW(r)                                                                                             \
    if (rows > r) {                                                                                             \
        __m512i x = _mm512_set1_epi32(*(const int32_t *)(a + r * lda + 2 * g));                                 \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, (__m512bh)x, (__m512bh)w0);                                         \
        c##r##1 = _mm512_dpbf16_ps(c##r##1, (__m512bh)x, (__m512bh)w1);                                         \
    }

/* bf16_panel: sums (rows x PANEL) of rows [0, rows) of a (pairs of k, lda apart) over one panel w */
PANEL_KERNEL(BF16_TARGET, bf16, uint16_t, uint16_t, float, _mm512_setzero_ps(), 2, BF16_ROW, _mm512_store_ps)

/* 16 bf16 widened to floats exactly */
BF16_TARGET static inline __m512 widened(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* GPT-2's GELU of 16 floats (native_math.h's, 8 at a time) */
BF16_TARGET static inline __m512 gelu16(__m512 v) {
    __m256 low = tanh_gelu(_mm512_castps512_ps256(v)),
           high = tanh_gelu(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high),
                                               1));
}

/* y's rows [0, rows), the panel's columns from `column`, from their sums: the bias added, rounded to bf16; then,
 * where asked, GPT-2's GELU of that (rounded again), and the residual (bf16, rows ldy apart; y's own place may be
 * it) added to that last (rounded again): each step the bits of torch's bf16 operation on the one before */
BF16_TARGET static void written(const float *sums, int rows, int n, int column, const uint16_t *bias, int gelu,
                                const uint16_t *residual, uint16_t *y, long ldy) {
    for (int h = 0; h < PANEL && column + h < n; h += 16) {
        int left = n - column - h < 16 ? n - column - h : 16;
        __mmask16 mask = (__mmask16)((1u << left) - 1u);
        __m512 b = bias ? widened(_mm256_maskz_loadu_epi16(mask, bias + column + h)) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_load_ps(sums + r * PANEL + h);
            if (bias) v = _mm512_add_ps(v, b);
            if (gelu) v = gelu16(widened(bf16_of(v)));
            if (residual)
                v = _mm512_add_ps(widened(_mm256_maskz_loadu_epi16(mask, residual + r * ldy + column + h)),
                                  widened(bf16_of(v)));
            _mm256_mask_storeu_epi16(y + r * ldy + column + h, mask, bf16_of(v));
        }
    }
}

/* y (m x n, bf16) = x (m x k, bf16, k even; rows lda apart) times the packed weights w + bias (n, bf16; NULL:
 * none), then GPT-2's GELU where `gelu`, then plus `residual` (m x n, bf16; NULL: none; it may be y) */
void lowmem_bf16_linear(const uint16_t *x, int m, int k, long lda, const uint16_t *w, int n, const uint16_t *bias,
                        int gelu, const uint16_t *residual, uint16_t *y, int threads) {
    const int panels = (n + PANEL - 1) / PANEL, kp = k;
#pragma omp parallel num_threads(threads)
    {
        float sums[ROWS * PANEL] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint16_t *wp = w + (long)p * kp * PANEL;
            for (int r = 0; r < m; r += ROWS) {
                int rows = m - r < ROWS ? m - r : ROWS;
                bf16_panel(x + (long)r * lda, lda, rows, wp, kp, sums);
                written(sums, rows, n, p * PANEL, bias, gelu, residual ? residual + (long)r * n : NULL,
                        y + (long)r * n, n);
            }
        }
    }
}
