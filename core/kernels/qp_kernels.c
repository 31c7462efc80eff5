/* quantplug's native kernels: matrix products on the weight forms of quantplug.kernels.forms, and
 * the few-token steps of the core model (gated MLP / routed experts, absorbed latent-attention decode,
 * a KDA linear-attention token).
 *
 * Built on first use by native.py (the system C compiler, -O3 -march=native -fopenmp
 * -ffp-contract=off, cached per hash of every source file, compiler and CPU); loaded with ctypes.
 * This file is the one translation unit: it includes the parts listed at its end (docs/kernels.md,
 * "Source layout"). Plain C11
 * with a C ABI, no Python or torch headers. OpenMP is the one torch already loaded
 * (libgomp.so.1), so these loops run on torch's threads and obey torch.set_num_threads.
 *
 * A weight is one qp_mat: a form id (ggml types keep gguf-py's GGMLQuantizationType numbers;
 * quantplug's own forms are >= 100), the packed rows, the scales and zero points, and how the
 * layer's activations are quantized before the product (qp_act). Every form has an exact mode:
 * each weight is decoded to the float32 value the form's torch reference gives (gguf-py for ggml
 * blocks; fp8 * scale; (q - zero) * scale; e2m1 * scale [* global]), rounded to the model dtype
 * when that is bfloat16 / float16 (as `dequantize(...).to(dtype)` does), and multiplied into
 * float32 sums. Only the order of the sums differs from a dequantize-then-matmul. The fast mode
 * exists for Q4_0 / Q8_0 (llama.cpp's CPU path: activations as int8 blocks, integer dots).
 *
 * Block layouts of the ggml types (ggml-org/llama.cpp ggml/src/ggml-common.h):
 *   Q4_0: 18 bytes = d (f16), qs[16]: x_j = d * ((qs[j] & 15) - 8), x_{j+16} = d * ((qs[j] >> 4) - 8)
 *   Q8_0: 34 bytes = d (f16), qs[32] int8: x_j = d * qs[j]
 *   Q4_1 / Q5_0 / Q5_1 / MXFP4 and the K-quants: as gguf-py dequantizes them (deq_* below).
 * quantplug forms (rows of k inputs):
 *   INT4: k/2 bytes, byte j = element 2j (low nibble) | element 2j+1 (high nibble), q = nibble - 8
 *         (compressed-tensors pack-quantized words read as bytes are exactly this)
 *   INT8: k int8 values q
 *   FP8:  k e4m3fn bytes, q = their value (NaN codes 0x7F / 0xFF decode to NaN)
 *   FP4:  k/2 bytes as INT4, q = E2M1 value of the nibble (sign bit 3)
 *   weight = (q - zero) * scale, zero and scale per (row block of gn rows, group of gk inputs):
 *   s[(r / gn) * lds + c / gk]; lds 0 = one scale for the whole matrix. A global scale gs enters
 *   as gmode says: QG_AFTER ((q - zero) * scale) * gs; QG_TIMES q * (scale * gs) (ModelOpt NVFP4:
 *   the block scale is f32(e4m3) * weight_scale_2, then times the value); QG_OVER q * (scale / gs)
 *   (compressed-tensors NVFP4: its weight_global_scale divides). Zero points are float32 or int8
 *   (zi8: integer zero points, exact either way).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QP_AVX512 1
#if defined(__AVX512VNNI__)
#define QP_VNNI512 1  /* 512-bit int8 dot products */
#endif
#endif

/* the IQ and ternary ggml types' block decoders (bit-exact with gguf-py), keyed by ggml type id */
#include "iq_blocks.h"

#define QK 32
#define QKK 256

/* One translation unit (the parts are static functions inlined across files, as when they were
 * one file); native.py hashes every file under core/kernels/ into the cache key. The order is the
 * order of dependence: */
#include "qp_types.h"               /* the constants and (qp_abi.h, from abi.py) the structs Python passes */
#include "arch/x86_f16c.h"          /* scalar half conversions */
#include "generic/scalar.c"         /* forms, scalar conversions, ggml block decoders */
#include "arch/x86_avx512.h"        /* vector primitives per instruction set */
#include "arch/x86_avx2.h"
#include "arch/dispatch.h"          /* the block steps' vector runs: the build's path or a portable fallback */
#include "generic/decode.c"         /* segment decoding, activations, prepared inputs, scale rows */
#include "arch/x86_avx2.c"          /* row kernels per instruction set */
#include "arch/x86_avx512.c"
#include "arch/dispatch_rows.h"     /* which row kernel a weight takes in this build */
#include "generic/rows.c"           /* the portable row kernels, the dispatch, the product entry points */
#include "blocks/gated_mlp.c"       /* block steps: gated MLP / routed experts */
#include "blocks/latent_attention.c" /* latent-attention decode step */
#include "blocks/router.c"          /* the MoE router as data (qp_router) */
#include "blocks/stack_step.c"      /* the whole-stack decode step, from token ids to logits */
#include "blocks/kda.c"             /* one decode token of KDA (gated delta rule) */
#include "blocks/hyper_mix.c"       /* hyper-connections: the streams' mix around a sub-layer */
#include "blocks/window_attention.c" /* sliding-window attention with sinks, pooled compressor, indexer */
#include "blocks/hyper_stack.c"     /* a stack of hyper-connection blocks, from token ids to logits */
#include "layout.c"                 /* qp_layout_table: the structs' offsets and sizes (tests, native.py) */

