/* The instruction-set choice of the block steps' vector runs (blocks/ hold no #if of their own):
 * each run computes a leading part of its loop with the build's widest path and returns where it
 * stopped (0 where the build has none; the caller's portable loop does the rest, or, for dot_lanes,
 * the portable 8-lane sum is the fallback here). Included after the arch/ headers. */

/* the sum of a[0, *at) * b[0, *at) in a fixed reduction order (so results do not depend on the
 * thread): 64 lanes with AVX512, else 8 lanes of portable C over whole groups of 8 */
static inline float dot_lanes(const float *a, const float *b, int64_t n, int64_t *at) {
#ifdef QP_AVX512
    return dot_run512(a, b, n, at);
#else
    int64_t i = 0;
    float acc[8] = {0.f}, s = 0.f;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; j++) s += acc[j];
    *at = i;
    return s;
#endif
}

/* y[i] += a * x[i] */
static inline int64_t axpy_run(float a, const float *x, float *y, int64_t n) {
#ifdef QP_AVX512
    return axpy_run512(a, x, y, n);
#else
    (void)a; (void)x; (void)y; (void)n;
    return 0;
#endif
}

/* g[i] = silu(g[i]) * u[i] */
static inline int64_t silu_mul_run(float *g, const float *u, int64_t n) {
#ifdef QP_AVX512
    return silu_mul_run512(g, u, n);
#else
    (void)g; (void)u; (void)n;
    return 0;
#endif
}

/* x[i] = e^x[i] (a few ulp from expf) */
static inline int64_t exp_run(float *x, int64_t n) {
#if defined(QP_AVX512)
    return exp_run512(x, n);
#elif defined(__AVX2__) && defined(__FMA__)
    return exp_run_avx2(x, n);
#else
    (void)x; (void)n;
    return 0;
#endif
}

/* a decayed bfloat16 row plus a rank-one term: v = r[j] * d + bk * delta[j] (separate roundings),
 * o[j] += q * v, r[j] = v rounded to bfloat16. AVX2 only: AVX512 builds vectorize the portable
 * loop themselves, the AVX2 ones leave its rounding scalar */
static inline int64_t bf16_row_decay_run(uint16_t *r, float d, float bk, const float *delta, float q, float *o,
                                         int64_t n) {
#if defined(__AVX2__) && !defined(QP_AVX512)
    return bf16_row_decay_run_avx2(r, d, bk, delta, q, o, n);
#else
    (void)r; (void)d; (void)bk; (void)delta; (void)q; (void)o; (void)n;
    return 0;
#endif
}

/* ---- the generic kernels' vector parts (generic/decode.c) ---------------------------------- */

/* a K-quant super-block (Q4_K / Q5_K / Q6_K) decoded in registers: 1 where the build has it */
static inline int deq_k_sb_vec(int type, const uint8_t *b, float *o) {
#ifdef QP_AVX512
    deq_k_sb512(type, b, o);
    return 1;
#else
    (void)type; (void)b; (void)o;
    return 0;
#endif
}

/* round_buf's vector part: o[i] rounded to the model dtype (QR_BF16 / QR_F16) */
static inline int64_t round_run(float *o, int64_t len, int wround) {
#ifdef QP_AVX512
    return round_run512(o, len, wround);
#elif defined(__AVX2__)
    return wround == QR_BF16 ? round_run_avx2(o, len) : 0;
#else
    (void)o; (void)len; (void)wround;
    return 0;
#endif
}

/* deq_seg_scaled's vector part: elements [i, end) of a scaled form's row (see there); returns where it stopped */
static inline int64_t scaled_run(int t, const uint8_t *restrict row, int nan, const void *zp, float s, float z, float gs,
                                 int has_g, int64_t i, int64_t end, int64_t c0, float *restrict o) {
#ifdef QP_AVX512
    return scaled_run512(t, row, nan, zp, s, z, gs, has_g, i, end, c0, o);
#elif defined(__AVX2__)
    (void)nan;
    return scaled_run_avx2(t, row, zp, s, z, gs, has_g, i, end, c0, o);
#else
    (void)t; (void)row; (void)nan; (void)zp; (void)s; (void)z; (void)gs; (void)has_g; (void)end; (void)c0; (void)o;
    return i;
#endif
}

/* a Q4_0 / Q8_0 row segment decoded (bf: rounded to bfloat16) in registers: 1 where the build takes
 * this path (AVX2; AVX512 builds decode these forms inside their exact tiles) */
static inline int deq_seg_q_vec(int type, const uint8_t *row, int64_t c0, int64_t len, float *o, int bf) {
#if defined(__AVX2__) && !defined(QP_AVX512)
    deq_seg_q_avx2(type, row, c0, len, o, bf);
    return 1;
#else
    (void)type; (void)row; (void)c0; (void)len; (void)o; (void)bf;
    return 0;
#endif
}

/* quantize_row (Q8_0 activation blocks) in registers: 1 where the build has it */
static inline int quantize_row_vec(const float *x, int64_t K, int8_t *q, float *d) {
#ifdef QP_AVX512
    quantize_row512(x, K, q, d);
    return 1;
#else
    (void)x; (void)K; (void)q; (void)d;
    return 0;
#endif
}

/* quantize_row_k (q8_K activation blocks) in registers: 1 where the build has it */
static inline int quantize_row_k_vec(const float *x, int64_t K, int8_t *q, float *d, int16_t *bs) {
#ifdef QP_AVX512
    quantize_row_k512(x, K, q, d, bs);
    return 1;
#else
    (void)x; (void)K; (void)q; (void)d; (void)bs;
    return 0;
#endif
}

/* whether the build has the bfloat16 pair products (AVX512-BF16) */
#if defined(QP_AVX512) && defined(__AVX512BF16__)
#define QP_PAIRS 1
#else
#define QP_PAIRS 0
#endif

/* a float row as bfloat16 pairs o [K] when the conversion is exact (1), else 0 (and always 0
 * without the pair products) */
static inline int xb_row(const float *x, int64_t K, uint16_t *o) {
#if QP_PAIRS
    return xb_row512(x, K, o);
#else
    (void)x; (void)K; (void)o;
    return 0;
#endif
}

/* e4m3 scale codes as float32 (exact, NaN codes NaN); returns where it stopped */
static inline int64_t e4m3_run(const uint8_t *s8, int64_t ng, float *sv) {
#ifdef QP_AVX512
    return e4m3_run512(s8, ng, sv);
#else
    (void)s8; (void)ng; (void)sv;
    return 0;
#endif
}

/* FP8 effective scales as the build's FP8 kernels take them (AVX512: times 256, fp8_fold) */
static inline void fold_fp8_scales(float *sv, int64_t ng) {
#ifdef QP_AVX512
    for (int64_t j = 0; j < ng; j++) sv[j] = fp8_fold(sv[j]);
#else
    (void)sv; (void)ng;
#endif
}
