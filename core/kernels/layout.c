/* The layout of every struct the Python side passes (qp_types.h) as this compiler lays it out:
 * each field's offset and size, and each struct's size (field ""). native.py compares its ctypes
 * Structures with this table when it loads the library (a mismatch refuses the library), and
 * tests/kernels/test_layout.py checks both sides field by field. Self-contained: the test also
 * compiles it alone as a probe of qp_types.h. */
#include <stddef.h>
#include <stdint.h>
#include "qp_types.h"

typedef struct {
    const char *type, *field;   /* field "": the struct itself */
    int64_t offset, size;
} qp_layout_entry;

#define QP_STRUCT(T) {#T, "", 0, (int64_t)sizeof(T)}
#define QP_FIELD(T, F) {#T, #F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T *)0)->F)}

static const qp_layout_entry QP_LAYOUT[] = {
    QP_STRUCT(qp_act),
    QP_FIELD(qp_act, kind), QP_FIELD(qp_act, group), QP_FIELD(qp_act, ue8m0), QP_FIELD(qp_act, epi),
    QP_FIELD(qp_act, scale), QP_FIELD(qp_act, offset), QP_FIELD(qp_act, floor), QP_FIELD(qp_act, pad),

    QP_STRUCT(qp_mat),
    QP_FIELD(qp_mat, type), QP_FIELD(qp_mat, sdt), QP_FIELD(qp_mat, n), QP_FIELD(qp_mat, k),
    QP_FIELD(qp_mat, w), QP_FIELD(qp_mat, ldw), QP_FIELD(qp_mat, s), QP_FIELD(qp_mat, lds),
    QP_FIELD(qp_mat, gk), QP_FIELD(qp_mat, gn), QP_FIELD(qp_mat, z), QP_FIELD(qp_mat, gs),
    QP_FIELD(qp_mat, mode), QP_FIELD(qp_mat, nan), QP_FIELD(qp_mat, big), QP_FIELD(qp_mat, gmode),
    QP_FIELD(qp_mat, zi8), QP_FIELD(qp_mat, tiny), QP_FIELD(qp_mat, rowsum), QP_FIELD(qp_mat, bias),
    QP_FIELD(qp_mat, os), QP_FIELD(qp_mat, act),

    QP_STRUCT(qp_latent_attn),
    QP_FIELD(qp_latent_attn, H), QP_FIELD(qp_latent_attn, q_lora), QP_FIELD(qp_latent_attn, kv_lora),
    QP_FIELD(qp_latent_attn, rope), QP_FIELD(qp_latent_attn, nope), QP_FIELD(qp_latent_attn, v),
    QP_FIELD(qp_latent_attn, nh), QP_FIELD(qp_latent_attn, eps_q), QP_FIELD(qp_latent_attn, eps_kv),
    QP_FIELD(qp_latent_attn, scale), QP_FIELD(qp_latent_attn, q_a), QP_FIELD(qp_latent_attn, kv_a),
    QP_FIELD(qp_latent_attn, q_b), QP_FIELD(qp_latent_attn, q_a_norm), QP_FIELD(qp_latent_attn, kv_a_norm),
    QP_FIELD(qp_latent_attn, norm_bf16), QP_FIELD(qp_latent_attn, kv_dense), QP_FIELD(qp_latent_attn, kv_b),
    QP_FIELD(qp_latent_attn, k_b), QP_FIELD(qp_latent_attn, v_b), QP_FIELD(qp_latent_attn, o),
    QP_FIELD(qp_latent_attn, g),

    QP_STRUCT(qp_router),
    QP_FIELD(qp_router, score), QP_FIELD(qp_router, select), QP_FIELD(qp_router, top_k), QP_FIELD(qp_router, n_group),
    QP_FIELD(qp_router, topk_group), QP_FIELD(qp_router, norm_topk), QP_FIELD(qp_router, scaling),
    QP_FIELD(qp_router, pad), QP_FIELD(qp_router, weight), QP_FIELD(qp_router, bias), QP_FIELD(qp_router, tid2eid),
    QP_FIELD(qp_router, vocab),

    QP_STRUCT(qp_layer),
    QP_FIELD(qp_layer, attn), QP_FIELD(qp_layer, attn_norm), QP_FIELD(qp_layer, ffn_norm),
    QP_FIELD(qp_layer, norm_bf16), QP_FIELD(qp_layer, eps), QP_FIELD(qp_layer, E), QP_FIELD(qp_layer, pad),
    QP_FIELD(qp_layer, route), QP_FIELD(qp_layer, gate),
    QP_FIELD(qp_layer, up), QP_FIELD(qp_layer, down), QP_FIELD(qp_layer, sg), QP_FIELD(qp_layer, su),
    QP_FIELD(qp_layer, sd),

    QP_STRUCT(qp_draft),
    QP_FIELD(qp_draft, layer), QP_FIELD(qp_draft, enorm), QP_FIELD(qp_draft, hnorm), QP_FIELD(qp_draft, fnorm),
    QP_FIELD(qp_draft, norm_bf16), QP_FIELD(qp_draft, eps), QP_FIELD(qp_draft, proj),
};
#undef QP_STRUCT
#undef QP_FIELD

/* the table and its length (*n) */
const qp_layout_entry *qp_layout_table(int64_t *n) {
    *n = (int64_t)(sizeof QP_LAYOUT / sizeof QP_LAYOUT[0]);
    return QP_LAYOUT;
}
