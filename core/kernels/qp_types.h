/* The constants the Python side (native.py) passes to the kernels, and the structs (qp_abi.h,
 * generated from abi.py, whence native.py's ctypes Structures come too); native.py and
 * tests/kernels/test_layout.py check every field's offset and size against this compiler's
 * (qp_layout_table, layout.c). */
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
enum { QM_SILU = 0, QM_SITU = 1, QM_SILU_CLAMP = 2 };
/* the kernels' own: QR_BF16 for weights known normal or zero (no subnormals, no NaN), where the
 * AVX512-BF16 conversion (round to nearest even; it flushes subnormal inputs) gives the same bits */
#define QR_BF16_NORMAL 3


/* the structs (qp_act, qp_mat, qp_latent_attn, qp_pool, qp_pool_state, qp_window_attn, qp_router, qp_layer,
 * qp_window_state, qp_hyper_block, qp_draft) and the router's
 * enums (QRS_*, QRT_*): generated from their one declaration, core/kernels/abi.py */
#include "qp_abi.h"

#endif
