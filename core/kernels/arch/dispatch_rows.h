/* The row kernels' instruction-set choice (generic/rows.c holds no #if of its own): which kernel
 * a weight takes in this build, and the build's tiles and row kernels behind it. Included after
 * the arch/ row kernels (x86_avx2.c, x86_avx512.c), before generic/rows.c. */

/* the row kernels (row_kernel, qp_row_kernel) */
enum { QK_GENERIC = 0, QK_FAST = 1, QK_INT = 2, QK_EXACT32 = 3, QK_KQUANT = 4, QK_SCALED = 5 };

/* which SIMD path this build took (qp_isa): 3 AVX512 with VNNI, 4 AVX512 without, 2 AVX2, 0 portable C */
#ifdef QP_VNNI512
#define QP_ISA 3
#elif defined(QP_AVX512)
#define QP_ISA 4
#elif defined(__AVX2__)
#define QP_ISA 2
#else
#define QP_ISA 0
#endif

/* a fast Q4_0 / Q8_0 tile (int8 activation blocks): 1 where the build has one (the 512-bit VNNI
 * tile; AVX2: dot = sum |v| * sign(x, v)); 0: the caller's portable loop */
static inline __attribute__((always_inline)) int fast_tile_vec(const qp_mat *m, const qp_in *in, int64_t r, int i0,
                                                               int rt, int mt, float *y, int64_t ldy) {
#ifdef QP_VNNI512
    QP_TILE(fast_tile512, m, in, r, i0, rt, mt, y, ldy);
    return 1;
#elif defined(__AVX2__)
    QP_TILE(fast_tile, m, in, r, i0, rt, mt, y, ldy);
    return 1;
#else
    (void)m; (void)in; (void)r; (void)i0; (void)rt; (void)mt; (void)y; (void)ldy;
    return 0;
#endif
}

/* fast K-quant rows [r, r + rt) against q8_K x rows: 1 where the build has a vector kernel (the
 * 512-bit VNNI one); 0: the caller's portable loop */
static inline int fast_k_rows_vec(const qp_mat *m, const qp_in *in, int64_t r, int rt, int xm, float *y, int64_t ldy) {
#ifdef QP_VNNI512
    fast_k_rows512(m, in, r, rt, xm, y, ldy);
    return 1;
#else
    (void)m; (void)in; (void)r; (void)rt; (void)xm; (void)y; (void)ldy;
    return 0;
#endif
}

/* int_rows's integer dot of u8 activations and int8 weights: the leading part; *at where it stopped */
static inline int32_t dot_u8s8_run(const uint8_t *u, const int8_t *wr, int64_t K, int64_t *at) {
#ifdef QP_VNNI512
    return dot_u8s8_run512(u, wr, K, at);
#else
    (void)u; (void)wr; (void)K;
    *at = 0;
    return 0;
#endif
}

/* the portable generic kernel's vector parts (AVX2; AVX512 builds take generic_rows512 instead):
 * bfloat16 rows of a float32 / bfloat16 model whole (1: done), and a segment's 8 lane sums */
static inline int bf16_rows_vec(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y,
                                int64_t ldy) {
#if defined(__AVX2__) && !defined(QP_AVX512)
    bf16_rows_avx2(m, in, r0, r1, xm, y, ldy);
    return 1;
#else
    (void)m; (void)in; (void)r0; (void)r1; (void)xm; (void)y; (void)ldy;
    return 0;
#endif
}
static inline int acc8_vec(float *acc, const float *restrict b, const float *restrict x, int64_t n) {
#if defined(__AVX2__) && !defined(QP_AVX512)
    acc8_run_avx2(acc, b, x, n);
    return 1;
#else
    (void)acc; (void)b; (void)x; (void)n;
    return 0;
#endif
}

/* the build's own row kernel for m (a QK_* above QK_INT), or QK_GENERIC */
static inline int row_kernel_vec(const qp_mat *m, int wround) {
#ifdef QP_AVX512
    /* Q4_0 / Q8_0 / K-quant weights round to bfloat16 in registers (QR_F16 keeps the generic path);
     * bfloat16 rows are already the model dtype's values */
    if ((m->type == QP_Q4_0 || m->type == QP_Q8_0) && wround != QR_F16) return QK_EXACT32;
    if (m->type == QP_BF16 && wround != QR_F16 && m->k % 32 == 0) return QK_EXACT32;
    if ((m->type == QP_Q4_K || m->type == QP_Q5_K || m->type == QP_Q6_K) && wround != QR_F16) return QK_KQUANT;
    if (m->type >= QP_INT4 && (m->gk % 16 == 0) && m->k % 16 == 0 && !m->big && (m->k + m->gk - 1) / m->gk <= QP_NG_MAX)
        return QK_SCALED;
#endif
    (void)m; (void)wround;
    return QK_GENERIC;
}

/* rows [r0, r1) of m on the build's row kernel `kernel` (row_kernel_vec's) or its generic one
 * (QK_GENERIC): 1 when the build has that kernel, 0 for the caller's portable one */
static inline __attribute__((always_inline)) int rows_vec(int kernel, const qp_mat *m, const qp_in *in, int64_t r0,
                                                          int64_t r1, int xm, float *y, int64_t ldy, int wround) {
#ifdef QP_AVX512
    switch (kernel) {
        case QK_EXACT32: {
            /* Q4_0 / Q8_0 weights are never subnormal (an f16 scale times a small integer): the
             * AVX512-BF16 conversion rounds them as round_bf16 does */
#if defined(__AVX512BF16__)
            const int bf = QR_BF16_NORMAL;
#else
            const int bf = QR_BF16;
#endif
            exact_rows_32(m, in, r0, r1, xm, y, ldy, m->type != QP_BF16 && wround == QR_BF16 ? bf : QR_NONE);
            return 1;
        }
        case QK_KQUANT:
            /* K-quant weights are f16 scales times small integers, less f16 minimums times small
             * integers: zero or at least 2^-24 in magnitude, never subnormal */
            if (wround != QR_BF16) kq_rows(m, in, r0, r1, xm, y, ldy);
#if defined(__AVX512BF16__)
            else kq_rows_bf16n(m, in, r0, r1, xm, y, ldy);
#else
            else kq_rows_bf16(m, in, r0, r1, xm, y, ldy);
#endif
            return 1;
        case QK_SCALED: {
            const int simple = !m->z && !(m->gmode == QG_AFTER && m->gs != 1.f) && !m->nan;
#if defined(__AVX512BF16__)
            /* a bfloat16 model's weights known normal or zero, on bfloat16 pairs: one vdpbf16ps per
             * 32 weights and x row (groups of 32k, or 16 two at a time) */
            if (in->xb && wround == QR_BF16 && !m->tiny && (m->gk % 32 == 0 || m->gk == 16)) {
                __atomic_fetch_add(&qp_pair_count, 1, __ATOMIC_RELAXED);
                switch (m->type) {
                    case QP_INT8: (simple ? pair_plain_int8 : pair_int8)(m, in, r0, r1, xm, y, ldy); break;
                    case QP_INT4: (simple ? pair_plain_int4 : pair_int4)(m, in, r0, r1, xm, y, ldy); break;
                    case QP_FP8: (simple ? pair_plain_fp8 : pair_fp8)(m, in, r0, r1, xm, y, ldy); break;
                    default: (simple ? pair_plain_fp4 : pair_fp4)(m, in, r0, r1, xm, y, ldy); break;
                }
                return 1;
            }
#endif
            const int p32 = simple && wround == QR_NONE, p16 = simple && wround == QR_BF16;
#if defined(__AVX512BF16__)
            const int p16n = p16 && !m->tiny;
#else
            const int p16n = 0;
#endif
            switch (m->type) {
                case QP_INT8: (p32 ? plain_int8 : p16n ? plain_int8_bf16n : p16 ? plain_int8_bf16 : fused_int8)(m, in, r0, r1, xm, y, ldy, wround); break;
                case QP_INT4: (p32 ? plain_int4 : p16n ? plain_int4_bf16n : p16 ? plain_int4_bf16 : fused_int4)(m, in, r0, r1, xm, y, ldy, wround); break;
                case QP_FP8: (p32 ? plain_fp8 : p16n ? plain_fp8_bf16n : p16 ? plain_fp8_bf16 : fused_fp8)(m, in, r0, r1, xm, y, ldy, wround); break;
                default: (p32 ? plain_fp4 : p16n ? plain_fp4_bf16n : p16 ? plain_fp4_bf16 : fused_fp4)(m, in, r0, r1, xm, y, ldy, wround); break;
            }
            return 1;
        }
        default:
            generic_rows512(m, in, r0, r1, xm, y, ldy, wround);
            return 1;
    }
#else
    (void)kernel; (void)m; (void)in; (void)r0; (void)r1; (void)xm; (void)y; (void)ldy; (void)wround;
    return 0;
#endif
}

/* qp_fp8_has_nan's vector scan: 1 when a NaN code was found; *at where it stopped */
static inline int fp8_nan_scan(const uint8_t *p, int64_t n, int64_t *at) {
#ifdef QP_AVX512
    return fp8_nan_scan512(p, n, at);
#else
    (void)p; (void)n; (void)at;
    return 0;
#endif
}
