/* Decode attention over a ragged batch, read in place from a paged pool (vLLM's PagedAttention,
 * Kwon et al. 2023).
 *
 * Each sequence of the batch has one query token and its own run of blocks in a layer's pool
 * [Hkv, num_blocks, P, D]; its attention is computed straight from those blocks, with no padded
 * copy of the batch. The query heads sharing a KV head are taken together, so each K/V row comes
 * from memory once per group and is then read from L1 by every head. Tokens are taken a tile of up
 * to TILE at a time, in three passes that carry no dependence from one token to the next: every
 * score of the tile (16 tokens' dot products summed into one vector at a time), then the tile's
 * softmax against each row's running maximum (FlashAttention's online softmax, Dao et al. 2022, one
 * rescale per tile), then the value sums, held in registers across the tile. float16 and bfloat16
 * rows are converted into float32 16 tokens at a time. A sequence's blocks may lie anywhere in the
 * pool: a block that does not continue the one before it in memory is prefetched by hand into L2, as
 * no hardware prefetcher sees it coming; one that does is left to the hardware, whose stream a
 * software prefetch would only crowd.
 * Built by kvfactory/kernels/__init__.py, called by kvfactory/storage/ragged.py.
 */
#include <math.h>

#include "common.h"

#define MAX_DIM 512  /* channels per head; checked by the caller */
#define MAX_GROUP 16 /* query heads taken together; larger groups go in slices of this many */
#define CHUNK 16     /* tokens scored (and converted from float16 / bfloat16) at a time */
#define TILE 1024    /* tokens per softmax step: R rows' scores stay in L2, and a sequence's K and V streams
                        * take turns rarely (a switch costs the hardware prefetcher its run-up) */
#define AHEAD 2      /* blocks prefetched ahead */
#define AHEAD_BYTES 4096  /* of each of their K and V, the first this many (the hardware streams the rest) */
#define INTO_L2 1    /* __builtin_prefetch's locality for them: L2, leaving L1's miss buffers to the loads */

/* A tile's tokens as runs of consecutive rows of the pool: run i is rows [row[i], row[i] + n[i]) of
 * the KV head's [num_blocks * P, D], n[i] <= CHUNK. */
typedef struct {
    int64_t row[TILE], n[TILE], runs;
} Runs;

/* The rows [first, first + n) of a KV head's K or V as float32: in place, or converted into buf. */
static inline const float *rows_f32(const char *base, int kind, int64_t D, int64_t first, int64_t n, float *buf) {
    const int64_t size = param_size(kind);
    if (kind == F32) return (const float *)(base + first * D * size);
    load_params(base + first * D * size, kind, 0, n * D, buf);
    return buf;
}

/* s[r * TILE + j] = qs[r] . k[j] for R rows (qs [R, D], scaled) and n <= CHUNK tokens k [n, D]. */
static inline __attribute__((always_inline)) void scores_chunk(const int64_t D, int64_t R, const float *qs,
                                                               const float *k, int64_t n, float *s) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        const int64_t NV = D / 16;
        const __mmask16 live = n == CHUNK ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        for (int64_t r = 0; r < R; r++) {
            __m512 qv[MAX_DIM / 16], dots[CHUNK];
            for (int64_t i = 0; i < NV; i++) qv[i] = _mm512_loadu_ps(qs + (r * NV + i) * 16);
            for (int64_t j = 0; j < CHUNK; j++) {
                dots[j] = _mm512_setzero_ps();
                if (j < n)
                    for (int64_t i = 0; i < NV; i++)
                        dots[j] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + (j * NV + i) * 16), dots[j]);
            }
            _mm512_mask_storeu_ps(s + r * TILE, live, sums16(dots));
        }
        return;
    }
#endif
#ifdef AVX2
    if (D % 8 == 0) {
        const int64_t NV = D / 8;
        for (int64_t r = 0; r < R; r++)
            for (int64_t h = 0; h * 8 < n; h++) {
                __m256 dots[8];
                for (int64_t j = 0; j < 8; j++) {
                    dots[j] = _mm256_setzero_ps();
                    if (h * 8 + j < n)
                        for (int64_t i = 0; i < NV; i++)
                            dots[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + (r * NV + i) * 8),
                                                      _mm256_loadu_ps(k + ((h * 8 + j) * NV + i) * 8), dots[j]);
                }
                _mm256_maskstore_ps(s + r * TILE + h * 8, live8(n - h * 8), sums8(dots));
            }
        return;
    }
#endif
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < n; j++) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qs[r * D + d] * k[j * D + d];
            s[r * TILE + j] = dot;
        }
}

#if defined(__AVX512F__)
#define AVX512 1
/* RB rows' value sums over a tile, for D = 16 NV channels: acc[r] = acc[r] * corr[r] +
 * sum_j w[r * TILE + j] v_j, the tile's value rows v_j read from the runs of the KV head at v. The
 * rows are taken together so each value vector is loaded once for all of them; their RB * NV sums
 * stay in registers for the whole tile, independent chains that keep the FMA units busy. */
static inline __attribute__((always_inline)) void values_avx(const int RB, const int64_t NV, const float *w,
                                                             const float *corr, const char *v, int kind,
                                                             const Runs *runs, float *buf, float *acc) {
    __m512 a[4][MAX_DIM / 16];
    for (int r = 0; r < RB; r++)
        for (int64_t i = 0; i < NV; i++)
            a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r * NV + i) * 16), _mm512_set1_ps(corr[r]));
    for (int64_t u = 0, t = 0; u < runs->runs; t += runs->n[u], u++) {
        const float *vc = rows_f32(v, kind, NV * 16, runs->row[u], runs->n[u], buf);
        for (int64_t j = 0; j < runs->n[u]; j++) {
            __m512 wj[4];
            for (int r = 0; r < RB; r++) wj[r] = _mm512_set1_ps(w[r * TILE + t + j]);
            for (int64_t i = 0; i < NV; i++) {
                const __m512 vi = _mm512_loadu_ps(vc + (j * NV + i) * 16);
                for (int r = 0; r < RB; r++) a[r][i] = _mm512_fmadd_ps(wj[r], vi, a[r][i]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int64_t i = 0; i < NV; i++) _mm512_storeu_ps(acc + (r * NV + i) * 16, a[r][i]);
}
#endif

#ifdef AVX2
/* values_avx in AVX2: RB rows by up to four 8-channel vectors at a time (so their sums, the weights'
 * broadcasts and one value vector fit in the 16 registers), the tile read once per four vectors. */
static inline __attribute__((always_inline)) void values_avx2(const int RB, const int64_t NV, const float *w,
                                                              const float *corr, const char *v, int kind,
                                                              const Runs *runs, float *buf, float *acc) {
    for (int64_t i0 = 0; i0 < NV; i0 += 4) {
        const int64_t width = NV - i0 < 4 ? NV - i0 : 4;
        __m256 a[3][4];
        for (int r = 0; r < RB; r++)
            for (int64_t i = 0; i < width; i++)
                a[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r * NV + i0 + i) * 8), _mm256_set1_ps(corr[r]));
        for (int64_t u = 0, t = 0; u < runs->runs; t += runs->n[u], u++) {
            const float *vc = rows_f32(v, kind, NV * 8, runs->row[u], runs->n[u], buf);
            for (int64_t j = 0; j < runs->n[u]; j++)
                for (int64_t i = 0; i < width; i++) {
                    const __m256 vi = _mm256_loadu_ps(vc + (j * NV + i0 + i) * 8);
                    for (int r = 0; r < RB; r++)
                        a[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(w[r * TILE + t + j]), vi, a[r][i]);
                }
        }
        for (int r = 0; r < RB; r++)
            for (int64_t i = 0; i < width; i++) _mm256_storeu_ps(acc + (r * NV + i0 + i) * 8, a[r][i]);
    }
}
#endif

/* acc[r] = acc[r] * corr[r] + sum_j w[r * TILE + j] v_j for R rows of D channels over the tile's runs
 * of the KV head at v. */
static inline __attribute__((always_inline)) void values_tile(const int64_t D, int64_t R, const float *w,
                                                              const float *corr, const char *v, int kind,
                                                              const Runs *runs, float *buf, float *acc) {
#ifdef AVX512
    if (D % 16 == 0) {
        const int64_t NV = D / 16, RB = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
        for (int64_t r = 0; r < R; r += RB) {
            const int64_t rows = R - r < RB ? R - r : RB;
            const float *wr = w + r * TILE;
            float *ar = acc + r * D;
            if (rows == 4) values_avx(4, NV, wr, corr + r, v, kind, runs, buf, ar);
            else if (rows == 3) values_avx(3, NV, wr, corr + r, v, kind, runs, buf, ar);
            else if (rows == 2) values_avx(2, NV, wr, corr + r, v, kind, runs, buf, ar);
            else values_avx(1, NV, wr, corr + r, v, kind, runs, buf, ar);
        }
        return;
    }
#endif
#ifdef AVX2
    if (D % 8 == 0) {
        for (int64_t r = 0; r < R; r += 3) {
            const int64_t rows = R - r < 3 ? R - r : 3;
            const float *wr = w + r * TILE;
            float *ar = acc + r * D;
            if (rows == 3) values_avx2(3, D / 8, wr, corr + r, v, kind, runs, buf, ar);
            else if (rows == 2) values_avx2(2, D / 8, wr, corr + r, v, kind, runs, buf, ar);
            else values_avx2(1, D / 8, wr, corr + r, v, kind, runs, buf, ar);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) acc[r * D + d] *= corr[r];
    for (int64_t u = 0, t = 0; u < runs->runs; t += runs->n[u], u++) {
        const float *vc = rows_f32(v, kind, D, runs->row[u], runs->n[u], buf);
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < runs->n[u]; j++) {
                const float p = w[r * TILE + t + j];
                float *ar = acc + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ar[d] += p * vc[j * D + d];
            }
    }
}

/* One sequence's R query rows q [R, D] (R <= MAX_GROUP) against the KV head whose blocks start at
 * k / v (that head's [num_blocks, P, D]); out [R, D]. D is a constant where inlined for the common
 * head sizes, so the AVX-512 loops unroll into registers. */
static inline __attribute__((always_inline)) void attend_rows(
        const int64_t D, int64_t R, const float *q, const char *k, const char *v, int kind, int64_t P,
        const int64_t *table, int64_t start, int64_t length, float scale, float *out, float *lse) {
    float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], m[MAX_GROUP], l[MAX_GROUP], corr[MAX_GROUP];
    float s[MAX_GROUP * TILE], buf[CHUNK * MAX_DIM];
    Runs runs;
    for (int64_t i = 0; i < R * D; i++) {
        qs[i] = q[i] * scale;
        acc[i] = 0.f;
    }
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int64_t end = start + length, last = (end - 1) / P, bytes = P * D * param_size(kind);
    for (int64_t t = start; t < end;) {
        int64_t n = 0;  /* the tile's tokens: its runs, and their scores */
        runs.runs = 0;
        while (t < end && n < TILE) {
            const int64_t at = t / P, offset = t % P;
            if (offset == 0 && at + AHEAD <= last && table[at + AHEAD] != table[at + AHEAD - 1] + 1) {
                const int64_t ahead = table[at + AHEAD] * bytes;
                for (int64_t i = 0; i < (bytes < AHEAD_BYTES ? bytes : AHEAD_BYTES); i += 64) {
                    __builtin_prefetch(k + ahead + i, 0, INTO_L2);
                    __builtin_prefetch(v + ahead + i, 0, INTO_L2);
                }
            }
            int64_t take = P - offset < end - t ? P - offset : end - t;
            take = take < CHUNK ? take : CHUNK;
            take = take < TILE - n ? take : TILE - n;
            const int64_t row = table[at] * P + offset;
            scores_chunk(D, R, qs, rows_f32(k, kind, D, row, take, buf), take, s + n);
            runs.row[runs.runs] = row;
            runs.n[runs.runs++] = take;
            n += take;
            t += take;
        }
        for (int64_t r = 0; r < R; r++) corr[r] = softmax_step(s + r * TILE, n, n, m + r, l + r);
        values_tile(D, R, s, corr, v, kind, &runs, buf, acc);
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
 * D <= MAX_DIM and the block ids are checked by the caller. KV heads are the outer loop, so blocks
 * that sequences share (a common prompt) are read from L2 by every sequence after the first. */
void paged_decode(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, const float *query, const void *k_pool,
                  const void *v_pool, int kind, int64_t num_blocks, int64_t P, const int64_t *tables,
                  int64_t max_blocks, const int64_t *starts, const int64_t *lengths, float scale, float *out,
                  float *lse) {
    const int64_t group = Hq / Hkv, head = num_blocks * P * D * param_size(kind);
    for (int64_t g = 0; g < Hkv; g++) {
        for (int64_t s = 0; s < S; s++) {
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
