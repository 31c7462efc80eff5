/* The row kernels' dispatch and the entry points of matrix products: each weight on the kernel of
 * its form and of this build's instruction set (arch/), the portable kernels where none applies. */

/* a K-quant super-block's codes as unsigned integers in element order (Q4_K / Q5_K: q; Q6_K: q + 32),
 * its scales per sub-block (Q4_K / Q5_K: 8 of 32 values, and 8 mins; Q6_K: 16 signed of 16), d, dmin */
static void kq_codes(int type, const uint8_t *b, uint8_t *u, int *sc, int *mn, float *d, float *dmin) {
    if (type == QP_Q6_K) {
        *d = f16_to_f32(b + 208); *dmin = 0.f;
        for (int i = 0; i < 16; i++) sc[i] = ((const int8_t *)(b + 192))[i];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            uint8_t *o = u + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        return;
    }
    const int five = type == QP_Q5_K;
    uint8_t s8[8], m8[8];
    *d = f16_to_f32(b); *dmin = f16_to_f32(b + 2);
    scale_min_k4(b + 4, s8, m8);
    for (int j = 0; j < 8; j++) { sc[j] = s8[j]; mn[j] = m8[j]; }
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            int q0 = qs[32 * j + l] & 15, q1 = qs[32 * j + l] >> 4;
            if (five) { q0 |= ((qh[l] >> (2 * j)) & 1) << 4; q1 |= ((qh[l] >> (2 * j + 1)) & 1) << 4; }
            u[64 * j + l] = (uint8_t)q0;
            u[64 * j + 32 + l] = (uint8_t)q1;
        }
}

/* fast Q4_K / Q5_K / Q6_K against q8_K activation blocks (ggml's vec_dot_q*_K_q8_K arithmetic):
 * per super-block, sumi = sum over sub-blocks of scale * (integer dot of codes and x codes) (Q6_K:
 * less 32 * sum scale * bsum), then d * dx * sumi (Q4_K / Q5_K: less dmin * dx * sum min * bsum of
 * the sub-block), float32 sums over super-blocks. The 512-bit VNNI tile where the build has one. */
static void fast_k_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    y -= r0;
    const int type = m->type;
    const int64_t K = m->k, nsb = K / QKK, bsize = type == QP_Q4_K ? 144 : type == QP_Q5_K ? 176 : 210;
    for (int64_t r = r0; r < r1; r += RT) {
        int rt = r1 - r < RT ? (int)(r1 - r) : RT;
        if (fast_k_rows_vec(m, in, r, rt, xm, y, ldy)) continue;
        for (int a = 0; a < rt; a++) {
            const uint8_t *row = m->w + (r + a) * m->ldw;
            float acc[MT] = {0.f};
            for (int i0 = 0; i0 < xm; i0 += MT) {
                const int mt = xm - i0 < MT ? xm - i0 : MT;
                for (int i = 0; i < mt; i++) acc[i] = 0.f;
                for (int64_t sb = 0; sb < nsb; sb++) {
                    uint8_t u[QKK];
                    int sc[16] = {0}, mn[8] = {0};
                    float d, dmin;
                    kq_codes(type, row + sb * bsize, u, sc, mn, &d, &dmin);
                    for (int i = 0; i < mt; i++) {
                        const int64_t xi = i0 + i;
                        const int8_t *xq = in->q8 + xi * K + sb * QKK;
                        const int16_t *bs = in->bs + xi * (K / 16) + sb * (QKK / 16);
                        const float dx = in->d8[xi * nsb + sb];
                        int32_t sumi = 0, summ = 0;
                        const int sub = type == QP_Q6_K ? 16 : 32;
                        for (int j = 0; j < QKK / sub; j++) {
                            int32_t dot = 0;
                            for (int t = 0; t < sub; t++) dot += (int32_t)u[sub * j + t] * xq[sub * j + t];
                            sumi += sc[j] * dot;
                        }
                        if (type == QP_Q6_K) {
                            for (int j = 0; j < 16; j++) sumi -= 32 * sc[j] * bs[j];
                        } else {
                            for (int j = 0; j < 8; j++) summ += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
                        }
                        acc[i] += (float)sumi * (d * dx) - (float)summ * (dmin * dx);
                    }
                }
                for (int i = 0; i < mt; i++) y[(int64_t)(i0 + i) * ldy + r + a] = acc[i];
            }
        }
    }
}

/* fast Q4_0 / Q8_0: x as int8 blocks, integer block dots with the weight codes (the 512-bit VNNI
 * tile; AVX2: dot = sum |v| * sign(x, v); else portable C) */
static void fast_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    if (is_fast_k(m)) { fast_k_rows(m, in, r0, r1, xm, y, ldy); return; }
    y -= r0;  /* y holds rows [r0, r1): y[i * ldy + r - r0] */
    for (int64_t r = r0; r < r1; r += RT) {
        int rt = r1 - r < RT ? (int)(r1 - r) : RT;
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
            if (fast_tile_vec(m, in, r, i0, rt, mt, y, ldy)) continue;
            const int type = m->type, size = type == QP_Q4_0 ? 18 : 34;
            const int64_t nb = m->k / QK;
            const int8_t *xq = in->q8;
            const float *xd = in->d8;
            for (int a = 0; a < rt; a++) {
                const uint8_t *wr = m->w + (r + a) * m->ldw;
                for (int i = 0; i < mt; i++) {
                    int64_t xi = (int64_t)(i0 + i);
                    float acc = 0.f;
                    for (int64_t b = 0; b < nb; b++) {
                        const uint8_t *blk = wr + b * size;
                        const int8_t *xb = xq + xi * m->k + b * QK;
                        int32_t dot = 0;
                        if (type == QP_Q4_0) {
                            for (int j = 0; j < 16; j++)
                                dot += ((int32_t)(blk[2 + j] & 15) - 8) * xb[j] + ((int32_t)(blk[2 + j] >> 4) - 8) * xb[j + 16];
                        } else {
                            for (int j = 0; j < 32; j++) dot += (int32_t)((const int8_t *)(blk + 2))[j] * xb[j];
                        }
                        acc += f16_to_f32(blk) * xd[xi * nb + b] * (float)dot;
                    }
                    y[xi * ldy + r + a] = acc;
                }
            }
        }
    }
}

/* exact, any form: each row's segments decoded into a buffer, multiplied into float32 sums (the
 * portable kernel; AVX512 builds take generic_rows512, arch/x86_avx512.c) */
static void generic_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy, int wround) {
    /* bfloat16 weights already hold the values of a float32 / bfloat16 model (a float16 model
     * rounds them: the loop below) */
    if (m->type == QP_BF16 && wround != QR_F16 && m->k % 8 == 0 && bf16_rows_vec(m, in, r0, r1, xm, y, ldy)) return;
    y -= r0;
    const int64_t K = m->k, seg = seg_len(m);
    float buf[QKK] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
            float acc[MT][8];
            memset(acc, 0, sizeof acc);
            for (int64_t c0 = 0; c0 < K; c0 += seg) {
                deq_seg(m, r, c0, seg, buf, wround);
                for (int i = 0; i < mt; i++) {
                    const float *xr = in->x + (int64_t)(i0 + i) * in->ldx + c0;
                    if (seg % 8 == 0 && acc8_vec(acc[i], buf, xr, seg)) continue;
                    for (int64_t j = 0; j < seg; j++) acc[i][j & 7] += buf[j] * xr[j];
                }
            }
            for (int i = 0; i < mt; i++) {
                float s = 0.f;
                for (int j = 0; j < 8; j++) s += acc[i][j];
                y[(int64_t)(i0 + i) * ldy + r] = s;
            }
        }
    }
}

/* INT8 weights x int8 activations on integers (ModelSlim W8A8 / W8A8_DYNAMIC per channel):
 * dot = sum (q + 128) * w - 128 * rowsum (exact int32); QE_STATIC: (dot + bias) * os[r];
 * QE_DYNAMIC: ((dot - o * rowsum) * xs) * s[r] */
static void int_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    y -= r0;
    const int64_t K = m->k;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = (const int8_t *)(m->w + r * m->ldw);
        const int32_t rs = m->rowsum[r];
        const float sr = scale_at(m, (r / m->gn) * m->lds);
        for (int i = 0; i < xm; i++) {
            const uint8_t *u = in->u8 + (int64_t)i * K;
            int64_t c = 0;
            int32_t dot = dot_u8s8_run(u, wr, K, &c);
            for (; c < K; c++) dot += (int32_t)u[c] * (int32_t)wr[c];
            dot -= 128 * rs;
            float v;
            if (m->act.epi == QE_STATIC) v = (float)(dot + m->bias[r]) * m->os[r];
            else v = ((float)(dot - (int32_t)in->xo[i] * rs) * in->xs[i]) * sr;
            y[(int64_t)i * ldy + r] = v;
        }
    }
}

/* The row kernel rows_any runs for m in a model whose weights round by wround (QR_*): one rule for
 * the dispatch and for qp_row_kernel, which tests read (a bfloat16 model must take the kernels of
 * a float32 one). */
static int row_kernel(const qp_mat *m, int wround) {
    if (is_fast(m)) return QK_FAST;
    if (is_int_path(m)) return QK_INT;
    return row_kernel_vec(m, wround);  /* the build's own kernels (arch/dispatch_rows.h) */
}

int qp_row_kernel(const qp_mat *m, int wround) { return row_kernel(m, wround); }

static void rows_any(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy, int wround) {
    const int kernel = row_kernel(m, wround);
    switch (kernel) {
        case QK_FAST: fast_rows(m, in, r0, r1, xm, y, ldy); return;
        case QK_INT: int_rows(m, in, r0, r1, xm, y, ldy); return;
        default:
            if (!rows_vec(kernel, m, in, r0, r1, xm, y, ldy, wround)) generic_rows(m, in, r0, r1, xm, y, ldy, wround);
    }
}

/* ---- validation: the C code trusts a qp_mat only after this --------------------------------- */

static int mat_ok(const qp_mat *m) {
    int64_t e, b;
    if (!m || !qp_form_info(m->type, &e, &b) || m->n <= 0 || m->k <= 0 || !m->w) return 0;
    if (m->k % (e > 2 ? e : QK)) return 0;
    if (m->act.kind < QA_NONE || m->act.kind > QA_MXFP4) return 0;
    if (m->ldw < m->k / e * b) return 0;
    if (m->type >= QP_INT4) {
        if (!m->s || m->gk <= 0 || m->gn <= 0 || m->lds < 0 || m->sdt < QS_F32 || m->sdt > QS_E4M3) return 0;
        if (m->gk < m->k && m->gk % 16) return 0;
        if (is_int_path(m) && (!m->rowsum || (m->act.epi == QE_STATIC && (!m->bias || !m->os)) || !is_int8_act(m->act.kind)))
            return 0;
        if (m->gmode < QG_AFTER || m->gmode > QG_OVER || (m->zi8 && !m->z)) return 0;
    }
    if (m->mode == 1 && !is_fast(m) && !is_ggml_block(m->type)) return 0;
    return 1;
}

/* ---- entry points ------------------------------------------------------------------------- */

int qp_check(const qp_mat *m) { return mat_ok(m) ? 0 : -1; }

/* rows [r0, r1) of m, exactly decoded (rounded to the model dtype: wround), into out (ldo apart) */
int qp_dequant(const qp_mat *m, int64_t r0, int64_t r1, float *out, int64_t ldo, int wround) {
    if (!mat_ok(m) || r0 < 0 || r1 > m->n || r0 > r1) return -1;
    const int64_t seg = seg_len(m), K = m->k;
    #pragma omp parallel for schedule(static) if ((r1 - r0) * K >= 1 << 16)
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c0 = 0; c0 < K; c0 += seg) deq_seg(m, r, c0, seg, out + (r - r0) * ldo + c0, wround);
    return 0;
}

/* activations as weight m's exact product sees them: M rows of K floats -> float rows */
int qp_act_rows(const qp_mat *m, int64_t M, const float *x, int64_t ldx, float *out) {
    if (!mat_ok(m) || M <= 0) return -1;
    qp_mat f = *m;
    f.act.epi = QE_FLOAT;  /* the float form of integer-path activations: (q - o) * s */
    f.mode = 0;
    qp_scratch sc;
    if (!scratch_alloc(&sc, M, m->k)) return -2;
    qp_in in;
    prepare(&f, M, m->k, x, ldx, &sc, &in, QR_NONE);
    for (int64_t i = 0; i < M; i++) memcpy(out + i * m->k, in.x + i * in.ldx, sizeof(float) * (size_t)m->k);
    scratch_free(&sc);
    return 0;
}

#define MIN_TASK_BYTES (8 * 1024)

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int64_t row_bytes(const qp_mat *m) {
    int64_t e, b;
    qp_form_info(m->type, &e, &b);
    return m->k / e * b;
}

/* y[yr[g] + i, yc[g] + j] = sum_c x'[xr[g] + i, c] * W_g[j, c]   (i < xm[g], j < n of mats[g]),
 * x' = x as mats[g]'s activation quantization and mode make it. One call covers a linear, sibling
 * projections of one input (side by side in y), the row groups of routed experts, and per-head
 * stacks. All mats have K inputs. */
int qp_gemm(const qp_mat *const *mats, int G, int64_t M, int64_t K, const float *x, int64_t ldx,
            const int64_t *xr, const int64_t *xm, const int64_t *yr, const int64_t *yc, float *y, int64_t ldy, int wround) {
    if (G <= 0 || M <= 0 || K <= 0) return -1;
    for (int g = 0; g < G; g++)
        if (!mat_ok(mats[g]) || mats[g]->k != K || xr[g] < 0 || xm[g] < 1 || xr[g] + xm[g] > M) return -1;
    /* one prepared input per distinct activation treatment, shared by the groups that use it */
    int *which = (int *)malloc(sizeof(int) * (size_t)G), *rep = (int *)malloc(sizeof(int) * (size_t)G);
    qp_scratch *sc = (qp_scratch *)calloc((size_t)G, sizeof(qp_scratch));
    qp_in *ins = (qp_in *)calloc((size_t)G, sizeof(qp_in));
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(G + 1)), *rows_per = (int64_t *)malloc(sizeof(int64_t) * (size_t)G);
    int nin = 0, rc = 0;
    if (!which || !rep || !sc || !ins || !first || !rows_per) { rc = -2; goto done; }
    for (int g = 0; g < G; g++) {
        int j = 0;
        while (j < nin && !same_input(mats[rep[j]], mats[g])) j++;
        if (j == nin) {
            if (!scratch_alloc(&sc[nin], M, K)) { rc = -2; goto done; }
            prepare(mats[g], M, K, x, ldx, &sc[nin], &ins[nin], wround);
            rep[nin++] = g;
        }
        which[g] = j;
    }
    int64_t total_bytes = 0, total = 0;
    for (int g = 0; g < G; g++) total_bytes += mats[g]->n * row_bytes(mats[g]) * (xm[g] < MT ? 1 : xm[g] / MT);
    int threads = max_threads();
    int64_t task_bytes = total_bytes / (4 * threads);
    if (task_bytes < MIN_TASK_BYTES) task_bytes = MIN_TASK_BYTES;
    for (int g = 0; g < G; g++) {
        int64_t per_row = row_bytes(mats[g]) * (xm[g] < MT ? 1 : xm[g] / MT);
        int64_t r = (task_bytes / per_row + RT - 1) / RT * RT;
        rows_per[g] = r < RT ? RT : r;
        first[g] = total;
        total += (mats[g]->n + rows_per[g] - 1) / rows_per[g];
    }
    first[G] = total;
    #pragma omp parallel for schedule(dynamic, 1) if (threads > 1 && total > 1 && total_bytes >= 2 * MIN_TASK_BYTES)
    for (int64_t t = 0; t < total; t++) {
        int g = 0;
        while (first[g + 1] <= t) g++;
        int64_t r0 = (t - first[g]) * rows_per[g], r1 = r0 + rows_per[g];
        if (r1 > mats[g]->n) r1 = mats[g]->n;
        qp_in in = ins[which[g]];
        in_skip(&in, xr[g], K);
        rows_any(mats[g], &in, r0, r1, (int)xm[g], y + yr[g] * ldy + yc[g] + r0, ldy, wround);
    }
done:
    for (int i = 0; i < nin; i++) scratch_free(&sc[i]);
    free(which); free(rep); free(sc); free(ins); free(first); free(rows_per);
    return rc;
}


/* Which SIMD path this build took: 3 AVX512 (with VNNI), 4 AVX512 without VNNI, 2 AVX2, 0 portable C. */
int qp_isa(void) { return QP_ISA; }

/* bfloat16 pair products (vdpbf16ps, AVX512-BF16 builds, a bfloat16 model): on (1) or off (0) for
 * the products that follow, -1 leaves it; returns the setting before the call, -1 where this
 * build has no pair products */
int qp_pair_products(int on) {
    if (!QP_PAIRS) return -1;
    const int was = qp_pairs_on;
    if (on >= 0) qp_pairs_on = on != 0;
    return was;
}

/* how many row tasks took the bfloat16 pair products since the library was loaded */
int64_t qp_pair_tasks(void) { return __atomic_load_n(&qp_pair_count, __ATOMIC_RELAXED); }

/* Whether any of the n bfloat16 values at p is subnormal (exponent 0, mantissa not 0): 1 yes, 0 no,
 * -1 bad arguments. Such a weight keeps its rows off the pair products, which read it as zero. */
int qp_bf16_has_subnormal(const uint16_t *p, int64_t n) {
    if (n < 0 || (n > 0 && !p)) return -1;
    int found = 0;
    for (int64_t i = 0; i < n; i += 4096) {
        const int64_t end = i + 4096 < n ? i + 4096 : n;
        for (int64_t j = i; j < end; j++) found |= (p[j] & 0x7F80) == 0 && (p[j] & 0x7F) != 0;
        if (found) return 1;
    }
    return 0;
}

/* Whether any of the n bytes at p is an e4m3 NaN code (S.1111.111), at memory speed (binding an
 * FP8 expert read from disk asks once per weight): 1 yes, 0 no, -1 bad arguments. Any alignment.
 * Eight bytes a lane: (b & 0x7F) + 1 sets bit 7 exactly for 0x7F (at most 0x80: no carry into the
 * next byte); the lanes of a 4 KiB block are OR-ed without a branch (the compiler vectorizes it),
 * the block then tested; the last n % 8 bytes one by one. */
int qp_fp8_has_nan(const uint8_t *p, int64_t n) {
    if (n < 0 || (n > 0 && !p)) return -1;
    const uint64_t low = 0x7F7F7F7F7F7F7F7Full, one = 0x0101010101010101ull, top = 0x8080808080808080ull;
    int64_t i = 0;
    if (fp8_nan_scan(p, n, &i)) return 1;
    enum { LANES = 512 };  /* 4 KiB */
    for (; i + 8 * LANES <= n; i += 8 * LANES) {
        uint64_t acc = 0;
        for (int j = 0; j < LANES; j++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * j, 8);
            acc |= ((w & low) + one) & top;
        }
        if (acc) return 1;
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        if (((w & low) + one) & top) return 1;
    }
    for (; i < n; i++)
        if ((p[i] & 0x7F) == 0x7F) return 1;
    return 0;
}

