/* ---- gated MLP over few rows: dense MLPs, shared experts, a step's routed experts ----------- */

static inline float silu(float v) { return v / (1.f + expf(-v)); }

/* float32 dot product in 64 lanes (the reduction order is fixed, so results do not depend on
 * the thread that computes them) */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = dot_lanes(a, b, n, &i);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[i] += a * x[i] */
static inline void axpy_f32(float a, const float *x, float *y, int64_t n) {
    int64_t i = axpy_run(a, x, y, n);
    for (; i < n; i++) y[i] += a * x[i];
}

/* g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u over n values (NaN propagates) */
static void silu_mul(float *g, const float *u, int64_t n) {
    int64_t i = silu_mul_run(g, u, n);
    for (; i < n; i++) g[i] = silu(g[i]) * u[i];
}

/* g[i] = SiTU(g[i], u[i]) = beta tanh(g / beta) sigmoid(g) * (lbeta tanh(u / lbeta), or u when
 * lbeta is 0) over n values, in the order of the torch formula (quantplug.layers.activation.situ_mul) */
static void situ_mul(float *g, const float *u, int64_t n, float beta, float lbeta) {
    for (int64_t i = 0; i < n; i++) {
        const float a = beta * tanhf(g[i] / beta) * (1.f / (1.f + expf(-g[i])));
        g[i] = a * (lbeta != 0.f ? lbeta * tanhf(u[i] / lbeta) : u[i]);
    }
}

/* the clamped SwiGLU: g[i] = silu(min(g[i], lim)) * clamp(u[i], -lim, lim) over n values (a NaN
 * stays NaN, as torch's clamp keeps it; u is clamped in place) */
static void silu_clamp_mul(float *g, float *u, int64_t n, float lim) {
    for (int64_t i = 0; i < n; i++) {
        if (g[i] > lim) g[i] = lim;
        if (u[i] > lim) u[i] = lim;
        else if (u[i] < -lim) u[i] = -lim;
    }
    silu_mul(g, u, n);
}

/* out[prow[p]] = sum over pairs p (in order) of pw[p] * down_e(act(gate_e x, up_e x)), x = row
 * prow[p] of x, e = pe[p]; pairs must come grouped by expert (pe non-decreasing). gate / up / down:
 * E experts' mats (gate / up: I x H; down: H x I). A row no pair names is set to zero. act: QM_SILU
 * (silu(gate) * up; act_a, act_b unused) or QM_SITU (beta act_a > 0, linear beta act_b >= 0, 0:
 * none; situ_mul) or QM_SILU_CLAMP (the clamped SwiGLU, limit act_a > 0; silu_clamp_mul). */
int qp_mlp(const qp_mat *const *gate, const qp_mat *const *up, const qp_mat *const *down, int E,
           int64_t M, const float *x, int64_t ldx, int P, const int32_t *pe, const int32_t *prow, const float *pw,
           float *out, int64_t ldo, int wround, int act, float act_a, float act_b) {
    if (E <= 0 || P <= 0 || M <= 0) return -1;
    if (act != QM_SILU && (act != QM_SITU || !(act_a > 0.f) || !(act_b >= 0.f) || !isfinite(act_a)
                           || !isfinite(act_b))
        && (act != QM_SILU_CLAMP || !(act_a > 0.f) || !isfinite(act_a))) return -1;
    const int64_t H = gate[0]->k, I = gate[0]->n;
    for (int e = 0; e < E; e++)
        if (!mat_ok(gate[e]) || !mat_ok(up[e]) || !mat_ok(down[e]) || gate[e]->k != H || up[e]->k != H
            || gate[e]->n != I || up[e]->n != I || down[e]->k != I || down[e]->n != H) return -1;
    for (int p = 0; p < P; p++)
        if (pe[p] < 0 || pe[p] >= E || prow[p] < 0 || prow[p] >= M || (p && pe[p] < pe[p - 1])) return -1;
    /* one activation treatment for every gate / up, one for every down (inputs prepared once):
     * otherwise (e.g. per-layer static scales) the caller composes the products instead */
    for (int e = 0; e < E; e++)
        if (!same_input(gate[0], gate[e]) || !same_input(gate[0], up[e]) || !same_input(down[0], down[e])) return -3;
    int32_t *start = (int32_t *)malloc(sizeof(int32_t) * (size_t)(E + 1));
    float *xg = (float *)malloc(sizeof(float) * (size_t)(P * H));
    float *hg = (float *)malloc(sizeof(float) * (size_t)(2 * P * I + P * H));
    qp_scratch sx, sh;
    int okx = scratch_alloc(&sx, P, H), okh = scratch_alloc(&sh, P, I);
    int rc = 0;
    if (!start || !xg || !hg || !okx || !okh) { rc = -2; goto done; }
    float *hu = hg + P * I, *yd = hu + P * I;
    for (int e = 0, p = 0; e <= E; e++) { while (p < P && pe[p] < e) p++; start[e] = p; }
    for (int p = 0; p < P; p++) memcpy(xg + p * H, x + prow[p] * ldx, sizeof(float) * (size_t)H);
    /* every expert's gate / up / down share one activation treatment (one scheme): prepared once */
    qp_in inx, inh;
    prepare(gate[0], P, H, xg, H, &sx, &inx, wround);
    const int threads = max_threads();
    int64_t rg = (2 * E * I) / (4 * threads), rd = (E * H) / (4 * threads);
    rg = rg < RT ? RT : (rg + RT - 1) / RT * RT;
    rd = rd < RT ? RT : (rd + RT - 1) / RT * RT;
    const int64_t per_i = (I + rg - 1) / rg, per_h = (H + rd - 1) / rd;
    const int64_t bytes = E * (I * (row_bytes(gate[0]) + row_bytes(up[0])) + H * row_bytes(down[0]));
    #pragma omp parallel if (threads > 1 && bytes >= 4 * MIN_TASK_BYTES)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < 2 * E * per_i; t++) {
            int64_t e = t / (2 * per_i), rest = t % (2 * per_i);
            int64_t n = start[e + 1] - start[e];
            if (n == 0) continue;
            int is_up = rest >= per_i;
            int64_t r0 = (rest % per_i) * rg, r1 = r0 + rg > I ? I : r0 + rg;
            qp_in in = inx;
            in_skip(&in, start[e], H);
            rows_any(is_up ? up[e] : gate[e], &in, r0, r1, (int)n, (is_up ? hu : hg) + start[e] * I + r0, I, wround);
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            float *g = hg + p * I, *u = hu + p * I;
            if (act == QM_SILU) silu_mul(g, u, I);
            else if (act == QM_SILU_CLAMP) silu_clamp_mul(g, u, I, act_a);
            else situ_mul(g, u, I, act_a, act_b);
        }
        #pragma omp single
        prepare(down[0], P, I, hg, I, &sh, &inh, wround);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < E * per_h; t++) {
            int64_t e = t / per_h, r0 = (t % per_h) * rd, r1 = r0 + rd > H ? H : r0 + rd;
            int64_t n = start[e + 1] - start[e];
            if (n == 0) continue;
            qp_in in = inh;
            in_skip(&in, start[e], I);
            rows_any(down[e], &in, r0, r1, (int)n, yd + start[e] * H + r0, H, wround);
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            float *o = out + r * ldo;
            int seen = 0;
            for (int p = 0; p < P; p++) {
                if (prow[p] != r) continue;
                const float *v = yd + p * H;
                if (!seen) { for (int64_t c = 0; c < H; c++) o[c] = pw[p] * v[c]; seen = 1; }
                else for (int64_t c = 0; c < H; c++) o[c] += pw[p] * v[c];
            }
            if (!seen) memset(o, 0, sizeof(float) * (size_t)H);
        }
    }
done:
    if (okx) scratch_free(&sx);
    if (okh) scratch_free(&sh);
    free(start); free(xg); free(hg);
    return rc;
}

