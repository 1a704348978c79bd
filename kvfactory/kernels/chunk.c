/* A prefill chunk's causal attention over its stored tokens and itself, on the CPU, in float32.
 *
 * The chunk's C queries are the last C of T positions; query position i sees keys [0, T - C + i].
 * FlashAttention's tiling (Dao et al. 2022): a tile of query positions, taken for every query head
 * of one KV head's group (GQA: the group's rows share each K/V row; about ROWS rows in all), meets
 * the keys KT at a time; each key tile's scores, their online softmax (a running maximum and sum
 * per row, one rescale per tile) and their value sums are computed before the next. Key tiles past
 * a query tile's last visible key are never computed, so the causal half costs nothing (SDPA's CPU
 * kernel computes 512-key blocks whole). Both products are register-blocked matrix products: the
 * keys are transposed once per call (16 x 16 in registers) so that scores vectorise over keys (12
 * rows by 32 keys), the value sums over channels (6 rows by 64 channels). The same kernel reads the
 * blocks that a batch of decoding sequences shares (causal 0, through a block table). Only the
 * AVX-512 body exists: elsewhere chunk_attention returns 0 and the caller takes its other path.
 * Built by kvfactory/kernels/__init__.py, called by kvfactory/attention.py and
 * kvfactory/storage/ragged.py.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

#define ROWS 192 /* query rows per tile: positions times the group's heads, a multiple of SR where it can be; each
                  * key tile is read from L2 once per query tile, so long contexts want many rows */
#define KT 128 /* keys per tile */
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

/* o[r, c:c+64] = o[r, c:c+64] * corr[r] + sum_j p[r * KT + j] v_j[c:c+64] for VR rows (o row stride D)
 * over n keys, key j's value row at vrows[j]. */
static inline void value_block(const float *p, const float *corr, const float **vrows, int64_t c, int64_t n,
                               float *o, int64_t D) {
    __m512 acc[VR][4];
    for (int r = 0; r < VR; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + i * 16), _mm512_set1_ps(corr[r]));
    for (int64_t j = 0; j < n; j++) {
        __m512 vj[4];
        for (int i = 0; i < 4; i++) vj[i] = _mm512_loadu_ps(vrows[j] + c + i * 16);
        for (int r = 0; r < VR; r++) {
            const __m512 w = _mm512_set1_ps(p[r * KT + j]);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_fmadd_ps(w, vj[i], acc[r][i]);
        }
    }
    for (int r = 0; r < VR; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(o + r * D + i * 16, acc[r][i]);
}

/* r[0..16), 16 rows of 16 floats, transposed in place: 32-bit, then 64-bit interleaves within
 * 128-bit lanes give each lane four rows' element, then a 4 x 4 transpose of the lanes. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* r[4i + k], lane L: element 4L + k of rows 4i .. 4i + 3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int k = 0; k < 4; k++) {
        const __m512 e = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), f = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xee);
        const __m512 g = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44), h = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xee);
        t[k] = _mm512_shuffle_f32x4(e, g, 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(e, g, 0xdd);
        t[8 + k] = _mm512_shuffle_f32x4(f, h, 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(f, h, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif

/* Where token t of a KV head starting at `head` lies: row t of a contiguous [T, D] (table NULL), else
 * row t % P of block table[t / P] of a pool [num_blocks, P, D]; rows `stride` floats apart. */
static inline const float *token_row(const float *head, const int64_t *table, int64_t P, int64_t stride, int64_t t) {
    return head + (table ? table[t / P] * P + t % P : t) * stride;
}

/* 1 where this build has chunk_attention's AVX-512 body, so a caller can skip preparing its inputs
 * (decoding packed pages, say) where the call would only return 0. */
int chunk_has_body(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* out[i, h] = softmax(scale * query[h, i] . K_g^T) V_g for the C query positions i of query head h
 * (KV head g = h / (Hq / Hkv)) over the T tokens of K_g / V_g: causally (position i sees tokens
 * [0, T - C + i], a prefill chunk's last C positions) or, with causal 0, every position all T (a
 * batch of decoding sequences, one position each, over the blocks they all share). query: float32,
 * element [h, i, d] at h * qh + i * qc + d. key / value: float32, token t of KV head g at key + g * kh
 * (value + g * vh) and then as token_row places it (table, P; rows kt / vt floats apart). out:
 * [C, Hq, D] contiguous float32; lse, unless NULL: [C, Hq] float32, each row's log-sum-exp of its
 * scores (for merging with attention over other tokens). Returns 1, or 0 without touching out where
 * this build has no AVX-512 body, D is not a multiple of 64 or memory for the tiles runs out.
 * 1 <= C <= T (causal), T >= 1 and the table's ids are checked by the caller. */
int chunk_attention(int64_t Hq, int64_t Hkv, int64_t C, int64_t T, int64_t D, const float *query, int64_t qh,
                    int64_t qc, const float *key, int64_t kh, int64_t kt, const float *value, int64_t vh,
                    int64_t vt, const int64_t *table, int64_t P, int causal, float scale, float *out, float *lse) {
#if defined(__AVX512F__)
    if (D % 64 != 0) return 0;
    const int64_t R = Hq / Hkv, QP = R < ROWS ? ROWS / R : 1, rows = R * QP, padded = (rows + SR - 1) / SR * SR;
    const int64_t ld = (T + 31) / 32 * 32;
    float *keys = aligned_alloc(64, (size_t)(D * ld + padded * KT + 2 * padded * D) * sizeof(float));
    float *m = malloc((size_t)(2 * padded) * sizeof(float)), *corr = malloc((size_t)padded * sizeof(float));
    const float **vrows = malloc(KT * sizeof(float *));
    if (!keys || !m || !corr || !vrows) {
        free(keys);
        free(m);
        free(corr);
        free(vrows);
        return 0;
    }
    float *s = keys + D * ld, *qs = s + padded * KT, *o = qs + padded * D, *l = m + padded;
    for (int64_t g = 0; g < Hkv; g++) {
        for (int64_t t0 = 0; t0 < ld; t0 += 16) {  /* the head's keys transposed, zero past T */
            const float *from[16];
            for (int64_t x = 0; x < 16; x++) from[x] = t0 + x < T ? token_row(key + g * kh, table, P, kt, t0 + x) : NULL;
            for (int64_t d = 0; d < D; d += 16) {
                __m512 r[16];
                for (int64_t x = 0; x < 16; x++) r[x] = from[x] ? _mm512_loadu_ps(from[x] + d) : _mm512_setzero_ps();
                transpose16(r);
                for (int64_t x = 0; x < 16; x++) _mm512_storeu_ps(keys + (d + x) * ld + t0, r[x]);
            }
        }
        for (int64_t i0 = 0; i0 < C; i0 += QP) {
            const int64_t n = C - i0 < QP ? C - i0 : QP, live = n * R, end = causal ? T - C + i0 + n : T;
            const int64_t used = (live + SR - 1) / SR * SR;  /* rows computed: a short last tile takes fewer */
            for (int64_t row = 0; row < used; row++) {  /* row = i * R + r: position i0 + i, head g * R + r */
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
                for (int64_t j = 0; j < nk; j++) vrows[j] = token_row(value + g * vh, table, P, vt, k0 + j);
                for (int64_t row = 0; row < used; row += SR)
                    for (int64_t b = 0; b < blocks; b++) score_block(D, qs + row * D, keys + k0 + b * 32, ld, s + row * KT + b * 32);
                for (int64_t row = 0; row < used; row++) {  /* causal: position i0 + i sees [0, T - C + i0 + i] */
                    const int64_t seen = row >= live ? 0 : causal ? T - C + i0 + row / R + 1 - k0 : nk;
                    corr[row] = softmax_step(s + row * KT, blocks * 32, seen, m + row, l + row);
                }
                for (int64_t row = 0; row < used; row += VR)
                    for (int64_t c = 0; c < D; c += 64) value_block(s + row * KT, corr + row, vrows, c, nk, o + row * D + c, D);
            }
            for (int64_t row = 0; row < live; row++) {
                const int64_t at = (i0 + row / R) * Hq + g * R + row % R;
                const float inv = 1.f / l[row];
                for (int64_t d = 0; d < D; d++) out[at * D + d] = o[row * D + d] * inv;
                if (lse) lse[at] = m[row] + logf(l[row]);
            }
        }
    }
    free(keys);
    free(m);
    free(corr);
    free(vrows);
    return 1;
#else
    (void)Hq, (void)Hkv, (void)C, (void)T, (void)D, (void)query, (void)qh, (void)qc, (void)key, (void)kh;
    (void)kt, (void)value, (void)vh, (void)vt, (void)table, (void)P, (void)causal, (void)scale, (void)out;
    (void)lse;
    return 0;
#endif
}
