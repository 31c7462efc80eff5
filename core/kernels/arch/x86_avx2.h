/* AVX2 (the x86-64-v3 build, no AVX512) vector primitives: bfloat16 rounding on 8 lanes and the
 * Q4_0 / Q8_0 segment decoder of the generic kernel. Included by qp_kernels.c only then. */
#if defined(__AVX2__) && !defined(QP_AVX512)
/* round_bf16 on 8 lanes, bit for bit (NaN quieted as it quiets them) */
static inline __m256 round8_bf16(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                       _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)))),
                                       _mm256_set1_epi32((int)0xffff0000u));
    const __m256 quiet = _mm256_castsi256_ps(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), quiet, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* round8_bf16 for finite values (no NaN lane) */
static inline __m256 round8_bf16_finite(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                               _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)))),
                               _mm256_set1_epi32((int)0xffff0000u)));
}

/* Q4_0 / Q8_0 blocks [c0, c0 + len) of a row decoded 8 weights a register (deq_q4_0_block's /
 * deq_q8_0_block's float32 products) and, with bf, rounded there (round8_bf16): the AVX2 build's
 * generic kernel then makes one pass over its buffer, in a bfloat16 model as in a float32 one */
static inline __attribute__((always_inline)) void deq_seg_q_avx2_w(int type, const uint8_t *row, int64_t c0, int64_t len,
                                                                    float *o, const int bf) {
    const int size = type == QP_Q4_0 ? 18 : 34;
    for (int64_t i = 0; i < len; i += QK) {
        const uint8_t *blk = row + (c0 + i) / QK * size;
        const __m256 d = _mm256_set1_ps(f16_to_f32(blk));
        __m256i q[4];
        if (type == QP_Q4_0) {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2)), f = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(qs, f), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), f), eight = _mm_set1_epi8(8);
            const __m128i l8 = _mm_sub_epi8(lo, eight), h8 = _mm_sub_epi8(hi, eight);
            q[0] = _mm256_cvtepi8_epi32(l8); q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(l8, 8));
            q[2] = _mm256_cvtepi8_epi32(h8); q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(h8, 8));
        } else {
            const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 2)), b = _mm_loadu_si128((const __m128i *)(blk + 18));
            q[0] = _mm256_cvtepi8_epi32(a); q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8));
            q[2] = _mm256_cvtepi8_epi32(b); q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
        }
        const int finite = isfinite(_mm256_cvtss_f32(d));
        for (int k = 0; k < 4; k++) {
            __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q[k]));
            /* a finite scale times an integer below 2^8 is finite: no NaN lane to keep */
            if (bf) v = finite ? round8_bf16_finite(v) : round8_bf16(v);
            _mm256_storeu_ps(o + i + 8 * k, v);
        }
    }
}
static void deq_seg_q_avx2(int type, const uint8_t *row, int64_t c0, int64_t len, float *o, int bf) {
    if (bf) deq_seg_q_avx2_w(type, row, c0, len, o, 1);
    else deq_seg_q_avx2_w(type, row, c0, len, o, 0);
}
/* round_buf's vector part (bfloat16): returns where it stopped */
static inline __attribute__((always_inline)) int64_t round_run_avx2(float *o, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) _mm256_storeu_ps(o + i, round8_bf16(_mm256_loadu_ps(o + i)));
    return i;
}

#ifdef __FMA__
/* e^x for 8 floats: exp512's Cody-Waite reduction and degree-6 polynomial (at most 3 ulp from the
 * correctly rounded value over [-87, 88], measured), times 2^n as two exponent-field factors (n up to 128 and down to -150 without overflow
 * of either); overflow to inf, underflow to 0, NaN kept */
static inline __m256 exp8_avx2(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.72283f), lo = _mm256_set1_ps(-103.97208f);
    const __m256 big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), big);
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), small);
    return _mm256_blendv_ps(y, x, nan);
}

/* x[i] = e^x[i] 8 lanes a step (exp8_avx2); returns where it stopped */
static inline int64_t exp_run_avx2(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8_avx2(_mm256_loadu_ps(x + i)));
    return i;
}
#endif

/* a decayed bfloat16 row plus a rank-one term, 8 lanes a step: v = r[j] * d + bk * delta[j]
 * (separate roundings, as the scalar loop), o[j] += q * v, r[j] = v rounded to bfloat16 (round8_bf16);
 * returns where it stopped (arch/dispatch.h: bf16_row_decay_run) */
static inline int64_t bf16_row_decay_run_avx2(uint16_t *r, float d, float bk, const float *delta, float q, float *o,
                                              int64_t n) {
    const __m256 vd = _mm256_set1_ps(d), vbk = _mm256_set1_ps(bk), vq = _mm256_set1_ps(q);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + j))), 16));
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(s, vd), _mm256_mul_ps(vbk, _mm256_loadu_ps(delta + j)));
        _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(vq, v)));
        const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(round8_bf16(v)), 16);
        _mm_storeu_si128((__m128i *)(r + j), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
    return j;
}
#endif

#if defined(__AVX2__)
/* 8 codes of a scaled form's row from element i on, as float32 (exactly the scalar loop's q) */
static inline __m256 raw8_int8_avx2(const uint8_t *row, int64_t i) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
}
static inline __m256i nib8_avx2(const uint8_t *row, int64_t i) {  /* i even: nibbles of 4 bytes, low first */
    int32_t four;
    memcpy(&four, row + i / 2, 4);
    const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four));
    /* lanes 0..7 take bytes 0,0,1,1,2,2,3,3: low nibble for even lanes, high for odd */
    const __m256i dup = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    const __m256i sh = _mm256_srlv_epi32(dup, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    return _mm256_and_si256(sh, _mm256_set1_epi32(15));
}

/* the scaled-form segment decoder's loop (deq_seg_scaled) on 8 values at a time, INT8 / INT4 /
 * FP4 codes (FP8: the scalar loop), the same float32 operations per value: ((q - z) * s) [* gs] */
static inline __attribute__((always_inline)) int64_t scaled_run_avx2(int t, const uint8_t *restrict row,
                                                                   const void *zp, float s, float z, float gs,
                                                                   int has_g, int64_t i, int64_t end, int64_t c0,
                                                                   float *restrict o) {
    if (t == QP_FP8 || (i & 1)) return i;
    const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z), vg = _mm256_set1_ps(gs);
#define QP_SCALED_LOOP8(RAW)                                                                \
    if (zp) { for (; i + 8 <= end; i += 8) {                                             \
        __m256 v = _mm256_mul_ps(_mm256_sub_ps(RAW, vz), vs);                              \
        _mm256_storeu_ps(o + (i - c0), has_g ? _mm256_mul_ps(v, vg) : v); } }              \
    else if (has_g) { for (; i + 8 <= end; i += 8)                                       \
        _mm256_storeu_ps(o + (i - c0), _mm256_mul_ps(_mm256_mul_ps(RAW, vs), vg)); }      \
    else { for (; i + 8 <= end; i += 8)                                                  \
        _mm256_storeu_ps(o + (i - c0), _mm256_mul_ps(RAW, vs)); }
    switch (t) {
        case QP_INT8: QP_SCALED_LOOP8(raw8_int8_avx2(row, i)) break;
        case QP_INT4:
            QP_SCALED_LOOP8(_mm256_cvtepi32_ps(_mm256_sub_epi32(nib8_avx2(row, i), _mm256_set1_epi32(8)))) break;
        default: {
            const __m256 lut_lo = _mm256_loadu_ps(E2M1), lut_hi = _mm256_loadu_ps(E2M1 + 8);
            QP_SCALED_LOOP8(_mm256_blendv_ps(
                _mm256_permutevar8x32_ps(lut_lo, nib8_avx2(row, i)), _mm256_permutevar8x32_ps(lut_hi, nib8_avx2(row, i)),
                _mm256_castsi256_ps(_mm256_slli_epi32(nib8_avx2(row, i), 28))))
        }
    }
#undef QP_SCALED_LOOP8
    return i;
}
#endif

#if defined(__AVX2__)
/* acc[j % 8] += b[j] * x[j] for j in [0, n), n a multiple of 8, in ascending j: the generic row
 * loop's 8 lane sums, on one register (multiply then add, as the scalar loop rounds) */
static inline void acc8_run_avx2(float *acc, const float *restrict b, const float *restrict x, int64_t n) {
    __m256 a = _mm256_loadu_ps(acc);
    for (int64_t j = 0; j < n; j += 8) a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(b + j), _mm256_loadu_ps(x + j)));
    _mm256_storeu_ps(acc, a);
}
#endif
