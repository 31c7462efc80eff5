/* ---- one decode token of KDA linear attention: gated delta rule, per-key-channel decay ----------
 * For B sequences at one position, per (sequence, head), all in float32 (docs/kernels.md):
 *   conv:   c = sum_{j<W} w[c, j] * x[t - W + 1 + j, c] over the W - 1 pre-conv inputs in conv_state
 *           (oldest first) and this token's u; conv_state then shifts by one (u appended); SiLU on
 *           q, k and v
 *   norms:  q, k / sqrt(sum x^2 + 1e-6) per head; q * K^-0.5
 *   gates:  beta = sigmoid(beta logit); per key channel i, p = gpre[i] + dt_bias[i], A = exp(A_log[h]):
 *           g = -A * softplus(p) (torch's threshold 20), or lb * sigmoid(A * p) with a lower bound lb
 *   state:  S [K, V] (rows = key channels) decays by exp(g) along rows, then
 *           S += beta * k (v - k^T S)^T, o = q^T S
 *   out:    RMSNorm of o over the head (weight shared by the heads, eps) times sigmoid(gate)
 * Every product is the torch twin's (quantplug.kernels.kda.kda_step_torch) in its order; only the
 * order of the sums differs. A bfloat16 state is read as float, updated in float and written back
 * rounded to nearest even; o is computed from the float update (as a fused recurrent kernel
 * holding the state in float32 registers does).
 *
 * The state is the step's cost (K3: 96 heads x 128 x 128 float32 = 6 MiB per layer and sequence),
 * so each head takes two passes over its rows: the first reads the decayed rows into k^T S (it must
 * be complete before any row is updated), the second updates each row and accumulates q^T S from
 * the updated row before writing it. A head's state (64 KiB in float32 at K = 128) stays in L2
 * between the two passes, so memory traffic is one read and one write of the state. */

#define KDA_MAX_K 512

static inline float kda_sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

/* torch.nn.functional.softplus(x) with beta 1, threshold 20 */
static inline float kda_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

/* bfloat16 bits <-> float */
static inline float kda_bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline uint16_t kda_f32_bf16(float f) { return (uint16_t)(f32_bits(round_bf16(f)) >> 16); }

/* ks[j] = sum_i k[i] * (S[i, j] * d[i]): k^T of the decayed rows (float32 state) */
static void kda_ks_f32(const float *restrict s, const float *restrict k, const float *restrict d,
                       float *restrict ks, int64_t K) {
    for (int64_t j = 0; j < K; j++) ks[j] = 0.f;
    for (int64_t i = 0; i < K; i++) {
        const float ki = k[i], di = d[i];
        const float *restrict r = s + i * K;
        for (int64_t j = 0; j < K; j++) ks[j] += ki * (r[j] * di);
    }
}

static void kda_ks_bf16(const uint16_t *restrict s, const float *restrict k, const float *restrict d,
                        float *restrict ks, int64_t K) {
    for (int64_t j = 0; j < K; j++) ks[j] = 0.f;
    for (int64_t i = 0; i < K; i++) {
        const float ki = k[i], di = d[i];
        const uint16_t *restrict r = s + i * K;
        for (int64_t j = 0; j < K; j++) ks[j] += ki * (kda_bf16_f32(r[j]) * di);
    }
}

/* S[i, :] = S[i, :] * d[i] + (beta k[i]) * delta; o += q[i] * S[i, :] (the updated float row) */
static void kda_update_f32(float *restrict s, const float *restrict q, const float *restrict k,
                           const float *restrict d, float beta, const float *restrict delta,
                           float *restrict o, int64_t K) {
    for (int64_t j = 0; j < K; j++) o[j] = 0.f;
    for (int64_t i = 0; i < K; i++) {
        const float di = d[i], bk = beta * k[i], qi = q[i];
        float *restrict r = s + i * K;
        for (int64_t j = 0; j < K; j++) {
            const float v = r[j] * di + bk * delta[j];
            r[j] = v;
            o[j] += qi * v;
        }
    }
}

static void kda_update_bf16(uint16_t *restrict s, const float *restrict q, const float *restrict k,
                            const float *restrict d, float beta, const float *restrict delta,
                            float *restrict o, int64_t K) {
    for (int64_t j = 0; j < K; j++) o[j] = 0.f;
    for (int64_t i = 0; i < K; i++) {
        const float di = d[i], bk = beta * k[i], qi = q[i];
        uint16_t *restrict r = s + i * K;
        int64_t j = bf16_row_decay_run(r, di, bk, delta, qi, o, K);  /* AVX2: the rounding the compiler leaves scalar */
        for (; j < K; j++) {
            const float v = kda_bf16_f32(r[j]) * di + bk * delta[j];
            r[j] = kda_f32_bf16(v);
            o[j] += qi * v;
        }
    }
}

/* x[i] = e^x[i] over n values: 16 / 8 lanes at a time where the build has them (a few ulp from
 * expf, as the twin's vectorised torch.exp may be), the rest by expf */
static void kda_exp(float *x, int64_t n) {
    int64_t i = exp_run(x, n);
    for (; i < n; i++) x[i] = expf(x[i]);
}

/* x[i] = x[i] / (1 + e^-x[i]) (SiLU) over n values; e: n floats of scratch */
static void kda_silu(float *x, float *e, int64_t n) {
    for (int64_t i = 0; i < n; i++) e[i] = -x[i];
    kda_exp(e, n);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] / (1.f + e[i]);
}

/* x[i] = 1 / (1 + e^-x[i]) (sigmoid) over n values */
static void kda_sigmoid_run(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = -x[i];
    kda_exp(x, n);
    for (int64_t i = 0; i < n; i++) x[i] = 1.f / (1.f + x[i]);
}

/* the short convolution of n channels (weights w [n, W], histories hist [n, W - 1], this token's x
 * [n]) into c [n], each history then shifted by one (x appended) */
static void kda_conv(const float *w, float *hist, const float *x, float *c, int64_t n, int64_t W) {
    for (int64_t i = 0; i < n; i++) {
        const float *wi = w + i * W;
        float *hi = hist + i * (W - 1);
        float acc = 0.f;
        for (int64_t j = 0; j < W - 1; j++) acc += wi[j] * hi[j];
        acc += wi[W - 1] * x[i];
        for (int64_t j = 0; j + 1 < W - 1; j++) hi[j] = hi[j + 1];
        if (W > 1) hi[W - 2] = x[i];
        c[i] = acc;
    }
}

/* x / sqrt(sum x^2 + 1e-6) over n values */
static inline void kda_l2norm(float *x, int64_t n) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] / r;
}

/* one (sequence b, head h) pair of qp_kda_step */
static void kda_head(int64_t b, int64_t h, int64_t H, int64_t K, int64_t W, const float *u, const float *conv_w,
                     float *conv_state, const float *gpre, const float *dt_bias, const float *a_log, int bounded,
                     float lower_bound, const float *beta_logits, const float *gate, const float *o_norm_w, float eps,
                     void *state, int state_bf16, float *out) {
    const int64_t D = H * K, C = 3 * D;
    /* q | k | v, then the decays d, the delta t (first k^T S), the output o, the gate's sigmoid sg */
    float qkv[3 * KDA_MAX_K], d[KDA_MAX_K], t[3 * KDA_MAX_K], o[KDA_MAX_K], sg[KDA_MAX_K];
    float *const q = qkv, *const k = qkv + K, *const v = qkv + 2 * K;
    for (int p = 0; p < 3; p++) {
        const int64_t c = p * D + h * K;
        kda_conv(conv_w + c * W, conv_state + (b * C + c) * (W - 1), u + b * C + c, qkv + p * K, K, W);
    }
    kda_silu(qkv, t, 3 * K);
    kda_l2norm(q, K);
    const float scale = (float)(1.0 / sqrt((double)K));  /* the twin's K ** -0.5 */
    for (int64_t i = 0; i < K; i++) q[i] = q[i] * scale;
    kda_l2norm(k, K);
    const float beta = kda_sigmoid(beta_logits[b * H + h]);
    const float A = expf(a_log[h]);
    const float *gp = gpre + b * D + h * K, *db = dt_bias + h * K;
    if (bounded) {  /* g = lb * sigmoid(A * p) */
        for (int64_t i = 0; i < K; i++) d[i] = A * (gp[i] + db[i]);
        kda_sigmoid_run(d, K);
        for (int64_t i = 0; i < K; i++) d[i] = lower_bound * d[i];
    } else {        /* g = -A * softplus(p) */
        for (int64_t i = 0; i < K; i++) d[i] = -A * kda_softplus(gp[i] + db[i]);
    }
    kda_exp(d, K);
    const int64_t off = (b * H + h) * K * K;
    if (state_bf16) kda_ks_bf16((const uint16_t *)state + off, k, d, t, K);
    else kda_ks_f32((const float *)state + off, k, d, t, K);
    for (int64_t j = 0; j < K; j++) t[j] = v[j] - t[j];
    if (state_bf16) kda_update_bf16((uint16_t *)state + off, q, k, d, beta, t, o, K);
    else kda_update_f32((float *)state + off, q, k, d, beta, t, o, K);
    float ss = 0.f;
    for (int64_t j = 0; j < K; j++) ss += o[j] * o[j];
    const float r = 1.f / sqrtf(ss / (float)K + eps);
    memcpy(sg, gate + b * D + h * K, sizeof(float) * (size_t)K);
    kda_sigmoid_run(sg, K);
    float *y = out + b * D + h * K;
    for (int64_t j = 0; j < K; j++) y[j] = o[j] * r * o_norm_w[j] * sg[j];
}

/* One KDA decode token for B sequences of H heads of width K (D = H K), every array float32 and
 * contiguous: u [B, 3D] (pre-conv q | k | v), conv_w [3D, W], conv_state [B, 3D, W - 1] (updated),
 * gpre [B, D] (dt_bias not added), dt_bias [D], a_log [H], bounded (0: the softplus gate; 1: the
 * lower-bounded sigmoid gate with lower_bound), beta_logits [B, H], gate [B, D] (before sigmoid),
 * o_norm_w [K], state [B, H, K, K] float32 or bfloat16 (state_bf16; updated), out [B, D].
 * Threads over the (sequence, head) pairs. -1: a bad size or a NULL array. */
int qp_kda_step(int64_t B, int64_t H, int64_t K, int64_t W, const float *u, const float *conv_w, float *conv_state,
                const float *gpre, const float *dt_bias, const float *a_log, int bounded, float lower_bound,
                const float *beta_logits, const float *gate, const float *o_norm_w, float eps, void *state,
                int state_bf16, float *out) {
    if (B <= 0 || H <= 0 || K <= 0 || K > KDA_MAX_K || W <= 0 || W > 64) return -1;
    if (!u || !conv_w || (W > 1 && !conv_state) || !gpre || !dt_bias || !a_log || !beta_logits || !gate
        || !o_norm_w || !state || !out) return -1;
    const int threads = max_threads();
    const int64_t pairs = B * H, bytes = pairs * K * K * (state_bf16 ? 2 : 4);
    #pragma omp parallel for schedule(static) if (threads > 1 && pairs > 1 && bytes >= 4 * MIN_TASK_BYTES)
    for (int64_t t = 0; t < pairs; t++)
        kda_head(t / H, t % H, H, K, W, u, conv_w, conv_state, gpre, dt_bias, a_log, bounded, lower_bound, beta_logits,
                 gate, o_norm_w, eps, state, state_bf16, out);
    return 0;
}
