/* GENERATED from core/kernels/abi.py by `python -m quantplug.kernels.abi`: do not edit.
 * The structs the Python side passes to the kernels (native.py builds its ctypes Structures
 * from the same declaration; layout.c expands QP_ABI_LAYOUT into qp_layout_table). */
#ifndef QP_ABI_H
#define QP_ABI_H

#include <stdint.h>

/* a router's scores of its logits (qp_router.score; quantplug.contract.routing.SCORES) */
enum { QRS_SIGMOID = 0, QRS_SOFTMAX = 1, QRS_SQRTSOFTPLUS = 2 };

/* a router's choice of experts (qp_router.select; quantplug.contract.routing.SELECTS): greedily over all, or
 * within the topk_group best of n_group groups, a group scored by the sum of its two best (biased) scores or
 * by its best */
enum { QRT_GREEDY = 0, QRT_GROUP_TOP2 = 1, QRT_GROUP_MAX = 2 };

/* how a layer's activations are quantized before its product (qp_mat.act) */
typedef struct {
    int32_t kind;                           /* QA_* */
    int32_t group;                          /* QA_FP8 / QA_*FP4: inputs per group (0: the whole row) */
    int32_t ue8m0;                          /* QA_FP8: scales rounded up to powers of two */
    int32_t epi;                            /* QE_*: INT8 weights with int8 activations computed on integers */
    float scale;                            /* static activation scale (NVFP4: the global input scale) */
    float offset;                           /* static activation offset */
    float floor;                            /* QA_FP8: least group amax (e.g. 1e-4); 0: a zero scale becomes 1 */
    int32_t pad;
} qp_act;

/* one weight matrix of one form */
typedef struct {
    int32_t type;                           /* form id */
    int32_t sdt;                            /* scale encoding (QS_*) */
    int64_t n;                              /* rows (outputs) */
    int64_t k;                              /* inputs */
    const uint8_t *w;                       /* row r at w + r * ldw */
    int64_t ldw;
    const void *s;                          /* scale of (r, c): s[(r / gn) * lds + c / gk] */
    int64_t lds;
    int64_t gk;
    int64_t gn;
    const void *z;                          /* zero points (float32, or int8 when zi8), indexed as s; NULL: none */
    float gs;                               /* global scale, entering as gmode says (QG_AFTER with 1: none) */
    int32_t mode;                           /* 0 exact, 1 fast (Q4_0 / Q8_0) */
    int32_t nan;                            /* FP8: may hold NaN codes */
    int32_t big;                            /* FP8: some effective scale >= 2^119 (its fold by 256 would
                                               overflow) */
    int32_t gmode;                          /* QG_*: how gs combines with the scale */
    int32_t zi8;                            /* zero points are int8 */
    int32_t tiny;                           /* scaled forms: some weight may be subnormal (a scale below 2^-117);
                                               bfloat16 rows (a bfloat16 model): some value is subnormal */
    const int32_t *rowsum;                  /* INT8 integer path: sum of each row's codes */
    const int32_t *bias;                    /* QE_STATIC: integer bias per row */
    const float *os;                        /* QE_STATIC: output scale per row */
    qp_act act;                             /* the activations' quantization */
} qp_mat;

/* one latent-attention layer (low-rank query, shared compressed key / value latent): dimensions and matrices */
typedef struct {
    int64_t H;                              /* hidden width */
    int64_t q_lora;
    int64_t kv_lora;
    int64_t rope;
    int64_t nope;
    int64_t v;
    int64_t nh;                             /* the heads computed here */
    float eps_q;
    float eps_kv;
    float scale;
    const qp_mat *q_a;                      /* [q_lora, H]; NULL: no q_lora, q_b is q_proj [nh*(nope+rope), H] */
    const qp_mat *kv_a;                     /* [kv_lora + rope, H] */
    const qp_mat *q_b;
    const void *q_a_norm;                   /* norm weights, f32 or bf16 (norm_bf16) */
    const void *kv_a_norm;
    int32_t norm_bf16;
    int32_t kv_dense;                       /* 1: kv_b [nh*(nope+v), kv_lora] (kv_b); 0: per-head k_b / v_b */
    const qp_mat *kv_b;
    const qp_mat *const *k_b;               /* per head [kv_lora, nope] */
    const qp_mat *const *v_b;               /* per head [v, kv_lora] */
    const qp_mat *o;                        /* [H, nh * v] */
    const qp_mat *g;                        /* output gate [nh * v, H] or NULL */
} qp_latent_attn;

/* a pooled compressor of one attention's keys: each window of ratio tokens becomes one entry, per channel the
 * softmax over the window's tokens of (wgate x + ape[t mod ratio]) weighting (wkv x); overlap: wkv / wgate /
 * ape are 2 * dim wide and the previous window's first halves join the own window's second halves (2 * ratio
 * slots); then an RMSNorm and the rotation at the window's first position */
typedef struct {
    int64_t dim;                            /* entry width */
    int64_t ratio;                          /* tokens per window */
    int32_t overlap;
    float eps;                              /* the entry norm's */
    const qp_mat *wkv;                      /* [width, H], width = dim (2 * dim with overlap) */
    const qp_mat *wgate;                    /* [width, H] */
    const float *ape;                       /* [ratio, width] float32 */
    const float *norm;                      /* [dim] float32 */
} qp_pool;

/* one decode call's view of a pooled compressor's state (buffers the caller owns): the unfinished window's
 * rows with room for this token's, the previous window's first halves, the entries with room for the one this
 * token may complete */
typedef struct {
    float *kv;                              /* [B, pending + 1, width]: the pending rows, this token's written at
                                               row pending */
    float *gate;                            /* [B, pending + 1, width] (without ape) */
    int64_t pending;                        /* rows of the unfinished window before this token */
    int64_t n;                              /* entries before this token */
    float *ent;                             /* [B, n (+ 1 when this token completes a window), dim] */
    const float *prev_kv;                   /* overlap: [B, ratio, dim] the previous window's first halves, or
                                               NULL */
    const float *prev_gate;                 /* overlap: [B, ratio, dim] with ape, or NULL */
    float *prev_kv_out;                     /* overlap, when this token completes a window: its first halves [B,
                                               ratio, dim] */
    float *prev_gate_out;
    const float *cos;                       /* [rope / 2] the rotation at the completed window's first position */
    const float *sin;
} qp_pool_state;

/* sliding-window attention with a per-head sink over one shared key / value head: a low-rank query (weighted
 * RMSNorm between, an unweighted RMSNorm per head), the key normed, interleaved rotation of the trailing rope
 * dims, the window's keys plus the pooled compressor's entries (all of them, or the top-k of an indexer over
 * its own compressor's keys) in one softmax with the sink, the output rotated back, a grouped low-rank output
 * projection */
typedef struct {
    int64_t H;                              /* hidden width */
    int64_t nh;                             /* query heads */
    int64_t hd;                             /* head width (key = value) */
    int64_t rope;                           /* rotated trailing dims */
    int64_t q_lora;
    int64_t groups;                         /* output groups G */
    int64_t o_rank;                         /* rows of each group's output projection R */
    int64_t window;                         /* keys of the window, the query's own included */
    int64_t idx_heads;                      /* indexer heads (0: no indexer) */
    int64_t idx_dim;
    int64_t idx_topk;
    float eps;
    float scale;                            /* the attention's logit scale */
    const qp_mat *wq_a;                     /* [q_lora, H] */
    const float *q_norm;                    /* [q_lora] float32 */
    const qp_mat *wq_b;                     /* [nh * hd, q_lora] */
    const qp_mat *wkv;                      /* [hd, H] */
    const float *kv_norm;                   /* [hd] float32 */
    const qp_mat *wo_a;                     /* [G * R, nh * hd / G] */
    const qp_mat *wo_b;                     /* [H, G * R] */
    const float *sink;                      /* [nh] float32 */
    const qp_pool *comp;                    /* the compressor, or NULL */
    const qp_mat *idx_q;                    /* the indexer's query [idx_heads * idx_dim, q_lora], or NULL */
    const float *idx_w;                     /* the indexer's head weights [idx_heads, H] float32 */
    const qp_pool *idx_comp;                /* the indexer's compressor (idx_dim wide entries) */
} qp_window_attn;

/* a routed MoE's router as data: scores (QRS_*) of the logits, the choice (QRT_*) on the scores plus bias
 * (when given; for choosing only), or the experts of the token id (tid2eid: routing by token, weights still
 * the chosen experts' scores); the weights normalized to sum 1 (norm_topk), then times scaling */
typedef struct {
    int32_t score;                          /* QRS_* */
    int32_t select;                         /* QRT_* */
    int32_t top_k;
    int32_t n_group;                        /* QRT_GROUP_*: groups of experts */
    int32_t topk_group;                     /* QRT_GROUP_*: the groups chosen */
    int32_t norm_topk;
    float scaling;
    int32_t pad;
    const float *weight;                    /* [E, H] float32 */
    const float *bias;                      /* [E] float32 added for choosing only, or NULL */
    const int32_t *tid2eid;                 /* [vocab, top_k] the experts of each token id, or NULL */
    int64_t vocab;                          /* rows of tid2eid */
} qp_router;

/* one decoder layer of the stack step: its latent attention, norms, and a dense gated MLP or a routed MoE
 * (its router: route) */
typedef struct {
    const qp_latent_attn *attn;             /* the layer's latent attention */
    const void *attn_norm;                  /* [H], f32 or bf16 (norm_bf16) */
    const void *ffn_norm;                   /* [H], f32 or bf16 (norm_bf16) */
    int32_t norm_bf16;
    float eps;
    int32_t E;                              /* routed experts; 0: a dense MLP (gate / up / down [0]) */
    int32_t pad;
    qp_router route;                        /* the router of a MoE (E > 0) */
    const qp_mat *const *gate;
    const qp_mat *const *up;
    const qp_mat *const *down;
    const qp_mat *sg;                       /* shared experts, or NULL */
    const qp_mat *su;
    const qp_mat *sd;
    int32_t act;                            /* the gated MLPs' activation QM_* (0: SiLU) */
    float act_a;                            /* its parameters (QM_SITU: beta, linear beta; QM_SILU_CLAMP: the
                                               limit) */
    float act_b;
    int32_t pad2;
} qp_layer;

/* one decode call's view of a window-attention layer's cache (buffers the caller owns) */
typedef struct {
    float *win;                             /* [B, nwin, hd] the window's keys, this token's written at row nwin
                                               - 1 */
    int64_t nwin;
    const float *cos;                       /* [rope / 2] the rotation of the position */
    const float *sin;
    const qp_pool_state *comp;              /* the compressor's state, or NULL */
    const qp_pool_state *idx;               /* the indexer's compressor's state, or NULL */
} qp_window_state;

/* one decoder layer of N residual streams (hyper-connections): the streams mixed into the attention's input
 * (its norm before), its output mixed back; the same around the feed-forward part */
typedef struct {
    const qp_window_attn *attn;
    const qp_layer *ffn;                    /* the feed-forward part: a routed MoE or a dense gated MLP (its attn
                                               unused) */
    const float *attn_norm;                 /* [H] float32 */
    const float *ffn_norm;                  /* [H] float32 */
    float eps;                              /* the two norms' */
    int32_t hc;                             /* streams N */
    int32_t iters;                          /* Sinkhorn normalizations */
    float hc_eps;
    float hc_norm_eps;                      /* the mixes' RMS normalization */
    int32_t pad;
    const float *a_fn;                      /* around the attention: [(2 + N) N, N H] float32 */
    const float *a_base;                    /* [(2 + N) N] */
    const float *a_scale;                   /* [3] */
    const float *f_fn;                      /* around the feed-forward part */
    const float *f_base;
    const float *f_scale;
} qp_hyper_block;

/* a drafter of greedy speculative decoding (a next-token-prediction block): for a token t and a hidden state
 * h of the stack, x = proj(cat(norm_e(embedding of t), norm_h(h))) through one decoder layer, then its final
 * norm; the stack's head picks the draft from it */
typedef struct {
    const qp_layer *layer;                  /* the block (its own latent cache) */
    const void *enorm;                      /* [H], f32 or bf16 (norm_bf16) */
    const void *hnorm;
    const void *fnorm;
    int32_t norm_bf16;
    float eps;
    const qp_mat *proj;                     /* [H, 2H] */
} qp_draft;

/* every struct S(name) and field F(name, field), in declaration order */
#define QP_ABI_LAYOUT(S, F) \
    S(qp_act) \
    F(qp_act, kind) \
    F(qp_act, group) \
    F(qp_act, ue8m0) \
    F(qp_act, epi) \
    F(qp_act, scale) \
    F(qp_act, offset) \
    F(qp_act, floor) \
    F(qp_act, pad) \
    S(qp_mat) \
    F(qp_mat, type) \
    F(qp_mat, sdt) \
    F(qp_mat, n) \
    F(qp_mat, k) \
    F(qp_mat, w) \
    F(qp_mat, ldw) \
    F(qp_mat, s) \
    F(qp_mat, lds) \
    F(qp_mat, gk) \
    F(qp_mat, gn) \
    F(qp_mat, z) \
    F(qp_mat, gs) \
    F(qp_mat, mode) \
    F(qp_mat, nan) \
    F(qp_mat, big) \
    F(qp_mat, gmode) \
    F(qp_mat, zi8) \
    F(qp_mat, tiny) \
    F(qp_mat, rowsum) \
    F(qp_mat, bias) \
    F(qp_mat, os) \
    F(qp_mat, act) \
    S(qp_latent_attn) \
    F(qp_latent_attn, H) \
    F(qp_latent_attn, q_lora) \
    F(qp_latent_attn, kv_lora) \
    F(qp_latent_attn, rope) \
    F(qp_latent_attn, nope) \
    F(qp_latent_attn, v) \
    F(qp_latent_attn, nh) \
    F(qp_latent_attn, eps_q) \
    F(qp_latent_attn, eps_kv) \
    F(qp_latent_attn, scale) \
    F(qp_latent_attn, q_a) \
    F(qp_latent_attn, kv_a) \
    F(qp_latent_attn, q_b) \
    F(qp_latent_attn, q_a_norm) \
    F(qp_latent_attn, kv_a_norm) \
    F(qp_latent_attn, norm_bf16) \
    F(qp_latent_attn, kv_dense) \
    F(qp_latent_attn, kv_b) \
    F(qp_latent_attn, k_b) \
    F(qp_latent_attn, v_b) \
    F(qp_latent_attn, o) \
    F(qp_latent_attn, g) \
    S(qp_pool) \
    F(qp_pool, dim) \
    F(qp_pool, ratio) \
    F(qp_pool, overlap) \
    F(qp_pool, eps) \
    F(qp_pool, wkv) \
    F(qp_pool, wgate) \
    F(qp_pool, ape) \
    F(qp_pool, norm) \
    S(qp_pool_state) \
    F(qp_pool_state, kv) \
    F(qp_pool_state, gate) \
    F(qp_pool_state, pending) \
    F(qp_pool_state, n) \
    F(qp_pool_state, ent) \
    F(qp_pool_state, prev_kv) \
    F(qp_pool_state, prev_gate) \
    F(qp_pool_state, prev_kv_out) \
    F(qp_pool_state, prev_gate_out) \
    F(qp_pool_state, cos) \
    F(qp_pool_state, sin) \
    S(qp_window_attn) \
    F(qp_window_attn, H) \
    F(qp_window_attn, nh) \
    F(qp_window_attn, hd) \
    F(qp_window_attn, rope) \
    F(qp_window_attn, q_lora) \
    F(qp_window_attn, groups) \
    F(qp_window_attn, o_rank) \
    F(qp_window_attn, window) \
    F(qp_window_attn, idx_heads) \
    F(qp_window_attn, idx_dim) \
    F(qp_window_attn, idx_topk) \
    F(qp_window_attn, eps) \
    F(qp_window_attn, scale) \
    F(qp_window_attn, wq_a) \
    F(qp_window_attn, q_norm) \
    F(qp_window_attn, wq_b) \
    F(qp_window_attn, wkv) \
    F(qp_window_attn, kv_norm) \
    F(qp_window_attn, wo_a) \
    F(qp_window_attn, wo_b) \
    F(qp_window_attn, sink) \
    F(qp_window_attn, comp) \
    F(qp_window_attn, idx_q) \
    F(qp_window_attn, idx_w) \
    F(qp_window_attn, idx_comp) \
    S(qp_router) \
    F(qp_router, score) \
    F(qp_router, select) \
    F(qp_router, top_k) \
    F(qp_router, n_group) \
    F(qp_router, topk_group) \
    F(qp_router, norm_topk) \
    F(qp_router, scaling) \
    F(qp_router, pad) \
    F(qp_router, weight) \
    F(qp_router, bias) \
    F(qp_router, tid2eid) \
    F(qp_router, vocab) \
    S(qp_layer) \
    F(qp_layer, attn) \
    F(qp_layer, attn_norm) \
    F(qp_layer, ffn_norm) \
    F(qp_layer, norm_bf16) \
    F(qp_layer, eps) \
    F(qp_layer, E) \
    F(qp_layer, pad) \
    F(qp_layer, route) \
    F(qp_layer, gate) \
    F(qp_layer, up) \
    F(qp_layer, down) \
    F(qp_layer, sg) \
    F(qp_layer, su) \
    F(qp_layer, sd) \
    F(qp_layer, act) \
    F(qp_layer, act_a) \
    F(qp_layer, act_b) \
    F(qp_layer, pad2) \
    S(qp_window_state) \
    F(qp_window_state, win) \
    F(qp_window_state, nwin) \
    F(qp_window_state, cos) \
    F(qp_window_state, sin) \
    F(qp_window_state, comp) \
    F(qp_window_state, idx) \
    S(qp_hyper_block) \
    F(qp_hyper_block, attn) \
    F(qp_hyper_block, ffn) \
    F(qp_hyper_block, attn_norm) \
    F(qp_hyper_block, ffn_norm) \
    F(qp_hyper_block, eps) \
    F(qp_hyper_block, hc) \
    F(qp_hyper_block, iters) \
    F(qp_hyper_block, hc_eps) \
    F(qp_hyper_block, hc_norm_eps) \
    F(qp_hyper_block, pad) \
    F(qp_hyper_block, a_fn) \
    F(qp_hyper_block, a_base) \
    F(qp_hyper_block, a_scale) \
    F(qp_hyper_block, f_fn) \
    F(qp_hyper_block, f_base) \
    F(qp_hyper_block, f_scale) \
    S(qp_draft) \
    F(qp_draft, layer) \
    F(qp_draft, enorm) \
    F(qp_draft, hnorm) \
    F(qp_draft, fnorm) \
    F(qp_draft, norm_bf16) \
    F(qp_draft, eps) \
    F(qp_draft, proj)

#endif
