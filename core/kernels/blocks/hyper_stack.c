/* ---- one decode step of a stack of hyper-connection blocks, from token ids to logits ------------
 * B sequences at one position, in one call: the embeddings copied into N streams; per layer
 * (qp_hyper_block) the streams mixed into the attention's input (qp_hyper_pre), its norm, the
 * window attention (qp_window_step: the cache rows and compressed entries written into the
 * caller's buffers, qp_window_state), the output mixed back (qp_hyper_post); the same around the
 * feed-forward part (the MoE: the layer's router, by token id where it routes so, the routed and
 * shared experts through qp_mlp with the layer's activation: moe_rows); then the head's collapse of
 * the streams, the final norm, the LM head and each row's greedy pick. The arithmetic is the
 * per-block native steps' own, in their order (float32 models). Python: compute.py HyperStackStep. */

/* ids [B] token ids; emb [V, H]; layers / states [L]; the head's collapse (h_fn [N, N H], h_base [N],
 * h_scale [1]), the final norm fnorm [H] (feps); hid [B, H] the final norm's output; head [V', H]
 * (NULL: no logits), logits [B, V'], best [B] (or NULL). Every argument is checked before any cache
 * buffer is written (-4: a token id outside the embedding or a routing table). */
int qp_hyper_decode_step(const qp_hyper_block *layers, const qp_window_state *states, int L, int64_t H, int64_t B,
                         const int64_t *ids, const qp_mat *emb, const float *h_fn, const float *h_base,
                         const float *h_scale, const float *fnorm, float feps, float *hid, const qp_mat *head,
                         float *logits, int64_t *best, int wround) {
    if (L <= 0 || H <= 0 || B <= 0 || !ids || !emb || !mat_ok(emb) || emb->k != H || !h_fn || !h_base || !h_scale
        || !fnorm || wround != QR_NONE || (head && (!logits || !mat_ok(head) || head->k != H))) return -1;
    const int N = layers[0].hc;
    if (N <= 0 || N > 64) return -1;
    for (int64_t b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= emb->n) return -4;
    for (int i = 0; i < L; i++) {
        const qp_hyper_block *l = &layers[i];
        const qp_window_state *s = &states[i];
        if (!l->attn || !window_ok(l->attn) || l->attn->H != H || !ffn_ok(l->ffn, H) || l->hc != N
            || l->iters < 1 || !l->attn_norm || !l->ffn_norm || !l->a_fn || !l->a_base || !l->a_scale || !l->f_fn
            || !l->f_base || !l->f_scale || !s->win || s->nwin < 1 || s->nwin > l->attn->window || !s->cos || !s->sin
            || (l->attn->comp && !s->comp) || (l->attn->idx_q && !s->idx)) return -1;
        if (l->ffn->E > 0 && l->ffn->route.tid2eid)
            for (int64_t b = 0; b < B; b++)
                if (ids[b] >= l->ffn->route.vocab) return -4;
    }
    const int64_t NH = (int64_t)N * H, M = (int64_t)(2 + N) * N;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * B * NH + 4 * B * H + B * (2 * N + N * N)));
    if (!buf) return -2;
    float *X = buf, *X2 = X + B * NH, *u = X2 + B * NH, *h = u + B * H, *a = h + B * H, *t = a + B * H;
    float *pre = t + B * H, *post = pre + B * N, *comb = post + B * N;
    const int64_t seg = seg_len(emb);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t c0 = 0; c0 < H; c0 += seg) deq_seg(emb, ids[b], c0, seg, X + b * NH + c0, wround);
        for (int k = 1; k < N; k++) memcpy(X + b * NH + k * H, X + b * NH, sizeof(float) * (size_t)H);
    }
    int rc = 0;
    for (int i = 0; i < L && rc == 0; i++) {
        const qp_hyper_block *l = &layers[i];
        const qp_window_state *s = &states[i];
        rc = qp_hyper_pre(B, N, H, X, l->a_fn, (int)M, l->a_base, l->a_scale, l->iters, l->hc_eps, l->hc_norm_eps, u,
                          pre, post, comb);
        if (rc) break;
        for (int64_t b = 0; b < B; b++) norm_into(u + b * H, h + b * H, H, l->attn_norm, 0, l->eps, 0);
        rc = qp_window_step(l->attn, B, h, s->cos, s->sin, s->win, s->nwin, s->comp, s->idx, a, wround);
        if (rc) break;
        qp_hyper_post(B, N, H, a, X, post, comb, X2);
        rc = qp_hyper_pre(B, N, H, X2, l->f_fn, (int)M, l->f_base, l->f_scale, l->iters, l->hc_eps, l->hc_norm_eps, u,
                          pre, post, comb);
        if (rc) break;
        for (int64_t b = 0; b < B; b++) norm_into(u + b * H, h + b * H, H, l->ffn_norm, 0, l->eps, 0);
        if (l->ffn->E > 0) rc = moe_rows(l->ffn, B, H, h, ids, a, t, wround);
        else {
            int32_t pe[2 * 64];
            float pw[64];
            if (B > 64) { rc = -1; break; }
            for (int64_t b = 0; b < B; b++) { pe[b] = 0; pe[B + b] = (int32_t)b; pw[b] = 1.f; }
            rc = qp_mlp(l->ffn->gate, l->ffn->up, l->ffn->down, 1, B, h, H, (int)B, pe, pe + B, pw, a, H, wround,
                        l->ffn->act, l->ffn->act_a, l->ffn->act_b);
        }
        if (rc) break;
        qp_hyper_post(B, N, H, a, X2, post, comb, X);
    }
    if (rc == 0) rc = qp_hyper_pre(B, N, H, X, h_fn, N, h_base, h_scale, 1, layers[0].hc_eps, layers[0].hc_norm_eps, u,
                                   pre, NULL, NULL);
    if (rc == 0)
        for (int64_t b = 0; b < B; b++) norm_into(u + b * H, hid + b * H, H, fnorm, 0, feps, 0);
    if (rc == 0 && head) {
        const int64_t zero = 0;
        rc = qp_gemm(&head, 1, B, H, hid, H, &zero, &B, &zero, &zero, logits, head->n, wround);
        if (rc == 0 && best)
            for (int64_t b = 0; b < B; b++) best[b] = argmax_row(logits + b * head->n, head->n);
    }
    free(buf);
    return rc;
}
