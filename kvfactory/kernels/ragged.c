/* Decode attention over a ragged batch, read in place from a paged pool (vLLM's PagedAttention,
 * Kwon et al. 2023).
 *
 * Each sequence of the batch has one query token and its own run of blocks in a layer's pool
 * [Hkv, num_blocks, P, D]; its attention is computed straight from those blocks, with no padded
 * copy of the batch. Blocks are read 16 tokens at a time (a chunk, rows contiguous within a block)
 * under an online softmax: each query row keeps its running maximum, the sum of its exponentials
 * and its weighted sum of values, rescaled when the maximum grows. The query heads sharing a KV
 * head are taken together, so each chunk of K/V comes from memory once per group and is then read
 * from L1 by every head. float16 and bfloat16 chunks are converted once per group into float32.
 * A sequence's blocks lie anywhere in the pool, so the next ones are prefetched by hand.
 * Built by kvfactory/kernels/__init__.py, called by kvfactory/storage/ragged.py.
 */
#include <math.h>

#include "common.h"

#define MAX_DIM 512  /* channels per head; checked by the caller */
#define MAX_GROUP 16 /* query heads taken together; larger groups go in slices of this many */
#define CHUNK 16     /* tokens per online-softmax step */
#define AHEAD 2      /* blocks prefetched ahead */
#define AHEAD_BYTES 4096  /* of each of their K and V, the first this many (the hardware streams the rest) */

/* One chunk of n <= CHUNK tokens (k, v: [n, D] float32) for R query rows (q: [R, D], scaled),
 * updating their running maxima m, sums l and value sums acc [R, D]. */
static inline __attribute__((always_inline)) void chunk_portable(const float *q, int64_t R, int64_t D,
                                                                 const float *k, const float *v, int64_t n,
                                                                 float *m, float *l, float *acc) {
    for (int64_t r = 0; r < R; r++) {
        const float *qr = q + r * D;
        float s[CHUNK], top = m[r];
        for (int64_t j = 0; j < n; j++) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qr[d] * k[j * D + d];
            s[j] = dot;
            top = dot > top ? dot : top;
        }
        const float corr = expf(m[r] - top);  /* 0 on the first chunk, where m[r] is -inf */
        float sum = 0.f, *ar = acc + r * D;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        l[r] = l[r] * corr + sum;
        m[r] = top;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) ar[d] *= corr;
        for (int64_t j = 0; j < n; j++) {
            const float p = s[j];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ar[d] += p * v[j * D + d];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define AVX512 1

/* RB query rows' value sums over one chunk: acc[r] = acc[r] * corr[r] + sum_j w[r, j] v[j] for rows of
 * NV 16-channel vectors. The rows are taken together so each value vector is loaded once for all of
 * them, and their RB * NV sums are independent chains that keep the FMA units busy. */
static inline __attribute__((always_inline)) void value_chunk_avx(const int RB, const int64_t NV, const float *w,
                                                                 const float *corr, const float *v, int64_t n,
                                                                 float *acc) {
    __m512 a[4][MAX_DIM / 16];
    for (int r = 0; r < RB; r++)
        for (int64_t i = 0; i < NV; i++)
            a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r * NV + i) * 16), _mm512_set1_ps(corr[r]));
    for (int64_t j = 0; j < n; j++) {
        __m512 wj[4];
        for (int r = 0; r < RB; r++) wj[r] = _mm512_set1_ps(w[r * CHUNK + j]);
        for (int64_t i = 0; i < NV; i++) {
            const __m512 vi = _mm512_loadu_ps(v + (j * NV + i) * 16);
            for (int r = 0; r < RB; r++) a[r][i] = _mm512_fmadd_ps(wj[r], vi, a[r][i]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int64_t i = 0; i < NV; i++) _mm512_storeu_ps(acc + (r * NV + i) * 16, a[r][i]);
}

/* chunk_portable in AVX-512 for D = 16 NV channels: a row's 16 scores accumulate side by side (one
 * independent chain per token) and are summed in one vector and exponentiated at once; then the
 * value sums of up to four rows at a time (value_chunk_avx). */
static inline __attribute__((always_inline)) void chunk_avx(const float *q, int64_t R, const int64_t NV,
                                                            const float *k, const float *v, int64_t n,
                                                            float *m, float *l, float *acc) {
    const __mmask16 live = n == CHUNK ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    float w[MAX_GROUP * CHUNK] __attribute__((aligned(64))), corr[MAX_GROUP];
    for (int64_t r = 0; r < R; r++) {
        __m512 qv[MAX_DIM / 16], dots[CHUNK];
        for (int64_t i = 0; i < NV; i++) qv[i] = _mm512_loadu_ps(q + (r * NV + i) * 16);
        for (int64_t j = 0; j < CHUNK; j++) {
            dots[j] = _mm512_setzero_ps();
            if (j < n)
                for (int64_t i = 0; i < NV; i++) dots[j] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + (j * NV + i) * 16), dots[j]);
        }
        const __m512 s = sums16(dots);
        const float top = fmaxf(m[r], _mm512_mask_reduce_max_ps(live, s));
        corr[r] = expf(m[r] - top);  /* 0 on the first chunk, where m[r] is -inf */
        const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(top))));
        _mm512_store_ps(w + r * CHUNK, p);
        l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(p);
        m[r] = top;
    }
    const int64_t RB = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
    for (int64_t r = 0; r < R; r += RB) {
        const int64_t rows = R - r < RB ? R - r : RB;
        float *ar = acc + r * NV * 16;
        if (rows == 4) value_chunk_avx(4, NV, w + r * CHUNK, corr + r, v, n, ar);
        else if (rows == 3) value_chunk_avx(3, NV, w + r * CHUNK, corr + r, v, n, ar);
        else if (rows == 2) value_chunk_avx(2, NV, w + r * CHUNK, corr + r, v, n, ar);
        else value_chunk_avx(1, NV, w + r * CHUNK, corr + r, v, n, ar);
    }
}
#endif

#ifdef AVX2
/* value_chunk_avx in AVX2: RB rows by up to four 8-channel vectors at a time (so their sums, the
 * weights' broadcasts and one value vector fit in the 16 registers). */
static inline __attribute__((always_inline)) void value_chunk_avx2(const int RB, const int64_t NV, const float *w,
                                                                  const float *corr, const float *v, int64_t n,
                                                                  float *acc) {
    for (int64_t i0 = 0; i0 < NV; i0 += 4) {
        const int64_t width = NV - i0 < 4 ? NV - i0 : 4;
        __m256 a[3][4];
        for (int r = 0; r < RB; r++)
            for (int64_t i = 0; i < width; i++)
                a[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r * NV + i0 + i) * 8), _mm256_set1_ps(corr[r]));
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < width; i++) {
                const __m256 vi = _mm256_loadu_ps(v + (j * NV + i0 + i) * 8);
                for (int r = 0; r < RB; r++) a[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(w[r * CHUNK + j]), vi, a[r][i]);
            }
        for (int r = 0; r < RB; r++)
            for (int64_t i = 0; i < width; i++) _mm256_storeu_ps(acc + (r * NV + i0 + i) * 8, a[r][i]);
    }
}

/* chunk_avx in AVX2 for D = 8 NV channels: a row's scores eight tokens at a time (one chain per
 * token, summed in one vector by sums8), exponentiated at once; then the value sums of up to three
 * rows at a time (value_chunk_avx2). */
static inline __attribute__((always_inline)) void chunk_avx2(const float *q, int64_t R, const int64_t NV,
                                                             const float *k, const float *v, int64_t n,
                                                             float *m, float *l, float *acc) {
    float w[MAX_GROUP * CHUNK] __attribute__((aligned(32))), corr[MAX_GROUP];
    for (int64_t r = 0; r < R; r++) {
        __m256 s[CHUNK / 8];
        for (int64_t h = 0; h < CHUNK / 8; h++) {
            __m256 dots[8];
            for (int64_t j = 0; j < 8; j++) {
                dots[j] = _mm256_setzero_ps();
                if (h * 8 + j < n)
                    for (int64_t i = 0; i < NV; i++)
                        dots[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (r * NV + i) * 8),
                                                  _mm256_loadu_ps(k + ((h * 8 + j) * NV + i) * 8), dots[j]);
            }
            s[h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sums8(dots),
                                    _mm256_castsi256_ps(live8(n - h * 8)));
        }
        const float top = fmaxf(m[r], reduce_max8(_mm256_max_ps(s[0], s[1])));
        corr[r] = expf(m[r] - top);  /* 0 on the first chunk, where m[r] is -inf */
        __m256 sum = _mm256_setzero_ps();
        for (int64_t h = 0; h < CHUNK / 8; h++) {
            const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(s[h], _mm256_set1_ps(top))),
                                           _mm256_castsi256_ps(live8(n - h * 8)));
            _mm256_store_ps(w + r * CHUNK + h * 8, p);
            sum = _mm256_add_ps(sum, p);
        }
        l[r] = l[r] * corr[r] + reduce_add8(sum);
        m[r] = top;
    }
    for (int64_t r = 0; r < R; r += 3) {
        const int64_t rows = R - r < 3 ? R - r : 3;
        float *ar = acc + r * NV * 8;
        if (rows == 3) value_chunk_avx2(3, NV, w + r * CHUNK, corr + r, v, n, ar);
        else if (rows == 2) value_chunk_avx2(2, NV, w + r * CHUNK, corr + r, v, n, ar);
        else value_chunk_avx2(1, NV, w + r * CHUNK, corr + r, v, n, ar);
    }
}
#endif

/* One sequence's R query rows q [R, D] (R <= MAX_GROUP) against the KV head whose blocks start at
 * k / v (that head's [num_blocks, P, D]); out [R, D]. D is a constant where inlined for the common
 * head sizes, so the AVX-512 loops unroll into registers. */
static inline __attribute__((always_inline)) void attend_rows(
        const int64_t D, int64_t R, const float *q, const char *k, const char *v, int kind, int64_t P,
        const int64_t *table, int64_t start, int64_t length, float scale, float *out, float *lse) {
    const int64_t size = param_size(kind);
    float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float kf[CHUNK * MAX_DIM], vf[CHUNK * MAX_DIM];
    for (int64_t i = 0; i < R * D; i++) {
        qs[i] = q[i] * scale;
        acc[i] = 0.f;
    }
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int64_t last = (start + length - 1) / P, bytes = P * D * size;
    for (int64_t t = start; t < start + length;) {
        const int64_t block = table[t / P], offset = t % P;
        if (t / P + AHEAD <= last) {  /* blocks are scattered, so no hardware prefetcher sees the next */
            const int64_t ahead = table[t / P + AHEAD] * bytes;
            for (int64_t i = 0; i < (bytes < AHEAD_BYTES ? bytes : AHEAD_BYTES); i += 64) {
                __builtin_prefetch(k + ahead + i);
                __builtin_prefetch(v + ahead + i);
            }
        }
        const int64_t end = start + length - t < P - offset ? start + length - t : P - offset;
        for (int64_t c = 0; c < end; c += CHUNK) {
            const int64_t n = end - c < CHUNK ? end - c : CHUNK, row = (block * P + offset + c) * D;
            const float *kc = (const float *)(k + row * size), *vc = (const float *)(v + row * size);
            if (kind != F32) {
                load_params(k + row * size, kind, 0, n * D, kf);
                load_params(v + row * size, kind, 0, n * D, vf);
                kc = kf;
                vc = vf;
            }
#ifdef AVX512
            if (D % 16 == 0) {
                chunk_avx(qs, R, D / 16, kc, vc, n, m, l, acc);
                continue;
            }
#endif
#ifdef AVX2
            if (D % 8 == 0) {
                chunk_avx2(qs, R, D / 8, kc, vc, n, m, l, acc);
                continue;
            }
#endif
            chunk_portable(qs, R, D, kc, vc, n, m, l, acc);
        }
        t += end;
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = length > 0 ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < D; d++) out[r * D + d] = acc[r * D + d] * inv;
        if (lse) lse[r] = length > 0 ? m[r] + logf(l[r]) : -INFINITY;
    }
}

/* out[s, h] = softmax(scale * query[s, h] . K_s^T) V_s for each of the S sequences, K_s / V_s being
 * KV head h / (Hq / Hkv) of tokens [starts[s], starts[s] + lengths[s]) counted from the start of the
 * sequence's first block, its blocks tables[s, 0..] ([S, max_blocks]). query, out: float32
 * [S, Hq, D] contiguous. k_pool, v_pool: [Hkv, num_blocks, P, D] contiguous, of dtype `kind` (F32,
 * F16 or BF16). A sequence of length 0 gets zeros. lse, unless NULL: [S, Hq] float32, each row's
 * log-sum-exp of its scores (-inf at length 0), for merging with attention over other tokens.
 * D <= MAX_DIM and the block ids are checked by the caller. */
void paged_decode(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, const float *query, const void *k_pool,
                  const void *v_pool, int kind, int64_t num_blocks, int64_t P, const int64_t *tables,
                  int64_t max_blocks, const int64_t *starts, const int64_t *lengths, float scale, float *out,
                  float *lse) {
    const int64_t group = Hq / Hkv, head = num_blocks * P * D * param_size(kind);
    for (int64_t s = 0; s < S; s++) {
        for (int64_t g = 0; g < Hkv; g++) {
            const char *k = (const char *)k_pool + g * head, *v = (const char *)v_pool + g * head;
            for (int64_t r = 0; r < group; r += MAX_GROUP) {
                const int64_t R = group - r < MAX_GROUP ? group - r : MAX_GROUP, at = (s * Hq + g * group + r) * D;
                const int64_t *table = tables + s * max_blocks;
                if (D == 64)
                    attend_rows(64, R, query + at, k, v, kind, P, table, starts[s], lengths[s], scale, out + at,
                                lse ? lse + at / D : NULL);
                else if (D == 128)
                    attend_rows(128, R, query + at, k, v, kind, P, table, starts[s], lengths[s], scale, out + at,
                                lse ? lse + at / D : NULL);
                else
                    attend_rows(D, R, query + at, k, v, kind, P, table, starts[s], lengths[s], scale, out + at,
                                lse ? lse + at / D : NULL);
            }
        }
    }
}
