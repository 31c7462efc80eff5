/* Portable decoding: a segment of a row exactly (rounded to the model dtype), the activations as
 * a form quantizes them, the prepared inputs of a product, and the scale rows of the scaled forms. */

static int is_ggml_block(int t) {
    switch (t) {
        case QP_Q4_0: case QP_Q4_1: case QP_Q5_0: case QP_Q5_1: case QP_Q8_0: case QP_MXFP4:
        case QP_Q2_K: case QP_Q3_K: case QP_Q4_K: case QP_Q5_K: case QP_Q6_K: return 1;
        default: return qp_iq_block_elems(t) > 0;
    }
}

static void deq_block(int type, const uint8_t *b, float *o) {
    switch (type) {
        case QP_Q4_0: deq_q4_0_block(b, o); break;
        case QP_Q4_1: deq_q4_1_block(b, o); break;
        case QP_Q5_0: deq_q5_0_block(b, o); break;
        case QP_Q5_1: deq_q5_1_block(b, o); break;
        case QP_Q8_0: deq_q8_0_block(b, o); break;
        case QP_MXFP4: deq_mxfp4_block(b, o); break;
        case QP_Q2_K: deq_q2_k_sb(b, o); break;
        case QP_Q3_K: deq_q3_k_sb(b, o); break;
        case QP_Q4_K: if (!deq_k_sb_vec(type, b, o)) deq_q4_k_sb(b, o); break;
        case QP_Q5_K: if (!deq_k_sb_vec(type, b, o)) deq_q5_k_sb(b, o); break;
        case QP_Q6_K: if (!deq_k_sb_vec(type, b, o)) deq_q6_k_sb(b, o); break;
        default: qp_iq_deq_block(type, b, o); break;
    }
}

/* ---- one segment of a row, decoded exactly ------------------------------------------------ */

static inline void round_buf(float *o, int64_t len, int wround) {
    if (wround == QR_NONE) return;
    int64_t i = round_run(o, len, wround);
    for (; i < len; i++) o[i] = wround == QR_BF16 ? round_bf16(o[i]) : round_f16(o[i]);
}

/* elements [c0, c0 + len) of row r of an INT4 / INT8 / FP8 / FP4 matrix (c0, len multiples of 32;
 * gk a multiple of 16 or >= k), exactly: ((q - z) * s) [* gs] as float32 ops, s the effective scale */
static void deq_seg_scaled(const qp_mat *m, int64_t r, int64_t c0, int64_t len, float *restrict o) {
    const uint8_t *restrict row = m->w + r * m->ldw;
    const int64_t srow = (r / m->gn) * m->lds, gk = m->gk;
    const int t = m->type, nan = m->nan;
    const void *zp = m->z;
    const float gs = m->gs;
    const int has_g = m->gmode == QG_AFTER && gs != 1.f;
    int64_t c = c0;
    while (c < c0 + len) {
        const int64_t j = c / gk, end0 = (j + 1) * gk, end = end0 < c0 + len ? end0 : c0 + len;
        const float s = eff_scale_at(m, srow + j), z = zp ? zero_at(m, srow + j) : 0.f;
        int64_t i = scaled_run(t, row, nan, zp, s, z, gs, has_g, c, end, c0, o);
        for (; i < end; i++) {
            float q;
            if (t == QP_INT8) q = (float)(int8_t)row[i];
            else if (t == QP_FP8) q = e4m3_to_f32(row[i]);
            else {
                int nib = (row[i / 2] >> (4 * (i & 1))) & 15;
                q = t == QP_INT4 ? (float)(nib - 8) : E2M1[nib];
            }
            float v = zp ? (q - z) * s : q * s;
            o[i - c0] = has_g ? v * gs : v;
        }
        c = end;
    }
}

/* elements [c0, c0 + len) of row r, exactly, rounded to the model dtype (c0 / len multiples of the
 * form's block, 32 for the scaled forms) */
static void deq_seg(const qp_mat *m, int64_t r, int64_t c0, int64_t len, float *o, int wround) {
    const uint8_t *row = m->w + r * m->ldw;
    switch (m->type) {
        case QP_F32: memcpy(o, row + 4 * c0, (size_t)len * 4); return;   /* float weights are in the model dtype */
        case QP_BF16: {
            const uint16_t *p = (const uint16_t *)row + c0;
            for (int64_t i = 0; i < len; i++) o[i] = bits_f32((uint32_t)p[i] << 16);
            return;
        }
        case QP_F16:
            for (int64_t i = 0; i < len; i++) o[i] = f16_to_f32(row + 2 * (c0 + i));
            return;
        case QP_INT4: case QP_INT8: case QP_FP8: case QP_FP4:
            deq_seg_scaled(m, r, c0, len, o);
            break;
        case QP_Q4_0: case QP_Q8_0:
            if ((wround == QR_NONE || wround == QR_BF16) && deq_seg_q_vec(m->type, row, c0, len, o, wround == QR_BF16))
                return;
            __attribute__((fallthrough));  /* float16 models, builds without it: block by block, then rounded */
        default: {
            int64_t e, b;
            qp_form_info(m->type, &e, &b);
            for (int64_t i = 0; i < len; i += e) deq_block(m->type, row + (c0 + i) / e * b, o + i);
        }
    }
    round_buf(o, len, wround);
}

/* ---- activations -------------------------------------------------------------------------- */

/* float -> e4m3fn -> float, round to nearest even, for |v| <= 448 (callers clamp) */
static inline float e4m3_round(float v) {
    float a = fabsf(v), r;
    if (!(a == a)) return v;
    if (a < 0x1p-6f) r = rintf(a * 512.f) * (1.f / 512.f);
    else {
        uint32_t b = f32_bits(a);
        b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
        r = bits_f32(b);
    }
    return copysignf(r, v);
}

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : v > hi ? hi : v; }

/* What a row of activations becomes for one weight: the float row the product uses (act emulated:
 * fp8 or int8 quantized and dequantized), or for the integer path the int8 codes (+128, unsigned)
 * with the row's scale and offset. */
typedef struct {
    const float *x; int64_t ldx;        /* float rows */
    const uint8_t *u8; const float *xs, *xo;   /* integer path: codes + 128, scale, offset per row */
    const int8_t *q8; const float *d8;  /* fast mode: int8 blocks of 32 and their scales; fast K-quants:
                                           int8 blocks of 256 (ggml's q8_K) and their scales */
    const int16_t *bs;                  /* fast K-quants: each 16 codes' sum (q8_K's bsums); NULL otherwise */
    const uint16_t *xb; int64_t ldxb;   /* bfloat16 pairs (AVX512-BF16, a bfloat16 model): the float
                                           rows as bfloat16 when every value is a normal bfloat16 or
                                           zero (xb_row512); NULL otherwise */
} qp_in;

/* the prepared rows from row i on (K inputs each): every representation moved alike */
static inline void in_skip(qp_in *in, int64_t i, int64_t K) {
    in->x += i * in->ldx;
    if (in->u8) { in->u8 += i * K; in->xs += i; in->xo += i; }
    if (in->q8) { in->q8 += i * K; in->d8 += i * (in->bs ? K / QKK : K / QK); }
    if (in->bs) in->bs += i * (K / 16);
    if (in->xb) in->xb += i * in->ldxb;
}

/* Block-wise fp8 activation quantization (block-FP8 checkpoints, compressed-tensors) of one row in groups (group 0: the
 * whole row): s = max(amax, floor) / 448 (floor 0: s = amax / 448, 0 -> 1), x' = e4m3(x / s) * s */
static void act_fp8_row(const qp_act *a, const float *x, int64_t k, float *o) {
    int64_t g = a->group > 0 && a->group < k ? a->group : k;
    for (int64_t c0 = 0; c0 < k; c0 += g) {
        int64_t c1 = c0 + g < k ? c0 + g : k;
        float s;
        if (a->kind == QA_FP8_STATIC) s = a->scale;
        else {
            float amax = 0.f;
            int nan = 0;
            for (int64_t i = c0; i < c1; i++) {
                float v = fabsf(x[i]);
                if (v != v) nan = 1;
                else if (v > amax) amax = v;
            }
            if (nan) { for (int64_t i = c0; i < c1; i++) o[i] = NAN; continue; }
            if (a->floor > 0.f) {
                s = (amax > a->floor ? amax : a->floor) / 448.f;
                if (a->ue8m0) s = exp2f(ceilf(log2f(s)));
            } else {
                s = amax / 448.f;
                if (s == 0.f) s = 1.f;
            }
        }
        for (int64_t i = c0; i < c1; i++) o[i] = e4m3_round(clampf(x[i] / s, -448.f, 448.f)) * s;
    }
}

/* the E2M1 value nearest to v, ties to the even code, |v| > 6 and NaN -> 6, negative when v < 0
 * (the backends' e2m1_round: midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5, the ties at 0.75 / 1.75 / 3.5
 * going up to the even code; -0 and NaN give +) */
static inline float e2m1_rne(float v) {
    const float a = fabsf(v);
    /* the steps up the grid as a sum of comparisons, each step's bound open or closed as the ties
     * go (to even); sums of halves are exact in any order, and without branches the loops over a
     * row vectorize */
    float q = (a > 0.25f ? 0.5f : 0.f) + (a >= 0.75f ? 0.5f : 0.f) + (a > 1.25f ? 0.5f : 0.f) +
              (a >= 1.75f ? 0.5f : 0.f) + (a > 2.5f ? 1.f : 0.f) + (a >= 3.5f ? 1.f : 0.f) + (a > 5.f ? 2.f : 0.f);
    q = a == a ? q : 6.f;
    return v < 0.f ? -q : q;
}

/* FP4 activations of one row, per group of a->group inputs (0: the whole row), each group's scale
 * b from its amax (NaN when the group holds a NaN), x' = e2m1_rne(x / b) * b:
 *   QA_NVFP4 (ModelOpt / TensorRT-LLM; a->scale = input_scale, a multiplier):
 *     s = amax / (6 * input_scale), 0 -> 1, clamped to [2^-9, 448], b = e4m3(s) * input_scale;
 *   QA_NVFP4_INV (compressed-tensors; a->scale = input_global_scale, a divisor):
 *     s = e4m3(min(input_global_scale * (amax / 6), 448)), 0 -> 0.125, b = s / input_global_scale,
 *     x / b clamped to [-6, 6];
 *   QA_MXFP4 (compressed-tensors): p = amax with its float32 bits + 2^21 and the mantissa dropped
 *     (round_to_power_2), e = clamp(log2(p) + 125, 0, 255) (p = 0: 0, inf: 255), b = 2^(e - 127)
 *     (e = 0: 2^-127, 255: inf), x / b clamped to [-6, 6]. */
static void act_fp4_row(const qp_act *a, const float *x, int64_t k, float *o) {
    const int64_t g = a->group > 0 && a->group < k ? a->group : k;
    const float gs = a->scale;
    for (int64_t c0 = 0; c0 < k; c0 += g) {
        const int64_t c1 = c0 + g < k ? c0 + g : k;
        float amax = 0.f, b;
        int nan = 0;
        for (int64_t i = c0; i < c1; i++) {  /* branch-free: vectorizes */
            const float v = fabsf(x[i]);
            nan |= v != v;
            amax = v > amax ? v : amax;
        }
        if (nan) amax = NAN;
        if (a->kind == QA_NVFP4) {
            float s = amax / (6.f * gs);
            if (s == 0.f) s = 1.f;
            b = e4m3_round(clampf(s, 0x1p-9f, 448.f)) * gs;
        } else if (a->kind == QA_NVFP4_INV) {
            float s = gs * (amax / 6.f);
            s = e4m3_round(s > 448.f ? 448.f : s);
            if (s == 0.f) s = 0.125f;
            b = s / gs;
        } else {
            const uint32_t p = (f32_bits(amax) + (1u << 21)) & 0xFF800000u;
            const int32_t ef = (int32_t)((p >> 23) & 0xFF);
            int32_t e;
            if ((p & 0x7FFFFFFFu) == 0) e = 0;                 /* log2(+-0) = -inf */
            else if (p == 0x7F800000u) e = 255;              /* log2(inf) = inf */
            else e = ef - 2 < 0 ? 0 : ef - 2;                 /* 127 + (ef - 127) - 2 */
            b = e == 0 ? 0x1p-127f : bits_f32((uint32_t)e << 23);
        }
        const int clamp6 = a->kind != QA_NVFP4;
        for (int64_t i = c0; i < c1; i++) {
            float v = x[i] / b;
            if (clamp6) v = clampf(v, -6.f, 6.f);
            o[i] = e2m1_rne(v) * b;
        }
    }
}

static inline int is_fp4_act(int kind) { return kind >= QA_NVFP4 && kind <= QA_MXFP4; }
static inline int is_int8_act(int kind) { return kind >= QA_INT8_SYM && kind <= QA_INT8_STATIC; }

/* int8 quantization of one row: codes q (as float), scale s and offset o with x' = (q - o) * s.
 * QA_INT8_SYM: s = amax / 127 (0 -> 1), o = 0 (vLLM / Ascend dynamic per token); QA_INT8_ASYM
 * (msmodelslim): lo = min(min x, 0), hi = max(max x, 0), s = (hi - lo) / 255, o = round(-128 - lo / s);
 * QA_INT8_STATIC: the given s and o. q = clamp(round(x / s + o), -128, 127). */
static void act_int8_row(const qp_act *a, const float *x, int64_t k, float *q, float *s_out, float *o_out) {
    float s, o = 0.f;
    int nan = 0;
    if (a->kind == QA_INT8_STATIC) { s = a->scale; o = a->offset; }
    else if (a->kind == QA_INT8_SYM) {
        float amax = 0.f;
        for (int64_t i = 0; i < k; i++) { float v = fabsf(x[i]); if (v != v) nan = 1; else if (v > amax) amax = v; }
        s = amax / 127.f;
        if (s == 0.f) s = 1.f;
    } else {
        float lo = 0.f, hi = 0.f;
        for (int64_t i = 0; i < k; i++) {
            float v = x[i];
            if (v != v) nan = 1;
            else { if (v < lo) lo = v; if (v > hi) hi = v; }
        }
        s = (hi - lo) / 255.f;
        if (s == 0.f) s = 1.f;
        o = rintf(-128.f - lo / s);
    }
    if (nan) s = NAN;
    for (int64_t i = 0; i < k; i++) {
        float v = a->kind == QA_INT8_SYM ? x[i] / s : x[i] / s + o;
        q[i] = clampf(rintf(v), -128.f, 127.f);
    }
    *s_out = s;
    *o_out = o;
}

/* fast mode: one row of K floats -> int8 blocks q and their scales d, as ggml's CPU backend makes
 * its Q8_0 activation blocks (quantize_row_q8_0, x86): amax = max |x| over 32 values, codes
 * rint(x * (127 / amax)) (round half to even), the scale amax / 127 stored as float16 and read
 * back, so d is that float16 value (0 for a zero block or one whose scale rounds to 0; infinity
 * past float16's range). A block holding a NaN or an infinity gets scale NaN, so every output it
 * touches is NaN, as a float matmul would give. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d) {
    if (quantize_row_vec(x, K, q, d)) return;
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        int finite = 1;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(xb[j]);
            if (!isfinite(a)) finite = 0;
            else if (a > amax) amax = a;
        }
        const float id = finite && amax != 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < QK; j++) q[b * QK + j] = (int8_t)lrintf(xb[j] * id);
        d[b] = finite ? round_f16(amax / 127.f) : NAN;
    }
}

/* fast mode, K-quants: one row of K floats (K a multiple of 256) -> int8 blocks of 256 as ggml's
 * CPU backend makes its q8_K activation blocks (quantize_row_q8_K_ref): max = the first value of
 * largest |x|, iscale = -127 / max, codes rint(iscale * x) (round half to even, as nearest_int),
 * at most 127; the scale 1 / iscale in float32; bs = each 16 codes' sum. A block holding a NaN or
 * an infinity gets scale NaN (every output it touches is NaN, as a float matmul would give); a
 * zero block scale 0 and codes 0. */
static void quantize_row_k(const float *x, int64_t K, int8_t *q, float *d, int16_t *bs) {
    if (quantize_row_k_vec(x, K, q, d, bs)) return;
    for (int64_t b = 0; b < K / QKK; b++) {
        const float *xb = x + b * QKK;
        int8_t *qb = q + b * QKK;
        float amax = 0.f, mx = 0.f;
        int finite = 1;
        for (int j = 0; j < QKK; j++) {
            const float a = fabsf(xb[j]);
            if (!(a < INFINITY)) finite = 0;
            else if (a > amax) { amax = a; mx = xb[j]; }
        }
        if (!finite || amax == 0.f) {
            memset(qb, 0, QKK);
            memset(bs + b * (QKK / 16), 0, sizeof(int16_t) * (QKK / 16));
            d[b] = finite ? 0.f : NAN;
            continue;
        }
        const float is = -127.f / mx;
        for (int j = 0; j < QKK; j++) {
            const long v = lrintf(is * xb[j]);
            qb[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int j = 0; j < QKK / 16; j++) {
            int s = 0;
            for (int t = 0; t < 16; t++) s += qb[16 * j + t];
            bs[b * (QKK / 16) + j] = (int16_t)s;
        }
        d[b] = 1.f / is;
    }
}

static int is_int_path(const qp_mat *m) { return m->type == QP_INT8 && m->act.epi != QE_FLOAT; }
/* fast K-quants (Q4_K / Q5_K / Q6_K against q8_K activation blocks) */
static int is_fast_k(const qp_mat *m) {
    return m->mode == 1 && (m->type == QP_Q4_K || m->type == QP_Q5_K || m->type == QP_Q6_K);
}
static int is_fast(const qp_mat *m) { return m->mode == 1 && (m->type == QP_Q4_0 || m->type == QP_Q8_0 || is_fast_k(m)); }

/* Scratch for the inputs of one weight: everything qp_prepare may need for M rows of K. */
typedef struct { float *f; uint8_t *u8; float *xs, *xo; int8_t *q8; float *d8; uint16_t *xb; float *r; int16_t *bs; } qp_scratch;

static int scratch_alloc(qp_scratch *sc, int64_t M, int64_t K) {
    sc->f = (float *)malloc(sizeof(float) * (size_t)(M * K));
    sc->u8 = (uint8_t *)malloc((size_t)(M * K + 64));
    sc->xs = (float *)malloc(sizeof(float) * (size_t)(2 * M));
    sc->q8 = (int8_t *)malloc((size_t)(M * K + 64));
    sc->d8 = (float *)malloc(sizeof(float) * (size_t)(M * (K / QK + 1)));
    sc->xb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(M * K + 32));
    sc->r = (float *)malloc(sizeof(float) * (size_t)(M * K));
    sc->bs = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * (K / 16 + 1)));
    sc->xo = sc->xs ? sc->xs + M : NULL;
    if (!sc->f || !sc->u8 || !sc->xs || !sc->q8 || !sc->d8 || !sc->xb || !sc->r || !sc->bs) {
        free(sc->f); free(sc->u8); free(sc->xs); free(sc->q8); free(sc->d8); free(sc->xb); free(sc->r); free(sc->bs);
        return 0;
    }
    return 1;
}

static void scratch_free(qp_scratch *sc) {
    free(sc->f); free(sc->u8); free(sc->xs); free(sc->q8); free(sc->d8); free(sc->xb); free(sc->r); free(sc->bs);
}

/* bfloat16 pair products (qp_pair_products): on unless switched off (tests compare both ways);
 * qp_pair_count counts the row tasks that took them */
static int qp_pairs_on = 1;
static int64_t qp_pair_count = 0;

/* M rows of x (K values, ldx apart) as weight m's product wants them, in a model whose weights
 * round by wround. A bfloat16 model's rows are first rounded to bfloat16 (QR_BF16): a product's
 * input is the value the model's torch module holds (the step's own intermediates, e.g. silu(g) *
 * u or an attention output, are float32 sums until here), then the layer's activation scheme
 * quantizes it, and its result is rounded to bfloat16 again (as the backends' torch emulations
 * return it in the model dtype). */
static void prepare(const qp_mat *m, int64_t M, int64_t K, const float *x, int64_t ldx, qp_scratch *sc, qp_in *in,
                    int wround) {
    memset(in, 0, sizeof *in);
    const qp_act *a = &m->act;
    if (wround == QR_BF16) {
        for (int64_t i = 0; i < M; i++) {
            memcpy(sc->r + i * K, x + i * ldx, sizeof(float) * (size_t)K);
            round_buf(sc->r + i * K, K, QR_BF16);
        }
        x = sc->r; ldx = K;
    }
    in->x = x; in->ldx = ldx;
    if (a->kind == QA_FP8 || a->kind == QA_FP8_STATIC) {
        for (int64_t i = 0; i < M; i++) act_fp8_row(a, x + i * ldx, K, sc->f + i * K);
        in->x = sc->f; in->ldx = K;
    } else if (is_fp4_act(a->kind)) {
        for (int64_t i = 0; i < M; i++) act_fp4_row(a, x + i * ldx, K, sc->f + i * K);
        in->x = sc->f; in->ldx = K;
    } else if (is_int8_act(a->kind)) {
        for (int64_t i = 0; i < M; i++) {
            float *q = sc->f + i * K;
            act_int8_row(a, x + i * ldx, K, q, sc->xs + i, sc->xo + i);
            if (is_int_path(m)) {
                for (int64_t c = 0; c < K; c++) sc->u8[i * K + c] = (uint8_t)((int)q[c] + 128);
            } else {  /* the float row (q - o) * s */
                const float s = sc->xs[i], o = sc->xo[i];
                for (int64_t c = 0; c < K; c++) q[c] = (q[c] - o) * s;
            }
        }
        in->x = sc->f; in->ldx = K;
        if (is_int_path(m)) { in->u8 = sc->u8; in->xs = sc->xs; in->xo = sc->xo; }
    }
    /* a bfloat16 model's quantized activations are bfloat16 values too: a layer's torch path
     * returns x' in x's dtype */
    if (wround == QR_BF16 && in->x == sc->f && !is_int_path(m))
        for (int64_t i = 0; i < M; i++) round_buf(sc->f + i * K, K, QR_BF16);
    if (is_fast_k(m)) {
        for (int64_t i = 0; i < M; i++)
            quantize_row_k(in->x + i * in->ldx, K, sc->q8 + i * K, sc->d8 + i * (K / QKK), sc->bs + i * (K / 16));
        in->q8 = sc->q8; in->d8 = sc->d8; in->bs = sc->bs;
    } else if (is_fast(m)) {
        for (int64_t i = 0; i < M; i++) quantize_row(in->x + i * in->ldx, K, sc->q8 + i * K, sc->d8 + i * (K / QK));
        in->q8 = sc->q8; in->d8 = sc->d8;
    }
    /* a bfloat16 model's float rows as bfloat16 pairs, when the conversion is exact (every value a
     * bfloat16, as rounded above unless the activation scheme changed it; none subnormal: the pair
     * instruction would flush it) */
    if (QP_PAIRS && qp_pairs_on && wround == QR_BF16 && K % QK == 0 && !is_fast(m) && !is_int_path(m)) {
        int exact = 1;
        for (int64_t i = 0; i < M && exact; i++) exact = xb_row(in->x + i * in->ldx, K, sc->xb + i * K);
        if (exact) { in->xb = sc->xb; in->ldxb = K; }
    }
}

static int same_input(const qp_mat *a, const qp_mat *b) {
    return memcmp(&a->act, &b->act, sizeof a->act) == 0 && is_fast(a) == is_fast(b) && is_fast_k(a) == is_fast_k(b)
           && is_int_path(a) == is_int_path(b);
}

/* ---- row kernels: y[i, r] for rows [r0, r1) of m against xm prepared input rows ------------ */

#define MT 4  /* x rows per pass over the weights */
#define RT 4  /* weight rows per pass over x */

/* a tile call with constant sizes for the full tiles (rt = RT, mt = 1..MT): the inlined tile then
 * keeps its rt x mt sums in registers (with runtime sizes GCC keeps them on the stack); an edge
 * tile with its runtime sizes */
#define QP_TILE(tile, m, in, r, i0, rt, mt, y, ldy)                              \
    do {                                                                          \
        if ((rt) == RT && (mt) == MT) tile(m, in, r, i0, RT, MT, y, ldy);         \
        else if ((rt) == RT && (mt) == 1) tile(m, in, r, i0, RT, 1, y, ldy);      \
        else if ((rt) == RT && (mt) == 2) tile(m, in, r, i0, RT, 2, y, ldy);      \
        else if ((rt) == RT && (mt) == 3) tile(m, in, r, i0, RT, 3, y, ldy);      \
        else tile(m, in, r, i0, rt, mt, y, ldy);                                  \
    } while (0)
#ifndef PF_AHEAD
#define PF_AHEAD 2048
#endif

/* the segment the generic kernel decodes at a time: whole blocks, at most 256 values */
static int64_t seg_len(const qp_mat *m) {
    int64_t e = 1;
    qp_form_info(m->type, &e, NULL);
    if (e >= QKK) return e;
    if (e == QK) return m->k % QKK == 0 ? QKK : QK;
    return m->k % QKK == 0 ? QKK : m->k % 64 == 0 ? 64 : QK;
}

/* the most scale groups per row the fused kernels take (their scales decoded into a stack buffer
 * once per row; 65536 inputs in groups of 16) */
#define QP_NG_MAX 4096

/* groups [0, ng) of row r: effective scales (global scale folded as gmode says, FP8's 256 folded
 * in) and zero points as float32, one loop per encoding: the per-group decoding leaves the product
 * loop (the same float32 values as eff_scale_at / zero_at) */
static QP_IQ_UNUSED void row_scales(const qp_mat *m, int64_t r, int64_t ng, float *restrict sv, float *restrict zv) {
    const int64_t srow = (r / m->gn) * m->lds;
    const uint8_t *s8 = (const uint8_t *)m->s + srow;
    switch (m->sdt) {
        case QS_F32: memcpy(sv, (const float *)m->s + srow, sizeof(float) * (size_t)ng); break;
        case QS_BF16: {
            const uint16_t *p = (const uint16_t *)m->s + srow;
            for (int64_t j = 0; j < ng; j++) sv[j] = bits_f32((uint32_t)p[j] << 16);
            break;
        }
        case QS_F16: for (int64_t j = 0; j < ng; j++) sv[j] = f16_to_f32((const uint8_t *)m->s + 2 * (srow + j)); break;
        case QS_E8M0: for (int64_t j = 0; j < ng; j++) sv[j] = e8m0_to_f32(s8[j]); break;
        default: {
            int64_t j = e4m3_run(s8, ng, sv);  /* exact, NaN codes NaN */
            for (; j < ng; j++) sv[j] = e4m3_to_f32(s8[j]);
        }
    }
    const float gs = m->gs;
    if (m->gmode == QG_TIMES) for (int64_t j = 0; j < ng; j++) sv[j] = sv[j] * gs;
    else if (m->gmode == QG_OVER) for (int64_t j = 0; j < ng; j++) sv[j] = sv[j] / gs;
    if (m->type == QP_FP8) fold_fp8_scales(sv, ng);
    if (m->z) {
        if (m->zi8) { const int8_t *z = (const int8_t *)m->z + srow; for (int64_t j = 0; j < ng; j++) zv[j] = (float)z[j]; }
        else memcpy(zv, (const float *)m->z + srow, sizeof(float) * (size_t)ng);
    }
}

