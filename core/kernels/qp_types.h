/* The structs and constants the Python side (native.py) passes to the kernels, in one place: its
 * ctypes Structures mirror these field by field, and tests/kernels/test_layout.py checks every
 * field's offset and size against this compiler's (qp_layout_table, layout.c). */
#ifndef QP_TYPES_H
#define QP_TYPES_H

#include <stdint.h>

/* ---- the facts shared with Python (forms.py: FORM_IDS; tests compare them with qp_form_info) -- */
enum {
    QP_F32 = 0, QP_F16 = 1, QP_Q4_0 = 2, QP_Q4_1 = 3, QP_Q5_0 = 6, QP_Q5_1 = 7, QP_Q8_0 = 8,
    QP_Q2_K = 10, QP_Q3_K = 11, QP_Q4_K = 12, QP_Q5_K = 13, QP_Q6_K = 14, QP_BF16 = 30, QP_MXFP4 = 39,
    QP_INT4 = 100, QP_INT8 = 101, QP_FP8 = 102, QP_FP4 = 103,
};
enum { QS_F32 = 0, QS_BF16 = 1, QS_F16 = 2, QS_E8M0 = 3, QS_E4M3 = 4 };
enum { QA_NONE = 0, QA_FP8 = 1, QA_FP8_STATIC = 2, QA_INT8_SYM = 3, QA_INT8_ASYM = 4, QA_INT8_STATIC = 5,
       QA_NVFP4 = 6, QA_NVFP4_INV = 7, QA_MXFP4 = 8 };
enum { QG_AFTER = 0, QG_TIMES = 1, QG_OVER = 2 };
enum { QE_FLOAT = 0, QE_STATIC = 1, QE_DYNAMIC = 2 };
enum { QR_NONE = 0, QR_BF16 = 1, QR_F16 = 2 };
/* the gated MLP's activation act(gate, up) (qp_mlp; compute.py: MLP_ACTS) */
enum { QM_SILU = 0, QM_SITU = 1 };
/* the kernels' own: QR_BF16 for weights known normal or zero (no subnormals, no NaN), where the
 * AVX512-BF16 conversion (round to nearest even; it flushes subnormal inputs) gives the same bits */
#define QR_BF16_NORMAL 3


typedef struct {
    int32_t kind;      /* QA_* */
    int32_t group;     /* QA_FP8 / QA_*FP4: inputs per group (0: the whole row) */
    int32_t ue8m0;     /* QA_FP8: scales rounded up to powers of two */
    int32_t epi;       /* QE_*: INT8 weights with int8 activations computed on integers */
    float scale, offset;   /* static activation scale / offset (NVFP4: the global input scale) */
    float floor;       /* QA_FP8: least group amax (e.g. 1e-4); 0: a zero scale becomes 1 */
    int32_t pad;
} qp_act;

typedef struct {
    int32_t type, sdt;             /* form id, scale encoding */
    int64_t n, k;                  /* rows (outputs), inputs */
    const uint8_t *w;              /* row r at w + r * ldw */
    int64_t ldw;
    const void *s;                 /* scale of (r, c): s[(r / gn) * lds + c / gk] */
    int64_t lds, gk, gn;
    const void *z;                 /* zero points (float32, or int8 when zi8), indexed as s; NULL: none */
    float gs;                      /* global scale, entering as gmode says (QG_AFTER with 1: none) */
    int32_t mode;                  /* 0 exact, 1 fast (Q4_0 / Q8_0) */
    int32_t nan;                   /* FP8: may hold NaN codes */
    int32_t big;                   /* FP8: some effective scale >= 2^119 (its fold by 256 would overflow) */
    int32_t gmode;                 /* QG_*: how gs combines with the scale */
    int32_t zi8;                   /* zero points are int8 */
    int32_t tiny;                  /* scaled forms: some weight may be subnormal (a scale below 2^-117);
                                      bfloat16 rows (a bfloat16 model): some value is subnormal */
    const int32_t *rowsum;         /* INT8 integer path: sum of each row's codes */
    const int32_t *bias;           /* QE_STATIC: integer bias per row */
    const float *os;               /* QE_STATIC: output scale per row */
    qp_act act;
} qp_mat;

/* one latent-attention layer (low-rank query, shared compressed key / value latent): dimensions and matrices */
typedef struct {
    int64_t H, q_lora, kv_lora, rope, nope, v, nh;  /* nh: the heads computed here */
    float eps_q, eps_kv, scale;
    const qp_mat *q_a;                 /* [q_lora, H]; NULL: no q_lora, q_b is q_proj [nh*(nope+rope), H] */
    const qp_mat *kv_a;                /* [kv_lora + rope, H] */
    const qp_mat *q_b;
    const void *q_a_norm, *kv_a_norm;  /* norm weights, f32 or bf16 (norm_bf16) */
    int32_t norm_bf16;
    int32_t kv_dense;                  /* 1: kv_b [nh*(nope+v), kv_lora] (kv_b); 0: per-head k_b / v_b */
    const qp_mat *kv_b;
    const qp_mat *const *k_b;          /* per head [kv_lora, nope] */
    const qp_mat *const *v_b;          /* per head [v, kv_lora] */
    const qp_mat *o;                   /* [H, nh * v] */
    const qp_mat *g;                   /* output gate [nh * v, H] or NULL */
} qp_latent_attn;

/* the router of a routed MoE (qp_router; quantplug.routing: SCORES, SELECTS): the scores of the
 * logits (router weight [E, H] times the normed row) */
enum { QRS_SIGMOID = 0, QRS_SOFTMAX = 1, QRS_SQRTSOFTPLUS = 2 };
/* how the top_k experts are chosen: greedily over all experts, or within the topk_group best of
 * n_group groups, a group scored by the sum of its two best (biased) scores or by its best */
enum { QRT_GREEDY = 0, QRT_GROUP_TOP2 = 1, QRT_GROUP_MAX = 2 };

/* a routed MoE's router as data: scores (QRS_*) of the logits, the choice (QRT_*) on the scores
 * plus bias (when given; for choosing only), or the experts of the token id (tid2eid: routing by
 * token, weights still the chosen experts' scores); the weights normalized to sum 1 (norm_topk),
 * then times scaling */
typedef struct {
    int32_t score, select;             /* QRS_*, QRT_* */
    int32_t top_k, n_group, topk_group, norm_topk;
    float scaling;
    int32_t pad;
    const float *weight;               /* [E, H] float32 */
    const float *bias;                 /* [E] float32 added for choosing only, or NULL */
    const int32_t *tid2eid;            /* [vocab, top_k] the experts of each token id, or NULL */
    int64_t vocab;
} qp_router;

/* one decoder layer of the stack step: its latent attention, norms, and a dense gated MLP or a
 * routed MoE (its router: route) */
typedef struct {
    const qp_latent_attn *attn;       /* the layer's latent attention */
    const void *attn_norm, *ffn_norm;  /* [H], f32 or bf16 (norm_bf16) */
    int32_t norm_bf16;
    float eps;
    int32_t E;                         /* routed experts; 0: a dense MLP (gate / up / down [0]) */
    int32_t pad;
    qp_router route;                   /* the router of a MoE (E > 0) */
    const qp_mat *const *gate;
    const qp_mat *const *up;
    const qp_mat *const *down;
    const qp_mat *sg, *su, *sd;        /* shared experts, or NULL */
} qp_layer;

/* a drafter of greedy speculative decoding (a next-token-prediction block): for a token t and a
 * hidden state h of the stack, x = proj(cat(norm_e(embedding of t), norm_h(h))) through one decoder
 * layer, then its final norm; the stack's head picks the draft from it */
typedef struct {
    const qp_layer *layer;             /* the block (its own latent cache) */
    const void *enorm, *hnorm, *fnorm; /* [H], f32 or bf16 (norm_bf16) */
    int32_t norm_bf16;
    float eps;
    const qp_mat *proj;                /* [H, 2H] */
} qp_draft;

#endif
