/* The sigmoid group-limited top-k router of a routed MoE layer, one row at a time. */

/* route_one of the core model for one normed row h: ids (ascending) and weights of its top_k experts */
static void route_row(const qp_layer *l, const float *h, int64_t H, double *sc, double *ch, int32_t *ids, float *ws) {
    const int E = l->E, per = E / l->n_group, G = l->n_group;
    for (int e = 0; e < E; e++) {
        float s = 1.f / (1.f + expf(-dot_f32(h, l->router + (int64_t)e * H, H)));
        sc[e] = (double)s;
        ch[e] = (double)s + (l->bias ? (double)l->bias[e] : 0.0);
    }
    double gs[1024];
    int take[1024];
    for (int g = 0; g < G; g++) {
        double a = -INFINITY, b = -INFINITY;  /* the two largest of the group */
        for (int j = 0; j < per; j++) {
            double v = ch[g * per + j];
            if (v > a) { b = a; a = v; } else if (v > b) b = v;
        }
        gs[g] = per >= 2 ? a + b : a;
        take[g] = 0;
    }
    for (int k = 0; k < l->topk_group; k++) {  /* highest group score first, ties to the lower id */
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!take[g] && (best < 0 || gs[g] > gs[best])) best = g;
        take[best] = 1;
    }
    int chosen[1024], n = 0;
    for (int k = 0; k < l->top_k; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (!take[e / per]) continue;
            int used = 0;
            for (int j = 0; j < n; j++) used |= chosen[j] == e;
            if (!used && (best < 0 || ch[e] > ch[best])) best = e;
        }
        chosen[n++] = best;
    }
    double total = 0.0;
    for (int j = 0; j < n; j++) total += sc[chosen[j]];
    total += 1e-20;
    /* ascending ids, weights as route_one's floats */
    for (int j = 0; j < n; j++) {
        int lo = j;
        for (int i = j + 1; i < n; i++) if (chosen[i] < chosen[lo]) lo = i;
        int t = chosen[j]; chosen[j] = chosen[lo]; chosen[lo] = t;
    }
    for (int j = 0; j < n; j++) {
        double w = sc[chosen[j]];
        if (l->norm_topk) w = w / total;
        ids[j] = chosen[j];
        ws[j] = (float)(w * (double)l->scaling);
    }
}

