/* lowmem_aitextgen's top-k of a few rows of logits (native_top_k.py calls it): each row's k largest values,
 * largest first, and their ids, in one pass over the row.
 *
 * The largest of 32 logits at a time is compared with the least of the k largest held (AVX2); only the logits
 * above it are gathered, and a quickselect keeps the k first of them when their room fills, so a row of GPT-2's
 * 50,257 costs one read and a few selections over a few hundred (~17 us here; a heap of k, its steps' branches
 * unforeseeable, took 53; torch's topk ~65).  Which of several equal values are kept, and their order among
 * themselves, is not torch's (ours: the earlier id first; torch's: unspecified): its callers use the values and
 * the set of ids, which any exact top-k gives alike where the k-th value is not tied past it.  A row holding NaN
 * (which torch's topk takes as the largest) is refused, for the caller to give torch. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "lowmem_kernels.h"

typedef struct {
    float value;
    int32_t id;
} entry;

/* a before b: the larger value, of equals the earlier id (a total order: no two entries are equal in it) */
static inline int before(entry a, entry b) { return a.value > b.value || (a.value == b.value && a.id < b.id); }

static inline void swap(entry *a, entry *b) {
    entry t = *a;
    *a = *b;
    *b = t;
}

/* a[0..k) the k first of a (n) in `before`'s order, in any order among themselves (quickselect, the middle of
 * three as the pivot) */
static void keep_first(entry *a, int n, int k) {
    int low = 0, high = n - 1;
    while (low < high) {
        int middle = low + (high - low) / 2;
        if (before(a[middle], a[low])) swap(a + middle, a + low);
        if (before(a[high], a[low])) swap(a + high, a + low);
        if (before(a[high], a[middle])) swap(a + high, a + middle);
        entry pivot = a[middle];
        int i = low, j = high;
        while (i <= j) {
            while (before(a[i], pivot)) i++;
            while (before(pivot, a[j])) j--;
            if (i <= j) swap(a + i++, a + j--);
        }
        if (k - 1 <= j) high = j;
        else if (k - 1 >= i) low = i;
        else return;
    }
}

/* the entries of x[i..i+8) above `least` appended to kept */
__attribute__((target("avx2"))) static inline int enter(const float *x, int i, __m256 v, float least, entry *kept,
                                                        int count) {
    int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(least), _CMP_GT_OQ));
    for (; above; above &= above - 1) {
        int at = i + __builtin_ctz(above);
        kept[count++] = (entry){x[at], at};
    }
    return count;
}

/* the k largest of row x (n), largest first (of equals the earlier id) into values and ids; -1 where x holds NaN.
 * `kept` holds room for 4k + 32 entries: the first k, then the logits above `least` (the least of the k held),
 * gathered 32 at a time where their largest is above it; each time it fills, only its k first stay and `least`
 * rises to the k-th. */
__attribute__((target("avx2"))) static int row_top_k(const float *x, int n, int k, entry *kept, float *values,
                                                     int64_t *ids) {
    const int room = 4 * k;
    float least = INFINITY;
    int count = k, i = k;
    for (int j = 0; j < k; j++) {
        if (x[j] != x[j]) return -1;
        kept[j] = (entry){x[j], j};
        least = x[j] < least ? x[j] : least;
    }
    __m256 nan = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q),
                                                          _mm256_cmp_ps(b, b, _CMP_UNORD_Q)),
                                             _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q),
                                                          _mm256_cmp_ps(d, d, _CMP_UNORD_Q))));
        __m256 most = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
        if (!_mm256_movemask_ps(_mm256_cmp_ps(most, _mm256_set1_ps(least), _CMP_GT_OQ))) continue;
        count = enter(x, i, a, least, kept, count);
        count = enter(x, i + 8, b, least, kept, count);
        count = enter(x, i + 16, c, least, kept, count);
        count = enter(x, i + 24, d, least, kept, count);
        if (count >= room) {
            keep_first(kept, count, k);
            count = k;
            least = kept[0].value;
            for (int j = 1; j < k; j++) least = kept[j].value < least ? kept[j].value : least;
        }
    }
    if (_mm256_movemask_ps(nan)) return -1;
    for (; i < n; i++) {
        if (x[i] != x[i]) return -1;
        if (x[i] > least) kept[count++] = (entry){x[i], i};
    }
    keep_first(kept, count, k);
    for (int j = 1; j < k; j++) { /* the k first in order: insertion */
        entry e = kept[j];
        int at = j;
        for (; at > 0 && before(e, kept[at - 1]); at--) kept[at] = kept[at - 1];
        kept[at] = e;
    }
    for (int j = 0; j < k; j++) {
        values[j] = kept[j].value;
        ids[j] = kept[j].id;
    }
    return 0;
}

/* values, ids (rows x k) = the k largest of each row of x (rows x n, rows `stride` floats apart), largest first.
 * Returns 0; -1 where a row holds NaN; -2 where the scratch memory cannot be had. */
int lowmem_top_k(const float *x, long stride, int rows, int n, int k, float *values, int64_t *ids, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* the room row_top_k fills to (4k), a block of 32 past it, and the row's last 31 logits */
        entry *kept = malloc(sizeof(entry) * ((size_t)4 * k + 64));
        if (!kept) {
#pragma omp atomic write
            failed = -2;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            if (kept && row_top_k(x + r * stride, n, k, kept, values + (long)r * k, ids + (long)r * k) != 0) {
#pragma omp atomic write
                failed = -1;
            }
        free(kept);
    }
    return failed;
}

/* The token of one row drawn among its k likeliest (sampling.py's top-k draw, its module docstring): the k + 1
 * largest of x (n) less the `barred` ids (nb, -1 for none), each divided by `temperature`; -2 where the k-th is
 * tied with the next (the caller keeps every tied token); else, in the order of the ids, the probabilities
 * e^(v - max) / their sum and their cumulative sum in double, and the first place where it passes `uniform` times
 * the total.  -1 where x holds NaN or fewer than k + 1 ids are left. */
static int64_t row_draw(const float *x, int n, int k, const int64_t *barred, int nb, float temperature,
                        double uniform, entry *kept, float *values, int64_t *ids) {
    const int wanted = k + 1 + nb;
    if (wanted > n || row_top_k(x, n, wanted, kept, values, ids) != 0) return -1;
    int count = 0;
    for (int j = 0; j < wanted && count <= k; j++) {
        int is_barred = 0;
        for (int b = 0; b < nb; b++) is_barred |= ids[j] == barred[b];
        if (!is_barred) {
            values[count] = values[j] / temperature;
            ids[count++] = ids[j];
        }
    }
    if (count <= k) return -1;
    if (values[k] == values[k - 1]) return -2;
    const float most = values[0]; /* (largest first until sorted by id) */
    for (int j = 1; j < k; j++) { /* the k in the order of their ids: insertion */
        float v = values[j];
        int64_t id = ids[j];
        int at = j;
        for (; at > 0 && ids[at - 1] > id; at--) {
            values[at] = values[at - 1];
            ids[at] = ids[at - 1];
        }
        values[at] = v;
        ids[at] = id;
    }
    double total = 0.0, *cumulative = (double *)kept; /* (kept holds 4k + 64 entries: room for k doubles) */
    for (int j = 0; j < k; j++) cumulative[j] = total += exp((double)(values[j] - most));
    const double target = uniform * total;
    for (int j = 0; j < k; j++)
        if (cumulative[j] > target) return ids[j];
    return ids[k - 1];
}

/* tokens[r] = row r of x (rows x n, `stride` floats apart) drawn among its k likeliest (row_draw, its barred ids
 * barred[r * nb ...], its temperatures[r] and uniforms[r]): a token, -2 where the row's k-th is tied (the caller's
 * to draw), -1 where it holds NaN or too few ids are left.  Returns 0; -2 where scratch memory cannot be had. */
int lowmem_top_k_draw(const float *x, long stride, int rows, int n, int k, const int64_t *barred, int nb,
                      const float *temperatures, const double *uniforms, int64_t *tokens, int threads) {
    int failed = 0;
    const size_t room = (size_t)4 * (k + 1 + nb) + 64;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        entry *kept = malloc(sizeof(entry) * room);
        float *values = malloc(sizeof(float) * (size_t)(k + 1 + nb));
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)(k + 1 + nb));
        if (!kept || !values || !ids) {
#pragma omp atomic write
            failed = -2;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            tokens[r] = kept && values && ids ? row_draw(x + r * stride, n, k, barred + (long)r * nb, nb,
                                                         temperatures[r], uniforms[r], kept, values, ids) : -1;
        free(kept);
        free(values);
        free(ids);
    }
    return failed;
}

/* The cut by mass (native_top_k.mass_cuts; cutoffs.py: top_p, typical_p, and a top_k past KERNEL_MAX_K): of a row's
 * n items ordered by `key` ascending (or descending), the first place where the cumulative `weight` (summed in
 * double; NULL: 1 an item) reaches `mass`, as transformers' warpers find it by sorting the row.  The keys fall into
 * CUT_BUCKETS buckets by a linear map between the least and largest finite key (rounding is monotone: a larger key
 * never falls in an earlier bucket; -inf and +inf have a bucket each, first and last), a bucket's count and weight
 * are summed in one pass, and only the bucket where the mass is reached is sorted: two reads of the row and a sort
 * of a few hundred, where transformers sorts 50,257. */
#define CUT_BUCKETS 2048

typedef struct {
    float key, weight;
} weighted;

static int by_key(const void *a, const void *b) {
    float x = ((const weighted *)a)->key, y = ((const weighted *)b)->key;
    return (x > y) - (x < y);
}

/* buckets[i] = the bucket of sign x key[i] (row_mass_cut), 8 keys at a time; *least and *most: the least and
 * largest finite of them (+inf and -inf where none).  -1 where a key is NaN. */
__attribute__((target("avx2"))) static int bucket_keys(const float *key, float sign, int n, int *buckets,
                                                       float *least, float *most) {
    const __m256 infinity = _mm256_set1_ps(INFINITY), minus = _mm256_set1_ps(-INFINITY);
    const __m256 by_sign = _mm256_set1_ps(sign);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 low = infinity, high = minus, nan = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(key + i), by_sign);
        __m256 finite = _mm256_cmp_ps(_mm256_and_ps(v, magnitude), infinity, _CMP_LT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        low = _mm256_min_ps(low, _mm256_blendv_ps(infinity, v, finite));
        high = _mm256_max_ps(high, _mm256_blendv_ps(minus, v, finite));
    }
    if (_mm256_movemask_ps(nan)) return -1;
    float l[8], h[8];
    _mm256_storeu_ps(l, low);
    _mm256_storeu_ps(h, high);
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < 8; j++) lo = l[j] < lo ? l[j] : lo, hi = h[j] > hi ? h[j] : hi;
    for (int j = i; j < n; j++) {
        float v = sign * key[j];
        if (v != v) return -1;
        if (isfinite(v)) lo = v < lo ? v : lo, hi = v > hi ? v : hi;
    }
    const float scale = hi > lo && isfinite(hi - lo) ? (CUT_BUCKETS - 1) / (hi - lo) : 0.0f;
    const __m256 from = _mm256_set1_ps(lo), by = _mm256_set1_ps(scale);
    const __m256i one = _mm256_set1_epi32(1), top = _mm256_set1_epi32(CUT_BUCKETS);
    const __m256i last = _mm256_set1_epi32(CUT_BUCKETS + 1), zero = _mm256_setzero_si256();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(key + i), by_sign);
        __m256i b = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_sub_ps(v, from), by));
        b = _mm256_min_epi32(_mm256_add_epi32(b, one), top); /* (a finite key: 1 to CUT_BUCKETS) */
        b = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(zero),
                                                 _mm256_cmp_ps(v, minus, _CMP_EQ_OQ)));
        b = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(last),
                                                 _mm256_cmp_ps(v, infinity, _CMP_EQ_OQ)));
        _mm256_storeu_si256((__m256i *)(buckets + i), b);
    }
    for (; i < n; i++) {
        float v = sign * key[i];
        int b = (int)((v - lo) * scale);
        buckets[i] = v == -INFINITY ? 0
                     : v == INFINITY ? CUT_BUCKETS + 1 : 1 + (b < CUT_BUCKETS - 1 ? b : CUT_BUCKETS - 1);
    }
    *least = lo, *most = hi;
    return 0;
}

/* row_mass_cut's answer, the keys in ascending order of sign x key (sign -1: descending): *cut the key where the
 * mass is reached (the last in the order where it never is), *after the key next in the order (past the last: +inf
 * ascending, -inf descending).  `counts` and `sums` hold CUT_BUCKETS + 2 each, `buckets` and `gathered` n each. */
static int row_mass_cut(const float *key, float sign, const float *weight, int n, double mass, int *counts,
                        double *sums, int *buckets, weighted *gathered, float *cut, float *after) {
    float least, most;
    if (bucket_keys(key, sign, n, buckets, &least, &most) != 0) return -1;
    for (int b = 0; b < CUT_BUCKETS + 2; b++) counts[b] = 0, sums[b] = 0.0;
    for (int i = 0; i < n; i++) counts[buckets[i]]++;
    if (weight)
        for (int i = 0; i < n; i++) sums[buckets[i]] += weight[i];
    else
        for (int b = 0; b < CUT_BUCKETS + 2; b++) sums[b] = counts[b];
    double total = 0.0;
    int b = 0;
    for (; b < CUT_BUCKETS + 2; b++) {
        if (counts[b] && total + sums[b] >= mass) break;
        total += sums[b];
    }
    if (b == CUT_BUCKETS + 2) { /* never reached: everything kept */
        *cut = sign * (counts[CUT_BUCKETS + 1] ? INFINITY : most); /* (-inf: no finite key) */
        *after = sign * INFINITY;
        return 0;
    }
    int next = b + 1, m = 0;
    while (next < CUT_BUCKETS + 2 && !counts[next]) next++;
    float next_least = INFINITY;
    for (int i = 0; i < n; i++) {
        if (buckets[i] == b) gathered[m++] = (weighted){sign * key[i], weight ? weight[i] : 1.0f};
        else if (buckets[i] == next && sign * key[i] < next_least) next_least = sign * key[i];
    }
    qsort(gathered, m, sizeof(weighted), by_key);
    int j = 0;
    for (; j < m - 1; j++) /* (the bucket's last where rounding leaves its sum short: the mass is reached there) */
        if ((total += gathered[j].weight) >= mass) break;
    *cut = sign * gathered[j].key;
    *after = sign * (j + 1 < m ? gathered[j + 1].key : next_least);
    return 0;
}

/* cuts[r], afters[r] = row_mass_cut of row r of key (and of weight, NULL: 1 an item; rows `stride` floats apart) at
 * masses[r], its keys in descending order where `descending`.  Returns 0; -1 where a key is NaN; -2 where scratch
 * memory cannot be had. */
int lowmem_mass_cut(const float *key, int descending, const float *weight, long stride, int rows, int n,
                    const double *masses, float *cuts, float *afters, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        int *counts = malloc(sizeof(int) * (CUT_BUCKETS + 2)), *buckets = malloc(sizeof(int) * (size_t)n);
        double *sums = malloc(sizeof(double) * (CUT_BUCKETS + 2));
        weighted *gathered = malloc(sizeof(weighted) * (size_t)n);
        if (!counts || !buckets || !sums || !gathered) {
#pragma omp atomic write
            failed = -2;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            if (counts && buckets && sums && gathered &&
                row_mass_cut(key + r * stride, descending ? -1.0f : 1.0f, weight ? weight + r * stride : NULL, n,
                             masses[r], counts, sums, buckets, gathered, cuts + r, afters + r) != 0) {
#pragma omp atomic write
                failed = -1;
            }
        free(counts);
        free(buckets);
        free(sums);
        free(gathered);
    }
    return failed;
}
