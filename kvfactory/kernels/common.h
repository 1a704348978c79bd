/* What the kernels share: reading stored parameters (scales, zero points, page features) of the
 * dtypes kvfactory keeps them in as float32; in AVX-512, and in AVX2 where a CPU stops there,
 * horizontal sums and exp for softmax; one row's online-softmax step (the attention kernels'). */
#ifndef KVFACTORY_COMMON_H
#define KVFACTORY_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { F32 = 0, F16 = 1, BF16 = 2, LUT8 = 3 };

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* n parameters of kind `kind` starting at `p` as floats in `out`. */
static inline void load_params(const void *p, int kind, const float *lut, int64_t n, float *out) {
    if (kind == F32) {
        memcpy(out, p, (size_t)n * 4);
    } else if (kind == F16) {
        const uint16_t *h = (const uint16_t *)p;
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) out[i] = half_to_float(h[i]);
    } else if (kind == BF16) {
        const uint16_t *h = (const uint16_t *)p;
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(out + i, &bits, 4);
        }
    } else {
        const uint8_t *b = (const uint8_t *)p;
        for (int64_t i = 0; i < n; i++) out[i] = lut[b[i]];
    }
}

static inline int64_t param_size(int kind) { return kind == F32 ? 4 : kind == LUT8 ? 1 : 2; }

/* 2^f for |f| <= 1/2: a degree-5 polynomial, minimax for relative error (2.4e-7), in Horner's form with
 * the vector width's broadcast SET1 and multiply-add FMADD (exp16 and exp8 share it). */
#define EXP2_POLY(SET1, FMADD, f)                                                                          \
    FMADD(FMADD(FMADD(FMADD(FMADD(SET1(1.327647129e-3f), f, SET1(9.675540961e-3f)), f, SET1(5.550713092e-2f)), \
                      f, SET1(2.402212024e-1f)), f, SET1(6.931469440e-1f)), f, SET1(1.000000119f))

#if defined(__AVX512F__)
#include <immintrin.h>

/* The horizontal sums of v[0..16) as one vector (lane j: the sum of v[j]): pairs of vectors are
 * folded by unpacking within 128-bit lanes, then across lanes, 45 instructions in all where 16
 * separate reductions take about 130. */
static inline __m512 sums16(const __m512 *v) {
    __m512 w[8], y[4];
    for (int k = 0; k < 8; k++)
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
        y[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xdd));
}

/* exp(x) for x <= 0 as 2^(x log2 e): x log2 e = n + f, |f| <= 1/2, 2^f by EXP2_POLY, then 2^n by
 * scalef. Below about -87 (n = -126) it stays near 1e-38, a weight no sum notices. Five multiply-adds
 * where Cephes' expf takes eight: it is the softmax's cost in every attention kernel. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
    return _mm512_scalef_ps(EXP2_POLY(_mm512_set1_ps, _mm512_fmadd_ps, f), n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define AVX2 1

/* The horizontal sums of v[0..8) as one vector (lane j: the sum of v[j]), by pairwise hadd. */
static inline __m256 sums8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float reduce_add8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

static inline float reduce_max8(__m256 v) {
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

/* Lanes [0, n) set, for masked loads of the last n < 8 elements. */
static inline __m256i live8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* exp(x) for x <= 0 as exp16 computes it, eight lanes at a time; 2^n is built in the exponent bits
 * (n >= -126 after the clamp, so it stays a normal number). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
    const __m256 p = EXP2_POLY(_mm256_set1_ps, _mm256_fmadd_ps, f);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* One online-softmax step of a row (FlashAttention, Dao et al. 2022) over n new scores s[0, n): the
 * first `seen` become exp(score - top) and the rest 0 (keys the row may not see), top the row's new
 * running maximum; returns corr = exp(old maximum - top), 0 at the row's first step (*m = -inf), and
 * updates the maximum *m and the sum *l. A row that sees none of them keeps its state (corr 1). */
static inline float softmax_step(float *s, int64_t n, int64_t seen, float *m, float *l) {
    if (seen <= 0) {
        memset(s, 0, (size_t)n * sizeof(float));
        return 1.f;
    }
    seen = seen < n ? seen : n;
    float top = *m, sum = 0.f;
#if defined(__AVX512F__)
    __m512 most = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; j += 16) {
        const __mmask16 live = seen - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (seen - j)) - 1);
        most = _mm512_mask_max_ps(most, live, most, _mm512_maskz_loadu_ps(live, s + j));
    }
    top = fmaxf(top, _mm512_reduce_max_ps(most));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 within = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __mmask16 live = j >= seen ? 0 : seen - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (seen - j)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(live, s + j);
        const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(top))));
        _mm512_mask_storeu_ps(s + j, within, p);
        sums = _mm512_add_ps(sums, p);
    }
    sum = _mm512_reduce_add_ps(sums);
#elif defined(AVX2)
    __m256 most = _mm256_set1_ps(-INFINITY), sums = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= seen; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(s + j));
    top = fmaxf(top, reduce_max8(most));
    for (int64_t t = j; t < seen; t++) top = s[t] > top ? s[t] : top;
    for (j = 0; j + 8 <= seen; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + j, p);
        sums = _mm256_add_ps(sums, p);
    }
    sum = reduce_add8(sums);
    for (; j < n; j++) {
        s[j] = j < seen ? expf(s[j] - top) : 0.f;
        sum += s[j];
    }
#else
    for (int64_t j = 0; j < seen; j++) top = s[j] > top ? s[j] : top;
    for (int64_t j = 0; j < n; j++) {
        s[j] = j < seen ? expf(s[j] - top) : 0.f;
        sum += s[j];
    }
#endif
    const float corr = expf(*m - top);
    *l = *l * corr + sum;
    *m = top;
    return corr;
}

#endif
