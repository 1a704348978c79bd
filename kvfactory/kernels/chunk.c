/* A prefill chunk's causal attention over its stored tokens and itself, on the CPU, in float32.
 *
 * The chunk's C queries are the last C of T positions; query position i sees keys [0, T - C + i].
 * FlashAttention's tiling (Dao et al. 2022): a tile of query positions, taken for every query head
 * of one KV head's group (GQA: the group's rows share each K/V row; about ROWS rows in all), meets
 * the keys KT at a time; each key tile's scores, their online softmax (a running maximum and sum per row, one
 * rescale per tile) and their value sums are computed before the next. Key tiles past a query
 * tile's last visible key are never computed, so the causal half costs nothing (SDPA's CPU kernel
 * computes 512-key blocks whole). Both products are register-blocked matrix products: the keys are
 * transposed once per call so that scores vectorise over keys (12 rows by 32 keys), the value sums
 * over channels (6 rows by 64 channels). Only the AVX-512 body exists: elsewhere chunk_attention
 * returns 0 and the caller runs SDPA.
 * Built by kvfactory/kernels/__init__.py, called by kvfactory/attention.py.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

#define ROWS 48 /* query rows per tile: positions times the group's heads, a multiple of SR where it can be */
#define KT 256 /* keys per tile */
#define SR 12  /* score rows per register block */
#define VR 6   /* value-sum rows per register block */

#if defined(__AVX512F__)
/* s[r * KT + j] = qs[r] . key j for SR rows (qs [SR, D], row stride D) and the 32 keys at kt, the
 * keys transposed (kt[d * ld + j]). */
static inline __attribute__((always_inline)) void score_block(const int64_t D, const float *qs, const float *kt,
                                                              int64_t ld, float *s) {
    __m512 acc[SR][2];
    for (int r = 0; r < SR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * ld), k1 = _mm512_loadu_ps(kt + d * ld + 16);
        for (int r = 0; r < SR; r++) {
            const __m512 q = _mm512_set1_ps(qs[r * D + d]);
            acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < SR; r++) {
        _mm512_storeu_ps(s + r * KT, acc[r][0]);
        _mm512_storeu_ps(s + r * KT + 16, acc[r][1]);
    }
}

/* o[r, c0:c0+64] = o[r, c0:c0+64] * corr[r] + sum_j p[r * KT + j] v[j, c0:c0+64] for VR rows (o row
 * stride D) over n keys (v row stride vt). */
static inline void value_block(const float *p, const float *corr, const float *v, int64_t vt, int64_t n,
                               float *o, int64_t D) {
    __m512 acc[VR][4];
    for (int r = 0; r < VR; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 16), _mm512_set1_ps(corr[r]));
    for (int64_t j = 0; j < n; j++) {
        __m512 vj[4];
        for (int c = 0; c < 4; c++) vj[c] = _mm512_loadu_ps(v + j * vt + c * 16);
        for (int r = 0; r < VR; r++) {
            const __m512 w = _mm512_set1_ps(p[r * KT + j]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(w, vj[c], acc[r][c]);
        }
    }
    for (int r = 0; r < VR; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

/* Row r's scores s[0, n) become exp(score - top) for its first `seen` keys and 0 after them (keys it
 * may not see), top its new running maximum; returns corr = exp(old maximum - top) and updates its
 * maximum m and sum l. A row that sees none of the tile keeps its state (corr 1). */
static inline float softmax_row(float *s, int64_t n, int64_t seen, float *m, float *l) {
    if (seen <= 0) {
        for (int64_t j = 0; j < n; j++) s[j] = 0.f;
        return 1.f;
    }
    seen = seen < n ? seen : n;
    __m512 most = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; j += 16) {
        const __mmask16 live = seen - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (seen - j)) - 1);
        most = _mm512_mask_max_ps(most, live, most, _mm512_maskz_loadu_ps(live, s + j));
    }
    const float top = fmaxf(*m, _mm512_reduce_max_ps(most));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = j >= seen ? 0 : seen - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (seen - j)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(top))));
        _mm512_storeu_ps(s + j, p);
        sums = _mm512_add_ps(sums, p);
    }
    const float corr = expf(*m - top);  /* 0 on the row's first tile, where m is -inf */
    *l = *l * corr + _mm512_reduce_add_ps(sums);
    *m = top;
    return corr;
}
#endif

/* out[i, h] = softmax(scale * query[h, i] . K_g^T, causal) V_g for the C query positions i of query
 * head h (KV head g = h / (Hq / Hkv)), K_g / V_g its T keys and values. query: float32, element
 * [h, i, d] at h * qh + i * qc + d; key / value: [g, t, d] at g * kh + t * kt + d (likewise vh, vt);
 * out: [C, Hq, D] contiguous float32. Returns 1, or 0 without touching out where this build has no
 * AVX-512 body, D is not a multiple of 64 or memory for the tiles runs out. C <= T is checked by the
 * caller. */
int chunk_attention(int64_t Hq, int64_t Hkv, int64_t C, int64_t T, int64_t D, const float *query, int64_t qh,
                    int64_t qc, const float *key, int64_t kh, int64_t kt, const float *value, int64_t vh,
                    int64_t vt, float scale, float *out) {
#if defined(__AVX512F__)
    if (D % 64 != 0) return 0;
    const int64_t R = Hq / Hkv, QP = R < ROWS ? ROWS / R : 1, rows = R * QP, padded = (rows + SR - 1) / SR * SR;
    const int64_t ld = (T + 31) / 32 * 32;
    float *keys = aligned_alloc(64, (size_t)(D * ld + padded * KT + 2 * padded * D) * sizeof(float));
    float *m = malloc((size_t)(2 * padded + VR) * sizeof(float)), *corr = malloc((size_t)padded * sizeof(float));
    if (!keys || !m || !corr) {
        free(keys);
        free(m);
        free(corr);
        return 0;
    }
    float *s = keys + D * ld, *qs = s + padded * KT, *o = qs + padded * D, *l = m + padded;
    for (int64_t g = 0; g < Hkv; g++) {
        for (int64_t t = 0; t < ld; t++)  /* the head's keys transposed, zero past T */
            for (int64_t d = 0; d < D; d++) keys[d * ld + t] = t < T ? key[g * kh + t * kt + d] : 0.f;
        for (int64_t i0 = 0; i0 < C; i0 += QP) {
            const int64_t n = C - i0 < QP ? C - i0 : QP, live = n * R, end = T - C + i0 + n;
            for (int64_t row = 0; row < padded; row++) {  /* row = i * R + r: position i0 + i, head g * R + r */
                const float *q = query + (g * R + row % R) * qh + (i0 + row / R) * qc;
                for (int64_t d = 0; d < D; d++) {
                    qs[row * D + d] = row < live ? q[d] * scale : 0.f;
                    o[row * D + d] = 0.f;
                }
                m[row] = -INFINITY;
                l[row] = 0.f;
            }
            for (int64_t k0 = 0; k0 < end; k0 += KT) {
                const int64_t nk = end - k0 < KT ? end - k0 : KT, blocks = (nk + 31) / 32;
                for (int64_t row = 0; row < padded; row += SR)
                    for (int64_t b = 0; b < blocks; b++) score_block(D, qs + row * D, keys + k0 + b * 32, ld, s + row * KT + b * 32);
                for (int64_t row = 0; row < padded; row++) {  /* position i0 + i sees keys [0, T - C + i0 + i] */
                    const int64_t seen = row < live ? T - C + i0 + row / R + 1 - k0 : 0;
                    corr[row] = softmax_row(s + row * KT, blocks * 32, seen, m + row, l + row);
                }
                for (int64_t row = 0; row < padded; row += VR)
                    for (int64_t c = 0; c < D; c += 64)
                        value_block(s + row * KT, corr + row, value + g * vh + k0 * vt + c, vt, nk, o + row * D + c, D);
            }
            for (int64_t row = 0; row < live; row++) {
                float *dst = out + ((i0 + row / R) * Hq + g * R + row % R) * D;
                const float inv = 1.f / l[row];
                for (int64_t d = 0; d < D; d++) dst[d] = o[row * D + d] * inv;
            }
        }
    }
    free(keys);
    free(m);
    free(corr);
    return 1;
#else
    (void)Hq, (void)Hkv, (void)C, (void)T, (void)D, (void)query, (void)qh, (void)qc, (void)key, (void)kh;
    (void)kt, (void)value, (void)vh, (void)vt, (void)scale, (void)out;
    return 0;
#endif
}
