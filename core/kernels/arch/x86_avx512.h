/* AVX512 (F, BW, VL; VNNI, BF16 where present) vector primitives: register decoders of the
 * forms, conversions and roundings, and the vector parts of the generic loops (each with its
 * portable remainder in generic/). Included by qp_kernels.c only when QP_AVX512. */
#ifdef QP_AVX512

/* AVX512 versions of the K-quant decoders above, the same float32 operations in the same order
 * (so bit-equal): 16 values per vector, each vector within one sub-block of 16 or 32 */
static inline __m512 i8x16_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

/* a Q6_K super-block's 256 weights in 16 registers, v[k] = values [16k, 16k + 16) */
static inline __attribute__((always_inline)) void q6_k_regs(const uint8_t *b, __m512 v[16]) {
    const float d = f16_to_f32(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    const __m128i m4 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3), c32 = _mm_set1_epi8(32);
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        _Pragma("GCC unroll 2") for (int part = 0; part < 2; part++) {       /* l in [16 part, 16 part + 16) */
            const int l = 16 * part, is = l / 16;
            __m128i lq0 = _mm_loadu_si128((const __m128i *)(ql + l)), lq1 = _mm_loadu_si128((const __m128i *)(ql + l + 32));
            __m128i hq = _mm_loadu_si128((const __m128i *)(qh + l));
            __m128i q0 = _mm_or_si128(_mm_and_si128(lq0, m4), _mm_slli_epi16(_mm_and_si128(hq, m3), 4));
            __m128i q1 = _mm_or_si128(_mm_and_si128(lq1, m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hq, 2), m3), 4));
            __m128i q2 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lq0, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hq, 4), m3), 4));
            __m128i q3 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lq1, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hq, 6), m3), 4));
            /* the OR of a 4-bit and a shifted 2-bit field never carries across bytes */
            const float s0 = d * (float)scales[8 * h + is], s1 = d * (float)scales[8 * h + is + 2];
            const float s2 = d * (float)scales[8 * h + is + 4], s3 = d * (float)scales[8 * h + is + 6];
            const int k = (128 * h + l) / 16;
            v[k] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q0, c32)), _mm512_set1_ps(s0));
            v[k + 2] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q1, c32)), _mm512_set1_ps(s1));
            v[k + 4] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q2, c32)), _mm512_set1_ps(s2));
            v[k + 6] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q3, c32)), _mm512_set1_ps(s3));
        }
    }
}

/* Q4_K / Q5_K: sub-block s of 32 values, dl * q - ml (a product then a difference, two roundings) */
static inline __attribute__((always_inline)) void q45_k_regs(const uint8_t *b, int five, __m512 v[16]) {
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    const __m128i m4 = _mm_set1_epi8(15), one = _mm_set1_epi8(1);
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {          /* bytes 32j + 16 half .. + 16 */
            const int l = 16 * half;
            __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * j + l));
            __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
            if (five) {
                __m128i h = _mm_loadu_si128((const __m128i *)(qh + l));
                /* bit s0 = 2j of qh[l] is the 5th bit of the low nibble, bit s1 = 2j + 1 of the high */
                lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2 * j), one), 4));
                hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2 * j + 1), one), 4));
            }
            const int s0 = 2 * j, s1 = 2 * j + 1;
            const __m512 dl0 = _mm512_set1_ps(d * (float)sc[s0]), ml0 = _mm512_set1_ps(dmin * (float)mn[s0]);
            const __m512 dl1 = _mm512_set1_ps(d * (float)sc[s1]), ml1 = _mm512_set1_ps(dmin * (float)mn[s1]);
            v[4 * j + half] = _mm512_sub_ps(_mm512_mul_ps(dl0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))), ml0);
            v[4 * j + 2 + half] = _mm512_sub_ps(_mm512_mul_ps(dl1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))), ml1);
        }
}

/* a K-quant super-block (Q4_K / Q5_K / Q6_K) in 16 registers */
static inline __attribute__((always_inline)) void kq_regs(int type, const uint8_t *b, __m512 v[16]) {
    if (type == QP_Q6_K) q6_k_regs(b, v);
    else q45_k_regs(b, type == QP_Q5_K, v);
}

static void deq_k_sb512(int type, const uint8_t *b, float *o) {
    __m512 v[16];
    kq_regs(type, b, v);
    for (int k = 0; k < 16; k++) _mm512_storeu_ps(o + 16 * k, v[k]);
}

static inline __m512 cvt_u8x16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
static inline __m512 fp8x16(const uint8_t *p, int nan) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i y = _mm256_cvtepi8_epi16(b);                        /* sign extended */
    y = _mm256_and_si256(_mm256_slli_epi16(y, 7), _mm256_set1_epi16((short)0xBFFF));
    __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(y), _mm512_set1_ps(256.f));  /* exact: a power of two */
    if (nan) {
        __mmask16 k = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        v = _mm512_mask_blend_ps(k, v, _mm512_set1_ps(NAN));
    }
    return v;
}
/* 16 e4m3 values divided by 256 (exact: a power of two), NaN codes NaN: the fused FP8 kernel
 * multiplies by the scale times 256, which rounds once to the same value as (value * scale) */
static inline __m512 fp8x16_div256(const uint8_t *p, int nan) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i y = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xBFFF));
    __m512 v = _mm512_cvtph_ps(y);
    if (nan) {
        __mmask16 k = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        v = _mm512_mask_blend_ps(k, v, _mm512_set1_ps(NAN));
    }
    return v;
}
/* the FP8 scale times 256: exact for the scales the fused kernel is given (m->big: no scale
 * >= 2^119, else the generic path runs) */
static inline float fp8_fold(float s) { return s * 256.f; }
static inline __m512 round_vec(__m512 v, int wround) {
#if defined(__AVX512BF16__)
    if (wround == QR_BF16_NORMAL)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#endif
    if (wround == QR_BF16 || wround == QR_BF16_NORMAL) {
        __m512i b = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32((int)0xffff0000u));
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), v);
    }
    if (wround == QR_F16)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

#if defined(__AVX512BF16__)
/* bfloat16 pair products (vdpbf16ps): a register holds 32 bfloat16 values of a block in their
 * order, dword l the values 2l and 2l + 1; the instruction adds value 2l + 1's product to lane l,
 * then value 2l's, each product exact (bfloat16 times bfloat16) and each sum rounded once: float32
 * sums as the FMA tiles make them, in another order. It treats subnormal inputs as zero (and
 * flushes a subnormal sum): callers pass no subnormal value. */

/* one row of K float32 values (K a multiple of 32) as bfloat16 at o; 0 (o partly written) when
 * some value is not a bfloat16 (low 16 bits set) or is subnormal */
static inline int xb_row512(const float *x, int64_t K, uint16_t *o) {
    const __m512i low = _mm512_set1_epi32(0xFFFF), expo = _mm512_set1_epi32(0x7F800000), mag = _mm512_set1_epi32(0x7FFFFFFF);
    __mmask16 bad = 0;
    for (int64_t c = 0; c < K; c += 32) {
        const __m512i a = _mm512_loadu_si512((const void *)(x + c)), b = _mm512_loadu_si512((const void *)(x + c + 16));
        bad |= _mm512_test_epi32_mask(a, low) | _mm512_test_epi32_mask(b, low);
        bad |= _mm512_testn_epi32_mask(a, expo) & _mm512_test_epi32_mask(a, mag);
        bad |= _mm512_testn_epi32_mask(b, expo) & _mm512_test_epi32_mask(b, mag);
        _mm512_storeu_si512((void *)(o + c), (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(b), _mm512_castsi512_ps(a)));
    }
    return bad == 0;
}

/* values [0, 16) and [16, 32) of a block (float32, normal or zero) as 32 bfloat16 (rounded to
 * nearest even, as round_vec's QR_BF16_NORMAL) */
static inline __m512i pair_words(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
#endif

/* 16 values of a scaled form at element i of a row, before the scale: one function per form, so
 * each decode loop below is specialized (no per-element branch) */
static inline __m512 raw16_int8(const uint8_t *row, int64_t i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
}
static inline __m512i nib16(const uint8_t *row, int64_t i) {  /* 16 nibbles from 8 bytes, element order */
    __m128i b = _mm_loadl_epi64((const __m128i *)(row + i / 2)), f = _mm_set1_epi8(15);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(b, f), _mm_and_si128(_mm_srli_epi16(b, 4), f)));
}
/* the 16 nibbles' indices as permutexvar reads them (only each index's low 4 bits count: no masks) */
static inline __m512i idx16(const uint8_t *row, int64_t i) {
    __m128i b = _mm_loadl_epi64((const __m128i *)(row + i / 2));
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));
}
static inline __m512 raw16_int4(const uint8_t *row, int64_t i) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(nib16(row, i), _mm512_set1_epi32(8)));
}

/* qp_fp8_has_nan's scan, 256 bytes a step: 1 when a NaN code is found; *at: where it stopped */
static inline int fp8_nan_scan512(const uint8_t *p, int64_t n, int64_t *at) {
    int64_t i = *at;
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    for (; i + 256 <= n; i += 256) {
        const __m512i a = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i)), m7f);
        const __m512i b = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i + 64)), m7f);
        const __m512i c = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i + 128)), m7f);
        const __m512i d = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i + 192)), m7f);
        /* the largest of (b & 0x7F) is 0x7F exactly when one byte is a NaN code */
        const __m512i mx = _mm512_max_epu8(_mm512_max_epu8(a, b), _mm512_max_epu8(c, d));
        if (_mm512_cmpeq_epi8_mask(mx, m7f)) return 1;
    }
    *at = i;
    return 0;
}

/* round_buf's vector part: the values round_vec gives, 16 at a time; returns where it stopped */
static inline __attribute__((always_inline)) int64_t round_run512(float *o, int64_t len, int wround) {
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) _mm512_storeu_ps(o + i, round_vec(_mm512_loadu_ps(o + i), wround));
    return i;
}

/* deq_seg_scaled's vector part for one group's elements [i, end): 16 weights at a time, the same
 * float32 operations as its scalar loop; returns where it stopped */
static inline __attribute__((always_inline)) int64_t scaled_run512(int t, const uint8_t *restrict row, int nan, const void *zp,
                                                              float s, float z, float gs, int has_g, int64_t i,
                                                              int64_t end, int64_t c0, float *restrict o) {
    const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z), vg = _mm512_set1_ps(gs);
    /* one loop per (form, zero point, global scale): the compiler keeps them branch-free */
#define QP_SCALED_LOOP(RAW)                                                                 \
    if (zp) { for (; i + 16 <= end; i += 16) {                                          \
        __m512 v = _mm512_mul_ps(_mm512_sub_ps(RAW, vz), vs);                           \
        _mm512_storeu_ps(o + (i - c0), has_g ? _mm512_mul_ps(v, vg) : v); } }           \
    else if (has_g) { for (; i + 16 <= end; i += 16)                                    \
        _mm512_storeu_ps(o + (i - c0), _mm512_mul_ps(_mm512_mul_ps(RAW, vs), vg)); }   \
    else { for (; i + 16 <= end; i += 16)                                               \
        _mm512_storeu_ps(o + (i - c0), _mm512_mul_ps(RAW, vs)); }
    switch (t) {
        case QP_INT8: QP_SCALED_LOOP(raw16_int8(row, i)) break;
        case QP_INT4: QP_SCALED_LOOP(raw16_int4(row, i)) break;
        case QP_FP8:
            if (nan) { QP_SCALED_LOOP(fp8x16(row + i, 1)) }
            else { QP_SCALED_LOOP(fp8x16(row + i, 0)) }
            break;
        default: {
            const __m512 lut = _mm512_loadu_ps(E2M1);
            QP_SCALED_LOOP(_mm512_permutexvar_ps(nib16(row, i), lut))
        }
    }
#undef QP_SCALED_LOOP
    return i;
}

/* quantize_row on 32 values at a time */
static inline __attribute__((always_inline)) void quantize_row512(const float *x, int64_t K, int8_t *q, float *d) {
    /* the same operations on 32 values at a time: max of |x| (exact), x * (127 / amax) rounded to
     * nearest even by the conversion (lrintf's rounding), narrowed (the codes fit int8); the scale
     * rounded to float16 (ggml's block_q8_0.d) */
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)), inf = _mm512_set1_ps(INFINITY);
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const __m512 a0 = _mm512_and_ps(x0, absmask), a1 = _mm512_and_ps(x1, absmask);
        const int finite = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == 0xFFFF;
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        const float id = finite && amax != 0.f ? 127.f / amax : 0.f;
        const __m512 vid = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vid))));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vid))));
        d[b] = finite ? round_f16(amax / 127.f) : NAN;
    }
}

/* quantize_row_k on 16 values at a time: the same float32 operations (|x| and its first largest
 * value exact, iscale = -127 / max, codes the conversion's round-half-even of iscale * x, at most
 * 127), each 16 codes' sum by a reduction */
static inline __attribute__((always_inline)) void quantize_row_k512(const float *x, int64_t K, int8_t *q, float *d, int16_t *bs) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)), inf = _mm512_set1_ps(INFINITY);
    for (int64_t b = 0; b < K / QKK; b++) {
        const float *xb = x + b * QKK;
        __m512 v[16], mx = _mm512_setzero_ps();
        int finite = 1;
        for (int j = 0; j < 16; j++) {
            v[j] = _mm512_loadu_ps(xb + 16 * j);
            const __m512 a = _mm512_and_ps(v[j], absmask);
            finite &= _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ) == 0xFFFF;
            mx = _mm512_max_ps(mx, a);
        }
        const float amax = _mm512_reduce_max_ps(mx);
        if (!finite || amax == 0.f) {
            memset(q + b * QKK, 0, QKK);
            memset(bs + b * (QKK / 16), 0, sizeof(int16_t) * (QKK / 16));
            d[b] = finite ? 0.f : NAN;
            continue;
        }
        float m = 0.f;
        for (int j = 0; j < 16; j++) {
            const __mmask16 at = _mm512_cmp_ps_mask(_mm512_and_ps(v[j], absmask), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (at) { m = xb[16 * j + __builtin_ctz((unsigned)at)]; break; }
        }
        const float is = -127.f / m;
        const __m512 vis = _mm512_set1_ps(is);
        for (int j = 0; j < 16; j++) {
            const __m512i c = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(vis, v[j])), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(q + b * QKK + 16 * j), _mm512_cvtepi32_epi8(c));
            bs[b * (QKK / 16) + j] = (int16_t)_mm512_reduce_add_epi32(c);
        }
        d[b] = 1.f / is;
    }
}

/* row_scales' e4m3 scales, 16 at a time (exact, NaN codes NaN); returns where it stopped */
static inline __attribute__((always_inline)) int64_t e4m3_run512(const uint8_t *s8, int64_t ng, float *sv) {
    int64_t j = 0;
    for (; j + 16 <= ng; j += 16) _mm512_storeu_ps(sv + j, fp8x16(s8 + j, 1));
    return j;
}

#ifdef QP_VNNI512
/* int_rows' integer dot of u8 codes with int8 weights, 64 a step (vpdpbusd); *at: where it stopped */
static inline __attribute__((always_inline)) int32_t dot_u8s8_run512(const uint8_t *u, const int8_t *wr, int64_t K, int64_t *at) {
    int64_t c = *at;
    __m512i acc = _mm512_setzero_si512();
    for (; c + 64 <= K; c += 64)
        acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512((const void *)(u + c)), _mm512_loadu_si512((const void *)(wr + c)));
    *at = c;
    return _mm512_reduce_add_epi32(acc);
}
#endif

/* dot_f32 in 64 lanes: the sum of a[0, *at) * b[0, *at) (fixed reduction order); *at: where it stopped */
static inline __attribute__((always_inline)) float dot_run512(const float *a, const float *b, int64_t n, int64_t *at) {
    int64_t i = 0;
    float s;
    __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps(), c3 = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        c0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), c0);
        c1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), c1);
        c2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), c2);
        c3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), c3);
    }
    for (; i + 16 <= n; i += 16) c0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), c0);
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
    *at = i;
    return s;
}

/* axpy_f32's vector part; returns where it stopped */
static inline __attribute__((always_inline)) int64_t axpy_run512(float a, const float *x, float *y, int64_t n) {
    int64_t i = 0;
    const __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    return i;
}

/* e^x for 16 floats: x = n ln2 + r (Cody-Waite), e^r by its degree-6 Taylor-Horner polynomial on
 * |r| <= ln2 / 2 (relative error below 2 ulp), times 2^n; overflow to inf, underflow to 0 */
static inline __m512 exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.72283f), lo = _mm512_set1_ps(-103.97208f);
    __mmask16 big = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), small = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    __m512 y = _mm512_scalef_ps(p, n);
    y = _mm512_mask_blend_ps(big, y, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(small, y, _mm512_setzero_ps());
}

/* x[i] = e^x[i] 16 lanes a step (exp512); returns where it stopped */
static inline __attribute__((always_inline)) int64_t exp_run512(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp512(_mm512_loadu_ps(x + i)));
    return i;
}

/* silu_mul's vector part; returns where it stopped */
static inline __attribute__((always_inline)) int64_t silu_mul_run512(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(g + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
    return i;
}

#endif
