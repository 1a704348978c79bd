/* Decode-step attention products straight from KIVI's packed codes, on the CPU.
 *
 * Built by kvfactory/kernels/__init__.py, called by kvfactory/codecs/native.py. Layouts are those
 * of kvfactory/codecs/kivi.py and packing.py:
 * P bytes hold the codes of Dp = P * 8 / bits channels in planes, byte j holding channel
 * j + k * P in bits [k * bits, (k + 1) * bits).
 *
 * Keys (per channel over groups of G tokens): a group's scores are
 *   q . (code * scale + zero) = (q * scale) . code + q . zero,
 * so the query is scaled once per group and each token costs one unpack and R dot products.
 * Values (per token over groups of channels): a token adds (p * scale) * code to the output, and
 * p * zero is summed per channel group and added once at the end.
 * Scales and zero points are read in their stored dtype (float32, float16, bfloat16, or FP8 through
 * a 256-entry table), so nothing is widened in memory per step.
 *
 * kivi_paged_decode runs both per block for a batch of decoding sequences, reading their pages in
 * place from a paged pool through block tables under an online softmax (kvfactory/quantization/
 * ragged.py merges its result with the full-precision window's); kivi_paged_dequantize decodes the
 * blocks that a batch's sequences all share, once, for a kernel that reads them for all at once.
 */
#include "common.h"

#define MAX_DIM 512  /* padded channels per head (Dp); checked by the caller */
#define MAX_ROWS 64  /* query rows per KV head (heads per group x query length); checked too */
#define MAX_BLOCK 256 /* tokens per quantized page in kivi_paged_decode; checked too */
#include <math.h>

/* One key group's query side: qs[r] = q[r] * scale (padded with zeros to Dp channels) and
 * c0[r] = q[r] . zero, from the group's stored scales and zero points. */
static inline void scale_query(const float *q, int64_t R, int64_t D, int64_t Dp, const char *scale, int skind,
                               const float *slut, const char *zero, int zkind, const float *zlut, float *qs,
                               float *c0) {
    float sc[MAX_DIM], ze[MAX_DIM];
    load_params(scale, skind, slut, D, sc);
    load_params(zero, zkind, zlut, D, ze);
    for (int64_t r = 0; r < R; r++) {
        float *qr = qs + r * Dp, acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; d++) {
            qr[d] = q[r * D + d] * sc[d];
            acc += q[r * D + d] * ze[d];
        }
        for (int64_t d = D; d < Dp; d++) qr[d] = 0.f;
        c0[r] = acc;
    }
}

/* Codes of one token (P bytes) as Dp floats in channel order. */
static inline void unpack(const uint8_t *codes, int64_t P, int bits, float *out) {
    if (bits == 4) {
#pragma omp simd
        for (int64_t j = 0; j < P; j++) {
            out[j] = (float)(codes[j] & 15);
            out[j + P] = (float)(codes[j] >> 4);
        }
    } else {
        for (int k = 0; k < 8 / bits; k++) {
            const int shift = k * bits, mask = (1 << bits) - 1;
#pragma omp simd
            for (int64_t j = 0; j < P; j++) out[k * P + j] = (float)((codes[j] >> shift) & mask);
        }
    }
}

/* One key group's scores: out[r * row + g] = c0[r] + qs[r] . code[g] for its G tokens. */
typedef void (*key_group_fn)(const float *qs, int64_t Dp, const float *c0, int64_t R, const uint8_t *group,
                             int64_t G, int64_t P, int bits, float *out, int64_t row);

static inline __attribute__((always_inline)) void key_group_portable(const float *qs, int64_t Dp, const float *c0,
                                                                     int64_t R, const uint8_t *group, int64_t G,
                                                                     int64_t P, int bits, float *out, int64_t row) {
    float cf[MAX_DIM] __attribute__((aligned(64)));
    for (int64_t g = 0; g < G; g++) {
        unpack(group + g * P, P, bits, cf);
        for (int64_t r = 0; r < R; r++) {
            const float *qr = qs + r * Dp;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < Dp; d++) acc += qr[d] * cf[d];
            out[r * row + g] = c0[r] + acc;
        }
    }
}

/* scores[b, h, r, n * G + g] = query[b, h, r, :] . key[b, h, n, g, :] for every stored token, one
 * group at a time by `step` (inlined: it is a constant at every call).
 * query: float [B, H, R, D] contiguous. codes: [B, H, N, G, P] with byte strides (cb, ch, cn) and
 * [G, P] contiguous. scale/zero: [B, H, N, 1, D] with element strides (sb, sh, sn), D contiguous.
 * scores: float, rows of stride `row` elements, [B, H, R] contiguous in rows.
 */
static inline __attribute__((always_inline)) void key_scores_loop(
        int64_t B, int64_t H, int64_t R, int64_t D, int bits, const float *query, const uint8_t *codes,
        int64_t cb, int64_t ch, int64_t cn, int64_t N, int64_t G, int64_t P, const void *scale, int skind,
        const float *slut, int64_t sb, int64_t sh, int64_t sn, const void *zero, int zkind, const float *zlut,
        int64_t zb, int64_t zh, int64_t zn, float *scores, int64_t row, key_group_fn step) {
    const int64_t Dp = P * (8 / bits);
    const int64_t ss = param_size(skind), zs = param_size(zkind);
    float qs[MAX_ROWS * MAX_DIM] __attribute__((aligned(64)));
    float c0[MAX_ROWS];
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float *q = query + (b * H + h) * R * D;
            float *out = scores + (b * H + h) * R * row;
            for (int64_t n = 0; n < N; n++) {
                scale_query(q, R, D, Dp, (const char *)scale + (b * sb + h * sh + n * sn) * ss, skind, slut,
                            (const char *)zero + (b * zb + h * zh + n * zn) * zs, zkind, zlut, qs, c0);
                step(qs, Dp, c0, R, codes + b * cb + h * ch + n * cn, G, P, bits, out + n * G, row);
            }
        }
    }
}

/* out[b, h, r, :] = sum_t probs[b, h, r, t] * value[b, h, t, :] over the T stored tokens.
 * probs: float rows of stride `row` elements, [B, H, R] contiguous in rows. codes: [B, H, T, P]
 * with byte strides (cb, ch, ct), P contiguous. scale/zero: [B, H, T, ceil(D / group)] with
 * element strides (sb, sh, st), the last dim contiguous. out: float [B, H, R, D] contiguous.
 */
static inline __attribute__((always_inline)) void value_sums_body(int64_t B, int64_t H, int64_t R, int64_t D, int bits, int64_t group, const float *probs,
                     int64_t row, const uint8_t *codes, int64_t cb, int64_t ch, int64_t ct, int64_t T, int64_t P,
                     const void *scale, int skind, const float *slut, int64_t sb, int64_t sh, int64_t st,
                     const void *zero, int zkind, const float *zlut, int64_t zb, int64_t zh, int64_t zt,
                     float *out) {
    const int64_t Dp = P * (8 / bits), groups = (D + group - 1) / group;
    const int64_t ss = param_size(skind), zs = param_size(zkind);
    float acc[MAX_ROWS * MAX_DIM] __attribute__((aligned(64)));
    float zsum[MAX_ROWS * MAX_DIM], sc[MAX_DIM], ze[MAX_DIM], cf[MAX_DIM] __attribute__((aligned(64)));
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float *p = probs + (b * H + h) * R * row;
            memset(acc, 0, sizeof(float) * R * Dp);
            memset(zsum, 0, sizeof(float) * R * groups);
            for (int64_t t = 0; t < T; t++) {
                load_params((const char *)scale + (b * sb + h * sh + t * st) * ss, skind, slut, groups, sc);
                load_params((const char *)zero + (b * zb + h * zh + t * zt) * zs, zkind, zlut, groups, ze);
                unpack(codes + b * cb + h * ch + t * ct, P, bits, cf);
                for (int64_t r = 0; r < R; r++) {
                    const float pr = p[r * row + t];
                    float *ar = acc + r * Dp;
                    for (int64_t k = 0; k < groups; k++) {
                        const float w = pr * sc[k];
                        const int64_t end = (k + 1) * group < D ? (k + 1) * group : D;
                        zsum[r * groups + k] += pr * ze[k];
#pragma omp simd
                        for (int64_t d = k * group; d < end; d++) ar[d] += w * cf[d];
                    }
                }
            }
            float *o = out + (b * H + h) * R * D;
            for (int64_t r = 0; r < R; r++)
                for (int64_t k = 0; k < groups; k++) {
                    const int64_t end = (k + 1) * group < D ? (k + 1) * group : D;
                    for (int64_t d = k * group; d < end; d++) o[r * D + d] = acc[r * Dp + d] + zsum[r * groups + k];
                }
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define AVX512 1

/* One token's codes (P bytes, P a multiple of 16) as P * 8 / bits / 16 vectors of 16 channels:
 * vector k * (P / 16) + m holds channels k * P + 16 m .. + 15. */
static inline __attribute__((always_inline)) void unpack16(const uint8_t *codes, int64_t P, int bits,
                                                           __m512 *c) {
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (int64_t m = 0; m < P / 16; m++) {
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * m)));
        for (int k = 0; k < 8 / bits; k++)
            c[k * (P / 16) + m] = _mm512_cvtepi32_ps(
                _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_set1_epi32(k * bits)), mask));
    }
}

/* Scores of RB query rows (their scaled queries `qs` [RB, Dp] and zero-point terms `c0`) against one
 * group of G tokens, 16 tokens at a time with a token per lane: a gather fetches four code bytes of
 * each token, every code becomes a vector over the 16 tokens and is multiplied by a broadcast query
 * channel, so no horizontal sums are needed. Four accumulators per row hide the FMA latency. */
static inline __attribute__((always_inline)) void key_rows_avx(const int RB, const float *qs, int64_t Dp,
                                                               const float *c0, const uint8_t *group, int64_t G,
                                                               int64_t P, int bits, float *out, int64_t row) {
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)P));
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
        const __mmask16 live = G - g0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g0)) - 1);
        const uint8_t *base = group + g0 * P;
        __m512 acc[4][4];
        for (int r = 0; r < RB; r++)
            for (int a = 0; a < 4; a++) acc[r][a] = _mm512_setzero_ps();
        for (int64_t j = 0; j < P; j += 4) {
            const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, base + j, 1);
            for (int e = 0; e < 4; e++) {
                for (int k = 0; k < 8 / bits; k++) {
                    const __m512 c = _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_set1_epi32(8 * e + k * bits)), mask));
                    const int64_t d = j + e + k * P;
                    const int a = (e & 1) * 2 + (k & 1);
                    for (int r = 0; r < RB; r++)
                        acc[r][a] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r * Dp + d]), c, acc[r][a]);
                }
            }
        }
        for (int r = 0; r < RB; r++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
            _mm512_mask_storeu_ps(out + r * row + g0, live, _mm512_add_ps(sum, _mm512_set1_ps(c0[r])));
        }
    }
}

/* The AVX-512 group step: query rows four at a time (key_rows_avx). */
static inline __attribute__((always_inline)) void key_group_avx(const float *qs, int64_t Dp, const float *c0,
                                                                int64_t R, const uint8_t *group, int64_t G,
                                                                int64_t P, int bits, float *out, int64_t row) {
    for (int64_t r = 0; r < R; r += 4) {
        const float *qr = qs + r * Dp;
        float *o = out + r * row;
        switch (R - r >= 4 ? 4 : R - r) {
            case 4: key_rows_avx(4, qr, Dp, c0 + r, group, G, P, bits, o, row); break;
            case 3: key_rows_avx(3, qr, Dp, c0 + r, group, G, P, bits, o, row); break;
            case 2: key_rows_avx(2, qr, Dp, c0 + r, group, G, P, bits, o, row); break;
            default: key_rows_avx(1, qr, Dp, c0 + r, group, G, P, bits, o, row);
        }
    }
}

/* Weighted sums of RB probability rows `p` (row stride `row`) over the T tokens of one head, 16 tokens
 * at a time: the block's scales and zero points are read at once, each row's weights p * scale are
 * formed as vectors over the tokens, and each token adds weight * code per 16-channel vector, the
 * weights broadcast from memory. The sums of p * zero are kept per channel group and added last. */
static inline __attribute__((always_inline)) void value_rows_avx(
        const int RB, const float *p, int64_t row, int64_t D, int bits, int64_t group, const uint8_t *codes,
        int64_t ct, int64_t T, int64_t P, const char *scale, int skind, const float *slut, int64_t st,
        const char *zero, int zkind, const float *zlut, int64_t zt, float *o) {
    const int64_t Dp = P * (8 / bits), NC = Dp / 16, groups = (D + group - 1) / group;
    const int64_t ss = param_size(skind), zs = param_size(zkind);
    int64_t chunk_group[MAX_DIM / 16];
    for (int64_t i = 0; i < NC; i++) chunk_group[i] = 16 * i / group;
    __m512 acc[4][MAX_DIM / 16 > 8 ? 8 : MAX_DIM / 16], zacc[4][MAX_DIM / 16];
    for (int r = 0; r < RB; r++) {
        for (int64_t i = 0; i < NC; i++) acc[r][i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < groups; k++) zacc[r][k] = _mm512_setzero_ps();
    }
    float pf[16 * MAX_DIM / 16], zf[16 * MAX_DIM / 16];
    float scT[MAX_DIM / 16][16] __attribute__((aligned(64))), zeT[MAX_DIM / 16][16] __attribute__((aligned(64)));
    float wt[4][MAX_DIM / 16][16] __attribute__((aligned(64)));
    for (int64_t t0 = 0; t0 < T; t0 += 16) {
        const int64_t m = T - t0 >= 16 ? 16 : T - t0;
        const __mmask16 live = m == 16 ? (__mmask16)0xffff : (__mmask16)((1u << m) - 1);
        if (st == groups) {
            load_params(scale + t0 * st * ss, skind, slut, m * groups, pf);
        } else {
            for (int64_t tt = 0; tt < m; tt++) load_params(scale + (t0 + tt) * st * ss, skind, slut, groups, pf + tt * groups);
        }
        if (zt == groups) {
            load_params(zero + t0 * zt * zs, zkind, zlut, m * groups, zf);
        } else {
            for (int64_t tt = 0; tt < m; tt++) load_params(zero + (t0 + tt) * zt * zs, zkind, zlut, groups, zf + tt * groups);
        }
        for (int64_t k = 0; k < groups; k++)
            for (int64_t tt = 0; tt < 16; tt++) {
                scT[k][tt] = tt < m ? pf[tt * groups + k] : 0.f;
                zeT[k][tt] = tt < m ? zf[tt * groups + k] : 0.f;
            }
        for (int r = 0; r < RB; r++) {
            const __m512 pv = _mm512_maskz_loadu_ps(live, p + r * row + t0);
            for (int64_t k = 0; k < groups; k++) {
                _mm512_store_ps(wt[r][k], _mm512_mul_ps(pv, _mm512_load_ps(scT[k])));
                zacc[r][k] = _mm512_fmadd_ps(pv, _mm512_load_ps(zeT[k]), zacc[r][k]);
            }
        }
        for (int64_t tt = 0; tt < m; tt++) {
            __m512 c[MAX_DIM / 16 > 8 ? 8 : MAX_DIM / 16];
            unpack16(codes + (t0 + tt) * ct, P, bits, c);
            for (int r = 0; r < RB; r++)
                for (int64_t i = 0; i < NC; i++)
                    acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(wt[r][chunk_group[i]][tt]), c[i], acc[r][i]);
        }
    }
    for (int r = 0; r < RB; r++) {
        float full[MAX_DIM] __attribute__((aligned(64))), zsum[MAX_DIM / 16];
        for (int64_t i = 0; i < NC; i++) _mm512_store_ps(full + 16 * i, acc[r][i]);
        for (int64_t k = 0; k < groups; k++) zsum[k] = _mm512_reduce_add_ps(zacc[r][k]);
        for (int64_t k = 0; k < groups; k++) {  /* by channel group: no division per channel */
            const int64_t end = (k + 1) * group < D ? (k + 1) * group : D;
            for (int64_t d = k * group; d < end; d++) o[r * D + d] = full[d] + zsum[k];
        }
    }
}

/* Rows are taken 4 at a time (2 for 128 channels) so their accumulators stay in registers. */
static inline __attribute__((always_inline)) void value_sums_avx(
        int64_t B, int64_t H, int64_t R, int64_t D, int bits, int64_t group, const float *probs, int64_t row,
        const uint8_t *codes, int64_t cb, int64_t ch, int64_t ct, int64_t T, int64_t P, const void *scale,
        int skind, const float *slut, int64_t sb, int64_t sh, int64_t st, const void *zero, int zkind,
        const float *zlut, int64_t zb, int64_t zh, int64_t zt, float *out) {
    const int64_t NC = P * (8 / bits) / 16, RB = NC <= 4 ? 4 : 2;
    const int64_t ss = param_size(skind), zs = param_size(zkind);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const uint8_t *c = codes + b * cb + h * ch;
            const char *sc = (const char *)scale + (b * sb + h * sh) * ss, *ze = (const char *)zero + (b * zb + h * zh) * zs;
            for (int64_t r = 0; r < R; r += RB) {
                const float *p = probs + ((b * H + h) * R + r) * row;
                float *o = out + ((b * H + h) * R + r) * D;
                switch (R - r >= RB ? RB : R - r) {
                    case 4: value_rows_avx(4, p, row, D, bits, group, c, ct, T, P, sc, skind, slut, st, ze, zkind, zlut, zt, o); break;
                    case 3: value_rows_avx(3, p, row, D, bits, group, c, ct, T, P, sc, skind, slut, st, ze, zkind, zlut, zt, o); break;
                    case 2: value_rows_avx(2, p, row, D, bits, group, c, ct, T, P, sc, skind, slut, st, ze, zkind, zlut, zt, o); break;
                    default: value_rows_avx(1, p, row, D, bits, group, c, ct, T, P, sc, skind, slut, st, ze, zkind, zlut, zt, o);
                }
            }
        }
    }
}
#endif

#ifdef AVX2
#define SUB 32  /* tokens whose value codes value_block_avx2 unpacks at once (32 KB at 256 channels) */

/* unpack16 in AVX2: one token's codes (P bytes, P a multiple of 8) as P * 8 / bits / 8 vectors of 8
 * channels, vector k * (P / 8) + m holding channels k * P + 8 m .. + 7. */
static inline __attribute__((always_inline)) void unpack8(const uint8_t *codes, int64_t P, int bits, __m256 *c) {
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    for (int64_t m = 0; m < P / 8; m++) {
        const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * m)));
        for (int k = 0; k < 8 / bits; k++)
            c[k * (P / 8) + m] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, k * bits), mask));
    }
}

/* The key group step in AVX2: each token's codes are unpacked once into registers and dotted with
 * every row's scaled query (two chains per dot); eight tokens' dots are then summed in one vector
 * (sums8), so a row's scores are stored eight at a time. */
static inline __attribute__((always_inline)) void key_group_avx2(const float *qs, int64_t Dp, const float *c0,
                                                                 int64_t R, const uint8_t *group, int64_t G,
                                                                 int64_t P, int bits, float *out, int64_t row) {
    const int64_t NV = Dp / 8;
    __m256 dots[MAX_ROWS][8];
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t n = G - g0 < 8 ? G - g0 : 8;
        for (int64_t j = 0; j < 8; j++) {
            __m256 c[MAX_DIM / 8];
            if (j < n) unpack8(group + (g0 + j) * P, P, bits, c);
            for (int64_t r = 0; r < R; r++) {
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                if (j < n)
                    for (int64_t i = 0; i < NV; i += 2) {
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qs + r * Dp + 8 * i), c[i], a0);
                        if (i + 1 < NV) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qs + r * Dp + 8 * i + 8), c[i + 1], a1);
                    }
                dots[r][j] = _mm256_add_ps(a0, a1);
            }
        }
        for (int64_t r = 0; r < R; r++) {
            const __m256 s = _mm256_add_ps(sums8(dots[r]), _mm256_set1_ps(c0[r]));
            if (n == 8) _mm256_storeu_ps(out + r * row + g0, s);
            else _mm256_maskstore_ps(out + r * row + g0, live8(n), s);
        }
    }
}

/* RB rows' value sums over n <= SUB unpacked tokens (cf [n, Dp]) for one tile of 32 channels:
 * o[r, :] += sum_t w[r, t] * code[t, :] on those channels. */
static inline __attribute__((always_inline)) void value_tile_avx2(const int RB, const float (*w)[SUB],
                                                                  const float *cf, int64_t Dp, int64_t n,
                                                                  float *o, int64_t D) {
    __m256 a[3][4];
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < 4; i++) a[r][i] = _mm256_loadu_ps(o + r * D + 8 * i);
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < 4; i++) {
            const __m256 c = _mm256_load_ps(cf + t * Dp + 8 * i);
            for (int r = 0; r < RB; r++) a[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][t]), c, a[r][i]);
        }
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + r * D + 8 * i, a[r][i]);
}

/* Value sums of R probability rows p (row stride `row`) over one block's T tokens (codes [T, P],
 * scales and zero points [T, groups]) into o [R, D], for D = Dp channels in groups of a multiple of
 * 32: SUB tokens at a time the codes are unpacked once into floats and the parameters transposed to
 * [group, token]; then tiles of three rows by 32 channels (one channel group) add weight * code,
 * the weights p * scale formed per tile, and the sums of p * zero are added per group at the end. */
static inline __attribute__((always_inline)) void value_block_avx2(
        int64_t R, const float *p, int64_t row, int64_t D, const int bits, int64_t group, const uint8_t *codes,
        int64_t T, const int64_t P, const char *scale, int skind, const float *slut, const char *zero,
        int zkind, const float *zlut, float *o) {
    const int64_t Dp = P * (8 / bits), groups = D / group;
    const int64_t ss = param_size(skind), zs = param_size(zkind);
    float cf[SUB * MAX_DIM] __attribute__((aligned(32)));
    float pf[SUB * MAX_DIM / 32], zf[SUB * MAX_DIM / 32], zsum[MAX_ROWS * MAX_DIM / 32];
    float sT[MAX_DIM / 32][SUB] __attribute__((aligned(32))), zT[MAX_DIM / 32][SUB] __attribute__((aligned(32)));
    float w[3][SUB] __attribute__((aligned(32)));
    memset(o, 0, sizeof(float) * R * D);
    memset(zsum, 0, sizeof(float) * R * groups);
    for (int64_t t0 = 0; t0 < T; t0 += SUB) {
        const int64_t n = T - t0 < SUB ? T - t0 : SUB;
        for (int64_t t = 0; t < n; t++) {
            __m256 c[MAX_DIM / 8];
            unpack8(codes + (t0 + t) * P, P, bits, c);
            for (int64_t i = 0; i < Dp / 8; i++) _mm256_store_ps(cf + t * Dp + 8 * i, c[i]);
        }
        load_params(scale + t0 * groups * ss, skind, slut, n * groups, pf);
        load_params(zero + t0 * groups * zs, zkind, zlut, n * groups, zf);
        for (int64_t k = 0; k < groups; k++)
            for (int64_t t = 0; t < SUB; t++) {
                sT[k][t] = t < n ? pf[t * groups + k] : 0.f;
                zT[k][t] = t < n ? zf[t * groups + k] : 0.f;
            }
        for (int64_t r = 0; r < R; r++)
            for (int64_t k = 0; k < groups; k++) {
                __m256 z = _mm256_setzero_ps();
                for (int64_t h = 0; h < SUB; h += 8)
                    z = _mm256_fmadd_ps(_mm256_maskload_ps(p + r * row + t0 + h, live8(n - h)),
                                        _mm256_load_ps(zT[k] + h), z);
                zsum[r * groups + k] += reduce_add8(z);
            }
        for (int64_t r0 = 0; r0 < R; r0 += 3) {
            const int64_t rows = R - r0 < 3 ? R - r0 : 3;
            for (int64_t i0 = 0; i0 < Dp / 8; i0 += 4) {
                const int64_t k = i0 * 8 / group;
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t h = 0; h < SUB; h += 8)
                        _mm256_store_ps(w[r] + h, _mm256_mul_ps(_mm256_maskload_ps(p + (r0 + r) * row + t0 + h,
                                                                                   live8(n - h)),
                                                                _mm256_load_ps(sT[k] + h)));
                float *ot = o + r0 * D + 8 * i0;
                if (rows == 3) value_tile_avx2(3, w, cf + 8 * i0, Dp, n, ot, D);
                else if (rows == 2) value_tile_avx2(2, w, cf + 8 * i0, Dp, n, ot, D);
                else value_tile_avx2(1, w, cf + 8 * i0, Dp, n, ot, D);
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < groups; k++) {
            const float z = zsum[r * groups + k];
            float *ok = o + r * D + k * group;
#pragma omp simd
            for (int64_t d = 0; d < group; d++) ok[d] += z;
        }
}
#endif

/* The public entry points: for the common head sizes (64 and 128 channels at 4 and 2 bits) the
 * bodies run with bits and P known at compile time, so the per-token loops unroll, in AVX-512
 * where the CPU has it (value groups a multiple of 16 channels); other sizes run the portable
 * bodies with run-time sizes. */
#ifdef AVX512
#define KEY_FAST key_group_avx
#define VALUE_FAST(BITS, PP) if (bits == BITS && P == PP && group % 16 == 0) { \
    value_sums_avx(B, H, R, D, BITS, group, probs, row, codes, cb, ch, ct, T, PP, scale, skind, slut, sb, sh, \
                   st, zero, zkind, zlut, zb, zh, zt, out); return; }
#else
#ifdef AVX2
#define KEY_FAST key_group_avx2
#else
#define KEY_FAST key_group_portable
#endif
#define VALUE_FAST(BITS, PP) if (bits == BITS && P == PP) { \
    value_sums_body(B, H, R, D, BITS, group, probs, row, codes, cb, ch, ct, T, PP, scale, skind, slut, sb, sh, \
                    st, zero, zkind, zlut, zb, zh, zt, out); return; }
#endif
#define KEY_CASE(BITS, PP) if (bits == BITS && P == PP) { \
    key_scores_loop(B, H, R, D, BITS, query, codes, cb, ch, cn, N, G, PP, scale, skind, slut, sb, sh, sn, \
                    zero, zkind, zlut, zb, zh, zn, scores, row, KEY_FAST); return; }

void kivi_key_scores(int64_t B, int64_t H, int64_t R, int64_t D, int bits, const float *query,
                     const uint8_t *codes, int64_t cb, int64_t ch, int64_t cn, int64_t N, int64_t G, int64_t P,
                     const void *scale, int skind, const float *slut, int64_t sb, int64_t sh, int64_t sn,
                     const void *zero, int zkind, const float *zlut, int64_t zb, int64_t zh, int64_t zn,
                     float *scores, int64_t row) {
    KEY_CASE(4, 32) KEY_CASE(4, 64) KEY_CASE(2, 16) KEY_CASE(2, 32)
    key_scores_loop(B, H, R, D, bits, query, codes, cb, ch, cn, N, G, P, scale, skind, slut, sb, sh, sn,
                    zero, zkind, zlut, zb, zh, zn, scores, row, key_group_portable);
}

void kivi_value_sums(int64_t B, int64_t H, int64_t R, int64_t D, int bits, int64_t group, const float *probs,
                     int64_t row, const uint8_t *codes, int64_t cb, int64_t ch, int64_t ct, int64_t T, int64_t P,
                     const void *scale, int skind, const float *slut, int64_t sb, int64_t sh, int64_t st,
                     const void *zero, int zkind, const float *zlut, int64_t zb, int64_t zh, int64_t zt,
                     float *out) {
    VALUE_FAST(4, 32) VALUE_FAST(4, 64) VALUE_FAST(2, 16) VALUE_FAST(2, 32)
    value_sums_body(B, H, R, D, bits, group, probs, row, codes, cb, ch, ct, T, P, scale, skind, slut, sb, sh, st,
                    zero, zkind, zlut, zb, zh, zt, out);
}

/* One sequence's R query rows q [R, D] (scaled by the softmax scale) over its quantized pages of one
 * KV head, read in place: its `tokens` (a multiple of G) fill blocks table[0..) of BT = KN * G tokens,
 * KN key groups each (the last block possibly in part). Pool
 * tensors (already at the KV head): key codes [NB, KN, G, P] with scales and zero points
 * [NB, KN, 1, D]; value codes [NB, BT, P] with scales and zero points [NB, BT, groups]. An online
 * softmax over the blocks (running maximum m, sum l, value sums acc, rescaled as the maximum grows);
 * out [R, D] and lse [R] (m + log l: the rows' log-sum-exp, for merging with the full-precision
 * window's part). */
static inline __attribute__((always_inline)) void paged_rows(
        const int bits, const int64_t P, int64_t R, int64_t D, int64_t group, const float *q,
        const uint8_t *kc, const char *ks, int kskind, const float *kslut, const char *kz, int kzkind,
        const float *kzlut, const uint8_t *vc, const char *vs, int vskind, const float *vslut, const char *vz,
        int vzkind, const float *vzlut, int64_t KN, int64_t G, const int64_t *table, int64_t tokens,
        float *out, float *lse) {
    const int64_t Dp = P * (8 / bits), BT = KN * G, groups = (D + group - 1) / group;
    const int64_t kss = param_size(kskind), kzs = param_size(kzkind);
    const int64_t vss = param_size(vskind), vzs = param_size(vzkind);
    float qs[MAX_ROWS * MAX_DIM] __attribute__((aligned(64))), c0[MAX_ROWS];
    float sc[MAX_ROWS * MAX_BLOCK] __attribute__((aligned(64)));
    float acc[MAX_ROWS * MAX_DIM], part[MAX_ROWS * MAX_DIM], m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(acc, 0, sizeof(float) * R * D);
    for (int64_t i = 0; i * BT < tokens; i++) {
        const int64_t b = table[i], T = tokens - i * BT < BT ? tokens - i * BT : BT;
        if ((i + 1) * BT < tokens) {  /* blocks are scattered, so no hardware prefetcher sees the next */
            const int64_t next = table[i + 1];
            for (int64_t off = 0; off < BT * P; off += 64) {
                __builtin_prefetch(kc + next * BT * P + off);
                __builtin_prefetch(vc + next * BT * P + off);
            }
            __builtin_prefetch(ks + next * KN * D * kss);
            __builtin_prefetch(kz + next * KN * D * kzs);
            __builtin_prefetch(vs + next * BT * groups * vss);
            __builtin_prefetch(vz + next * BT * groups * vzs);
        }
        for (int64_t n = 0; n < T / G; n++) {
            const int64_t at = b * KN + n;
            scale_query(q, R, D, Dp, ks + at * D * kss, kskind, kslut, kz + at * D * kzs, kzkind, kzlut, qs, c0);
#if defined(AVX512)
            key_group_avx(qs, Dp, c0, R, kc + at * G * P, G, P, bits, sc + n * G, BT);
#elif defined(AVX2)
            if (P % 8 == 0) key_group_avx2(qs, Dp, c0, R, kc + at * G * P, G, P, bits, sc + n * G, BT);
            else key_group_portable(qs, Dp, c0, R, kc + at * G * P, G, P, bits, sc + n * G, BT);
#else
            key_group_portable(qs, Dp, c0, R, kc + at * G * P, G, P, bits, sc + n * G, BT);
#endif
        }
        for (int64_t r = 0; r < R; r++) corr[r] = softmax_step(sc + r * BT, T, T, m + r, l + r);
        const uint8_t *codes = vc + b * BT * P;
        const char *scale = vs + b * BT * groups * vss, *zero = vz + b * BT * groups * vzs;
#ifdef AVX512
        if (group % 16 == 0 && P % 16 == 0 && Dp <= 128) {
            const int64_t RB = Dp / 16 <= 4 ? 4 : 2;
            for (int64_t r = 0; r < R; r += RB) {
                const float *p = sc + r * BT;
                float *o = part + r * D;
                switch (R - r >= RB ? RB : R - r) {
                    case 4: value_rows_avx(4, p, BT, D, bits, group, codes, P, T, P, scale, vskind, vslut, groups, zero, vzkind, vzlut, groups, o); break;
                    case 3: value_rows_avx(3, p, BT, D, bits, group, codes, P, T, P, scale, vskind, vslut, groups, zero, vzkind, vzlut, groups, o); break;
                    case 2: value_rows_avx(2, p, BT, D, bits, group, codes, P, T, P, scale, vskind, vslut, groups, zero, vzkind, vzlut, groups, o); break;
                    default: value_rows_avx(1, p, BT, D, bits, group, codes, P, T, P, scale, vskind, vslut, groups, zero, vzkind, vzlut, groups, o);
                }
            }
        } else
#elif defined(AVX2)
        if (group % 32 == 0 && D % group == 0 && D == Dp && P % 8 == 0)
            value_block_avx2(R, sc, BT, D, bits, group, codes, T, P, scale, vskind, vslut, zero, vzkind, vzlut, part);
        else
#endif
            value_sums_body(1, 1, R, D, bits, group, sc, BT, codes, 0, 0, P, T, P, scale, vskind, vslut, 0, 0,
                            groups, zero, vzkind, vzlut, 0, 0, groups, part);
        for (int64_t r = 0; r < R; r++)
            for (int64_t d = 0; d < D; d++) acc[r * D + d] = acc[r * D + d] * corr[r] + part[r * D + d];
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = tokens > 0 ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < D; d++) out[r * D + d] = acc[r * D + d] * inv;
        lse[r] = tokens > 0 ? m[r] + logf(l[r]) : -INFINITY;
    }
}

#define PAGED_ARGS R, D, group, q, kc, ks, kskind, kslut, kz, kzkind, kzlut, vc, vs, vskind, vslut, vz, vzkind, \
    vzlut, KN, G, tables + s * max_blocks, tokens[s], out + at, lse + (s * Hq + h * R)

/* Decode attention of a ragged batch of S sequences (one query token each, query [S, Hq, D] float32)
 * over their quantized pages in a layer's pool, read in place through each sequence's block table
 * (tables [S, max_blocks]; tokens[s] quantized tokens, a multiple of G, from its first block's start): out [S, Hq, D] and lse [S, Hq] float32, query head
 * h reading KV head h / (Hq / Hkv). Pool tensors as BlockPool holds them, [Hkv, NB, ...] contiguous
 * (see paged_rows); scores are scale * q . k. Sizes are checked by the caller
 * (kvfactory/quantization/ragged.py). For int4 at 64 and 128 channels the body is inlined with the
 * sizes constant, as in kivi_key_scores (each inlined copy adds to the build's time). KV heads are
 * the outer loop, so blocks that sequences share (a common prompt) are read from L2 after the first. */
void kivi_paged_decode(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int bits, int64_t group,
                       const float *query, float scale, const uint8_t *kcodes, const void *kscale, int kskind,
                       const float *kslut, const void *kzero, int kzkind, const float *kzlut,
                       const uint8_t *vcodes, const void *vscale, int vskind, const float *vslut,
                       const void *vzero, int vzkind, const float *vzlut, int64_t NB, int64_t KN, int64_t G,
                       int64_t P, const int64_t *tables, int64_t max_blocks, const int64_t *tokens, float *out,
                       float *lse) {
    const int64_t R = Hq / Hkv, BT = KN * G, groups = (D + group - 1) / group;
    float q[MAX_ROWS * MAX_DIM];
    for (int64_t h = 0; h < Hkv; h++) {
        for (int64_t s = 0; s < S; s++) {
            const int64_t at = (s * Hq + h * R) * D;
            for (int64_t i = 0; i < R * D; i++) q[i] = query[at + i] * scale;
            const uint8_t *kc = kcodes + h * NB * BT * P, *vc = vcodes + h * NB * BT * P;
            const char *ks = (const char *)kscale + h * NB * KN * D * param_size(kskind);
            const char *kz = (const char *)kzero + h * NB * KN * D * param_size(kzkind);
            const char *vs = (const char *)vscale + h * NB * BT * groups * param_size(vskind);
            const char *vz = (const char *)vzero + h * NB * BT * groups * param_size(vzkind);
            if (bits == 4 && P == 32) paged_rows(4, 32, PAGED_ARGS);
            else if (bits == 4 && P == 64) paged_rows(4, 64, PAGED_ARGS);
            else paged_rows(bits, P, PAGED_ARGS);
        }
    }
}

/* The first `tokens` tokens (a multiple of G) of each KV head's quantized pages in blocks ids[0..) of
 * BT = KN * G tokens, decoded to float32: token t of KV head h to keys + h * kh + t * D (code * scale
 * + zero per channel over its key group) and values + h * vh + t * D (per channel group of the
 * token), so a read of many query rows (a prefill chunk, a prompt that a batch of decoding sequences
 * shares) decodes each token once. Pool tensors as kivi_paged_decode reads them. */
void kivi_paged_dequantize(int64_t Hkv, int64_t D, int bits, int64_t group, const uint8_t *kcodes,
                           const void *kscale, int kskind, const float *kslut, const void *kzero, int kzkind,
                           const float *kzlut, const uint8_t *vcodes, const void *vscale, int vskind,
                           const float *vslut, const void *vzero, int vzkind, const float *vzlut, int64_t NB,
                           int64_t KN, int64_t G, int64_t P, const int64_t *ids, int64_t tokens, float *keys,
                           int64_t kh, float *values, int64_t vh) {
    const int64_t BT = KN * G, groups = (D + group - 1) / group;
    const int64_t kss = param_size(kskind), kzs = param_size(kzkind), vss = param_size(vskind), vzs = param_size(vzkind);
    float cf[MAX_DIM] __attribute__((aligned(64))), sc[MAX_DIM], ze[MAX_DIM];
    for (int64_t h = 0; h < Hkv; h++) {
        for (int64_t i = 0; i * BT < tokens; i++) {
            const int64_t b = h * NB + ids[i], T = tokens - i * BT < BT ? tokens - i * BT : BT;
            float *k = keys + h * kh + i * BT * D, *v = values + h * vh + i * BT * D;
            for (int64_t kn = 0; kn < T / G; kn++) {
                load_params((const char *)kscale + (b * KN + kn) * D * kss, kskind, kslut, D, sc);
                load_params((const char *)kzero + (b * KN + kn) * D * kzs, kzkind, kzlut, D, ze);
                for (int64_t g = 0; g < G; g++) {
                    unpack(kcodes + ((b * KN + kn) * G + g) * P, P, bits, cf);
                    float *row = k + (kn * G + g) * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) row[d] = cf[d] * sc[d] + ze[d];
                }
            }
            for (int64_t t = 0; t < T; t++) {
                load_params((const char *)vscale + (b * BT + t) * groups * vss, vskind, vslut, groups, sc);
                load_params((const char *)vzero + (b * BT + t) * groups * vzs, vzkind, vzlut, groups, ze);
                unpack(vcodes + (b * BT + t) * P, P, bits, cf);
                for (int64_t c = 0; c < groups; c++) {
                    const int64_t end = (c + 1) * group < D ? (c + 1) * group : D;
                    const float s = sc[c], z = ze[c];
                    float *row = v + t * D;
#pragma omp simd
                    for (int64_t d = c * group; d < end; d++) row[d] = cf[d] * s + z;
                }
            }
        }
    }
}

/* KIVI's encoder (kvfactory/codecs/kivi.py, bit for bit): the value of positive code c of a parameter
 * dtype (its bits without the sign), and x rounded to that dtype's grid up (the least value >= x) or
 * down, as stored bits; x within the dtype's finite range, a zero result signed as x. The grid is
 * monotone in the codes, so a binary search over [0, top] (the largest finite code) finds it. The
 * stored-dtype kinds: F16, BF16 and LUT8 (FP8 through its table); float32 is stored as it is. */
static inline float grid_value(int kind, const float *lut, uint32_t c) {
    if (kind == F16) return half_to_float((uint16_t)c);
    if (kind == BF16) {
        const uint32_t bits = c << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return lut[c];
}

static inline uint32_t grid_round(float x, int kind, const float *lut, uint32_t top, int up) {
#if defined(__F16C__)
    if (kind == F16) {  /* to nearest even, then one step to the side asked for where it missed it */
        const uint16_t h = (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
        const float stored = _cvtsh_ss(h);
        if (up ? stored < x : stored > x) return (uint16_t)(((int16_t)h < 0) == up ? h - 1 : h + 1);
        return h;
    }
#endif
    uint32_t xbits;
    memcpy(&xbits, &x, 4);
    const int negative = xbits >> 31;
    const float m = fabsf(x);
    const int ceil_m = up != negative;  /* up for a positive x, down for a negative one: |x| rounded up */
    uint32_t lo = 0, hi = top;  /* the least code whose value >= m (ceil_m), else the greatest <= m */
    if (ceil_m) {
        while (lo < hi) {
            const uint32_t mid = (lo + hi) / 2;
            if (grid_value(kind, lut, mid) >= m) hi = mid; else lo = mid + 1;
        }
    } else {
        while (lo < hi) {
            const uint32_t mid = (lo + hi + 1) / 2;
            if (grid_value(kind, lut, mid) <= m) lo = mid; else hi = mid - 1;
        }
    }
    return negative ? lo | (kind == LUT8 ? 0x80u : 0x8000u) : lo;
}

/* A parameter x stored as `kind` (float32: as it is, else clamped to +-limit and rounded up or down),
 * written at p; returns the stored value. */
static inline float store_param(float x, int kind, const float *lut, uint32_t top, float limit, int up, void *p) {
    if (kind == F32) {
        memcpy(p, &x, 4);
        return x;
    }
    x = x < -limit ? -limit : x > limit ? limit : x;
    const uint32_t bits = grid_round(x, kind, lut, top, up);
    if (kind == LUT8) *(uint8_t *)p = (uint8_t)bits; else *(uint16_t *)p = (uint16_t)bits;
    const float v = grid_value(kind, lut, bits & (kind == LUT8 ? 0x7fu : 0x7fffu));
    return bits & (kind == LUT8 ? 0x80u : 0x8000u) ? -v : v;
}

/* A parameter dtype as the encoder takes it: kind, FP8 table, largest finite code, its value, and the
 * smallest positive value (the floor of a scale). */
typedef struct {
    int kind;
    const float *lut;
    uint32_t top;
    float limit, smallest;
} param_dtype;

/* One group's parameters from its minimum lo and maximum hi: the zero point rounded down, the scale
 * (hi - zero) / (2^bits - 1) at least the smallest positive value, rounded up; stored at zp / sp. */
static inline void group_params(float lo, float hi, int bits, param_dtype zt, void *zp, param_dtype st, void *sp,
                                float *zero, float *scale) {
    *zero = store_param(lo, zt.kind, zt.lut, zt.top, zt.limit, 0, zp);
    float step = (hi - *zero) / (float)((1 << bits) - 1);
    step = step < st.smallest ? st.smallest : step;
    *scale = store_param(step, st.kind, st.lut, st.top, st.limit, 1, sp);
}

/* Codes of D channels (zero past D up to the planes' 8 / bits * P) packed in planes into P bytes
 * (kvfactory/codecs/packing.py). */
static inline void pack_codes(uint8_t *q, int64_t D, int64_t P, int bits, uint8_t *out) {
    const int64_t planes = 8 / bits;
    memset(q + D, 0, (size_t)(planes * P - D));
    memcpy(out, q, (size_t)P);
    for (int64_t k = 1; k < planes; k++)
#pragma omp simd
        for (int64_t j = 0; j < P; j++) out[j] |= (uint8_t)(q[k * P + j] << (k * bits));
}

/* round((x - zero) / scale) clamped to [0, top], rounding half to even (rintf in the default mode), as
 * the torch path's round_ and clamp_. */
static inline void codes_of(const float *x, const float *zero, const float *scale, int64_t n, float top,
                            uint8_t *q) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) {
        float c = rintf((x[d] - zero[d]) / scale[d]);
        c = c < 0.0f ? 0.0f : c > top ? top : c;
        q[d] = (uint8_t)c;
    }
}

/* KIVI keys x [BH, N * G, D] (float32, contiguous): per channel over each group of G tokens, codes to
 * codes [BH, N, G, P], scales and zero points [BH, N, D] of their dtypes. */
void kivi_encode_keys(int64_t BH, int64_t N, int64_t G, int64_t D, int bits, const float *x, uint8_t *codes,
                      int64_t P, void *scale, int skind, const float *slut, int64_t stop, float slimit,
                      float ssmallest, void *zero, int zkind, const float *zlut, int64_t ztop, float zlimit,
                      float zsmallest) {
    const param_dtype st = {skind, slut, (uint32_t)stop, slimit, ssmallest},
                      zt = {zkind, zlut, (uint32_t)ztop, zlimit, zsmallest};
    const int64_t ss = param_size(skind), zs = param_size(zkind);
    const float top = (float)((1 << bits) - 1);
    float lo[MAX_DIM], hi[MAX_DIM], sc[MAX_DIM], ze[MAX_DIM];
    uint8_t q[2 * MAX_DIM];
    for (int64_t i = 0; i < BH * N; i++) {
        const float *group = x + i * G * D;
        for (int64_t d = 0; d < D; d++) lo[d] = hi[d] = group[d];
        for (int64_t g = 1; g < G; g++)
            for (int64_t d = 0; d < D; d++) {
                const float v = group[g * D + d];
                lo[d] = v < lo[d] ? v : lo[d];
                hi[d] = v > hi[d] ? v : hi[d];
            }
        for (int64_t d = 0; d < D; d++)
            group_params(lo[d], hi[d], bits, zt, (char *)zero + (i * D + d) * zs, st, (char *)scale + (i * D + d) * ss,
                         ze + d, sc + d);
        for (int64_t g = 0; g < G; g++) {
            codes_of(group + g * D, ze, sc, D, top, q);
            pack_codes(q, D, P, bits, codes + (i * G + g) * P);
        }
    }
}

/* KIVI values x [BT, D] (float32, contiguous; BT tokens of every head): per token over each group of
 * `group` channels (the last one smaller where group does not divide D), codes to codes [BT, P],
 * scales and zero points [BT, ceil(D / group)] of their dtypes. */
void kivi_encode_values(int64_t BT, int64_t D, int64_t group, int bits, const float *x, uint8_t *codes, int64_t P,
                        void *scale, int skind, const float *slut, int64_t stop, float slimit, float ssmallest,
                        void *zero, int zkind, const float *zlut, int64_t ztop, float zlimit, float zsmallest) {
    const param_dtype st = {skind, slut, (uint32_t)stop, slimit, ssmallest},
                      zt = {zkind, zlut, (uint32_t)ztop, zlimit, zsmallest};
    const int64_t ss = param_size(skind), zs = param_size(zkind), groups = (D + group - 1) / group;
    const float top = (float)((1 << bits) - 1);
    uint8_t q[2 * MAX_DIM];
    float sc[MAX_DIM], ze[MAX_DIM];
    for (int64_t t = 0; t < BT; t++) {
        const float *row = x + t * D;
        for (int64_t c = 0; c < groups; c++) {
            const int64_t end = (c + 1) * group < D ? (c + 1) * group : D;
            float lo = row[c * group], hi = lo, z, s;
            for (int64_t d = c * group + 1; d < end; d++) {
                lo = row[d] < lo ? row[d] : lo;
                hi = row[d] > hi ? row[d] : hi;
            }
            group_params(lo, hi, bits, zt, (char *)zero + (t * groups + c) * zs, st,
                         (char *)scale + (t * groups + c) * ss, &z, &s);
            for (int64_t d = c * group; d < end; d++) {
                ze[d] = z;
                sc[d] = s;
            }
        }
        codes_of(row, ze, sc, D, top, q);
        pack_codes(q, D, P, bits, codes + t * P);
    }
}
