/* ---- one latent-attention decode step (absorbed form) for B sequences at one position --------------------- */


static inline float norm_w(const qp_latent_attn *m, const void *w, int64_t i) {
    return m->norm_bf16 ? bits_f32((uint32_t)((const uint16_t *)w)[i] << 16) : ((const float *)w)[i];
}

static void rms_norm_row(const qp_latent_attn *m, float *x, int64_t n, const void *w, float eps) {
    float ss = dot_f32(x, x, n);
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = norm_w(m, w, i) * (x[i] * r);
}

static void rope_row(const float *x, const float *rot, int64_t d, float *out) {
    for (int64_t j = 0; j < d; j++) {
        float acc = 0.f;
        for (int64_t i = 0; i < d; i++) acc += x[i] * rot[i * d + j];
        out[j] = acc;
    }
}

/* a transposed product over rows [r0, r0 + n) of m: y[c] = sum_j a[j] * W[r0 + j, c] (exact weights) */
static void rows_t(const qp_mat *m, int64_t r0, int64_t n, const float *a, float *y, int wround) {
    const int64_t K = m->k, seg = seg_len(m);
    float buf[QKK];
    for (int64_t c = 0; c < K; c++) y[c] = 0.f;
    for (int64_t j = 0; j < n; j++)
        for (int64_t c0 = 0; c0 < K; c0 += seg) {
            deq_seg(m, r0 + j, c0, seg, buf, wround);
            for (int64_t c = 0; c < seg; c++) y[c0 + c] += a[j] * buf[c];
        }
}

/* one matrix's rows [0, n) times B prepared rows, tasks inside an open parallel region */
static void par_rows(const qp_mat *m, const qp_in *in, int64_t B, float *y, int64_t ldy, int wround) {
    const int64_t n = m->n, step = 4 * RT;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < (n + step - 1) / step; t++) {
        int64_t r0 = t * step, r1 = r0 + step > n ? n : r0 + step;
        rows_any(m, in, r0, r1, (int)B, y + r0, ldy, wround);
    }
}

static int latent_ok(const qp_latent_attn *m) {
    const int64_t qh = m->nope + m->rope;
    if (m->H <= 0 || m->kv_lora <= 0 || m->rope <= 0 || m->nope <= 0 || m->v <= 0 || m->nh <= 0) return 0;
    if (!mat_ok(m->kv_a) || m->kv_a->n != m->kv_lora + m->rope || m->kv_a->k != m->H) return 0;
    if (m->q_a) {
        if (!mat_ok(m->q_a) || m->q_a->n != m->q_lora || m->q_a->k != m->H) return 0;
        if (!mat_ok(m->q_b) || m->q_b->n != m->nh * qh || m->q_b->k != m->q_lora) return 0;
    } else if (!mat_ok(m->q_b) || m->q_b->n != m->nh * qh || m->q_b->k != m->H) return 0;
    if (m->kv_dense) {
        if (!mat_ok(m->kv_b) || m->kv_b->n != m->nh * (m->nope + m->v) || m->kv_b->k != m->kv_lora) return 0;
    } else {
        for (int64_t h = 0; h < m->nh; h++)
            if (!mat_ok(m->k_b[h]) || m->k_b[h]->n != m->kv_lora || m->k_b[h]->k != m->nope
                || !mat_ok(m->v_b[h]) || m->v_b[h]->n != m->v || m->v_b[h]->k != m->kv_lora
                || !same_input(m->k_b[0], m->k_b[h]) || !same_input(m->v_b[0], m->v_b[h])) return 0;
    }
    if (!mat_ok(m->o) || m->o->n != m->H || m->o->k != m->nh * m->v) return 0;
    if (m->g && (!mat_ok(m->g) || m->g->n != m->nh * m->v || m->g->k != m->H)) return 0;
    return m->q_a_norm && m->kv_a_norm;
}

/* B rows x [B, H] at one position: qcat [B, nh, kv_lora + rope] = (q_nope absorbed through W_UK ‖
 * roped q_rope), kvrow [B, kv_lora + rope] = (normed latent ‖ roped key), gate [B, nh * v] (when g).
 * rot: B rotation matrices [rope, rope] (roped = x @ rot). */
int qp_latent_pre(const qp_latent_attn *m, int64_t B, const float *x, const float *rot, float *qcat, float *kvrow, float *gate, int wround) {
    if (!latent_ok(m) || B <= 0 || (m->g && !gate)) return -1;
    const int64_t H = m->H, ql = m->q_a ? m->q_lora : 0, kl = m->kv_lora, rp = m->rope, np_ = m->nope, nh = m->nh;
    const int64_t qh = np_ + rp, qrows = nh * qh, qin = m->q_a ? ql : H;
    float *qa = (float *)malloc(sizeof(float) * (size_t)(B * (ql + kl + rp + qrows + nh * np_) + 1));
    qp_scratch s[5];
    int ok[5] = {0, 0, 0, 0, 0}, rc = 0;
    ok[0] = scratch_alloc(&s[0], B, H);
    ok[1] = scratch_alloc(&s[1], B, H);
    ok[2] = scratch_alloc(&s[2], B, H);
    ok[3] = scratch_alloc(&s[3], B, qin);
    ok[4] = scratch_alloc(&s[4], B * nh, np_);
    for (int i = 0; i < 5; i++) if (!ok[i]) rc = -2;
    if (!qa || rc) { rc = -2; goto done; }
    float *kva = qa + B * ql, *qb = kva + B * (kl + rp), *qn = qb + B * qrows;
    qp_in ikv, iqa, ig, iq, ik;
    prepare(m->kv_a, B, H, x, H, &s[0], &ikv, wround);
    if (m->q_a) { if (same_input(m->q_a, m->kv_a)) iqa = ikv; else prepare(m->q_a, B, H, x, H, &s[1], &iqa, wround); }
    if (m->g) prepare(m->g, B, H, x, H, &s[2], &ig, wround);
    #pragma omp parallel
    {
        if (m->q_a) par_rows(m->q_a, &iqa, B, qa, ql, wround);
        par_rows(m->kv_a, &ikv, B, kva, kl + rp, wround);
        if (m->g) par_rows(m->g, &ig, B, gate, nh * m->v, wround);
        #pragma omp single
        {
            for (int64_t b = 0; b < B; b++) {
                float *kv = kvrow + b * (kl + rp);
                if (m->q_a) rms_norm_row(m, qa + b * ql, ql, m->q_a_norm, m->eps_q);
                memcpy(kv, kva + b * (kl + rp), sizeof(float) * (size_t)kl);
                rms_norm_row(m, kv, kl, m->kv_a_norm, m->eps_kv);
                rope_row(kva + b * (kl + rp) + kl, rot + b * rp * rp, rp, kv + kl);
            }
            prepare(m->q_b, B, qin, m->q_a ? qa : x, m->q_a ? ql : H, &s[3], &iq, wround);
        }
        par_rows(m->q_b, &iq, B, qb, qrows, wround);
        if (!m->kv_dense) {
            /* every head's q_nope as the k_b stack's products want it (one scheme: one treatment) */
            #pragma omp single
            {
                for (int64_t t = 0; t < B * nh; t++)
                    memcpy(qn + t * np_, qb + (t / nh) * qrows + (t % nh) * qh, sizeof(float) * (size_t)np_);
                prepare(m->k_b[0], B * nh, np_, qn, np_, &s[4], &ik, wround);
            }
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * nh; t++) {
            int64_t b = t / nh, h = t % nh;
            const float *qp = qb + b * qrows + h * qh;
            float *dst = qcat + t * (kl + rp);
            if (m->kv_dense) rows_t(m->kv_b, h * (np_ + m->v), np_, qp, dst, wround);
            else {
                qp_in in = ik;
                in_skip(&in, t, np_);
                rows_any(m->k_b[h], &in, 0, kl, 1, dst, 0, wround);
            }
            rope_row(qp + np_, rot + b * rp * rp, rp, dst + kl);
        }
    }
done:
    for (int i = 0; i < 5; i++) if (ok[i]) scratch_free(&s[i]);
    free(qa);
    return rc;
}

/* element offset of cached token j of row b: through the page map rmap [B, rm_ld], else strided */
static inline int64_t cache_at(const int64_t *rmap, int64_t rm_ld, int64_t b, int64_t j, int64_t ld, int64_t lds_b) {
    return rmap ? rmap[b * rm_ld + j] * ld : b * lds_b + j * ld;
}

/* attention of every head of each row b on its n cached tokens (latent row j of b at lat + b * lds_b
 * + j * ld_lat, its roped key at kr + b * krs_b + j * ld_kr, in elements; lat_bf16: the cache holds
 * bfloat16), each head's output through W_UV, the output gate, then o_proj: out [B, H].
 * A paged cache (an engine's blocks): rmap [B, rm_ld] gives the physical row of token j of row b
 * (latent at lat + rmap[b * rm_ld + j] * ld_lat, key at kr + rmap[..] * ld_kr; lds_b / krs_b unused);
 * lens [B] (or NULL: n each) the number of tokens of each row, at most n. */
int qp_latent_post(const qp_latent_attn *m, int64_t B, const float *qcat, const void *lat, int64_t ld_lat, int64_t lds_b,
                const void *kr, int64_t ld_kr, int64_t krs_b, int64_t n, const int64_t *rmap, int64_t rm_ld,
                const int64_t *lens, int lat_bf16, const float *gate, float *out, int wround) {
    if (!latent_ok(m) || B <= 0 || n <= 0 || (rmap && rm_ld < n)) return -1;
    for (int64_t b = 0; b < B && lens; b++)
        if (lens[b] <= 0 || lens[b] > n) return -1;
    const int64_t H = m->H, kl = m->kv_lora, rp = m->rope, nh = m->nh, vd = m->v;
    /* the latent as kv_b's activation quantization makes it: the expanded form quantizes kv_b's
     * input (the latent, per token), so the absorbed form attends on the quantized rows */
    const int latent_act = m->kv_dense && m->kv_b->act.kind != QA_NONE;
    /* float32 contiguous cache rows without a quantization to apply are read in place; otherwise copied */
    const int copy = lat_bf16 || latent_act || rmap || lens;
    float *lf = (float *)malloc(sizeof(float) * (size_t)(copy ? B * n * (kl + rp) : 1));
    float *sc = (float *)malloc(sizeof(float) * (size_t)(B * nh * (n + kl + vd)));
    qp_scratch so, sl, sv;
    int oo = scratch_alloc(&so, B, nh * vd), ol_ = latent_act ? scratch_alloc(&sl, n, kl) : 0;
    int ov_ = !m->kv_dense ? scratch_alloc(&sv, B * nh, kl) : 0;
    int rc = 0;
    if (!lf || !sc || !oo || (latent_act && !ol_) || (!m->kv_dense && !ov_)) { rc = -2; goto done; }
    /* float copies of the cached rows: [B, n, kl + rp] (latent ‖ key), the rows split over the
     * threads (a serial copy of a bfloat16 cache was a few percent of a small model's step) */
    #pragma omp parallel for schedule(static) if (copy && B * n * (kl + rp) >= 8192)
    for (int64_t t = 0; t < (copy ? B * n : 0); t++) {
        const int64_t b = t / n, j = t % n;
        if (j >= (lens ? lens[b] : n)) continue;
        float *dst = lf + (b * n + j) * (kl + rp);
        const int64_t lo = cache_at(rmap, rm_ld, b, j, ld_lat, lds_b), ko = cache_at(rmap, rm_ld, b, j, ld_kr, krs_b);
        if (lat_bf16) {
            const uint16_t *src = (const uint16_t *)lat + lo, *ks = (const uint16_t *)kr + ko;
            for (int64_t i = 0; i < kl; i++) dst[i] = bits_f32((uint32_t)src[i] << 16);
            for (int64_t i = 0; i < rp; i++) dst[kl + i] = bits_f32((uint32_t)ks[i] << 16);
        } else {
            memcpy(dst, (const float *)lat + lo, sizeof(float) * (size_t)kl);
            memcpy(dst + kl, (const float *)kr + ko, sizeof(float) * (size_t)rp);
        }
    }
    for (int64_t b = 0; b < B && copy; b++) {
        const int64_t nb = lens ? lens[b] : n;
        if (latent_act) {
            qp_in in;
            qp_mat kq = *m->kv_b;
            kq.act.epi = QE_FLOAT;  /* the float rows (q - o) * s, also for an integer-product form */
            kq.mode = 0;
            prepare(&kq, nb, kl, lf + b * n * (kl + rp), kl + rp, &sl, &in, QR_NONE);
            for (int64_t j = 0; j < nb; j++)
                memcpy(lf + (b * n + j) * (kl + rp), in.x + j * in.ldx, sizeof(float) * (size_t)kl);
        }
    }
    float *ol = sc + B * nh * n, *ov = ol + B * nh * kl;
    qp_in io, iv;
    qp_mat vb;
    if (m->kv_dense) { vb = *m->kv_b; vb.act.kind = QA_NONE; vb.act.epi = QE_FLOAT; }  /* latent quantized above */
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * nh; t++) {
            const int64_t b = t / nh, nb = lens ? lens[b] : n;
            const float *q = qcat + t * (kl + rp);
            const float *lb = copy ? lf + b * n * (kl + rp) : (const float *)lat + b * lds_b;
            const float *kb = copy ? lb + kl : (const float *)kr + b * krs_b;
            const int64_t ldl = copy ? kl + rp : ld_lat, ldk = copy ? kl + rp : ld_kr;
            float *s = sc + t * n, mx = -INFINITY, sum = 0.f;
            for (int64_t j = 0; j < nb; j++) {
                const float a = dot_f32(q, lb + j * ldl, kl), c = dot_f32(q + kl, kb + j * ldk, rp);
                s[j] = a * m->scale + c * m->scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            for (int64_t j = 0; j < nb; j++) { s[j] = expf(s[j] - mx); sum += s[j]; }
            float inv = 1.f / sum, *o = ol + t * kl;
            for (int64_t i = 0; i < kl; i++) o[i] = 0.f;
            for (int64_t j = 0; j < nb; j++) axpy_f32(s[j] * inv, lb + j * ldl, o, kl);
        }
        if (!m->kv_dense) {
            #pragma omp single
            prepare(m->v_b[0], B * nh, kl, ol, kl, &sv, &iv, wround);
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * nh; t++) {
            const int64_t h = t % nh;
            float *dst = ov + t * vd;
            if (m->kv_dense) {
                qp_in in;
                memset(&in, 0, sizeof in);
                in.x = ol + t * kl; in.ldx = kl;
                const int64_t r0 = h * (m->nope + vd) + m->nope;
                rows_any(&vb, &in, r0, r0 + vd, 1, dst, 0, wround);
            } else {
                qp_in in = iv;
                in_skip(&in, t, kl);
                rows_any(m->v_b[h], &in, 0, vd, 1, dst, 0, wround);
            }
            if (gate) {
                const float *gg = gate + t * vd;
                for (int64_t i = 0; i < vd; i++) dst[i] *= 1.f / (1.f + expf(-gg[i]));
            }
        }
        #pragma omp single
        prepare(m->o, B, nh * vd, ov, nh * vd, &so, &io, wround);
        par_rows(m->o, &io, B, out, H, wround);
    }
done:
    if (oo) scratch_free(&so);
    if (ol_) scratch_free(&sl);
    if (ov_) scratch_free(&sv);
    free(lf); free(sc);
    return rc;
}

/* One whole decode step for B sequences at position pos: qp_latent_pre, the token's latent and key
 * written into each sequence's cache row pos (float32, or bfloat16 rounded to nearest even, as
 * torch's conversion), then qp_latent_post over the pos + 1 cached tokens. bpos [B] (or NULL: pos
 * each): each sequence's own position; rmap / rm_ld: a paged cache, as qp_latent_post reads it (the
 * token is written at its physical row rmap[b * rm_ld + position]). */
int qp_latent_step(const qp_latent_attn *m, int64_t B, const float *x, const float *rot, void *lat, int64_t ld_lat, int64_t lds_b,
                void *kr, int64_t ld_kr, int64_t krs_b, int64_t pos, const int64_t *rmap, int64_t rm_ld,
                const int64_t *bpos, int lat_bf16, float *out, int wround) {
    if (!latent_ok(m) || B <= 0 || pos < 0) return -1;
    int64_t n = pos + 1;
    if (bpos) {
        n = 0;
        for (int64_t b = 0; b < B; b++) {
            if (bpos[b] < 0) return -1;
            n = bpos[b] + 1 > n ? bpos[b] + 1 : n;
        }
    }
    if (rmap && rm_ld < n) return -1;
    const int64_t kl = m->kv_lora, rp = m->rope, gw = m->g ? m->nh * m->v : 0;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * (m->nh * (kl + rp) + kl + rp + gw) + 1));
    int64_t *lens = bpos ? (int64_t *)malloc(sizeof(int64_t) * (size_t)B) : NULL;
    if (!buf || (bpos && !lens)) { free(buf); free(lens); return -2; }
    float *qcat = buf, *kvrow = qcat + B * m->nh * (kl + rp), *gate = kvrow + B * (kl + rp);
    int rc = qp_latent_pre(m, B, x, rot, qcat, kvrow, m->g ? gate : NULL, wround);
    if (rc == 0) {
        for (int64_t b = 0; b < B; b++) {
            const float *row = kvrow + b * (kl + rp);
            const int64_t p = bpos ? bpos[b] : pos;
            const int64_t lo = cache_at(rmap, rm_ld, b, p, ld_lat, lds_b), ko = cache_at(rmap, rm_ld, b, p, ld_kr, krs_b);
            if (lens) lens[b] = p + 1;
            if (lat_bf16) {
                uint16_t *l = (uint16_t *)lat + lo, *k = (uint16_t *)kr + ko;
                for (int64_t i = 0; i < kl; i++) l[i] = (uint16_t)(f32_bits(round_bf16(row[i])) >> 16);
                for (int64_t i = 0; i < rp; i++) k[i] = (uint16_t)(f32_bits(round_bf16(row[kl + i])) >> 16);
            } else {
                memcpy((float *)lat + lo, row, sizeof(float) * (size_t)kl);
                memcpy((float *)kr + ko, row + kl, sizeof(float) * (size_t)rp);
            }
        }
        rc = qp_latent_post(m, B, qcat, lat, ld_lat, lds_b, kr, ld_kr, krs_b, n, rmap, rm_ld, lens, lat_bf16,
                            m->g ? gate : NULL, out, wround);
    }
    free(buf); free(lens);
    return rc;
}
