/* Page selection for sparse decode: score every page of a layer, then keep the best k.
 *
 * A page's score is the best dot product of a few query rows with its feature vector: Quest's
 * bound (rows: each query head's query split here into two halves weighing the page's key maxima
 * and minima, see split_rows) or OVAL's logit (one routing vector against the page's embedding).
 * Each page's features are read once, in their stored dtype (float16 halves the bytes a step
 * reads), where torch's batched product packs the whole feature matrix first.
 * Built by kvfactory/kernels/__init__.py, called by kvfactory/selectors/pages.py.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define AHEAD 8  /* pages prefetched ahead */

/* 16 features starting at f (float32 or float16) as a vector. */
static inline __m512 load16(const void *f, int kind, int64_t i) {
    if (kind == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)f + i)));
    return _mm512_loadu_ps((const float *)f + i);
}

#define BLOCK 16     /* pages scored together: one vector of their scores per row */
#define WIDEST 128   /* features a block keeps converted (BLOCK x WIDEST floats, 8 KB) */

/* Pages [p, p + BLOCK) of one (b, h): features converted once into a float32 block, then each row's
 * 16 dot products accumulate side by side (16 independent chains) and are summed in one vector. */
static inline void score_block(const float *q, const char *f, int kind, int64_t size, int64_t fp, int64_t R,
                               int64_t F, int64_t p, float *out) {
    float block[BLOCK * WIDEST] __attribute__((aligned(64)));
    for (int64_t j = 0; j < BLOCK; j++) {
        const char *page = f + (p + j) * fp * size;
        for (int64_t i = 0; i < F * size; i += 64)  /* summaries are cold: ask for the next block */
            _mm_prefetch(page + BLOCK * fp * size + i, _MM_HINT_T0);
        for (int64_t i = 0; i < F / 16; i++) _mm512_store_ps(block + j * F + 16 * i, load16(page, kind, 16 * i));
    }
    __m512 best = _mm512_set1_ps(-__builtin_inff());
    for (int64_t r = 0; r < R; r++) {
        __m512 acc[BLOCK];
        for (int j = 0; j < BLOCK; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < F / 16; i++) {
            const __m512 qi = _mm512_loadu_ps(q + r * F + 16 * i);
            for (int j = 0; j < BLOCK; j++) acc[j] = _mm512_fmadd_ps(qi, _mm512_load_ps(block + j * F + 16 * i), acc[j]);
        }
        best = _mm512_max_ps(best, sums16(acc));
    }
    _mm512_storeu_ps(out + p, best);
}
#endif

#ifdef AVX2
#define BLOCK8 8     /* pages scored together in AVX2 */
#define WIDEST8 512  /* features a block keeps converted (BLOCK8 x WIDEST8 floats, 16 KB) */

/* score_block in AVX2: pages [p, p + BLOCK8) of one (b, h), their features converted once into
 * float32, each row's 8 dot products side by side and summed in one vector (sums8). */
static inline void score_block8(const float *q, const char *f, int kind, int64_t size, int64_t fp, int64_t R,
                                int64_t F, int64_t p, float *out) {
    float block[BLOCK8 * WIDEST8] __attribute__((aligned(32)));
    for (int64_t j = 0; j < BLOCK8; j++) {
        const char *page = f + (p + j) * fp * size;
        for (int64_t i = 0; i < F * size; i += 64) __builtin_prefetch(page + BLOCK8 * fp * size + i);
        load_params(page, kind, 0, F, block + j * F);
    }
    __m256 best = _mm256_set1_ps(-__builtin_inff());
    for (int64_t r = 0; r < R; r++) {
        __m256 acc[BLOCK8];
        for (int j = 0; j < BLOCK8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < F / 8; i++) {
            const __m256 qi = _mm256_loadu_ps(q + r * F + 8 * i);
            for (int j = 0; j < BLOCK8; j++) acc[j] = _mm256_fmadd_ps(qi, _mm256_load_ps(block + j * F + 8 * i), acc[j]);
        }
        best = _mm256_max_ps(best, sums8(acc));
    }
    _mm256_storeu_ps(out + p, best);
}
#endif

/* Each row x of width F / 2 as the F-wide row [max(x, 0) | min(x, 0)], whose dot with a page's
 * [maxima | minima] is x . centre + |x| . half-width: Quest's bound. */
static void split_rows(const float *x, int64_t R, int64_t F, float *out) {
    const int64_t D = F / 2;
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < D; c++) {
            const float v = x[r * D + c];
            out[r * F + c] = v > 0.f ? v : 0.f;
            out[r * F + D + c] = v < 0.f ? v : 0.f;
        }
}

/* scores[b, h, p] = max over r of rows[b, h, r, :] . features[b, h, p, :F] ([B, H, P]).
 * rows: float32 [B, H, R, F] contiguous; with bound, [B, H, R, F / 2] queries taken as
 * split_rows(rows). features: float32 (kind F32) or float16 (F16) with element strides
 * (fb, fh, fp), the F channels contiguous. scores: float32, contiguous. Returns -1 if working memory
 * (the split rows) cannot be allocated, else 0. */
int page_scores(int64_t B, int64_t H, int64_t R, int64_t F, int64_t P, const float *rows, const void *features,
                int kind, int64_t fb, int64_t fh, int64_t fp, int bound, float *scores) {
    const int64_t size = param_size(kind), width = bound ? F / 2 : F;
    float *expanded = NULL;
    if (bound && !(expanded = malloc(sizeof(float) * (size_t)(R * F)))) return -1;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float *q = rows + (b * H + h) * R * width;
            if (expanded) {
                split_rows(q, R, F, expanded);
                q = expanded;
            }
            const char *feat = (const char *)features + (b * fb + h * fh) * size;
            float *out = scores + (b * H + h) * P;
            int64_t p = 0;
#if defined(__AVX512F__)
            if (F % 16 == 0 && F <= WIDEST)
                for (; p + BLOCK <= P; p += BLOCK) score_block(q, feat, kind, size, fp, R, F, p, out);
#endif
#ifdef AVX2
            if (F % 8 == 0 && F <= WIDEST8)
                for (; p + BLOCK8 <= P; p += BLOCK8) score_block8(q, feat, kind, size, fp, R, F, p, out);
#endif
            for (; p < P; p++) {
                const char *f = feat + p * fp * size;
                float best = 0.f;
#if defined(__AVX512F__)
                if (F % 16 == 0 && F <= 512) {
                    for (int64_t i = 0; i < F * size; i += 64)  /* summaries are cold: ask for pages ahead */
                        _mm_prefetch(f + AHEAD * fp * size + i, _MM_HINT_T0);
                    __m512 x[32];
                    for (int64_t i = 0; i < F / 16; i++) x[i] = load16(f, kind, 16 * i);
                    for (int64_t r = 0; r < R; r++) {
                        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + r * F), x[0]);
                        for (int64_t i = 1; i < F / 16; i++)
                            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * F + 16 * i), x[i], acc);
                        const float dot = _mm512_reduce_add_ps(acc);
                        best = r == 0 || dot > best ? dot : best;
                    }
                    out[p] = best;
                    continue;
                }
#endif
                float x[512];
                for (int64_t r = 0; r < R; r++) {
                    float dot = 0.f;
                    for (int64_t i0 = 0; i0 < F; i0 += 512) {
                        const int64_t n = F - i0 < 512 ? F - i0 : 512;
                        load_params(f + i0 * size, kind, 0, n, x);
                        for (int64_t i = 0; i < n; i++) dot += q[r * F + i0 + i] * x[i];
                    }
                    best = r == 0 || dot > best ? dot : best;
                }
                out[p] = best;
            }
        }
    }
    free(expanded);
    return 0;
}

/* Quickselect: reorder idx[0..n) so that its first k entries index the k largest values. */
static void select_largest(const float *values, int64_t *idx, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = values[idx[lo + (hi - lo) / 2]];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (values[idx[i]] > pivot) i++;
            while (values[idx[j]] < pivot) j--;
            if (i <= j) {
                const int64_t t = idx[i];
                idx[i] = idx[j];
                idx[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

/* For each of `rows` score rows of length P: the indices of the k largest of scores[lo..hi),
 * unordered, into out [rows, k] (k <= hi - lo). NaN scores count as the smallest. Returns -1 if
 * its working memory cannot be allocated. */
int top_pages(int64_t rows, int64_t P, const float *scores, int64_t lo, int64_t hi, int64_t k, int64_t *out) {
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(hi - lo));
    float *values = malloc(sizeof(float) * (size_t)(hi - lo));
    if (!idx || !values) {
        free(idx);
        free(values);
        return -1;
    }
    for (int64_t row = 0; row < rows; row++) {
        const float *s = scores + row * P;
        for (int64_t i = 0; i < hi - lo; i++) {
            idx[i] = i;
            values[i] = s[lo + i] == s[lo + i] ? s[lo + i] : -__builtin_inff();
        }
        select_largest(values, idx, hi - lo, k);
        for (int64_t i = 0; i < k; i++) out[row * k + i] = idx[i] + lo;
    }
    free(idx);
    free(values);
    return 0;
}

/* x[i] = exp(x[i] - m) for i < n (every x[i] <= m); returns their sum. */
static float exp_shifted(float *x, int64_t n, float m) {
    int64_t i = 0;
    float total = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    total = _mm512_reduce_add_ps(acc);
#elif defined(AVX2)
    __m256 acc = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = reduce_add8(acc);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - m);
        total += x[i];
    }
    return total;
}

/* The log of each page's estimated attention share from per-token int8 codes (OVAL's query scorer,
 * kvfactory/selectors/oval/lowrank.py): for each (b, h), each of the R rows (a query head's
 * projected query, code scales folded in, C floats) scores the T stored tokens, the rows' softmaxes
 * over the tokens are averaged, and the shares are summed per page of `page` tokens:
 * out[b, h, p] = log(share of page p), P = ceil(T / page), floored at the smallest normal float.
 * rows: float32 [B, H, R, C] contiguous; codes: int8, channel-major [B, H, C, T] with element
 * strides (cb, ch, cc), the tokens contiguous; out: float32 [B, H, P] contiguous. Returns -1 if the
 * scratch rows cannot be allocated, else 0. Each row's logits are summed one channel at a time over
 * all tokens (a contiguous pass each, which vectorises), then exponentiated in place. */
int token_shares(int64_t B, int64_t H, int64_t R, int64_t C, int64_t T, int64_t page, const float *rows,
                 const int8_t *codes, int64_t cb, int64_t ch, int64_t cc, float *out) {
    float *logits = malloc(sizeof(float) * (size_t)(R * T + R));
    if (!logits) return -1;
    float *weight = logits + R * T;  /* 1 / (R * sum of each row's exps) */
    const int64_t P = (T + page - 1) / page;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const int8_t *code = codes + b * cb + h * ch;
            const float *q = rows + (b * H + h) * R * C;
            for (int64_t r = 0; r < R; r++) {
                float *l = logits + r * T;
                const float *qr = q + r * C;
                const float q0 = qr[0];
#pragma omp simd
                for (int64_t t = 0; t < T; t++) l[t] = q0 * (float)code[t];
                for (int64_t c = 1; c < C; c++) {
                    const float qc = qr[c];
                    const int8_t *k = code + c * cc;
#pragma omp simd
                    for (int64_t t = 0; t < T; t++) l[t] += qc * (float)k[t];
                }
                float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < T; t++) m = l[t] > m ? l[t] : m;
                weight[r] = 1.f / ((float)R * exp_shifted(l, T, m));
            }
            float *o = out + (b * H + h) * P;
            for (int64_t p = 0; p < P; p++) {
                const int64_t end = (p + 1) * page < T ? (p + 1) * page : T;
                float share = 0.f;
                for (int64_t r = 0; r < R; r++) {
                    const float *e = logits + r * T;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t t = p * page; t < end; t++) s += e[t];
                    share += s * weight[r];
                }
                o[p] = logf(share > 1.17549435e-38f ? share : 1.17549435e-38f);
            }
        }
    }
    free(logits);
    return 0;
}
