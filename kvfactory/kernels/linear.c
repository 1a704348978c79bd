/* A linear layer on one thread, y = x W^T + b, over a weight laid out in panels of 32 output columns:
 * panel p holds columns 32p .. 32p+31 as [K][32], so a panel streams from memory once, in order, and
 * each k multiplies two vectors of weights by the same input value of every row taken together.
 *
 * A decode step multiplies few rows by every weight: the work is reading the weights, so up to 16 rows
 * (two accumulators a row) take each panel in one pass. A prefill chunk multiplies hundreds of rows:
 * they go in blocks of 64, which stay in the L2 cache while every panel passes over them, 8 rows at a
 * time. AVX-512 only: elsewhere linear_has_body() is 0 and callers keep their GEMM.
 *
 * Each k also prefetches the panel AHEAD floats on into L2 by hand: the hardware prefetcher alone, with
 * the multiply-adds of 8 rows between a panel's 128-byte rows, streams it at about two thirds of the
 * core's read rate (benchmarks/linear_layouts.py). */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>

enum { PANEL = 32, ROWS = 8, WIDE = 16, BLOCK = 64, AHEAD = 512 /* 2 KiB: 16 k ahead */ };

#define ROW_KERNEL(MR)                                                                                \
    static void rows##MR(int64_t K, const float *x, int64_t xs, const float *w, const float *bias,    \
                         float *out, int64_t os) {                                                    \
        __m512 acc[MR][2];                                                                            \
        __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                               \
        __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();                          \
        for (int m = 0; m < MR; m++) acc[m][0] = b0, acc[m][1] = b1;                                   \
        for (int64_t k = 0; k < K; k++) {                                                             \
            _mm_prefetch((const char *)(w + k * PANEL + AHEAD), _MM_HINT_T1);                          \
            _mm_prefetch((const char *)(w + k * PANEL + AHEAD + 16), _MM_HINT_T1);                     \
            __m512 w0 = _mm512_loadu_ps(w + k * PANEL), w1 = _mm512_loadu_ps(w + k * PANEL + 16);     \
            for (int m = 0; m < MR; m++) {                                                            \
                __m512 v = _mm512_set1_ps(x[m * xs + k]);                                             \
                acc[m][0] = _mm512_fmadd_ps(v, w0, acc[m][0]);                                        \
                acc[m][1] = _mm512_fmadd_ps(v, w1, acc[m][1]);                                        \
            }                                                                                         \
        }                                                                                             \
        for (int m = 0; m < MR; m++) {                                                                \
            _mm512_storeu_ps(out + m * os, acc[m][0]);                                                \
            _mm512_storeu_ps(out + m * os + 16, acc[m][1]);                                           \
        }                                                                                             \
    }
ROW_KERNEL(1) ROW_KERNEL(2) ROW_KERNEL(3) ROW_KERNEL(4) ROW_KERNEL(5) ROW_KERNEL(6) ROW_KERNEL(7) ROW_KERNEL(8)
ROW_KERNEL(9) ROW_KERNEL(10) ROW_KERNEL(11) ROW_KERNEL(12) ROW_KERNEL(13) ROW_KERNEL(14) ROW_KERNEL(15) ROW_KERNEL(16)

typedef void (*row_kernel)(int64_t, const float *, int64_t, const float *, const float *, float *, int64_t);
static const row_kernel KERNELS[WIDE + 1] = {0, rows1, rows2, rows3, rows4, rows5, rows6, rows7, rows8, rows9,
                                             rows10, rows11, rows12, rows13, rows14, rows15, rows16};
#endif

int linear_has_body(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* out [M, N] (row stride os) = x [M, K] (row stride xs) times the weight in panels, w [N / 32, K, 32],
 * plus bias [N] (or NULL). Returns 0 without a body or when N is not a multiple of 32. */
int rows_linear(int64_t M, int64_t N, int64_t K, const float *x, int64_t xs, const float *w,
                const float *bias, float *out, int64_t os) {
#if defined(__AVX512F__)
    if (N % PANEL != 0) return 0;
    if (M <= WIDE) {  /* a decode step: each panel read once for all its rows */
        for (int64_t p = 0; p < N / PANEL && M > 0; p++)
            KERNELS[M](K, x, xs, w + p * K * PANEL, bias ? bias + p * PANEL : 0, out + p * PANEL, os);
        return 1;
    }
    for (int64_t b = 0; b < M; b += BLOCK) {
        int64_t end = M - b < BLOCK ? M : b + BLOCK;
        for (int64_t p = 0; p < N / PANEL; p++) {
            const float *panel = w + p * K * PANEL;
            const float *pb = bias ? bias + p * PANEL : 0;
            for (int64_t m = b; m < end; m += ROWS) {
                int64_t rows = end - m < ROWS ? end - m : ROWS;
                KERNELS[rows](K, x + m * xs, xs, panel, pb, out + m * os + p * PANEL, os);
            }
        }
    }
    return 1;
#else
    (void)M, (void)N, (void)K, (void)x, (void)xs, (void)w, (void)bias, (void)out, (void)os;
    return 0;
#endif
}
