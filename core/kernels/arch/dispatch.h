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
