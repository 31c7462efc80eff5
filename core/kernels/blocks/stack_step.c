/* ---- one decode step of the whole decoder stack ------------------------------------------------
 * Every layer of a stack of latent-attention layers for B sequences at one position in one call: input
 * norm, the absorbed latent-attention step (qp_latent_step, appending to the layer's cache), residual, post-
 * attention norm, the dense gated MLP or the MoE (the layer's router, qp_router: router.c; the
 * routed experts and the shared experts through qp_mlp, gated by the layer's act: SiLU unless it says
 * otherwise), residual; then the final norm.
 * The arithmetic is the per-layer steps' own, in their order (a float32 model): the choice of
 * experts is the router's route_one (float32 scores, the choice and the weights in double, ties to
 * the lower id), each token's experts summed in ascending id order. */


/* RMSNorm of one row as RMSNorm.forward computes it: float32 statistics; in a bfloat16 model
 * (round) the normalized row is rounded to bfloat16, then the product with the weight */
static void norm_into(const float *x, float *o, int64_t n, const void *w, int bf16, float eps, int round) {
    float ss = dot_f32(x, x, n);
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) {
        float wi = bf16 ? bits_f32((uint32_t)((const uint16_t *)w)[i] << 16) : ((const float *)w)[i];
        o[i] = round ? round_bf16(wi * round_bf16(x[i] * r)) : wi * (x[i] * r);
    }
}

/* x = x + a, both rounded to bfloat16 first in a bfloat16 model (a module's output, then the sum) */
static void add_rows(float *x, float *a, int64_t n, int round) {
    if (round) for (int64_t j = 0; j < n; j++) x[j] = round_bf16(x[j] + round_bf16(a[j]));
    else for (int64_t j = 0; j < n; j++) x[j] = x[j] + a[j];
}

/* a layer's FFN (an MLP, or routed experts with their router and an optional shared expert) over
 * hidden width H (also the hyper-connection stack's, blocks/hyper_stack.c) */
static int ffn_ok(const qp_layer *l, int64_t H) {
    if (!l || !l->gate || !l->up || !l->down) return 0;
    const int E = l->E > 0 ? l->E : 1;
    for (int e = 0; e < E; e++)
        if (!l->gate[e] || !l->up[e] || !l->down[e] || !mat_ok(l->gate[e]) || l->gate[e]->k != H || l->down[e]->n != H)
            return 0;
    if (l->E > 0) {
        if (!l->route.weight || !router_ok(&l->route, l->E)) return 0;
        if (l->sg && (!l->su || !l->sd || !mat_ok(l->sg) || l->sg->k != H || l->sd->n != H)) return 0;
    }
    return 1;
}

static int layer_ok(const qp_layer *l, int64_t H) {
    if (!l->attn || !latent_ok(l->attn) || l->attn->H != H || !l->attn_norm || !l->ffn_norm) return 0;
    return ffn_ok(l, H);
}

/* the MoE of one layer for B normed rows h [B, H]: out [B, H] = routed (+ shared) */
static int moe_rows(const qp_layer *l, int64_t B, int64_t H, const float *h, const int64_t *tok, float *out, float *tmp,
                    int wround) {
    const int E = l->E, K = l->route.top_k;
    const int64_t P = B * K;
    int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)(P * 3 + E + 1));
    float *ws = (float *)malloc(sizeof(float) * (size_t)(P * 2));
    const qp_mat **mats = (const qp_mat **)malloc(sizeof(qp_mat *) * (size_t)(3 * (P + 1)));
    int rc = 0;
    if (!ids || !ws || !mats) { rc = -2; goto done; }
    int32_t *pe = ids + P, *prow = pe + P, *slot = prow + P;
    float *pw = ws + P;
    for (int64_t b = 0; b < B && rc == 0; b++) rc = route_row(&l->route, E, h + b * H, H, tok ? tok[b] : -1, ids + b * K, ws + b * K);
    if (rc) goto done;
    /* pairs grouped by expert (ascending id), rows ascending within one expert */
    for (int e = 0; e < E; e++) slot[e] = -1;
    int used = 0;
    int64_t p = 0;
    for (int e = 0; e < E; e++) {
        for (int64_t b = 0; b < B; b++)
            for (int j = 0; j < K; j++)
                if (ids[b * K + j] == e) {
                    if (slot[e] < 0) {
                        slot[e] = used;
                        mats[used] = l->gate[e]; mats[P + 1 + used] = l->up[e]; mats[2 * (P + 1) + used] = l->down[e];
                        used++;
                    }
                    pe[p] = slot[e]; prow[p] = (int32_t)b; pw[p] = ws[b * K + j]; p++;
                }
    }
    /* the shared experts as one more expert of the same call when they are shaped and quantized as
     * the routed ones, weight 1 for every row, after the routed pairs: each row's sum is then
     * (routed sum) + 1 * shared, the two-call result bit for bit, in one parallel region. A
     * bfloat16 model rounds the two sums before adding them: there the shared pairs write rows
     * B..2B-1 of a second output (the input rows repeated), the sums added after the call. */
    if (l->sg && l->sg->n == l->gate[0]->n && l->sd->k == l->down[0]->k) {
        const int bf = wround == QR_BF16;
        mats[used] = l->sg; mats[P + 1 + used] = l->su; mats[2 * (P + 1) + used] = l->sd;
        int32_t *pe2 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * (p + B)));
        float *pw2 = (float *)malloc(sizeof(float) * (size_t)(p + B));
        float *h2 = bf ? (float *)malloc(sizeof(float) * (size_t)(4 * B * H)) : NULL;
        if (!pe2 || !pw2 || (bf && !h2)) { free(pe2); free(pw2); free(h2); rc = -2; goto done; }
        int32_t *prow2 = pe2 + p + B;
        memcpy(pe2, pe, sizeof(int32_t) * (size_t)p); memcpy(prow2, prow, sizeof(int32_t) * (size_t)p);
        memcpy(pw2, pw, sizeof(float) * (size_t)p);
        for (int64_t b = 0; b < B; b++) { pe2[p + b] = used; prow2[p + b] = (int32_t)(bf ? B + b : b); pw2[p + b] = 1.f; }
        if (bf) {
            float *o2 = h2 + 2 * B * H;
            memcpy(h2, h, sizeof(float) * (size_t)(B * H)); memcpy(h2 + B * H, h, sizeof(float) * (size_t)(B * H));
            rc = qp_mlp(mats, mats + (P + 1), mats + 2 * (P + 1), used + 1, 2 * B, h2, H, (int)(p + B), pe2, prow2, pw2, o2, H, wround, l->act, l->act_a, l->act_b);
            if (rc == 0)  /* each module's output in the model dtype, then their sum (as below) */
                for (int64_t i = 0; i < B * H; i++) out[i] = round_bf16(round_bf16(o2[i]) + round_bf16(o2[B * H + i]));
        } else {
            rc = qp_mlp(mats, mats + (P + 1), mats + 2 * (P + 1), used + 1, B, h, H, (int)(p + B), pe2, prow2, pw2, out, H, wround, l->act, l->act_a, l->act_b);
        }
        free(pe2); free(pw2); free(h2);
        if (rc != -3) goto done;  /* -3: the shared experts quantize their inputs otherwise: two calls */
    }
    rc = qp_mlp(mats, mats + (P + 1), mats + 2 * (P + 1), used, B, h, H, (int)p, pe, prow, pw, out, H, wround, l->act, l->act_a, l->act_b);
    if (rc == 0 && l->sg) {
        const qp_mat *g1[1] = {l->sg}, *u1[1] = {l->su}, *d1[1] = {l->sd};
        for (int64_t b = 0; b < B; b++) { pe[b] = 0; prow[b] = (int32_t)b; pw[b] = 1.f; }
        rc = qp_mlp(g1, u1, d1, 1, B, h, H, (int)B, pe, prow, pw, tmp, H, wround, l->act, l->act_a, l->act_b);
        if (rc == 0 && wround == QR_BF16)  /* each module's output in the model dtype, then their sum */
            for (int64_t i = 0; i < B * H; i++) out[i] = round_bf16(round_bf16(out[i]) + round_bf16(tmp[i]));
        else if (rc == 0)
            for (int64_t i = 0; i < B * H; i++) out[i] = out[i] + tmp[i];
    }
done:
    free(ids); free(ws); free(mats);
    return rc;
}

/* the whole stack for B rows x [B, H] (the embeddings; overwritten by the residual stream) at
 * position pos of every sequence (tok [B]: their token ids, which a router by token needs; else
 * NULL): layer i's latent / key rows at lat[i] / kr[i] (strides as in
 * qp_latent_step, the same for every layer; rmap / rm_ld / bpos as there: a paged cache, each sequence's
 * own position); rot [B, rope, rope]; out [B, H] = the final norm of the last residual. */
static int qp_stack_step(const qp_layer *layers, int L, int64_t H, int64_t B, float *x, const int64_t *tok, const float *rot,
                  void *const *lat, void *const *kr, int64_t ld_lat, int64_t lds_b, int64_t ld_kr, int64_t krs_b,
                  int64_t pos, const int64_t *rmap, int64_t rm_ld, const int64_t *bpos, int lat_bf16,
                  const void *fnorm, int fnorm_bf16, float feps, float *out, int wround) {
    if (L <= 0 || H <= 0 || B <= 0 || pos < 0 || !fnorm || (wround != QR_NONE && wround != QR_BF16)) return -1;
    const int rnd = wround == QR_BF16;  /* a bfloat16 model: x holds bfloat16 values */
    for (int i = 0; i < L; i++) {
        if (!layer_ok(&layers[i], H) || !lat[i] || !kr[i]) return -1;
        if (layers[i].E > 0 && layers[i].route.tid2eid) {  /* routing by token: every id in its table */
            if (!tok) return -1;
            for (int64_t b = 0; b < B; b++)
                if (tok[b] < 0 || tok[b] >= layers[i].route.vocab) return -4;
        }
    }
    float *h = (float *)malloc(sizeof(float) * (size_t)(3 * B * H));
    if (!h) return -2;
    float *a = h + B * H, *t = a + B * H;
    int rc = 0;
    for (int i = 0; i < L && rc == 0; i++) {
        const qp_layer *l = &layers[i];
        for (int64_t b = 0; b < B; b++) norm_into(x + b * H, h + b * H, H, l->attn_norm, l->norm_bf16, l->eps, rnd);
        rc = qp_latent_step(l->attn, B, h, rot, lat[i], ld_lat, lds_b, kr[i], ld_kr, krs_b, pos, rmap, rm_ld, bpos, lat_bf16,
                            a, wround);
        if (rc) break;
        add_rows(x, a, B * H, rnd);
        for (int64_t b = 0; b < B; b++) norm_into(x + b * H, h + b * H, H, l->ffn_norm, l->norm_bf16, l->eps, rnd);
        if (l->E > 0) rc = moe_rows(l, B, H, h, tok, a, t, wround);
        else {
            int32_t *pe = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * B));
            float *pw = (float *)malloc(sizeof(float) * (size_t)B);
            if (!pe || !pw) rc = -2;
            else {
                for (int64_t b = 0; b < B; b++) { pe[b] = 0; pe[B + b] = (int32_t)b; pw[b] = 1.f; }
                rc = qp_mlp(l->gate, l->up, l->down, 1, B, h, H, (int)B, pe, pe + B, pw, a, H, wround, l->act, l->act_a, l->act_b);
            }
            free(pe); free(pw);
        }
        if (rc) break;
        add_rows(x, a, B * H, rnd);
    }
    if (rc == 0)
        for (int64_t b = 0; b < B; b++) norm_into(x + b * H, out + b * H, H, fnorm, fnorm_bf16, feps, rnd);
    free(h);
    return rc;
}

/* the first NaN of v [n], else the first largest value: torch.argmax's pick */
static int64_t argmax_row(const float *v, int64_t n) {
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        if (v[i] != v[i]) return i;
        if (v[i] > v[at]) at = i;
    }
    return at;
}

/* ---- one decode step from token ids to logits ---------------------------------------------------
 * qp_stack_step with the embedding lookup before it and the LM head after it, so that a decode
 * step crosses from Python into C once: x [B, H] = rows ids of emb exactly decoded (rounded to the
 * model dtype, as the embedding's own lookup; emb NULL: x holds the embeddings already, and ids,
 * when given, the token ids for a router by token only), the stack
 * into hid [B, H], then logits [B, head->n] = hid through head (a bfloat16 model: rounded to
 * bfloat16, as the head's output in the model dtype; head NULL: no logits) and, when best is given,
 * each row's greedy pick best[b] as torch.argmax takes it (the first NaN, else the first largest).
 * Every argument is checked before any cache row is written; -4: a token id outside the embedding. */
int qp_decode_step(const qp_layer *layers, int L, int64_t H, int64_t B, const int64_t *ids, const qp_mat *emb,
                   float *x, const float *rot, void *const *lat, void *const *kr, int64_t ld_lat, int64_t lds_b,
                   int64_t ld_kr, int64_t krs_b, int64_t pos, const int64_t *rmap, int64_t rm_ld, const int64_t *bpos,
                   int lat_bf16, const void *fnorm, int fnorm_bf16, float feps, float *hid, const qp_mat *head,
                   float *logits, int64_t *best, int wround) {
    if (B <= 0 || H <= 0 || (wround != QR_NONE && wround != QR_BF16)) return -1;
    if (emb) {
        if (!ids || !mat_ok(emb) || emb->k != H) return -1;
        for (int64_t b = 0; b < B; b++)
            if (ids[b] < 0 || ids[b] >= emb->n) return -4;
    }
    if (head && (!logits || !mat_ok(head) || head->k != H)) return -1;
    if (emb) {
        const int64_t seg = seg_len(emb);
        for (int64_t b = 0; b < B; b++)
            for (int64_t c0 = 0; c0 < H; c0 += seg) deq_seg(emb, ids[b], c0, seg, x + b * H + c0, wround);
    }
    int rc = qp_stack_step(layers, L, H, B, x, ids, rot, lat, kr, ld_lat, lds_b, ld_kr, krs_b, pos, rmap, rm_ld, bpos,
                           lat_bf16, fnorm, fnorm_bf16, feps, hid, wround);
    if (rc || !head) return rc;
    const int64_t zero = 0;
    rc = qp_gemm(&head, 1, B, H, hid, H, &zero, &B, &zero, &zero, logits, head->n, wround);
    if (rc == 0 && wround == QR_BF16)
        for (int64_t i = 0; i < B * head->n; i++) logits[i] = round_bf16(logits[i]);
    if (rc == 0 && best)
        for (int64_t b = 0; b < B; b++) best[b] = argmax_row(logits + b * head->n, head->n);
    return rc;
}

/* One step of greedy speculative decoding with one drafted token, in one call. The stack runs as
 * qp_decode_step (embedding, stack, head, picks) on ids = (the last emitted token, the draft) of ONE
 * sequence at positions pos and pos + 1 (every cache of batch 1: rows at lat[i] + j * ld_lat; rot
 * [2, rope, rope]); each row's arithmetic is a one-token step's. The draft is accepted when the pick
 * at pos equals it. The drafter then runs on the accepted pairs, (hid[0], ids[1]) and (hid[1], best[1])
 * when accepted, else (hid[0], best[0]), appending its cache rows from dpos on (its cache laid out as
 * the stack's; drot [2, rope, rope] each pair's rotation), and runs the head on its last row: dlogits [head->n], whose greedy pick is the next draft. hid [2, H] the stack's final
 * norm, logits [2, head->n]; res = {best[0], best[1], accepted}. Every argument is checked before
 * any cache row is written (-4: a token id outside the embedding). */
int qp_spec_step(const qp_layer *layers, int L, int64_t H, const int64_t *ids, const qp_mat *emb, const float *rot,
                 void *const *lat, void *const *kr, int64_t ld_lat, int64_t ld_kr, int64_t pos, int lat_bf16,
                 const void *fnorm, int fnorm_bf16, float feps, const qp_mat *head, const qp_draft *dr,
                 void *dlat, void *dkr, int64_t dpos, const float *drot, float *hid, float *logits, float *dlogits,
                 int64_t *res, int wround) {
    if (!ids || !emb || !head || !dr || !dr->layer || !dr->enorm || !dr->hnorm || !dr->fnorm || !dr->proj
        || !dlat || !dkr || dpos < 0 || pos < 0 || !drot || !res || !dlogits || !mat_ok(dr->proj) || dr->proj->k != 2 * H
        || dr->proj->n != H || !layer_ok(dr->layer, H)
        || (dr->layer->E > 0 && dr->layer->route.tid2eid && dr->layer->route.vocab < emb->n)
        || !mat_ok(emb) || emb->k != H || (wround != QR_NONE && wround != QR_BF16))
        return -1;
    const int rnd = wround == QR_BF16;
    const int64_t V = head->n, zero = 0, one = 1;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * H + 4 * H + 2 * H + 2 * H));
    if (!buf) return -2;
    float *x = buf, *cat = x + 2 * H, *u = cat + 4 * H, *dh = u + 2 * H;
    const int64_t bpos[2] = {pos, pos + 1}, dbpos[2] = {dpos, dpos + 1};
    int64_t best[2];
    int rc = qp_decode_step(layers, L, H, 2, ids, emb, x, rot, lat, kr, ld_lat, 0, ld_kr, 0, pos, NULL, 0, bpos,
                            lat_bf16, fnorm, fnorm_bf16, feps, hid, head, logits, best, wround);
    if (rc) goto done;
    const int acc = best[0] == ids[1];
    const int64_t n = acc ? 2 : 1, tok[2] = {acc ? ids[1] : best[0], best[1]};
    const int64_t seg = seg_len(emb);
    for (int64_t r = 0; r < n; r++) {  /* the drafter's input rows: cat(norm_e(embedding), norm_h(hidden)) */
        for (int64_t c0 = 0; c0 < H; c0 += seg) deq_seg(emb, tok[r], c0, seg, x + c0, wround);
        norm_into(x, cat + r * 2 * H, H, dr->enorm, dr->norm_bf16, dr->eps, rnd);
        norm_into(hid + r * H, cat + r * 2 * H + H, H, dr->hnorm, dr->norm_bf16, dr->eps, rnd);
    }
    rc = qp_gemm(&dr->proj, 1, n, 2 * H, cat, 2 * H, &zero, &n, &zero, &zero, u, H, wround);
    if (rc) goto done;
    if (rnd) for (int64_t i = 0; i < n * H; i++) u[i] = round_bf16(u[i]);
    rc = qp_stack_step(dr->layer, 1, H, n, u, tok, drot, &dlat, &dkr, ld_lat, 0, ld_kr, 0, dpos, NULL, 0, dbpos, lat_bf16,
                       dr->fnorm, dr->norm_bf16, dr->eps, dh, wround);
    if (rc) goto done;
    rc = qp_gemm(&head, 1, 1, H, dh + (n - 1) * H, H, &zero, &one, &zero, &zero, dlogits, V, wround);
    if (rc) goto done;
    if (rnd) for (int64_t i = 0; i < V; i++) dlogits[i] = round_bf16(dlogits[i]);
    res[0] = best[0]; res[1] = best[1]; res[2] = acc;
done:
    free(buf);
    return rc;
}

