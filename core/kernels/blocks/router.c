/* The router of a routed MoE layer as data (qp_router), one row at a time: the reference is
 * quantplug.contract.routing.route (the same ids; the weights to the last float32 bit or two). */

/* the largest expert count and group count a router takes (the row's scratch lives on the stack) */
#define QP_ROUTE_MAX 1024

/* the router's checks for E experts (its weight: checked where it is read) */
static int router_ok(const qp_router *r, int E) {
    if (E < 1 || E > QP_ROUTE_MAX || r->top_k < 1 || r->top_k > E) return 0;
    if (r->score < QRS_SIGMOID || r->score > QRS_SQRTSOFTPLUS || r->select < QRT_GREEDY || r->select > QRT_GROUP_MAX)
        return 0;
    if (r->tid2eid) return r->vocab > 0;
    if (r->select != QRT_GREEDY)
        return r->n_group >= 1 && r->n_group <= QP_ROUTE_MAX && E % r->n_group == 0 && r->topk_group >= 1
               && r->topk_group <= r->n_group && r->top_k <= r->topk_group * (E / r->n_group);
    return 1;
}

/* float32 scores sc [E] of float32 logits lg [E], as torch computes them elementwise: sigmoid;
 * softmax (exp of logit - max, times the reciprocal of their sum); sqrt(softplus) (softplus as
 * torch's: the logit itself above 20) */
static void route_scores(int score, const float *lg, int E, float *sc) {
    if (score == QRS_SOFTMAX) {
        float m = lg[0];
        for (int e = 1; e < E; e++) m = lg[e] > m ? lg[e] : m;
        double sum = 0.0;
        for (int e = 0; e < E; e++) { sc[e] = expf(lg[e] - m); sum += (double)sc[e]; }
        const float inv = (float)(1.0 / sum);
        for (int e = 0; e < E; e++) sc[e] = sc[e] * inv;
    } else if (score == QRS_SQRTSOFTPLUS) {
        for (int e = 0; e < E; e++) sc[e] = sqrtf(lg[e] > 20.f ? lg[e] : log1pf(expf(lg[e])));
    } else {
        for (int e = 0; e < E; e++) sc[e] = 1.f / (1.f + expf(-lg[e]));
    }
}

/* the route of one row: its logits lg [E] (float32), the token id tok (routing by token), ids
 * (ascending) and weights ws of its top_k experts. The choice runs in double on the float32
 * scores plus the bias, every tie to the lower id (group or expert); the weights are the chosen
 * experts' scores, divided by their sum + 1e-20 (norm_topk), times scaling, rounded to float32
 * once. -4: a token id outside tid2eid or an expert id outside [0, E) there. */
static int route_logits(const qp_router *r, int E, const float *lg, int64_t tok, int32_t *ids, float *ws) {
    float sc[QP_ROUTE_MAX];
    double ch[QP_ROUTE_MAX], gs[QP_ROUTE_MAX];
    int take[QP_ROUTE_MAX], chosen[QP_ROUTE_MAX];
    route_scores(r->score, lg, E, sc);
    int n = 0;
    if (r->tid2eid) {
        if (tok < 0 || tok >= r->vocab) return -4;
        for (int k = 0; k < r->top_k; k++) {
            const int32_t e = r->tid2eid[tok * r->top_k + k];
            if (e < 0 || e >= E) return -4;
            chosen[n++] = e;
        }
    } else {
        for (int e = 0; e < E; e++) ch[e] = (double)sc[e] + (r->bias ? (double)r->bias[e] : 0.0);
        const int grouped = r->select != QRT_GREEDY;
        const int G = grouped ? r->n_group : 1, per = E / G;
        for (int g = 0; g < G; g++) {
            double a = -INFINITY, b = -INFINITY;  /* the two largest of the group */
            for (int j = 0; j < per; j++) {
                double v = ch[g * per + j];
                if (v > a) { b = a; a = v; } else if (v > b) b = v;
            }
            gs[g] = r->select == QRT_GROUP_TOP2 && per >= 2 ? a + b : a;
            take[g] = !grouped;
        }
        for (int k = 0; grouped && k < r->topk_group; k++) {  /* highest group score first, ties to the lower id */
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!take[g] && (best < 0 || gs[g] > gs[best])) best = g;
            take[best] = 1;
        }
        for (int k = 0; k < r->top_k; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                if (!take[e / per]) continue;
                int used = 0;
                for (int j = 0; j < n; j++) used |= chosen[j] == e;
                if (!used && (best < 0 || ch[e] > ch[best])) best = e;
            }
            chosen[n++] = best;
        }
    }
    double total = 0.0;
    for (int j = 0; j < n; j++) total += (double)sc[chosen[j]];
    total += 1e-20;
    for (int j = 0; j < n; j++) {  /* ascending ids */
        int lo = j;
        for (int i = j + 1; i < n; i++) if (chosen[i] < chosen[lo]) lo = i;
        int t = chosen[j]; chosen[j] = chosen[lo]; chosen[lo] = t;
    }
    for (int j = 0; j < n; j++) {
        double w = (double)sc[chosen[j]];
        if (r->norm_topk) w = w / total;
        ids[j] = chosen[j];
        ws[j] = (float)(w * (double)r->scaling);
    }
    return 0;
}

/* the route of one normed row h [H] (its logits: the router's float32 weight rows times h) */
static int route_row(const qp_router *r, int E, const float *h, int64_t H, int64_t tok, int32_t *ids, float *ws) {
    float lg[QP_ROUTE_MAX];
    for (int e = 0; e < E; e++) lg[e] = dot_f32(h, r->weight + (int64_t)e * H, H);
    return route_logits(r, E, lg, tok, ids, ws);
}

/* The route of B rows for tests and callers outside the stack step: x [B, H] the normed rows
 * (r->weight their router), or with logits set x [B, E] the logits themselves; tok [B] the token
 * ids (routing by token; else NULL); ids / ws [B, top_k], ids ascending per row. -1: a bad
 * router; -4: a token id or table entry out of range. */
int qp_route(const qp_router *r, int32_t E, int64_t B, int64_t H, const float *x, int32_t logits, const int64_t *tok,
             int32_t *ids, float *ws) {
    if (!r || !x || !ids || !ws || B < 1 || H < 1 || !router_ok(r, E) || (r->tid2eid && !tok) || (logits && H != E)
        || (!logits && !r->weight))
        return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t t = tok ? tok[b] : -1;
        int rc = logits ? route_logits(r, E, x + b * H, t, ids + b * r->top_k, ws + b * r->top_k)
                        : route_row(r, E, x + b * H, H, t, ids + b * r->top_k, ws + b * r->top_k);
        if (rc) return rc;
    }
    return 0;
}
