/* AVX2 kernels (fast Q4_0 / Q8_0 tile; with AVX512-VNNI's 256-bit dot where the CPU has it).
 * Included by qp_kernels.c; each part compiled only where its instructions exist. */

#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {  /* 8 int32 lane sums of u8 x s8 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* one block of a Q4_0 / Q8_0 weight row as signed int8 codes (Q4_0: q - 8) */
static inline __m256i codes(int type, const uint8_t *blk) {
    if (type == QP_Q4_0) {
        __m128i qv = _mm_loadu_si128((const __m128i *)(blk + 2)), m = _mm_set1_epi8(15);
        __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qv, 4), m), _mm_and_si128(qv, m));
        return _mm256_sub_epi8(u, _mm256_set1_epi8(8));
    }
    return _mm256_loadu_si256((const __m256i *)(blk + 2));
}
#endif

#if defined(__AVX2__)
/* one fast tile: rt weight rows from r times mt x rows from i0 (called through QP_TILE) */
static inline __attribute__((always_inline)) void fast_tile(const qp_mat *m, const qp_in *in, int64_t r, int i0,
                                                           const int rt, const int mt, float *y, int64_t ldy) {
    const int type = m->type, size = type == QP_Q4_0 ? 18 : 34;
    const int64_t nb = m->k / QK;
    const int8_t *xq = in->q8;
    const float *xd = in->d8;
    __m256 acc[RT][MT];
    for (int a = 0; a < rt; a++) for (int i = 0; i < mt; i++) acc[a][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[RT], u[RT];
        float dw[RT];
        for (int a = 0; a < rt; a++) {
            const uint8_t *blk = m->w + (r + a) * m->ldw + b * size;
            _mm_prefetch((const char *)(blk + RT * m->ldw), _MM_HINT_T1);
            dw[a] = f16_to_f32(blk);
            v[a] = codes(type, blk);
            u[a] = _mm256_sign_epi8(v[a], v[a]);
        }
        for (int i = 0; i < mt; i++) {
            int64_t xi = (int64_t)(i0 + i);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + xi * m->k + b * QK));
            float xdb = xd[xi * nb + b];
            for (int a = 0; a < rt; a++) {
                __m256i d = dot_u8s8(u[a], _mm256_sign_epi8(xv, v[a]));
                acc[a][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(dw[a] * xdb), acc[a][i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int a = 0; a < rt; a++) y[(int64_t)(i0 + i) * ldy + r + a] = hsum256(acc[a][i]);
}
#endif


#if defined(__AVX2__) && !defined(QP_AVX512)
/* Exact rows of bfloat16 weights (AVX2): each weight widened to float32 in registers (exact), one
 * 8-lane accumulator per input row, multiply then add (no FMA: the build has fp-contract off) in
 * the lanes and order of generic_rows (lane j % 8, ascending j; the 8 lanes summed in order), so
 * the results are bit-identical to it while reading each weight once, straight from the matrix
 * (generic_rows decodes a segment into a buffer first: 6x slower on a 12288 x 7168 GEMV). */
static void bf16_rows_avx2(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    y -= r0;
    const int64_t K = m->k;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *w = (const uint16_t *)(m->w + r * m->ldw);
        for (int i0 = 0; i0 < xm; i0 += MT) {
            const int mt = xm - i0 < MT ? xm - i0 : MT;
            __m256 acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < K; j += 8) {
                const __m256 wv = _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + j))), 16));
                for (int i = 0; i < mt; i++)
                    acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(wv, _mm256_loadu_ps(in->x + (int64_t)(i0 + i) * in->ldx + j)));
            }
            for (int i = 0; i < mt; i++) {
                float a[8], s = 0.f;
                _mm256_storeu_ps(a, acc[i]);
                for (int j = 0; j < 8; j++) s += a[j];
                y[(int64_t)(i0 + i) * ldy + r] = s;
            }
        }
    }
}
#endif
