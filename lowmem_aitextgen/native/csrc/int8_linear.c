/* lowmem_aitextgen's int8 Linear for decoding on x86 CPUs (native_int8.py builds it, int8_kernels.NativeProduct
 * calls it): each row of x quantized alone, the int8 product, its sums dequantized, in one call.
 *
 * Its bits are fbgemm's (TokenwiseInt8Linear on FbgemmProduct): a row's size is the largest |x| (at least 1e-12);
 * x / size times the activations' inverse scale plus the zero point, in double, rounded to float, then to the
 * nearest integer (ties to even) within 0..255; the sums are exact integers on every path; a sum less the zero
 * point times its column's weights, as a float, times the product of the two scales, times the size, plus the
 * bias: each operation rounded alone (no fused multiply-add: built with -ffp-contract=off).  So the path, the
 * rows beside a row and the threads never change a row's output.  Where asked, GPT-2's tanh GELU of the output in
 * the same call (a tanh of its own: within 2e-7 of the output's size of torch's, not its bits).
 *
 * The weights are packed once (native_int8.pack): rows of K padded with zeros to a multiple of KSTEP, columns in
 * panels of PANEL, each panel (K/4 groups) x (PANEL columns) x (4 consecutive k): the layout VNNI's and AMX's
 * int8 dot products read, and contiguous, so one pass over a panel serves every row of the call.
 *
 * | path       | instructions                  | rows a pass over a panel serves (the rest: another pass) |
 * |------------|-------------------------------|-----------------------------------------------------------|
 * | 0 avx2     | vpmaddubsw + vpmaddwd (16-bit | 2 (16 vector registers); 7-bit activations keep the       |
 * |            | pairs, exact for 7 bits)      | 16-bit pair sums from saturating                          |
 * | 1 vnni     | AVX512-VNNI vpdpbusd          | 8                                                         |
 * | 2 amx      | AMX-INT8 tdpbusd              | 16 (a tile's rows)                                        |
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lowmem_kernels.h"
#include "native_math.h"

#define PANEL 32
#define KSTEP 64

typedef void (*panel_fn)(const uint8_t *a, long lda, int rows, const int8_t *w, int kp, int32_t *sums);

/* ---- avx2 ------------------------------------------------------------------------------------------------ */

__attribute__((target("avx2"))) static inline void avx2_rows(const uint8_t *a, long lda, const int rows,
                                                             const int8_t *w, int kp, int32_t *sums) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm256_setzero_si256();
    for (int g = 0; g < kp / 4; g++) {
        const __m256i *wg = (const __m256i *)(w + (long)g * PANEL * 4);
        __m256i w0 = _mm256_loadu_si256(wg), w1 = _mm256_loadu_si256(wg + 1);
        __m256i w2 = _mm256_loadu_si256(wg + 2), w3 = _mm256_loadu_si256(wg + 3);
        for (int r = 0; r < rows; r++) {
            __m256i x = _mm256_set1_epi32(*(const int32_t *)(a + r * lda + g * 4));
            c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w0), ones));
            c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w1), ones));
            c[r][2] = _mm256_add_epi32(c[r][2], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w2), ones));
            c[r][3] = _mm256_add_epi32(c[r][3], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w3), ones));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(sums + r * PANEL + j * 8), c[r][j]);
}

__attribute__((target("avx2"))) static void avx2_panel(const uint8_t *a, long lda, int rows, const int8_t *w,
                                                       int kp, int32_t *sums) {
    if (rows == 1) avx2_rows(a, lda, 1, w, kp, sums);
    else avx2_rows(a, lda, 2, w, kp, sums);
}

/* ---- avx512 vnni ----------------------------------------------------------------------------------------- */

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
/* one accumulator pair a row, named (an array of them is kept in memory by gcc, not in registers) */
#define VNNI_ROW(r)                                                                                             \
    if (rows > r) {                                                                                             \
        __m512i x = _mm512_set1_epi32(*(const int32_t *)(a + r * lda + g * 4));                                 \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, x, w0);                                                          \
        c##r##1 = _mm512_dpbusd_epi32(c##r##1, x, w1);                                                          \
    }

/* vnni_panel: sums (rows x PANEL) of rows [0, rows) of a (groups of 4 k, lda apart) over one panel w */
PANEL_KERNEL(VNNI_TARGET, vnni, uint8_t, int8_t, int32_t, _mm512_setzero_si512(), 4, VNNI_ROW, _mm512_store_si512)

/* ---- amx ------------------------------------------------------------------------------------------------- */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks Linux for the AMX tile state (a process needs it before its first tile instruction): 0 where granted. */
int lowmem_amx_request(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles: 0 the rows' activations (rows x 64 bytes), 1 and 2 the panel's halves (16 groups x 16 columns x 4),
 * 3 and 4 their sums (rows x 16 int32) */
__attribute__((target("amx-tile,amx-int8"))) static void amx_configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) c.colsb[t] = 64;
    c.rows[0] = c.rows[3] = c.rows[4] = (uint8_t)rows;
    c.rows[1] = c.rows[2] = 16;
    /* gcc 12 does not see the builtin read past the palette and drops the stores to the rest: a barrier keeps them */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

__attribute__((target("amx-tile,amx-int8"))) static void amx_panel(const uint8_t *a, long lda, int rows,
                                                                   const int8_t *w, int kp, int32_t *sums) {
    (void)rows;  /* the tiles' configuration holds it (amx_configure) */
    _tile_zero(3);
    _tile_zero(4);
    for (int k = 0; k < kp; k += KSTEP) {
        const int8_t *wk = w + (long)(k / 4) * PANEL * 4;
        _tile_loadd(0, a + k, lda);
        _tile_loadd(1, wk, PANEL * 4);
        _tile_loadd(2, wk + 64, PANEL * 4);
        _tile_dpbusd(3, 0, 1);
        _tile_dpbusd(4, 0, 2);
    }
    _tile_stored(3, sums, PANEL * 4);
    _tile_stored(4, sums + 16, PANEL * 4);
}

__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }

/* ---- the call ---------------------------------------------------------------------------------------------- */

/* A row of x (k floats) as bytes (kp, the padding's 0: the weights there are 0), and its size. */
__attribute__((target("avx2"))) static void quantize_row(const float *row, int k, int kp, float inverse, float zero,
                                                         uint8_t *out, float *size_out) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 most = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= k; i += 8) most = _mm256_max_ps(most, _mm256_and_ps(_mm256_loadu_ps(row + i), magnitude));
    float lanes[8], size = 0.f;
    _mm256_storeu_ps(lanes, most);
    for (int j = 0; j < 8; j++) size = lanes[j] > size ? lanes[j] : size;
    for (; i < k; i++) {
        float v = row[i] < 0.f ? -row[i] : row[i];
        size = v > size ? v : size;
    }
    size = size < 1e-12f ? 1e-12f : size;
    *size_out = size;
    const __m256 by = _mm256_set1_ps(size);
    const __m256d scale = _mm256_set1_pd(inverse), shift = _mm256_set1_pd(zero);
    for (i = 0; i + 8 <= k; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(row + i), by);
        __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), high = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        __m128 lo = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(low, scale), shift));
        __m128 hi = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(high, scale), shift));
        __m256 t = _mm256_round_ps(_mm256_set_m128(hi, lo), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_min_ps(_mm256_max_ps(t, _mm256_setzero_ps()), _mm256_set1_ps(255.f));
        __m256i n = _mm256_cvtps_epi32(t);
        __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
        _mm_storel_epi64((__m128i *)(out + i), _mm_packus_epi16(words, words));
    }
    for (; i < k; i++) {
        float t = (float)((double)(row[i] / size) * inverse + zero);
        t = __builtin_nearbyintf(t);
        out[i] = (uint8_t)(t < 0.f ? 0.f : (t > 255.f ? 255.f : t));
    }
    memset(out + k, 0, (size_t)(kp - k));
}

/* y's rows [0, rows) for the panel's columns from their sums (module comment's order of operations), then
 * GPT-2's GELU where `gelu` (the stepping decoder's c_fc and its activation in one call). */
__attribute__((target("avx2"))) static void dequantize(const int32_t *sums, int rows, const int32_t *zero_sums,
                                                       int n, int column, float scale, const float *sizes,
                                                       const float *bias, int gelu, const float *residual,
                                                       float *y) {
    const __m256 by = _mm256_set1_ps(scale);
    for (int h = 0; h < PANEL && column + h < n; h += 8) {
        int c = column + h, left = n - c < 8 ? n - c : 8;
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256i zero = _mm256_maskload_epi32(zero_sums + c, mask);
        __m256 b = bias ? _mm256_maskload_ps(bias + c, mask) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m256i s = _mm256_sub_epi32(_mm256_load_si256((const __m256i *)(sums + r * PANEL + h)), zero);
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), by), _mm256_set1_ps(sizes[r]));
            if (bias) v = _mm256_add_ps(v, b);
            if (gelu) v = tanh_gelu(v);
            if (residual) v = _mm256_add_ps(_mm256_maskload_ps(residual + (long)r * n + c, mask), v);
            _mm256_maskstore_ps(y + (long)r * n + c, mask, v);
        }
    }
}

static const int ROWS_A_PASS[3] = {2, 8, 16};

/* y (m x n) = the int8 Linear of x (m x k) by the packed weights w (kp = k padded), zero_sums[c] = the zero
 * point times column c's weights, scale = the float product of the two scales, `gelu`: GPT-2's GELU applied to
 * the output, `residual` (m x n; NULL: none) added to it last (a rounding of its own: the bits of torch's add of
 * the two); `path` as the table.  Returns 0, or -1 where the scratch memory cannot be had. */
int lowmem_int8_linear(int path, const float *x, int m, int k, int kp, const int8_t *w, const int32_t *zero_sums,
                       int n, float scale, const float *bias, int gelu, float inverse, float zero, float *y,
                       int threads, const float *residual) {
    uint8_t *q = aligned_alloc(64, ((size_t)m * kp + 63) / 64 * 64);
    float *sizes = malloc(sizeof(float) * (size_t)m);
    if (!q || !sizes) {
        free(q);
        free(sizes);
        return -1;
    }
    const panel_fn panel = path == 2 ? amx_panel : path == 1 ? vnni_panel : avx2_panel;
    const int step = ROWS_A_PASS[path], panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        int32_t sums[16 * PANEL] __attribute__((aligned(64)));
        int configured = 0;
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) quantize_row(x + (long)r * k, k, kp, inverse, zero, q + (long)r * kp, sizes + r);
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const int8_t *wp = w + (long)p * kp * PANEL;
            for (int r = 0; r < m; r += step) {
                int rows = m - r < step ? m - r : step;
                if (path == 2 && configured != rows) {
                    amx_configure(rows);
                    configured = rows;
                }
                panel(q + (long)r * kp, kp, rows, wp, kp, sums);
                dequantize(sums, rows, zero_sums, n, p * PANEL, scale, sizes + r, bias, gelu,
                           residual ? residual + (long)r * n : NULL, y + (long)r * n);
            }
        }
        if (configured) amx_release();
    }
    free(q);
    free(sizes);
    return 0;
}
