/* ---- hyper-connections: N residual streams mixed around a sub-layer, float32 -------------------
 *
 * A row's state is N streams of D values (x [N * D]). Around a sub-layer, from the streams
 * RMS-normalized as one row (no weight), M = (2 + N) * N mixes m = fn . x_hat, then
 *   pre_k  = sigmoid(m_k * scale[0] + base_k) + eps_hc           (k < N)
 *   post_k = 2 sigmoid(m_{N+k} * scale[1] + base_{N+k})
 *   comb   = Sinkhorn-Knopp of the [N, N] logits m_{2N + j N + k} * scale[2] + base_{2N + j N + k}:
 *            softmax over k, + eps_hc; columns / (column sum + eps_hc); then iters - 1 times rows,
 *            then columns, each / (sum + eps_hc)
 * the sub-layer reads u = sum_k pre_k x_k, and its output f goes back as
 *   x'_k = post_k f + sum_j comb[j, k] x_j.
 * A head (M = N: pre only, scale[0]) collapses the streams once. Python: compute.py HyperStep; the
 * math is quantplug.blocks.hyper's. */

static inline float sigmoid_f(float v) { return 1.f / (1.f + expf(-v)); }

/* one row: the mixes of x [N * D] by fn [M, N * D], x's rms over N * D values */
static void hc_mixes(const float *x, int64_t nd, const float *fn, int M, float norm_eps, float *mix) {
    const float ms = dot_f32(x, x, nd) / (float)nd;
    const float r = 1.f / sqrtf(ms + norm_eps);
    for (int m = 0; m < M; m++) mix[m] = dot_f32(fn + (int64_t)m * nd, x, nd) * r;
}

/* pre, post [N] and comb [N * N] (comb[j * N + k]: from stream j into stream k) of mixes mix [M]
 * (M = (2 + N) N; M = N: pre only, post / comb untouched) */
static void hc_weights(const float *mix, int N, int M, const float *base, const float *scale, int iters,
                       float hc_eps, float *pre, float *post, float *comb) {
    for (int k = 0; k < N; k++) pre[k] = sigmoid_f(mix[k] * scale[0] + base[k]) + hc_eps;
    if (M == N) return;
    for (int k = 0; k < N; k++) post[k] = 2.f * sigmoid_f(mix[N + k] * scale[1] + base[N + k]);
    for (int j = 0; j < N; j++) {
        float *row = comb + j * N, mx = -INFINITY, s = 0.f;
        for (int k = 0; k < N; k++) {
            row[k] = mix[2 * N + j * N + k] * scale[2] + base[2 * N + j * N + k];
            if (row[k] > mx) mx = row[k];
        }
        for (int k = 0; k < N; k++) { row[k] = expf(row[k] - mx); s += row[k]; }
        for (int k = 0; k < N; k++) row[k] = row[k] / s + hc_eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0)
            for (int j = 0; j < N; j++) {
                float s = 0.f;
                for (int k = 0; k < N; k++) s += comb[j * N + k];
                for (int k = 0; k < N; k++) comb[j * N + k] /= s + hc_eps;
            }
        for (int k = 0; k < N; k++) {
            float s = 0.f;
            for (int j = 0; j < N; j++) s += comb[j * N + k];
            for (int j = 0; j < N; j++) comb[j * N + k] /= s + hc_eps;
        }
    }
}

/* B rows of streams x [B, N, D] -> the sub-layer inputs u [B, D] and each row's pre [B, N], post
 * [B, N], comb [B, N, N] (M = (2 + N) N: a hyper-connection; M = N: a head, u only, post / comb may
 * be NULL). fn [M, N * D], base [M], scale [3] (a head: [1]). 0, or -1 on bad arguments. */
int qp_hyper_pre(int64_t B, int N, int64_t D, const float *x, const float *fn, int M, const float *base,
                 const float *scale, int iters, float hc_eps, float norm_eps, float *u, float *pre, float *post,
                 float *comb) {
    if (B <= 0 || N <= 0 || D <= 0 || (M != N && M != (2 + N) * N) || iters < 1 || N > 64) return -1;
    if (M != N && (!post || !comb)) return -1;
    const int64_t nd = (int64_t)N * D;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * nd;
        float mix[64 * 66];
        hc_mixes(xb, nd, fn, M, norm_eps, mix);
        float *pb = pre + b * N;
        hc_weights(mix, N, M, base, scale, iters, hc_eps, pb, post ? post + b * N : NULL,
                   comb ? comb + b * N * N : NULL);
        float *ub = u + b * D;
        for (int64_t d = 0; d < D; d++) {
            float s = pb[0] * xb[d];
            for (int k = 1; k < N; k++) s += pb[k] * xb[k * D + d];
            ub[d] = s;
        }
    }
    return 0;
}

/* the new streams out [B, N, D] = post_k f + sum_j comb[j, k] x_j of the sub-layer outputs f [B, D],
 * the streams x [B, N, D] and qp_hyper_pre's post / comb (out may not alias x). */
int qp_hyper_post(int64_t B, int N, int64_t D, const float *f, const float *x, const float *post,
                  const float *comb, float *out) {
    if (B <= 0 || N <= 0 || D <= 0) return -1;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * N * D, *fb = f + b * D, *pb = post + b * N, *cb = comb + b * N * N;
        float *ob = out + b * N * D;
        for (int k = 0; k < N; k++) {
            float *o = ob + k * D;
            for (int64_t d = 0; d < D; d++) {
                float s = cb[k] * xb[d];
                for (int j = 1; j < N; j++) s += cb[j * N + k] * xb[j * D + d];
                o[d] = pb[k] * fb[d] + s;
            }
        }
    }
    return 0;
}
