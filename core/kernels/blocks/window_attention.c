/* ---- sliding-window attention with sinks, a pooled compressor and a top-k indexer: one decode
 * token of B sequences at one position (qp_window_attn; Python: compute.py WindowAttnStep, the
 * math is the attention block's and its compressors' forwards) -------------------------------- */

/* y [B, m->n] (ldy) = the B rows x (ldx, m->k inputs each) through m */
static int mat_apply(const qp_mat *m, int64_t B, const float *x, int64_t ldx, float *y, int64_t ldy, int wround) {
    qp_scratch s;
    if (!scratch_alloc(&s, B, m->k)) return -2;
    qp_in in;
    prepare(m, B, m->k, x, ldx, &s, &in, wround);
    const int threads = max_threads();
    #pragma omp parallel if (threads > 1 && m->n * row_bytes(m) >= 4 * MIN_TASK_BYTES)
    par_rows(m, &in, B, y, ldy, wround);
    scratch_free(&s);
    return 0;
}

/* x [n] <- x / sqrt(mean(x^2) + eps), times w when given */
static void rms_row(float *x, int64_t n, const float *w, float eps) {
    const float r = 1.f / sqrtf(dot_f32(x, x, n) / (float)n + eps);
    if (w) for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * w[i];
    else for (int64_t i = 0; i < n; i++) x[i] = x[i] * r;
}

/* the trailing rope dims of x [d] rotated in interleaved pairs (2i, 2i + 1) by cos / sin [rope / 2]
 * (sign -1: rotated back) */
static void rope_pairs(float *x, int64_t d, int64_t rope, const float *cs, const float *sn, float sign) {
    float *r = x + d - rope;
    for (int64_t i = 0; i < rope / 2; i++) {
        const float x1 = r[2 * i], x2 = r[2 * i + 1], s = sign * sn[i];
        r[2 * i] = x1 * cs[i] - x2 * s;
        r[2 * i + 1] = x2 * cs[i] + x1 * s;
    }
}

static int pool_ok(const qp_pool *c, int64_t H, int64_t rope) {
    const int64_t width = c->dim * (c->overlap ? 2 : 1);
    return c->dim > 0 && c->ratio > 0 && c->dim >= rope && mat_ok(c->wkv) && mat_ok(c->wgate)
           && c->wkv->n == width && c->wgate->n == width && c->wkv->k == H && c->wgate->k == H && c->ape && c->norm;
}

/* this token's rows of a pooled compressor (x [B, H]) into its state; when it completes a window,
 * the window's entry (and, overlapping, the window's first halves for the next) */
static int pool_step(const qp_pool *c, const qp_pool_state *st, int64_t B, const float *x, int64_t H, int64_t rope,
                     int wround) {
    const int64_t dim = c->dim, r = c->ratio, width = dim * (c->overlap ? 2 : 1), np1 = st->pending + 1;
    if (st->pending < 0 || st->pending >= r || st->n < 0) return -1;
    int rc = mat_apply(c->wkv, B, x, H, st->kv + st->pending * width, np1 * width, wround);
    if (!rc) rc = mat_apply(c->wgate, B, x, H, st->gate + st->pending * width, np1 * width, wround);
    if (rc || np1 < r) return rc;
    if (c->overlap && (!st->prev_kv_out || !st->prev_gate_out)) return -1;
    const int64_t slots = c->overlap ? 2 * r : r;
    float *sk = (float *)malloc(sizeof(float) * (size_t)(2 * slots));
    if (!sk) return -2;
    float *sg = sk + slots;
    for (int64_t b = 0; b < B; b++) {
        const float *kv = st->kv + b * np1 * width, *gt = st->gate + b * np1 * width;
        float *e = st->ent + (b * (st->n + 1) + st->n) * dim;
        for (int64_t ch = 0; ch < dim; ch++) {
            int64_t s = 0;
            if (c->overlap) {
                for (int64_t t = 0; t < r; t++, s++) {
                    const int have = st->prev_kv && st->prev_gate;
                    sk[s] = have ? st->prev_kv[(b * r + t) * dim + ch] : 0.f;
                    sg[s] = have ? st->prev_gate[(b * r + t) * dim + ch] : -INFINITY;
                }
            }
            const int64_t off = c->overlap ? dim : 0;
            for (int64_t t = 0; t < r; t++, s++) {
                sk[s] = kv[t * width + off + ch];
                sg[s] = gt[t * width + off + ch] + c->ape[t * width + off + ch];
            }
            float mx = -INFINITY, sum = 0.f, acc = 0.f;
            for (s = 0; s < slots; s++) mx = sg[s] > mx ? sg[s] : mx;
            for (s = 0; s < slots; s++) { sg[s] = expf(sg[s] - mx); sum += sg[s]; }
            for (s = 0; s < slots; s++) acc += sk[s] * (sg[s] / sum);
            e[ch] = acc;
        }
        rms_row(e, dim, c->norm, c->eps);
        rope_pairs(e, dim, rope, st->cos, st->sin, 1.f);
        if (c->overlap)
            for (int64_t t = 0; t < r; t++)
                for (int64_t ch = 0; ch < dim; ch++) {
                    st->prev_kv_out[(b * r + t) * dim + ch] = kv[t * width + ch];
                    st->prev_gate_out[(b * r + t) * dim + ch] = gt[t * width + ch] + c->ape[t * width + ch];
                }
    }
    free(sk);
    return 0;
}

static int window_ok(const qp_window_attn *a) {
    const int64_t H = a->H, nh = a->nh, hd = a->hd;
    if (H <= 0 || nh <= 0 || hd <= 0 || a->rope <= 0 || a->rope % 2 || a->rope > hd || a->groups <= 0
        || nh % a->groups || a->o_rank <= 0 || a->window <= 0 || !a->q_norm || !a->kv_norm || !a->sink) return 0;
    if (!mat_ok(a->wq_a) || a->wq_a->k != H || a->wq_a->n != a->q_lora) return 0;
    if (!mat_ok(a->wq_b) || a->wq_b->k != a->q_lora || a->wq_b->n != nh * hd) return 0;
    if (!mat_ok(a->wkv) || a->wkv->k != H || a->wkv->n != hd) return 0;
    if (!mat_ok(a->wo_a) || a->wo_a->k != nh * hd / a->groups || a->wo_a->n != a->groups * a->o_rank) return 0;
    if (!mat_ok(a->wo_b) || a->wo_b->k != a->groups * a->o_rank || a->wo_b->n != H) return 0;
    if (a->comp && (!pool_ok(a->comp, H, a->rope) || a->comp->dim != hd)) return 0;
    if (a->idx_q) {
        if (!a->comp || !a->idx_comp || !a->idx_w || a->idx_heads <= 0 || a->idx_dim < a->rope || a->idx_topk <= 0
            || !mat_ok(a->idx_q) || a->idx_q->k != a->q_lora || a->idx_q->n != a->idx_heads * a->idx_dim
            || !pool_ok(a->idx_comp, H, a->rope) || a->idx_comp->dim != a->idx_dim
            || a->idx_comp->ratio != a->comp->ratio) return 0;
    }
    return 1;
}

/* B rows x [B, H] (the attention norm's output) at one position: cos / sin [rope / 2] its rotation;
 * win [B, nwin, hd] the window's keys, this token's written at row nwin - 1 (nwin <= window: every
 * row visible); comp / idx: the compressors' states (NULL where the layer has none); out [B, H]. */
int qp_window_step(const qp_window_attn *a, int64_t B, const float *x, const float *cs, const float *sn,
                   float *win, int64_t nwin, const qp_pool_state *comp, const qp_pool_state *idx, float *out,
                   int wround) {
    if (!window_ok(a) || B <= 0 || nwin < 1 || nwin > a->window || (a->comp && !comp) || (a->idx_q && !idx))
        return -1;
    const int64_t H = a->H, nh = a->nh, hd = a->hd, ql = a->q_lora, rp = a->rope, G = a->groups, R = a->o_rank;
    const int64_t nI = a->idx_q ? a->idx_heads : 0, dI = a->idx_q ? a->idx_dim : 0;
    int rc = 0;
    if (a->comp) rc = pool_step(a->comp, comp, B, x, H, rp, wround);
    if (!rc && a->idx_q) rc = pool_step(a->idx_comp, idx, B, x, H, rp, wround);
    if (rc) return rc;
    const int64_t n = a->comp ? comp->n + (comp->pending + 1 == a->comp->ratio) : 0;
    const int64_t nkeys = nwin + n;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * (ql + nh * hd + nh * hd + G * R + nI * dI + nI)
                                                          + nkeys + n + 1));
    int64_t *sel = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!buf || !sel) { free(buf); free(sel); return -2; }
    float *qr = buf, *q = qr + B * ql, *o = q + B * nh * hd, *y = o + B * nh * hd, *qi = y + B * G * R;
    float *wI = qi + B * nI * dI, *lg = wI + B * nI, *isc = lg + nkeys;
    rc = mat_apply(a->wq_a, B, x, H, qr, ql, wround);
    for (int64_t b = 0; !rc && b < B; b++) rms_row(qr + b * ql, ql, a->q_norm, a->eps);
    if (!rc) rc = mat_apply(a->wq_b, B, qr, ql, q, nh * hd, wround);
    if (!rc) rc = mat_apply(a->wkv, B, x, H, win + (nwin - 1) * hd, nwin * hd, wround);
    if (!rc && a->idx_q) rc = mat_apply(a->idx_q, B, qr, ql, qi, nI * dI, wround);
    if (rc) goto done;
    for (int64_t b = 0; b < B; b++) {
        float *kv = win + (b * nwin + nwin - 1) * hd;
        rms_row(kv, hd, a->kv_norm, a->eps);
        rope_pairs(kv, hd, rp, cs, sn, 1.f);
        for (int64_t h = 0; h < nh; h++) {
            float *qh = q + (b * nh + h) * hd;
            rms_row(qh, hd, NULL, a->eps);
            rope_pairs(qh, hd, rp, cs, sn, 1.f);
        }
        /* the entries this query attends: all (no indexer) or the indexer's top-k, ties to the lower */
        int64_t ns = n;
        const float *ent = a->comp ? comp->ent + b * n * hd : NULL;
        for (int64_t j = 0; j < n; j++) sel[j] = j;
        if (a->idx_q && n > 0) {
            const float *K = idx->ent + b * n * dI, *xb = x + b * H;
            float *qb = qi + b * nI * dI, *wb = wI + b * nI;
            for (int64_t h = 0; h < nI; h++) {
                rope_pairs(qb + h * dI, dI, rp, cs, sn, 1.f);
                wb[h] = dot_f32(a->idx_w + h * H, xb, H) * (1.f / sqrtf((float)nI));
            }
            const float sd = 1.f / sqrtf((float)dI);
            for (int64_t j = 0; j < n; j++) {
                float s = 0.f;
                for (int64_t h = 0; h < nI; h++) {
                    float d = dot_f32(qb + h * dI, K + j * dI, dI);
                    s += (d > 0.f ? d : 0.f) * sd * wb[h];
                }
                isc[j] = s;
            }
            ns = n < a->idx_topk ? n : a->idx_topk;
            for (int64_t t = 0; t < ns; t++) {  /* the best left, ties to the lower index */
                int64_t best = t;
                for (int64_t j = t + 1; j < n; j++)
                    if (isc[sel[j]] > isc[sel[best]] || (isc[sel[j]] == isc[sel[best]] && sel[j] < sel[best]))
                        best = j;
                int64_t tmp = sel[t]; sel[t] = sel[best]; sel[best] = tmp;
            }
            for (int64_t t = 1; t < ns; t++)  /* in entry order, as the mask keeps them */
                for (int64_t u = t; u > 0 && sel[u - 1] > sel[u]; u--) { int64_t tmp = sel[u]; sel[u] = sel[u - 1]; sel[u - 1] = tmp; }
        }
        const float *wk = win + b * nwin * hd;
        for (int64_t h = 0; h < nh; h++) {
            const float *qh = q + (b * nh + h) * hd;
            float *oh = o + (b * nh + h) * hd;
            const int64_t nk = nwin + ns;
            float mx = a->sink[h];
            for (int64_t j = 0; j < nk; j++) {
                const float *k = j < nwin ? wk + j * hd : ent + sel[j - nwin] * hd;
                lg[j] = dot_f32(qh, k, hd) * a->scale;
                mx = lg[j] > mx ? lg[j] : mx;
            }
            float sum = 0.f;
            for (int64_t j = 0; j < nk; j++) { lg[j] = expf(lg[j] - mx); sum += lg[j]; }
            sum += expf(a->sink[h] - mx);
            for (int64_t c = 0; c < hd; c++) oh[c] = 0.f;
            for (int64_t j = 0; j < nk; j++) {
                const float *k = j < nwin ? wk + j * hd : ent + sel[j - nwin] * hd;
                axpy_f32(lg[j] / sum, k, oh, hd);
            }
            rope_pairs(oh, hd, rp, cs, sn, -1.f);
        }
    }
    /* the grouped output projection: group g's heads through rows g R .. (g + 1) R of wo_a */
    for (int64_t g = 0; !rc && g < G; g++) {
        const int64_t gin = nh * hd / G;
        qp_scratch s;
        if (!scratch_alloc(&s, B, gin)) { rc = -2; break; }
        qp_in in;
        prepare(a->wo_a, B, gin, o + g * gin, nh * hd, &s, &in, wround);
        rows_any(a->wo_a, &in, g * R, (g + 1) * R, (int)B, y + g * R, G * R, wround);
        scratch_free(&s);
    }
    if (!rc) rc = mat_apply(a->wo_b, B, y, G * R, out, H, wround);
done:
    free(buf); free(sel);
    return rc;
}
