/* quantplug's native kernels: matrix products on the weight forms of quantplug.kernels.forms, and
 * the few-token steps of the core model (gated MLP / routed experts, absorbed MLA decode).
 *
 * Built on first use by native.py (the system C compiler, -O3 -march=native -fopenmp
 * -ffp-contract=off, cached per source hash, compiler and CPU); loaded with ctypes. Plain C11
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
/* the kernels' own: QR_BF16 for weights known normal or zero (no subnormals, no NaN), where the
 * AVX512-BF16 conversion (round to nearest even; it flushes subnormal inputs) gives the same bits */
#define QR_BF16_NORMAL 3

/* elements and bytes of one block of a form (0: unknown form) */
int qp_form_info(int type, int64_t *elems, int64_t *bytes) {
    int64_t e, b;
    switch (type) {
        case QP_F32: e = 1; b = 4; break;
        case QP_F16: case QP_BF16: e = 1; b = 2; break;
        case QP_Q4_0: e = 32; b = 18; break;
        case QP_Q4_1: e = 32; b = 20; break;
        case QP_Q5_0: e = 32; b = 22; break;
        case QP_Q5_1: e = 32; b = 24; break;
        case QP_Q8_0: e = 32; b = 34; break;
        case QP_MXFP4: e = 32; b = 17; break;
        case QP_Q2_K: e = 256; b = 84; break;
        case QP_Q3_K: e = 256; b = 110; break;
        case QP_Q4_K: e = 256; b = 144; break;
        case QP_Q5_K: e = 256; b = 176; break;
        case QP_Q6_K: e = 256; b = 210; break;
        case QP_INT4: case QP_FP4: e = 2; b = 1; break;
        case QP_INT8: case QP_FP8: e = 1; b = 1; break;
        default:
            e = qp_iq_block_elems(type);
            b = qp_iq_block_bytes(type);
            if (e <= 0 || b <= 0) return 0;
    }
    if (elems) *elems = e;
    if (bytes) *bytes = b;
    return 1;
}

/* Which SIMD path this build took: 3 AVX512 (with VNNI), 4 AVX512 without VNNI, 2 AVX2, 0 portable C. */
int qp_isa(void) {
#ifdef QP_VNNI512
    return 3;
#elif defined(QP_AVX512)
    return 4;
#elif defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}

/* Whether any of the n bytes at p is an e4m3 NaN code (S.1111.111), at memory speed (binding an
 * FP8 expert read from disk asks once per weight): 1 yes, 0 no, -1 bad arguments. Any alignment.
 * Eight bytes a lane: (b & 0x7F) + 1 sets bit 7 exactly for 0x7F (at most 0x80: no carry into the
 * next byte); the lanes of a 4 KiB block are OR-ed without a branch (the compiler vectorizes it),
 * the block then tested; the last n % 8 bytes one by one. */
int qp_fp8_has_nan(const uint8_t *p, int64_t n) {
    if (n < 0 || (n > 0 && !p)) return -1;
    const uint64_t low = 0x7F7F7F7F7F7F7F7Full, one = 0x0101010101010101ull, top = 0x8080808080808080ull;
    int64_t i = 0;
#ifdef QP_AVX512
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    for (; i + 256 <= n; i += 256) {
        const __m512i a = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i)), m7f);
        const __m512i b = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i + 64)), m7f);
        const __m512i c = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i + 128)), m7f);
        const __m512i d = _mm512_and_si512(_mm512_loadu_si512((const void *)(p + i + 192)), m7f);
        /* the largest of (b & 0x7F) is 0x7F exactly when one byte is a NaN code */
        const __m512i mx = _mm512_max_epu8(_mm512_max_epu8(a, b), _mm512_max_epu8(c, d));
        if (_mm512_cmpeq_epi8_mask(mx, m7f)) return 1;
    }
#endif
    enum { LANES = 512 };  /* 4 KiB */
    for (; i + 8 * LANES <= n; i += 8 * LANES) {
        uint64_t acc = 0;
        for (int j = 0; j < LANES; j++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * j, 8);
            acc |= ((w & low) + one) & top;
        }
        if (acc) return 1;
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        if (((w & low) + one) & top) return 1;
    }
    for (; i < n; i++)
        if ((p[i] & 0x7F) == 0x7F) return 1;
    return 0;
}

typedef struct {
    int32_t kind;      /* QA_* */
    int32_t group;     /* QA_FP8 / QA_*FP4: inputs per group (0: the whole row) */
    int32_t ue8m0;     /* QA_FP8: scales rounded up to powers of two */
    int32_t epi;       /* QE_*: INT8 weights with int8 activations computed on integers */
    float scale, offset;   /* static activation scale / offset (NVFP4: the global input scale) */
    float floor;       /* QA_FP8: least group amax (DeepSeek 1e-4); 0: a zero scale becomes 1 */
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
    int32_t tiny;                  /* scaled forms: some weight may be subnormal (a scale below 2^-117) */
    const int32_t *rowsum;         /* INT8 integer path: sum of each row's codes */
    const int32_t *bias;           /* QE_STATIC: integer bias per row */
    const float *os;               /* QE_STATIC: output scale per row */
    qp_act act;
} qp_mat;

/* ---- scalar conversions ------------------------------------------------------------------- */

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal */
            exp = 113;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

static inline float bits_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static inline float e4m3_to_f32(uint8_t b) {
    if ((b & 0x7F) == 0x7F) return NAN;
    uint32_t sign = (uint32_t)(b & 0x80) << 24, e = (b >> 3) & 15, m = b & 7;
    float v = e ? bits_f32(((e + 120) << 23) | (m << 20)) : (float)m * 0x1p-9f;
    return sign ? -v : v;
}

static inline float e8m0_to_f32(uint8_t e) {
    if (e == 255) return NAN;
    return e ? bits_f32((uint32_t)e << 23) : 0x1p-127f;
}

static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

static inline float round_bf16(float f) {
    uint32_t b = f32_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return bits_f32(b | 0x00400000u);  /* NaN stays NaN */
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    return bits_f32(b);
}

static inline float round_f16(float f) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    /* portable: through the nearest representable half by scaling (finite values) */
    if (!isfinite(f)) return f;
    float a = fabsf(f);
    if (a >= 65520.f) return copysignf(INFINITY, f);
    if (a < 0x1p-14f) return copysignf(rintf(a * 0x1p24f) * 0x1p-24f, f);
    uint32_t b = f32_bits(f);
    b = (b + 0xfffu + ((b >> 13) & 1u)) & 0xffffe000u;
    return bits_f32(b);
#endif
}

static inline float scale_at(const qp_mat *m, int64_t idx) {
    switch (m->sdt) {
        case QS_F32: return ((const float *)m->s)[idx];
        case QS_BF16: return bits_f32((uint32_t)((const uint16_t *)m->s)[idx] << 16);
        case QS_F16: return f16_to_f32((const uint8_t *)m->s + 2 * idx);
        case QS_E8M0: return e8m0_to_f32(((const uint8_t *)m->s)[idx]);
        default: return e4m3_to_f32(((const uint8_t *)m->s)[idx]);
    }
}

/* the scale of group idx with the global scale folded in (QG_TIMES / QG_OVER: the vendor's block
 * scale, one float32 rounding as its torch code takes it) */
static inline float eff_scale_at(const qp_mat *m, int64_t idx) {
    const float s = scale_at(m, idx);
    return m->gmode == QG_TIMES ? s * m->gs : m->gmode == QG_OVER ? s / m->gs : s;
}

static inline float zero_at(const qp_mat *m, int64_t idx) {
    return m->zi8 ? (float)((const int8_t *)m->z)[idx] : ((const float *)m->z)[idx];
}

/* ---- ggml block dequantization (bit-exact with gguf-py: no fused multiply-add) ------------ */

static void deq_q4_0_block(const uint8_t *b, float *o) {
    float d = f16_to_f32(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((int)(qs[j] & 15) - 8);
        o[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

static void deq_q8_0_block(const uint8_t *b, float *o) {
    float d = f16_to_f32(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) o[j] = d * (float)qs[j];
}

/* Q4_1: d, m (f16), qs[16]: x = d * q + m (gguf-py: d * q + m, two roundings) */
static void deq_q4_1_block(const uint8_t *b, float *o) {
    float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)(qs[j] & 15) + m;
        o[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

/* Q5_0: d, qh (u32: bit j = 5th bit of x_j), qs[16]: x = d * (q - 16) */
static void deq_q5_0_block(const uint8_t *b, float *o) {
    float d = f16_to_f32(b);
    uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)(((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        o[j] = d * (float)(lo - 16);
        o[j + 16] = d * (float)(hi - 16);
    }
}

/* Q5_1: d, m, qh, qs[16]: x = d * q + m */
static void deq_q5_1_block(const uint8_t *b, float *o) {
    float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    uint32_t qh = (uint32_t)b[4] | ((uint32_t)b[5] << 8) | ((uint32_t)b[6] << 16) | ((uint32_t)b[7] << 24);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)(((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        o[j] = d * (float)lo + m;
        o[j + 16] = d * (float)hi + m;
    }
}

/* ggml MXFP4: e (e8m0), qs[16]: x_j = 2^(e-128) * kvalues[lo_j], x_{j+16} = ... [hi_j]
 * (ggml_e8m0_to_fp32_half; kvalues are twice the E2M1 values) */
static void deq_mxfp4_block(const uint8_t *b, float *o) {
    static const float kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    uint32_t e = b[0];
    float d = e < 2 ? bits_f32(0x00200000u << e) : bits_f32((e - 1) << 23);
    const uint8_t *qs = b + 1;
    for (int j = 0; j < 16; j++) {
        o[j] = kv[qs[j] & 15] * d;
        o[j + 16] = kv[qs[j] >> 4] * d;
    }
}

/* Q4_K / Q5_K: 8 six-bit scales and mins from 12 bytes (gguf-py's get_scale_min) */
static void scale_min_k4(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (uint8_t)((q[j + 8] & 15) | ((q[j] >> 2) & 0x30));
        mn[j + 4] = (uint8_t)((q[j + 8] >> 4) | ((q[j + 4] >> 2) & 0x30));
    }
}

/* Q4_K: d, dmin (f16), scales[12], qs[128]; sub-block s of 32: dl * q - ml with dl = d * sc[s],
 * ml = dmin * mn[s]; bytes 32j..32j+31 hold sub-blocks 2j (low nibbles) and 2j + 1 (high) */
static QP_IQ_UNUSED void deq_q4_k_sb(const uint8_t *b, float *o) {  /* the portable build's */
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 4; j++) {
        const float dl0 = d * (float)sc[2 * j], ml0 = dmin * (float)mn[2 * j];
        const float dl1 = d * (float)sc[2 * j + 1], ml1 = dmin * (float)mn[2 * j + 1];
        for (int l = 0; l < 32; l++) {
            o[64 * j + l] = dl0 * (float)(qs[32 * j + l] & 15) - ml0;
            o[64 * j + 32 + l] = dl1 * (float)(qs[32 * j + l] >> 4) - ml1;
        }
    }
}

/* Q5_K: d, dmin, scales[12], qh[32], qs[128]: as Q4_K with bit s of qh[l] as the 5th bit */
static QP_IQ_UNUSED void deq_q5_k_sb(const uint8_t *b, float *o) {  /* the portable build's */
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 4; j++) {
        const int s0 = 2 * j, s1 = 2 * j + 1;
        const float dl0 = d * (float)sc[s0], ml0 = dmin * (float)mn[s0];
        const float dl1 = d * (float)sc[s1], ml1 = dmin * (float)mn[s1];
        for (int l = 0; l < 32; l++) {
            int q0 = (qs[32 * j + l] & 15) | (((qh[l] >> s0) & 1) << 4);
            int q1 = (qs[32 * j + l] >> 4) | (((qh[l] >> s1) & 1) << 4);
            o[64 * j + l] = dl0 * (float)q0 - ml0;
            o[64 * j + 32 + l] = dl1 * (float)q1 - ml1;
        }
    }
}

/* Q6_K: ql[128], qh[64], scales int8[16], d: value 128h + t of half h: low 4 bits from
 * ql[64h + t % 64] (nibble t / 64), high 2 from qh[32h + t % 32] (bits 2 * (t / 32)), minus 32;
 * times d * scales[v / 16] (that product first, as gguf-py) */
static QP_IQ_UNUSED void deq_q6_k_sb(const uint8_t *b, float *o) {  /* the portable build's */
    const float d = f16_to_f32(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    float dl[16];
    for (int i = 0; i < 16; i++) dl[i] = d * (float)scales[i];
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const float *sc = dl + 8 * h;
        float *y = o + 128 * h;
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            y[l] = (float)((int)((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32) * sc[is];
            y[l + 32] = (float)((int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32) * sc[is + 2];
            y[l + 64] = (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * sc[is + 4];
            y[l + 96] = (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * sc[is + 6];
        }
    }
}

/* Q2_K: scales[16] (low 4 bits scale, high 4 min), qs[64], d, dmin: value v = 128h + 32k + l is
 * 2 bits of qs[32h + l] at shift 2k; sub-block v / 16: d * sc * q - dmin * m */
static void deq_q2_k_sb(const uint8_t *b, float *o) {
    const float d = f16_to_f32(b + 80), dmin = f16_to_f32(b + 82);
    float dl[16], ml[16];
    for (int i = 0; i < 16; i++) {
        dl[i] = d * (float)(b[i] & 15);
        ml[i] = dmin * (float)(b[i] >> 4);
    }
    const uint8_t *qs = b + 16;
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int half = 0; half < 2; half++) {
                const int s = 8 * h + 2 * k + half, sh = 2 * k;
                const float a = dl[s], m = ml[s];
                const uint8_t *q = qs + 32 * h + 16 * half;
                float *y = o + 16 * s;
                for (int l = 0; l < 16; l++) y[l] = a * (float)((q[l] >> sh) & 3) - m;
            }
}

/* Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales, offset 32), d: value v = 128h + 32k + l
 * is 2 bits of qs[32h + l] at shift 2k, minus 4 when bit v / 32 of hmask[l] is 0; times
 * d * (scale[v / 16] - 32) */
static void deq_q3_k_sb(const uint8_t *b, float *o) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = f16_to_f32(b + 108);
    float dl[16];
    for (int s = 0; s < 16; s++) {
        int lo = (sc[s % 8] >> (4 * (s / 8))) & 15, hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        dl[s] = d * (float)((int8_t)(uint8_t)(lo | (hi << 4)) - 32);
    }
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int half = 0; half < 2; half++) {
                const int s = 8 * h + 2 * k + half, sh = 2 * k, bit = 4 * h + k;
                const float a = dl[s];
                const uint8_t *q = qs + 32 * h + 16 * half, *m = hm + 16 * half;
                float *y = o + 16 * s;
                for (int l = 0; l < 16; l++)
                    y[l] = (float)(((q[l] >> sh) & 3) - (((m[l] >> bit) & 1) ? 0 : 4)) * a;
            }
}

#ifdef QP_AVX512
/* AVX512 versions of the K-quant decoders above, the same float32 operations in the same order
 * (so bit-equal): 16 values per vector, each vector within one sub-block of 16 or 32 */
static inline __m512 i8x16_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

/* a Q6_K super-block's 256 weights in 16 registers, v[k] = values [16k, 16k + 16) */
static inline __attribute__((always_inline)) void q6_k_regs(const uint8_t *b, __m512 v[16]) {
    const float d = f16_to_f32(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    const __m128i m4 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3), c32 = _mm_set1_epi8(32);
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        _Pragma("GCC unroll 2") for (int part = 0; part < 2; part++) {       /* l in [16 part, 16 part + 16) */
            const int l = 16 * part, is = l / 16;
            __m128i lq0 = _mm_loadu_si128((const __m128i *)(ql + l)), lq1 = _mm_loadu_si128((const __m128i *)(ql + l + 32));
            __m128i hq = _mm_loadu_si128((const __m128i *)(qh + l));
            __m128i q0 = _mm_or_si128(_mm_and_si128(lq0, m4), _mm_slli_epi16(_mm_and_si128(hq, m3), 4));
            __m128i q1 = _mm_or_si128(_mm_and_si128(lq1, m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hq, 2), m3), 4));
            __m128i q2 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lq0, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hq, 4), m3), 4));
            __m128i q3 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lq1, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hq, 6), m3), 4));
            /* the OR of a 4-bit and a shifted 2-bit field never carries across bytes */
            const float s0 = d * (float)scales[8 * h + is], s1 = d * (float)scales[8 * h + is + 2];
            const float s2 = d * (float)scales[8 * h + is + 4], s3 = d * (float)scales[8 * h + is + 6];
            const int k = (128 * h + l) / 16;
            v[k] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q0, c32)), _mm512_set1_ps(s0));
            v[k + 2] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q1, c32)), _mm512_set1_ps(s1));
            v[k + 4] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q2, c32)), _mm512_set1_ps(s2));
            v[k + 6] = _mm512_mul_ps(i8x16_ps(_mm_sub_epi8(q3, c32)), _mm512_set1_ps(s3));
        }
    }
}

/* Q4_K / Q5_K: sub-block s of 32 values, dl * q - ml (a product then a difference, two roundings) */
static inline __attribute__((always_inline)) void q45_k_regs(const uint8_t *b, int five, __m512 v[16]) {
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    const __m128i m4 = _mm_set1_epi8(15), one = _mm_set1_epi8(1);
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {          /* bytes 32j + 16 half .. + 16 */
            const int l = 16 * half;
            __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * j + l));
            __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
            if (five) {
                __m128i h = _mm_loadu_si128((const __m128i *)(qh + l));
                /* bit s0 = 2j of qh[l] is the 5th bit of the low nibble, bit s1 = 2j + 1 of the high */
                lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2 * j), one), 4));
                hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2 * j + 1), one), 4));
            }
            const int s0 = 2 * j, s1 = 2 * j + 1;
            const __m512 dl0 = _mm512_set1_ps(d * (float)sc[s0]), ml0 = _mm512_set1_ps(dmin * (float)mn[s0]);
            const __m512 dl1 = _mm512_set1_ps(d * (float)sc[s1]), ml1 = _mm512_set1_ps(dmin * (float)mn[s1]);
            v[4 * j + half] = _mm512_sub_ps(_mm512_mul_ps(dl0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))), ml0);
            v[4 * j + 2 + half] = _mm512_sub_ps(_mm512_mul_ps(dl1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))), ml1);
        }
}

/* a K-quant super-block (Q4_K / Q5_K / Q6_K) in 16 registers */
static inline __attribute__((always_inline)) void kq_regs(int type, const uint8_t *b, __m512 v[16]) {
    if (type == QP_Q6_K) q6_k_regs(b, v);
    else q45_k_regs(b, type == QP_Q5_K, v);
}

static void deq_k_sb512(int type, const uint8_t *b, float *o) {
    __m512 v[16];
    kq_regs(type, b, v);
    for (int k = 0; k < 16; k++) _mm512_storeu_ps(o + 16 * k, v[k]);
}
#endif

static int is_ggml_block(int t) {
    switch (t) {
        case QP_Q4_0: case QP_Q4_1: case QP_Q5_0: case QP_Q5_1: case QP_Q8_0: case QP_MXFP4:
        case QP_Q2_K: case QP_Q3_K: case QP_Q4_K: case QP_Q5_K: case QP_Q6_K: return 1;
        default: return qp_iq_block_elems(t) > 0;
    }
}

static void deq_block(int type, const uint8_t *b, float *o) {
    switch (type) {
        case QP_Q4_0: deq_q4_0_block(b, o); break;
        case QP_Q4_1: deq_q4_1_block(b, o); break;
        case QP_Q5_0: deq_q5_0_block(b, o); break;
        case QP_Q5_1: deq_q5_1_block(b, o); break;
        case QP_Q8_0: deq_q8_0_block(b, o); break;
        case QP_MXFP4: deq_mxfp4_block(b, o); break;
        case QP_Q2_K: deq_q2_k_sb(b, o); break;
        case QP_Q3_K: deq_q3_k_sb(b, o); break;
#ifdef QP_AVX512
        case QP_Q4_K: case QP_Q5_K: case QP_Q6_K: deq_k_sb512(type, b, o); break;
#else
        case QP_Q4_K: deq_q4_k_sb(b, o); break;
        case QP_Q5_K: deq_q5_k_sb(b, o); break;
        case QP_Q6_K: deq_q6_k_sb(b, o); break;
#endif
        default: qp_iq_deq_block(type, b, o); break;
    }
}

/* ---- one segment of a row, decoded exactly ------------------------------------------------ */

#ifdef QP_AVX512
static inline __m512 cvt_u8x16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
static inline __m512 fp8x16(const uint8_t *p, int nan) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i y = _mm256_cvtepi8_epi16(b);                        /* sign extended */
    y = _mm256_and_si256(_mm256_slli_epi16(y, 7), _mm256_set1_epi16((short)0xBFFF));
    __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(y), _mm512_set1_ps(256.f));  /* exact: a power of two */
    if (nan) {
        __mmask16 k = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        v = _mm512_mask_blend_ps(k, v, _mm512_set1_ps(NAN));
    }
    return v;
}
/* 16 e4m3 values divided by 256 (exact: a power of two), NaN codes NaN: the fused FP8 kernel
 * multiplies by the scale times 256, which rounds once to the same value as (value * scale) */
static inline __m512 fp8x16_div256(const uint8_t *p, int nan) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i y = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xBFFF));
    __m512 v = _mm512_cvtph_ps(y);
    if (nan) {
        __mmask16 k = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        v = _mm512_mask_blend_ps(k, v, _mm512_set1_ps(NAN));
    }
    return v;
}
/* the FP8 scale times 256: exact for the scales the fused kernel is given (m->big: no scale
 * >= 2^119, else the generic path runs) */
static inline float fp8_fold(float s) { return s * 256.f; }
static inline __m512 round_vec(__m512 v, int wround) {
#if defined(__AVX512BF16__)
    if (wround == QR_BF16_NORMAL)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#endif
    if (wround == QR_BF16 || wround == QR_BF16_NORMAL) {
        __m512i b = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32((int)0xffff0000u));
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), v);
    }
    if (wround == QR_F16)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}
#endif

#if defined(__AVX2__) && !defined(QP_AVX512)
/* round_bf16 on 8 lanes, bit for bit (NaN quieted as it quiets them) */
static inline __m256 round8_bf16(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                       _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)))),
                                       _mm256_set1_epi32((int)0xffff0000u));
    const __m256 quiet = _mm256_castsi256_ps(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), quiet, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* round8_bf16 for finite values (no NaN lane) */
static inline __m256 round8_bf16_finite(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                               _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)))),
                               _mm256_set1_epi32((int)0xffff0000u)));
}

/* Q4_0 / Q8_0 blocks [c0, c0 + len) of a row decoded 8 weights a register (deq_q4_0_block's /
 * deq_q8_0_block's float32 products) and, with bf, rounded there (round8_bf16): the AVX2 build's
 * generic kernel then makes one pass over its buffer, in a bfloat16 model as in a float32 one */
static inline __attribute__((always_inline)) void deq_seg_q_avx2_w(int type, const uint8_t *row, int64_t c0, int64_t len,
                                                                    float *o, const int bf) {
    const int size = type == QP_Q4_0 ? 18 : 34;
    for (int64_t i = 0; i < len; i += QK) {
        const uint8_t *blk = row + (c0 + i) / QK * size;
        const __m256 d = _mm256_set1_ps(f16_to_f32(blk));
        __m256i q[4];
        if (type == QP_Q4_0) {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2)), f = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(qs, f), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), f), eight = _mm_set1_epi8(8);
            const __m128i l8 = _mm_sub_epi8(lo, eight), h8 = _mm_sub_epi8(hi, eight);
            q[0] = _mm256_cvtepi8_epi32(l8); q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(l8, 8));
            q[2] = _mm256_cvtepi8_epi32(h8); q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(h8, 8));
        } else {
            const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 2)), b = _mm_loadu_si128((const __m128i *)(blk + 18));
            q[0] = _mm256_cvtepi8_epi32(a); q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8));
            q[2] = _mm256_cvtepi8_epi32(b); q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
        }
        const int finite = isfinite(_mm256_cvtss_f32(d));
        for (int k = 0; k < 4; k++) {
            __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q[k]));
            /* a finite scale times an integer below 2^8 is finite: no NaN lane to keep */
            if (bf) v = finite ? round8_bf16_finite(v) : round8_bf16(v);
            _mm256_storeu_ps(o + i + 8 * k, v);
        }
    }
}
static void deq_seg_q_avx2(int type, const uint8_t *row, int64_t c0, int64_t len, float *o, int bf) {
    if (bf) deq_seg_q_avx2_w(type, row, c0, len, o, 1);
    else deq_seg_q_avx2_w(type, row, c0, len, o, 0);
}
#endif

static inline void round_buf(float *o, int64_t len, int wround) {
    if (wround == QR_NONE) return;
    int64_t i = 0;
#ifdef QP_AVX512
    for (; i + 16 <= len; i += 16) _mm512_storeu_ps(o + i, round_vec(_mm512_loadu_ps(o + i), wround));
#elif defined(__AVX2__)
    if (wround == QR_BF16)
        for (; i + 8 <= len; i += 8) _mm256_storeu_ps(o + i, round8_bf16(_mm256_loadu_ps(o + i)));
#endif
    for (; i < len; i++) o[i] = wround == QR_BF16 ? round_bf16(o[i]) : round_f16(o[i]);
}

#ifdef QP_AVX512
/* 16 values of a scaled form at element i of a row, before the scale: one function per form, so
 * each decode loop below is specialized (no per-element branch) */
static inline __m512 raw16_int8(const uint8_t *row, int64_t i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
}
static inline __m512i nib16(const uint8_t *row, int64_t i) {  /* 16 nibbles from 8 bytes, element order */
    __m128i b = _mm_loadl_epi64((const __m128i *)(row + i / 2)), f = _mm_set1_epi8(15);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(b, f), _mm_and_si128(_mm_srli_epi16(b, 4), f)));
}
/* the 16 nibbles' indices as permutexvar reads them (only each index's low 4 bits count: no masks) */
static inline __m512i idx16(const uint8_t *row, int64_t i) {
    __m128i b = _mm_loadl_epi64((const __m128i *)(row + i / 2));
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));
}
static inline __m512 raw16_int4(const uint8_t *row, int64_t i) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(nib16(row, i), _mm512_set1_epi32(8)));
}
#endif

/* elements [c0, c0 + len) of row r of an INT4 / INT8 / FP8 / FP4 matrix (c0, len multiples of 32;
 * gk a multiple of 16 or >= k), exactly: ((q - z) * s) [* gs] as float32 ops, s the effective scale */
static void deq_seg_scaled(const qp_mat *m, int64_t r, int64_t c0, int64_t len, float *restrict o) {
    const uint8_t *restrict row = m->w + r * m->ldw;
    const int64_t srow = (r / m->gn) * m->lds, gk = m->gk;
    const int t = m->type, nan = m->nan;
    const void *zp = m->z;
    const float gs = m->gs;
    const int has_g = m->gmode == QG_AFTER && gs != 1.f;
    int64_t c = c0;
    while (c < c0 + len) {
        const int64_t j = c / gk, end0 = (j + 1) * gk, end = end0 < c0 + len ? end0 : c0 + len;
        const float s = eff_scale_at(m, srow + j), z = zp ? zero_at(m, srow + j) : 0.f;
        int64_t i = c;
#ifdef QP_AVX512
        const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z), vg = _mm512_set1_ps(gs);
        /* one loop per (form, zero point, global scale): the compiler keeps them branch-free */
#define QP_SCALED_LOOP(RAW)                                                                 \
        if (zp) { for (; i + 16 <= end; i += 16) {                                          \
            __m512 v = _mm512_mul_ps(_mm512_sub_ps(RAW, vz), vs);                           \
            _mm512_storeu_ps(o + (i - c0), has_g ? _mm512_mul_ps(v, vg) : v); } }           \
        else if (has_g) { for (; i + 16 <= end; i += 16)                                    \
            _mm512_storeu_ps(o + (i - c0), _mm512_mul_ps(_mm512_mul_ps(RAW, vs), vg)); }   \
        else { for (; i + 16 <= end; i += 16)                                               \
            _mm512_storeu_ps(o + (i - c0), _mm512_mul_ps(RAW, vs)); }
        switch (t) {
            case QP_INT8: QP_SCALED_LOOP(raw16_int8(row, i)) break;
            case QP_INT4: QP_SCALED_LOOP(raw16_int4(row, i)) break;
            case QP_FP8:
                if (nan) { QP_SCALED_LOOP(fp8x16(row + i, 1)) }
                else { QP_SCALED_LOOP(fp8x16(row + i, 0)) }
                break;
            default: {
                const __m512 lut = _mm512_loadu_ps(E2M1);
                QP_SCALED_LOOP(_mm512_permutexvar_ps(nib16(row, i), lut))
            }
        }
#undef QP_SCALED_LOOP
#endif
        for (; i < end; i++) {
            float q;
            if (t == QP_INT8) q = (float)(int8_t)row[i];
            else if (t == QP_FP8) q = e4m3_to_f32(row[i]);
            else {
                int nib = (row[i / 2] >> (4 * (i & 1))) & 15;
                q = t == QP_INT4 ? (float)(nib - 8) : E2M1[nib];
            }
            float v = zp ? (q - z) * s : q * s;
            o[i - c0] = has_g ? v * gs : v;
        }
        c = end;
    }
}

/* the ggml blocks of elements [c0, c0 + len) of a row, one block at a time */
static void deq_block_run(int type, const uint8_t *row, int64_t c0, int64_t len, float *o) {
    int64_t e, b;
    qp_form_info(type, &e, &b);
    for (int64_t i = 0; i < len; i += e) deq_block(type, row + (c0 + i) / e * b, o + i);
}

/* elements [c0, c0 + len) of row r, exactly, rounded to the model dtype (c0 / len multiples of the
 * form's block, 32 for the scaled forms) */
static void deq_seg(const qp_mat *m, int64_t r, int64_t c0, int64_t len, float *o, int wround) {
    const uint8_t *row = m->w + r * m->ldw;
    switch (m->type) {
        case QP_F32: memcpy(o, row + 4 * c0, (size_t)len * 4); return;   /* float weights are in the model dtype */
        case QP_BF16: {
            const uint16_t *p = (const uint16_t *)row + c0;
            for (int64_t i = 0; i < len; i++) o[i] = bits_f32((uint32_t)p[i] << 16);
            return;
        }
        case QP_F16:
            for (int64_t i = 0; i < len; i++) o[i] = f16_to_f32(row + 2 * (c0 + i));
            return;
        case QP_INT4: case QP_INT8: case QP_FP8: case QP_FP4:
            deq_seg_scaled(m, r, c0, len, o);
            break;
#if defined(__AVX2__) && !defined(QP_AVX512)
        case QP_Q4_0: case QP_Q8_0:
            if (wround == QR_NONE || wround == QR_BF16) { deq_seg_q_avx2(m->type, row, c0, len, o, wround == QR_BF16); return; }
            deq_block_run(m->type, row, c0, len, o);
            break;
#endif
        default: deq_block_run(m->type, row, c0, len, o);
    }
    round_buf(o, len, wround);
}

/* ---- activations -------------------------------------------------------------------------- */

/* float -> e4m3fn -> float, round to nearest even, for |v| <= 448 (callers clamp) */
static inline float e4m3_round(float v) {
    float a = fabsf(v), r;
    if (!(a == a)) return v;
    if (a < 0x1p-6f) r = rintf(a * 512.f) * (1.f / 512.f);
    else {
        uint32_t b = f32_bits(a);
        b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
        r = bits_f32(b);
    }
    return copysignf(r, v);
}

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : v > hi ? hi : v; }

/* What a row of activations becomes for one weight: the float row the product uses (act emulated:
 * fp8 or int8 quantized and dequantized), or for the integer path the int8 codes (+128, unsigned)
 * with the row's scale and offset. */
typedef struct {
    const float *x; int64_t ldx;        /* float rows */
    const uint8_t *u8; const float *xs, *xo;   /* integer path: codes + 128, scale, offset per row */
    const int8_t *q8; const float *d8;  /* fast mode: int8 blocks of 32 and their scales */
} qp_in;

/* DeepSeek / compressed-tensors fp8 activation quantization of one row in groups (group 0: the
 * whole row): s = max(amax, floor) / 448 (floor 0: s = amax / 448, 0 -> 1), x' = e4m3(x / s) * s */
static void act_fp8_row(const qp_act *a, const float *x, int64_t k, float *o) {
    int64_t g = a->group > 0 && a->group < k ? a->group : k;
    for (int64_t c0 = 0; c0 < k; c0 += g) {
        int64_t c1 = c0 + g < k ? c0 + g : k;
        float s;
        if (a->kind == QA_FP8_STATIC) s = a->scale;
        else {
            float amax = 0.f;
            int nan = 0;
            for (int64_t i = c0; i < c1; i++) {
                float v = fabsf(x[i]);
                if (v != v) nan = 1;
                else if (v > amax) amax = v;
            }
            if (nan) { for (int64_t i = c0; i < c1; i++) o[i] = NAN; continue; }
            if (a->floor > 0.f) {
                s = (amax > a->floor ? amax : a->floor) / 448.f;
                if (a->ue8m0) s = exp2f(ceilf(log2f(s)));
            } else {
                s = amax / 448.f;
                if (s == 0.f) s = 1.f;
            }
        }
        for (int64_t i = c0; i < c1; i++) o[i] = e4m3_round(clampf(x[i] / s, -448.f, 448.f)) * s;
    }
}

/* the E2M1 value nearest to v, ties to the even code, |v| > 6 and NaN -> 6, negative when v < 0
 * (the backends' e2m1_round: midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5, the ties at 0.75 / 1.75 / 3.5
 * going up to the even code; -0 and NaN give +) */
static inline float e2m1_rne(float v) {
    const float a = fabsf(v);
    /* the steps up the grid as a sum of comparisons, each step's bound open or closed as the ties
     * go (to even); sums of halves are exact in any order, and without branches the loops over a
     * row vectorize */
    float q = (a > 0.25f ? 0.5f : 0.f) + (a >= 0.75f ? 0.5f : 0.f) + (a > 1.25f ? 0.5f : 0.f) +
              (a >= 1.75f ? 0.5f : 0.f) + (a > 2.5f ? 1.f : 0.f) + (a >= 3.5f ? 1.f : 0.f) + (a > 5.f ? 2.f : 0.f);
    q = a == a ? q : 6.f;
    return v < 0.f ? -q : q;
}

/* FP4 activations of one row, per group of a->group inputs (0: the whole row), each group's scale
 * b from its amax (NaN when the group holds a NaN), x' = e2m1_rne(x / b) * b:
 *   QA_NVFP4 (ModelOpt / TensorRT-LLM; a->scale = input_scale, a multiplier):
 *     s = amax / (6 * input_scale), 0 -> 1, clamped to [2^-9, 448], b = e4m3(s) * input_scale;
 *   QA_NVFP4_INV (compressed-tensors; a->scale = input_global_scale, a divisor):
 *     s = e4m3(min(input_global_scale * (amax / 6), 448)), 0 -> 0.125, b = s / input_global_scale,
 *     x / b clamped to [-6, 6];
 *   QA_MXFP4 (compressed-tensors): p = amax with its float32 bits + 2^21 and the mantissa dropped
 *     (round_to_power_2), e = clamp(log2(p) + 125, 0, 255) (p = 0: 0, inf: 255), b = 2^(e - 127)
 *     (e = 0: 2^-127, 255: inf), x / b clamped to [-6, 6]. */
static void act_fp4_row(const qp_act *a, const float *x, int64_t k, float *o) {
    const int64_t g = a->group > 0 && a->group < k ? a->group : k;
    const float gs = a->scale;
    for (int64_t c0 = 0; c0 < k; c0 += g) {
        const int64_t c1 = c0 + g < k ? c0 + g : k;
        float amax = 0.f, b;
        int nan = 0;
        for (int64_t i = c0; i < c1; i++) {  /* branch-free: vectorizes */
            const float v = fabsf(x[i]);
            nan |= v != v;
            amax = v > amax ? v : amax;
        }
        if (nan) amax = NAN;
        if (a->kind == QA_NVFP4) {
            float s = amax / (6.f * gs);
            if (s == 0.f) s = 1.f;
            b = e4m3_round(clampf(s, 0x1p-9f, 448.f)) * gs;
        } else if (a->kind == QA_NVFP4_INV) {
            float s = gs * (amax / 6.f);
            s = e4m3_round(s > 448.f ? 448.f : s);
            if (s == 0.f) s = 0.125f;
            b = s / gs;
        } else {
            const uint32_t p = (f32_bits(amax) + (1u << 21)) & 0xFF800000u;
            const int32_t ef = (int32_t)((p >> 23) & 0xFF);
            int32_t e;
            if ((p & 0x7FFFFFFFu) == 0) e = 0;                 /* log2(+-0) = -inf */
            else if (p == 0x7F800000u) e = 255;              /* log2(inf) = inf */
            else e = ef - 2 < 0 ? 0 : ef - 2;                 /* 127 + (ef - 127) - 2 */
            b = e == 0 ? 0x1p-127f : bits_f32((uint32_t)e << 23);
        }
        const int clamp6 = a->kind != QA_NVFP4;
        for (int64_t i = c0; i < c1; i++) {
            float v = x[i] / b;
            if (clamp6) v = clampf(v, -6.f, 6.f);
            o[i] = e2m1_rne(v) * b;
        }
    }
}

static inline int is_fp4_act(int kind) { return kind >= QA_NVFP4 && kind <= QA_MXFP4; }
static inline int is_int8_act(int kind) { return kind >= QA_INT8_SYM && kind <= QA_INT8_STATIC; }

/* int8 quantization of one row: codes q (as float), scale s and offset o with x' = (q - o) * s.
 * QA_INT8_SYM: s = amax / 127 (0 -> 1), o = 0 (vLLM / Ascend dynamic per token); QA_INT8_ASYM
 * (msmodelslim): lo = min(min x, 0), hi = max(max x, 0), s = (hi - lo) / 255, o = round(-128 - lo / s);
 * QA_INT8_STATIC: the given s and o. q = clamp(round(x / s + o), -128, 127). */
static void act_int8_row(const qp_act *a, const float *x, int64_t k, float *q, float *s_out, float *o_out) {
    float s, o = 0.f;
    int nan = 0;
    if (a->kind == QA_INT8_STATIC) { s = a->scale; o = a->offset; }
    else if (a->kind == QA_INT8_SYM) {
        float amax = 0.f;
        for (int64_t i = 0; i < k; i++) { float v = fabsf(x[i]); if (v != v) nan = 1; else if (v > amax) amax = v; }
        s = amax / 127.f;
        if (s == 0.f) s = 1.f;
    } else {
        float lo = 0.f, hi = 0.f;
        for (int64_t i = 0; i < k; i++) {
            float v = x[i];
            if (v != v) nan = 1;
            else { if (v < lo) lo = v; if (v > hi) hi = v; }
        }
        s = (hi - lo) / 255.f;
        if (s == 0.f) s = 1.f;
        o = rintf(-128.f - lo / s);
    }
    if (nan) s = NAN;
    for (int64_t i = 0; i < k; i++) {
        float v = a->kind == QA_INT8_SYM ? x[i] / s : x[i] / s + o;
        q[i] = clampf(rintf(v), -128.f, 127.f);
    }
    *s_out = s;
    *o_out = o;
}

/* fast mode: one row of K floats -> int8 blocks q and their scales d (a block holding a NaN or an
 * infinity gets scale NaN, so every output it touches is NaN, as a float matmul would give) */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d) {
#ifdef QP_AVX512
    /* the same operations on 32 values at a time: max of |x| (exact), x * id rounded to nearest
     * even by the conversion (lrintf's rounding), narrowed (the codes fit int8) */
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)), inf = _mm512_set1_ps(INFINITY);
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const __m512 a0 = _mm512_and_ps(x0, absmask), a1 = _mm512_and_ps(x1, absmask);
        const int finite = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == 0xFFFF;
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        const float db = finite ? amax / 127.f : NAN, id = finite && db != 0.f ? 1.f / db : 0.f;
        const __m512 vid = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vid))));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vid))));
        d[b] = db;
    }
#else
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        int finite = 1;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(xb[j]);
            if (!isfinite(a)) finite = 0;
            else if (a > amax) amax = a;
        }
        float db = finite ? amax / 127.f : NAN, id = finite && db != 0.f ? 1.f / db : 0.f;
        for (int j = 0; j < QK; j++) q[b * QK + j] = (int8_t)lrintf(xb[j] * id);
        d[b] = db;
    }
#endif
}

static int is_int_path(const qp_mat *m) { return m->type == QP_INT8 && m->act.epi != QE_FLOAT; }
static int is_fast(const qp_mat *m) { return m->mode == 1 && (m->type == QP_Q4_0 || m->type == QP_Q8_0); }

/* Scratch for the inputs of one weight: everything qp_prepare may need for M rows of K. */
typedef struct { float *f; uint8_t *u8; float *xs, *xo; int8_t *q8; float *d8; } qp_scratch;

static int scratch_alloc(qp_scratch *sc, int64_t M, int64_t K) {
    sc->f = (float *)malloc(sizeof(float) * (size_t)(M * K));
    sc->u8 = (uint8_t *)malloc((size_t)(M * K + 64));
    sc->xs = (float *)malloc(sizeof(float) * (size_t)(2 * M));
    sc->q8 = (int8_t *)malloc((size_t)(M * K + 64));
    sc->d8 = (float *)malloc(sizeof(float) * (size_t)(M * (K / QK + 1)));
    sc->xo = sc->xs ? sc->xs + M : NULL;
    if (!sc->f || !sc->u8 || !sc->xs || !sc->q8 || !sc->d8) {
        free(sc->f); free(sc->u8); free(sc->xs); free(sc->q8); free(sc->d8);
        return 0;
    }
    return 1;
}

static void scratch_free(qp_scratch *sc) { free(sc->f); free(sc->u8); free(sc->xs); free(sc->q8); free(sc->d8); }

/* M rows of x (K values, ldx apart) as weight m's product wants them */
static void prepare(const qp_mat *m, int64_t M, int64_t K, const float *x, int64_t ldx, qp_scratch *sc, qp_in *in) {
    memset(in, 0, sizeof *in);
    const qp_act *a = &m->act;
    in->x = x; in->ldx = ldx;
    if (a->kind == QA_FP8 || a->kind == QA_FP8_STATIC) {
        for (int64_t i = 0; i < M; i++) act_fp8_row(a, x + i * ldx, K, sc->f + i * K);
        in->x = sc->f; in->ldx = K;
    } else if (is_fp4_act(a->kind)) {
        for (int64_t i = 0; i < M; i++) act_fp4_row(a, x + i * ldx, K, sc->f + i * K);
        in->x = sc->f; in->ldx = K;
    } else if (is_int8_act(a->kind)) {
        for (int64_t i = 0; i < M; i++) {
            float *q = sc->f + i * K;
            act_int8_row(a, x + i * ldx, K, q, sc->xs + i, sc->xo + i);
            if (is_int_path(m)) {
                for (int64_t c = 0; c < K; c++) sc->u8[i * K + c] = (uint8_t)((int)q[c] + 128);
            } else {  /* the float row (q - o) * s */
                const float s = sc->xs[i], o = sc->xo[i];
                for (int64_t c = 0; c < K; c++) q[c] = (q[c] - o) * s;
            }
        }
        in->x = sc->f; in->ldx = K;
        if (is_int_path(m)) { in->u8 = sc->u8; in->xs = sc->xs; in->xo = sc->xo; }
    }
    if (is_fast(m)) {
        for (int64_t i = 0; i < M; i++) quantize_row(in->x + i * in->ldx, K, sc->q8 + i * K, sc->d8 + i * (K / QK));
        in->q8 = sc->q8; in->d8 = sc->d8;
    }
}

static int same_input(const qp_mat *a, const qp_mat *b) {
    return memcmp(&a->act, &b->act, sizeof a->act) == 0 && is_fast(a) == is_fast(b) && is_int_path(a) == is_int_path(b);
}

/* ---- row kernels: y[i, r] for rows [r0, r1) of m against xm prepared input rows ------------ */

#define MT 4  /* x rows per pass over the weights */
#define RT 4  /* weight rows per pass over x */

/* a tile call with constant sizes for the full tiles (rt = RT, mt = 1..MT): the inlined tile then
 * keeps its rt x mt sums in registers (with runtime sizes GCC keeps them on the stack); an edge
 * tile with its runtime sizes */
#define QP_TILE(tile, m, in, r, i0, rt, mt, y, ldy)                              \
    do {                                                                          \
        if ((rt) == RT && (mt) == MT) tile(m, in, r, i0, RT, MT, y, ldy);         \
        else if ((rt) == RT && (mt) == 1) tile(m, in, r, i0, RT, 1, y, ldy);      \
        else if ((rt) == RT && (mt) == 2) tile(m, in, r, i0, RT, 2, y, ldy);      \
        else if ((rt) == RT && (mt) == 3) tile(m, in, r, i0, RT, 3, y, ldy);      \
        else tile(m, in, r, i0, rt, mt, y, ldy);                                  \
    } while (0)
#ifndef PF_AHEAD
#define PF_AHEAD 2048
#endif

#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {  /* 8 int32 lane sums of u8 x s8 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* one block of a Q4_0 / Q8_0 weight row as signed int8 codes (Q4_0: q - 8) */
static inline __m256i codes(int type, const uint8_t *blk) {
    if (type == QP_Q4_0) {
        __m128i qv = _mm_loadu_si128((const __m128i *)(blk + 2)), m = _mm_set1_epi8(15);
        __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qv, 4), m), _mm_and_si128(qv, m));
        return _mm256_sub_epi8(u, _mm256_set1_epi8(8));
    }
    return _mm256_loadu_si256((const __m256i *)(blk + 2));
}
#endif

#if defined(__AVX2__)
/* one fast tile: rt weight rows from r times mt x rows from i0 (called through QP_TILE) */
static inline __attribute__((always_inline)) void fast_tile(const qp_mat *m, const qp_in *in, int64_t r, int i0,
                                                           const int rt, const int mt, float *y, int64_t ldy) {
    const int type = m->type, size = type == QP_Q4_0 ? 18 : 34;
    const int64_t nb = m->k / QK;
    const int8_t *xq = in->q8;
    const float *xd = in->d8;
    __m256 acc[RT][MT];
    for (int a = 0; a < rt; a++) for (int i = 0; i < mt; i++) acc[a][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[RT], u[RT];
        float dw[RT];
        for (int a = 0; a < rt; a++) {
            const uint8_t *blk = m->w + (r + a) * m->ldw + b * size;
            _mm_prefetch((const char *)(blk + RT * m->ldw), _MM_HINT_T1);
            dw[a] = f16_to_f32(blk);
            v[a] = codes(type, blk);
            u[a] = _mm256_sign_epi8(v[a], v[a]);
        }
        for (int i = 0; i < mt; i++) {
            int64_t xi = (int64_t)(i0 + i);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + xi * m->k + b * QK));
            float xdb = xd[xi * nb + b];
            for (int a = 0; a < rt; a++) {
                __m256i d = dot_u8s8(u[a], _mm256_sign_epi8(xv, v[a]));
                acc[a][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(dw[a] * xdb), acc[a][i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int a = 0; a < rt; a++) y[(int64_t)(i0 + i) * ldy + r + a] = hsum256(acc[a][i]);
}
#endif

#ifdef QP_VNNI512
/* Two blocks per 512-bit register (VNNI: one vpdpbusd per 64 weights and x row, where the AVX2 tile
 * needs a sign and a dot per 32). Lanes 0-7 hold block b, lanes 8-15 block b + 1 (last: block b
 * alone, the upper half zero). vpdpbusd multiplies unsigned by signed bytes: the weights go in
 * unsigned, offset by o (Q4_0: the codes q = v + 8 as stored; Q8_0: v + 128, v ^ 0x80), x signed,
 * and sum v x = sum (v + o) x - o sum x: the second term per x row and lane (one vpdpbusd of o with
 * x, shared by the tile's weight rows) starts the sums, so every lane is the exact int32 dot. */
static inline __m512i pair_codes(int type, const uint8_t *blk, int size, int last) {
    if (type == QP_Q4_0) {  /* [q0 low nibbles, q0 high, q1 low, q1 high]: x's byte order */
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = last ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)(blk + size + 2));
        const __m256i q = _mm256_set_m128i(q1, q0);
        __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
        z = _mm512_and_si512(z, _mm512_set1_epi8(15));
        return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
    }
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m256i w1 = last ? _mm256_set1_epi8((char)0x80) : _mm256_loadu_si256((const __m256i *)(blk + size + 2));
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), _mm512_set1_epi8((char)0x80));
}

/* two float32 scales a, b (b = 0 for a last lone block) as lanes 0-7 = a, 8-15 = b */
static inline __m512 pair_scales(__m128 ab) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(ab));
}

/* one fast tile (512-bit VNNI): rt weight rows from r times mt x rows from i0 (through QP_TILE) */
static inline __attribute__((always_inline)) void fast_tile512(const qp_mat *m, const qp_in *in, int64_t r, int i0,
                                                              const int rt, const int mt, float *y, int64_t ldy) {
    const int type = m->type, size = type == QP_Q4_0 ? 18 : 34;
    const int64_t nb = m->k / QK;
    const int8_t *xq = in->q8;
    const float *xd = in->d8;
    const __m512i zero = _mm512_setzero_si512(), off = _mm512_set1_epi8(type == QP_Q4_0 ? 8 : (char)0x80);
    __m512 acc[RT][MT];
    for (int a = 0; a < rt; a++) for (int i = 0; i < mt; i++) acc[a][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int last = b + 1 == nb;
        __m512i w[RT];
        __m512 dw[RT];
        for (int a = 0; a < rt; a++) {
            const uint8_t *blk = m->w + (r + a) * m->ldw + b * size;
            _mm_prefetch((const char *)(blk + RT * m->ldw), _MM_HINT_T1);
            _mm_prefetch((const char *)(blk + RT * m->ldw + 64), _MM_HINT_T1);
            uint16_t h0, h1 = 0;
            memcpy(&h0, blk, 2);
            if (!last) memcpy(&h1, blk + size, 2);
            dw[a] = pair_scales(_mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)h0 | (uint32_t)h1 << 16))));
            w[a] = pair_codes(type, blk, size, last);
        }
        const __mmask64 km = last ? 0xFFFFFFFFull : ~0ull;
        for (int i = 0; i < mt; i++) {
            const int64_t xi = (int64_t)(i0 + i);
            const __m512i xv = _mm512_maskz_loadu_epi8(km, xq + xi * m->k + b * QK);
            const float *xdb = xd + xi * nb + b;
            const __m512 dx = pair_scales(_mm_setr_ps(xdb[0], last ? 0.f : xdb[1], 0.f, 0.f));
            const __m512i cx = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, off, xv));
            for (int a = 0; a < rt; a++) {
                const __m512i d = _mm512_dpbusd_epi32(cx, w[a], xv);
                acc[a][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw[a], dx), acc[a][i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int a = 0; a < rt; a++) y[(int64_t)(i0 + i) * ldy + r + a] = _mm512_reduce_add_ps(acc[a][i]);
}
#endif

/* fast Q4_0 / Q8_0: x as int8 blocks, integer block dots with the weight codes (the 512-bit VNNI
 * tile; AVX2: dot = sum |v| * sign(x, v); else portable C) */
static void fast_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    y -= r0;  /* y holds rows [r0, r1): y[i * ldy + r - r0] */
    for (int64_t r = r0; r < r1; r += RT) {
        int rt = r1 - r < RT ? (int)(r1 - r) : RT;
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
#ifdef QP_VNNI512
            QP_TILE(fast_tile512, m, in, r, i0, rt, mt, y, ldy);
#elif defined(__AVX2__)
            QP_TILE(fast_tile, m, in, r, i0, rt, mt, y, ldy);
#else
            const int type = m->type, size = type == QP_Q4_0 ? 18 : 34;
            const int64_t nb = m->k / QK;
            const int8_t *xq = in->q8;
            const float *xd = in->d8;
            for (int a = 0; a < rt; a++) {
                const uint8_t *wr = m->w + (r + a) * m->ldw;
                for (int i = 0; i < mt; i++) {
                    int64_t xi = (int64_t)(i0 + i);
                    float acc = 0.f;
                    for (int64_t b = 0; b < nb; b++) {
                        const uint8_t *blk = wr + b * size;
                        const int8_t *xb = xq + xi * m->k + b * QK;
                        int32_t dot = 0;
                        if (type == QP_Q4_0) {
                            for (int j = 0; j < 16; j++)
                                dot += ((int32_t)(blk[2 + j] & 15) - 8) * xb[j] + ((int32_t)(blk[2 + j] >> 4) - 8) * xb[j + 16];
                        } else {
                            for (int j = 0; j < 32; j++) dot += (int32_t)((const int8_t *)(blk + 2))[j] * xb[j];
                        }
                        acc += f16_to_f32(blk) * xd[xi * nb + b] * (float)dot;
                    }
                    y[xi * ldy + r + a] = acc;
                }
            }
#endif
        }
    }
}

#ifdef QP_AVX512
/* one Q4_0 / Q8_0 block's 32 exact weights (d * q, float32, no FMA) in two registers, rounded
 * to the model dtype by wr (QR_NONE, QR_BF16, QR_BF16_NORMAL: round_vec, the values round_buf
 * gives; wr a constant in every caller, so the rounding folds away in a float32 model) */
static inline __attribute__((always_inline)) void deq_block512(int type, const uint8_t *blk, __m512 *lo, __m512 *hi,
                                                               const int wr) {
    __m512 d = _mm512_set1_ps(f16_to_f32(blk));
    __m128i l, h;
    if (type == QP_Q4_0) {
        /* the block's 16 possible weights d * (q - 8) in one register (each the same float32
         * product as below), looked up by nibble: permutexvar reads an index's low 4 bits only,
         * so neither nibble needs masking; rounding the 16 table entries rounds every weight */
        __m512 tab = _mm512_mul_ps(d, _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f,
                                                     0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f));
        if (wr) tab = round_vec(tab, wr);
        __m128i qv = _mm_loadu_si128((const __m128i *)(blk + 2));
        *lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(qv), tab);
        *hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(qv, 4)), tab);
        return;
    } else {
        l = _mm_loadu_si128((const __m128i *)(blk + 2));
        h = _mm_loadu_si128((const __m128i *)(blk + 18));
    }
    *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l)));
    *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h)));
    if (wr) { *lo = round_vec(*lo, wr); *hi = round_vec(*hi, wr); }
}

/* 32 bfloat16 values widened in registers (a bfloat16 is the top half of its float32: exact) */
static inline void bf16x32(const uint16_t *p, __m512 *lo, __m512 *hi) {
    __m512i w = _mm512_loadu_si512((const void *)p);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
    *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
}

/* exact Q4_0 / Q8_0 with float32 weights, and bfloat16 rows (a float weight kept as stored, e.g. a
 * bfloat16 lm_head; already the model dtype's values, so callers take it for QR_NONE / QR_BF16):
 * 32-value blocks decoded in registers, RT rows x MT x rows, prefetching ahead */
/* one exact tile: rt weight rows from r times mt x rows from i0 (called through QP_TILE), the
 * Q4_0 / Q8_0 weights rounded by wr (a constant: one instance per rounding, below) */
static inline __attribute__((always_inline)) void exact_tile_32w(const qp_mat *m, const qp_in *in, int64_t r, int i0,
                                                                const int rt, const int mt, float *y, int64_t ldy,
                                                                const int wr) {
    const int type = m->type, size = type == QP_Q4_0 ? 18 : type == QP_Q8_0 ? 34 : 64;
    const int64_t nb = m->k / QK;
    __m512 acc[RT][MT];
    for (int a = 0; a < rt; a++) for (int i = 0; i < mt; i++) acc[a][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo[RT], hi[RT];
        for (int a = 0; a < rt; a++) {
            const uint8_t *blk = m->w + (r + a) * m->ldw + b * size;
            _mm_prefetch((const char *)(blk + RT * m->ldw), _MM_HINT_T1);
            if (type == QP_BF16) bf16x32((const uint16_t *)blk, &lo[a], &hi[a]);
            else deq_block512(type, blk, &lo[a], &hi[a], wr);
        }
        for (int i = 0; i < mt; i++) {
            const float *xb = in->x + (int64_t)(i0 + i) * in->ldx + b * QK;
            __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            for (int a = 0; a < rt; a++)
                acc[a][i] = _mm512_fmadd_ps(hi[a], x1, _mm512_fmadd_ps(lo[a], x0, acc[a][i]));
        }
    }
    for (int i = 0; i < mt; i++)
        for (int a = 0; a < rt; a++) y[(int64_t)(i0 + i) * ldy + r + a] = _mm512_reduce_add_ps(acc[a][i]);
}

/* exact Q4_0 / Q8_0 with float32 weights, and bfloat16 rows (a float weight kept as stored, e.g. a
 * bfloat16 lm_head; already the model dtype's values, so callers take it for QR_NONE / QR_BF16):
 * 32-value blocks decoded in registers, RT rows x MT x rows, prefetching ahead */
#define QP_EXACT_TILE(NAME, WR)                                                                     \
static inline __attribute__((always_inline)) void NAME(const qp_mat *m, const qp_in *in, int64_t r, int i0, \
                                                       const int rt, const int mt, float *y, int64_t ldy) { \
    exact_tile_32w(m, in, r, i0, rt, mt, y, ldy, WR);                                               \
}
QP_EXACT_TILE(exact_tile_32, QR_NONE)
QP_EXACT_TILE(exact_tile_32_bf16, QR_BF16)
QP_EXACT_TILE(exact_tile_32_bf16n, QR_BF16_NORMAL)
#undef QP_EXACT_TILE

/* wround: how the Q4_0 / Q8_0 weights are rounded (QR_NONE / QR_BF16 / QR_BF16_NORMAL; bfloat16
 * rows take QR_NONE: their values are already bfloat16) */
static void exact_rows_32(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy,
                          int wround) {
    y -= r0;
    for (int64_t r = r0; r < r1; r += RT) {
        int rt = r1 - r < RT ? (int)(r1 - r) : RT;
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
            if (wround == QR_BF16_NORMAL) QP_TILE(exact_tile_32_bf16n, m, in, r, i0, rt, mt, y, ldy);
            else if (wround == QR_BF16) QP_TILE(exact_tile_32_bf16, m, in, r, i0, rt, mt, y, ldy);
            else QP_TILE(exact_tile_32, m, in, r, i0, rt, mt, y, ldy);
        }
    }
}

#endif

#ifdef QP_AVX512
/* 16 decoded weights v at element off of the super-block starting at c0, into every x row's sums */
static inline void kq_fma(__m512 acc[MT][2], int mt, const float *x, int64_t ldx, int64_t at, int half, __m512 v) {
    for (int i = 0; i < mt; i++) acc[i][half] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + (int64_t)i * ldx + at), acc[i][half]);
}

/* exact Q4_K / Q5_K / Q6_K rows: each super-block decoded in registers with deq_q45_k_sb512's /
 * deq_q6_k_sb512's float32 operations (the same weights, bit for bit), rounded to the model dtype
 * by wr (a constant: one instance per rounding, below), and multiplied into the sums at once,
 * instead of through a buffer; the row RT rows ahead prefetched into L2 */
static inline __attribute__((always_inline)) void kq_rows_w(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1,
                                                           int xm, float *y, int64_t ldy, const int wr) {
    y -= r0;
    const int type = m->type;
    const int64_t nsb = m->k / QKK, bsize = type == QP_Q4_K ? 144 : type == QP_Q5_K ? 176 : 210, ldx = in->ldx;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = m->w + r * m->ldw;
        for (int i0 = 0; i0 < xm; i0 += MT) {
            const int mt = xm - i0 < MT ? xm - i0 : MT;
            const float *xr = in->x + (int64_t)i0 * ldx;
            __m512 acc[MT][2];
            for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *b = row + sb * bsize;
                if (i0 == 0) for (int64_t o = 0; o < bsize; o += 64) _mm_prefetch((const char *)(b + RT * m->ldw + o), _MM_HINT_T1);
                __m512 v[16];
                kq_regs(type, b, v);
                if (wr) for (int k = 0; k < 16; k++) v[k] = round_vec(v[k], wr);
                _Pragma("GCC unroll 16") for (int k = 0; k < 16; k++) kq_fma(acc, mt, xr, ldx, sb * QKK + 16 * k, k & 1, v[k]);
            }
            for (int i = 0; i < mt; i++) y[(int64_t)(i0 + i) * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
        }
    }
}
static void kq_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    kq_rows_w(m, in, r0, r1, xm, y, ldy, QR_NONE);
}
#if defined(__AVX512BF16__)
static void kq_rows_bf16n(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    kq_rows_w(m, in, r0, r1, xm, y, ldy, QR_BF16_NORMAL);
}
#else
static void kq_rows_bf16(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    kq_rows_w(m, in, r0, r1, xm, y, ldy, QR_BF16);
}
#endif
#endif

/* the segment the generic kernel decodes at a time: whole blocks, at most 256 values */
static int64_t seg_len(const qp_mat *m) {
    int64_t e = 1;
    qp_form_info(m->type, &e, NULL);
    if (e >= QKK) return e;
    if (e == QK) return m->k % QKK == 0 ? QKK : QK;
    return m->k % QKK == 0 ? QKK : m->k % 64 == 0 ? 64 : QK;
}

/* exact, any form: each row's segments decoded into a buffer, multiplied into float32 sums */
static void generic_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy, int wround) {
    y -= r0;
    const int64_t K = m->k, seg = seg_len(m);
    float buf[QKK] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
#ifdef QP_AVX512
            __m512 acc[MT][2];
            for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int64_t c0 = 0; c0 < K; c0 += seg) {
                deq_seg(m, r, c0, seg, buf, wround);
                for (int i = 0; i < mt; i++) {
                    const float *xr = in->x + (int64_t)(i0 + i) * in->ldx + c0;
                    for (int64_t j = 0; j < seg; j += 32) {
                        acc[i][0] = _mm512_fmadd_ps(_mm512_load_ps(buf + j), _mm512_loadu_ps(xr + j), acc[i][0]);
                        acc[i][1] = _mm512_fmadd_ps(_mm512_load_ps(buf + j + 16), _mm512_loadu_ps(xr + j + 16), acc[i][1]);
                    }
                }
            }
            for (int i = 0; i < mt; i++) y[(int64_t)(i0 + i) * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
#else
            float acc[MT][8];
            memset(acc, 0, sizeof acc);
            for (int64_t c0 = 0; c0 < K; c0 += seg) {
                deq_seg(m, r, c0, seg, buf, wround);
                for (int i = 0; i < mt; i++) {
                    const float *xr = in->x + (int64_t)(i0 + i) * in->ldx + c0;
                    for (int64_t j = 0; j < seg; j++) acc[i][j & 7] += buf[j] * xr[j];
                }
            }
            for (int i = 0; i < mt; i++) {
                float s = 0.f;
                for (int j = 0; j < 8; j++) s += acc[i][j];
                y[(int64_t)(i0 + i) * ldy + r] = s;
            }
#endif
        }
    }
}

/* INT8 weights x int8 activations on integers (ModelSlim W8A8 / W8A8_DYNAMIC per channel):
 * dot = sum (q + 128) * w - 128 * rowsum (exact int32); QE_STATIC: (dot + bias) * os[r];
 * QE_DYNAMIC: ((dot - o * rowsum) * xs) * s[r] */
static void int_rows(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) {
    y -= r0;
    const int64_t K = m->k;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = (const int8_t *)(m->w + r * m->ldw);
        const int32_t rs = m->rowsum[r];
        const float sr = scale_at(m, (r / m->gn) * m->lds);
        for (int i = 0; i < xm; i++) {
            const uint8_t *u = in->u8 + (int64_t)i * K;
            int64_t c = 0;
            int32_t dot = 0;
#ifdef QP_VNNI512
            __m512i acc = _mm512_setzero_si512();
            for (; c + 64 <= K; c += 64)
                acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512((const void *)(u + c)), _mm512_loadu_si512((const void *)(wr + c)));
            dot = _mm512_reduce_add_epi32(acc);
#endif
            for (; c < K; c++) dot += (int32_t)u[c] * (int32_t)wr[c];
            dot -= 128 * rs;
            float v;
            if (m->act.epi == QE_STATIC) v = (float)(dot + m->bias[r]) * m->os[r];
            else v = ((float)(dot - (int32_t)in->xo[i] * rs) * in->xs[i]) * sr;
            y[(int64_t)i * ldy + r] = v;
        }
    }
}

/* the most scale groups per row the fused kernels take (their scales decoded into a stack buffer
 * once per row; 65536 inputs in groups of 16) */
#define QP_NG_MAX 4096

/* groups [0, ng) of row r: effective scales (global scale folded as gmode says, FP8's 256 folded
 * in) and zero points as float32, one loop per encoding: the per-group decoding leaves the product
 * loop (the same float32 values as eff_scale_at / zero_at) */
static QP_IQ_UNUSED void row_scales(const qp_mat *m, int64_t r, int64_t ng, float *restrict sv, float *restrict zv) {
    const int64_t srow = (r / m->gn) * m->lds;
    const uint8_t *s8 = (const uint8_t *)m->s + srow;
    switch (m->sdt) {
        case QS_F32: memcpy(sv, (const float *)m->s + srow, sizeof(float) * (size_t)ng); break;
        case QS_BF16: {
            const uint16_t *p = (const uint16_t *)m->s + srow;
            for (int64_t j = 0; j < ng; j++) sv[j] = bits_f32((uint32_t)p[j] << 16);
            break;
        }
        case QS_F16: for (int64_t j = 0; j < ng; j++) sv[j] = f16_to_f32((const uint8_t *)m->s + 2 * (srow + j)); break;
        case QS_E8M0: for (int64_t j = 0; j < ng; j++) sv[j] = e8m0_to_f32(s8[j]); break;
        default: {
            int64_t j = 0;
#ifdef QP_AVX512
            for (; j + 16 <= ng; j += 16) _mm512_storeu_ps(sv + j, fp8x16(s8 + j, 1));  /* exact, NaN codes NaN */
#endif
            for (; j < ng; j++) sv[j] = e4m3_to_f32(s8[j]);
        }
    }
    const float gs = m->gs;
    if (m->gmode == QG_TIMES) for (int64_t j = 0; j < ng; j++) sv[j] = sv[j] * gs;
    else if (m->gmode == QG_OVER) for (int64_t j = 0; j < ng; j++) sv[j] = sv[j] / gs;
#ifdef QP_AVX512
    if (m->type == QP_FP8) for (int64_t j = 0; j < ng; j++) sv[j] = fp8_fold(sv[j]);
#endif
    if (m->z) {
        if (m->zi8) { const int8_t *z = (const int8_t *)m->z + srow; for (int64_t j = 0; j < ng; j++) zv[j] = (float)z[j]; }
        else memcpy(zv, (const float *)m->z + srow, sizeof(float) * (size_t)ng);
    }
}

#ifdef QP_AVX512
/* The scaled forms (INT4 / INT8 / FP8 / FP4) fused: each 16 weights decoded in a register, scaled
 * (and rounded to the model dtype) exactly as deq_seg_scaled does, and multiplied into float32
 * sums; the weights never go through memory. One function per form (no per-element branch), 32
 * weights per step with two accumulators per x row; groups of 16 (NVFP4) two groups a step (K is
 * a multiple of 32: mat_ok), other groups not a multiple of 32 (48, ...) 16 weights a step. The
 * row's scales and zero points are decoded once per row (row_scales), at most QP_NG_MAX groups:
 * wider rows take the generic path. */
#define QP_SCALE16(RAW, V)                                                                          \
    {                                                                                               \
        V = RAW;                                                                                    \
        if (zp) V = _mm512_sub_ps(V, vz);                                                           \
        V = _mm512_mul_ps(V, vs);                                                                   \
        if (has_g) V = _mm512_mul_ps(V, vg);                                                        \
        if (wround) V = round_vec(V, wround);                                                       \
    }
/* rows [r0, r1) (a multiple of 4) in groups of 4 against xm x rows (two at a time): each x
 * vector loaded once for the 4 rows; every row's sums in the order the one-row loop makes them
 * (bit-identical results); gk a multiple of 32 */
#define QP_FUSED_SCALED4(NAME, RAWI, ANY, WR, TAB, BASE)                                            \
static void NAME##_rows4(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy, int wround_) { \
    y -= r0;                                                                                        \
    const int64_t K = m->k, gk = m->gk, ldx = in->ldx, ldw = m->ldw;                                \
    const void *zp = ANY ? m->z : NULL;                                                             \
    const float gs = m->gs;                                                                         \
    const int has_g = ANY && m->gmode == QG_AFTER && gs != 1.f, nan = ANY && m->nan;                \
    const int wround = ANY ? wround_ : WR;                                                          \
    const __m512 lut = _mm512_loadu_ps(E2M1), vg = _mm512_set1_ps(gs);                            \
    const int64_t ng = (K + gk - 1) / gk, pf = RT * ldw;                                            \
    float svz[8][ng];  /* the 4 rows' scales and zero points (ng <= QP_NG_MAX: 128 KiB at most) */ \
    float (*sv)[ng] = svz, (*zv)[ng] = svz + 4;                                                     \
    (void)lut; (void)nan;                                                                           \
    for (int64_t r = r0; r < r1; r += 4) {                                                          \
        const uint8_t *restrict rows[4];                                                            \
        for (int a = 0; a < 4; a++) { rows[a] = m->w + (r + a) * ldw; row_scales(m, r + a, ng, sv[a], zv[a]); } \
        for (int i0 = 0; i0 < xm; i0 += 2) {                                                        \
            const int two = xm - i0 >= 2;                                                           \
            const float *restrict x0 = in->x + (int64_t)i0 * ldx, *restrict x1 = x0 + (two ? ldx : 0); \
            __m512 acc[4][4];                                                                       \
            for (int a = 0; a < 4; a++) acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = _mm512_setzero_ps(); \
            for (int64_t c0 = 0; c0 < K; c0 += gk) {                                                \
                const int64_t j = c0 / gk, end = c0 + gk < K ? c0 + gk : K;                         \
                __m512 vsa[4], vza[4], taba[4];                                                     \
                for (int a = 0; a < 4; a++) { vsa[a] = _mm512_set1_ps(sv[a][j]); vza[a] = _mm512_set1_ps(zp ? zv[a][j] : 0.f); } \
                if (TAB) for (int a = 0; a < 4; a++) {                                              \
                    const __m512 vs = vsa[a], vz = vza[a]; (void)vz; QP_SCALE16(BASE, taba[a]) }    \
                for (int64_t i = c0; i < end; i += 32) {                                            \
                    const __m512 xa = _mm512_loadu_ps(x0 + i), xb = _mm512_loadu_ps(x0 + i + 16);   \
                    const __m512 xc = _mm512_loadu_ps(x1 + i), xd = _mm512_loadu_ps(x1 + i + 16);   \
                    _Pragma("GCC unroll 4") for (int a = 0; a < 4; a++) {                           \
                        const uint8_t *restrict row = rows[a];                                      \
                        const __m512 vs = vsa[a], vz = vza[a];                                      \
                        __m512 v0, v1;                                                              \
                        (void)vz;                                                                   \
                        if (i0 == 0) _mm_prefetch((const char *)(row + pf) + i, _MM_HINT_T1);        \
                        if (TAB) { v0 = _mm512_permutexvar_ps(idx16(row, i), taba[a]);              \
                                   v1 = _mm512_permutexvar_ps(idx16(row, i + 16), taba[a]); }       \
                        else { QP_SCALE16(RAWI(i), v0) QP_SCALE16(RAWI(i + 16), v1) }               \
                        acc[a][0] = _mm512_fmadd_ps(v0, xa, acc[a][0]);                             \
                        acc[a][1] = _mm512_fmadd_ps(v1, xb, acc[a][1]);                             \
                        if (two) { acc[a][2] = _mm512_fmadd_ps(v0, xc, acc[a][2]);                  \
                                   acc[a][3] = _mm512_fmadd_ps(v1, xd, acc[a][3]); }                \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            for (int a = 0; a < 4; a++) {                                                           \
                y[(int64_t)i0 * ldy + r + a] = _mm512_reduce_add_ps(_mm512_add_ps(acc[a][0], acc[a][1])); \
                if (two) y[(int64_t)(i0 + 1) * ldy + r + a] = _mm512_reduce_add_ps(_mm512_add_ps(acc[a][2], acc[a][3])); \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
}
#define QP_FUSED_SCALED(NAME, RAWI, ANY, WR, TAB, BASE)                                             \
QP_FUSED_SCALED4(NAME, RAWI, ANY, WR, TAB, BASE)                                                    \
static void NAME(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy, int wround_) { \
    y -= r0;                                                                                        \
    const int64_t K = m->k, gk = m->gk, ldx = in->ldx, ldw = m->ldw, step = gk % 32 ? 16 : 32;       \
    const void *zp = ANY ? m->z : NULL;                                                             \
    const float gs = m->gs;                                                                         \
    const int has_g = ANY && m->gmode == QG_AFTER && gs != 1.f, nan = ANY && m->nan;                \
    const int wround = ANY ? wround_ : WR;                                                          \
    const __m512 lut = _mm512_loadu_ps(E2M1), vg = _mm512_set1_ps(gs);                            \
    const int64_t ng = (K + gk - 1) / gk;                                                           \
    float sv[QP_NG_MAX], zv[QP_NG_MAX];                                                             \
    (void)lut; (void)nan;                                                                           \
    /* the same bytes RT rows ahead, into L2: rows shorter than the hardware prefetcher's ramp */ \
    const int64_t pf = RT * ldw;                                                                    \
    /* groups of 4 rows sharing each load of x (the x rows stay in L2 / L1 for 4x fewer reads) */  \
    if (step == 32 && r1 - r0 >= 4) {                                                               \
        const int64_t rq = r0 + (r1 - r0) / 4 * 4;                                                  \
        NAME##_rows4(m, in, r0, rq, xm, y + r0, ldy, wround_);                                      \
        r0 = rq;                                                                                    \
    }                                                                                               \
    for (int64_t r = r0; r < r1; r++) {                                                             \
        const uint8_t *restrict row = m->w + r * ldw;                                               \
        row_scales(m, r, ng, sv, zv);                                                               \
        for (int i0 = 0; i0 < xm; i0 += 2) {                                                        \
            const int two = xm - i0 >= 2;                                                           \
            const float *restrict x0 = in->x + (int64_t)i0 * ldx, *restrict x1 = x0 + (two ? ldx : 0); \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;                              \
            for (int64_t c0 = 0; c0 < K; c0 += gk) {                                                \
                const int64_t j = c0 / gk, end = c0 + gk < K ? c0 + gk : K;                         \
                const __m512 vs = _mm512_set1_ps(sv[j]);                                            \
                const __m512 vz = _mm512_set1_ps(zp ? zv[j] : 0.f);                                 \
                __m512 tab = vs;  /* not for the NVFP4 branch: its groups are one step each */     \
                if (TAB && (step == 32 || gk != 16 || (K & 31))) QP_SCALE16(BASE, tab)              \
                if (step == 32) {                                                                   \
                    for (int64_t i = c0; i < end; i += 32) {                                        \
                        __m512 v0, v1;                                                              \
                        if (i0 == 0) _mm_prefetch((const char *)(row + pf) + i, _MM_HINT_T1);        \
                        if (TAB) { v0 = _mm512_permutexvar_ps(idx16(row, i), tab);                  \
                                   v1 = _mm512_permutexvar_ps(idx16(row, i + 16), tab); }           \
                        else { QP_SCALE16(RAWI(i), v0) QP_SCALE16(RAWI(i + 16), v1) }               \
                        a0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x0 + i), a0);                       \
                        a1 = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x0 + i + 16), a1);                  \
                        if (two) { b0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x1 + i), b0);            \
                                   b1 = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x1 + i + 16), b1); }     \
                    }                                                                               \
                } else if (gk == 16 && !(K & 31)) {  /* NVFP4: two groups a step, two sums */       \
                    const int64_t i = c0;                                                           \
                    __m512 v0, v1;                                                                  \
                    { const __m512 vs = _mm512_set1_ps(sv[j]), vz = _mm512_set1_ps(zp ? zv[j] : 0.f); \
                      (void)vz; QP_SCALE16(RAWI(i), v0) }                                           \
                    { const __m512 vs = _mm512_set1_ps(sv[j + 1]), vz = _mm512_set1_ps(zp ? zv[j + 1] : 0.f); \
                      (void)vz; QP_SCALE16(RAWI(i + 16), v1) }                                      \
                    a0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x0 + i), a0);                           \
                    a1 = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x0 + i + 16), a1);                      \
                    if (two) { b0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x1 + i), b0);                \
                               b1 = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x1 + i + 16), b1); }         \
                    c0 += 16;  /* the second group done too */                                      \
                } else {                                                                            \
                    for (int64_t i = c0; i < end; i += 16) {                                        \
                        __m512 v0;                                                                  \
                        if (TAB) v0 = _mm512_permutexvar_ps(idx16(row, i), tab);                    \
                        else QP_SCALE16(RAWI(i), v0)                                                \
                        a0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x0 + i), a0);                       \
                        if (two) b0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x1 + i), b0);              \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            y[(int64_t)i0 * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                 \
            if (two) y[(int64_t)(i0 + 1) * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));   \
        }                                                                                           \
    }                                                                                               \
}
/* INT4 / FP4: the group's 16 possible weights made once (the same operations on each code value
 * as QP_SCALE16 makes per weight: bit-identical) and looked up per nibble: INT4_BASE the codes
 * q - 8, lut the E2M1 values */
#define INT4_BASE _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f)
#define RAW_INT8(i) raw16_int8(row, i)
#define RAW_INT4(i) raw16_int4(row, i)
#define RAW_FP8(i) fp8x16_div256(row + (i), nan)
#define RAW_FP4(i) _mm512_permutexvar_ps(nib16(row, i), lut)
/* each form three times: for any matrix, and specialized for the plain one (no zero points, no
 * global scale after, no NaN codes) in a float32 and in a bfloat16 model, whose per-16-weight
 * branches then fold away */
QP_FUSED_SCALED(fused_int8, RAW_INT8, 1, 0, 0, lut)
QP_FUSED_SCALED(fused_int4, RAW_INT4, 1, 0, 1, INT4_BASE)
QP_FUSED_SCALED(fused_fp8, RAW_FP8, 1, 0, 0, lut)
QP_FUSED_SCALED(fused_fp4, RAW_FP4, 1, 0, 1, lut)
QP_FUSED_SCALED(plain_int8, RAW_INT8, 0, QR_NONE, 0, lut)
QP_FUSED_SCALED(plain_int4, RAW_INT4, 0, QR_NONE, 1, INT4_BASE)
QP_FUSED_SCALED(plain_fp8, RAW_FP8, 0, QR_NONE, 0, lut)
QP_FUSED_SCALED(plain_fp4, RAW_FP4, 0, QR_NONE, 1, lut)
QP_FUSED_SCALED(plain_int8_bf16, RAW_INT8, 0, QR_BF16, 0, lut)
QP_FUSED_SCALED(plain_int4_bf16, RAW_INT4, 0, QR_BF16, 1, INT4_BASE)
QP_FUSED_SCALED(plain_fp8_bf16, RAW_FP8, 0, QR_BF16, 0, lut)
QP_FUSED_SCALED(plain_fp4_bf16, RAW_FP4, 0, QR_BF16, 1, lut)
QP_FUSED_SCALED(plain_int8_bf16n, RAW_INT8, 0, QR_BF16_NORMAL, 0, lut)
QP_FUSED_SCALED(plain_int4_bf16n, RAW_INT4, 0, QR_BF16_NORMAL, 1, INT4_BASE)
QP_FUSED_SCALED(plain_fp8_bf16n, RAW_FP8, 0, QR_BF16_NORMAL, 0, lut)
QP_FUSED_SCALED(plain_fp4_bf16n, RAW_FP4, 0, QR_BF16_NORMAL, 1, lut)
#undef QP_FUSED_SCALED
#undef QP_SCALE16
#endif

/* The row kernel rows_any runs for m in a model whose weights round by wround (QR_*): one rule for
 * the dispatch and for qp_row_kernel, which tests read (a bfloat16 model must take the kernels of
 * a float32 one). */
enum { QK_GENERIC = 0, QK_FAST = 1, QK_INT = 2, QK_EXACT32 = 3, QK_KQUANT = 4, QK_SCALED = 5 };
static int row_kernel(const qp_mat *m, int wround) {
    if (is_fast(m)) return QK_FAST;
    if (is_int_path(m)) return QK_INT;
#ifdef QP_AVX512
    /* Q4_0 / Q8_0 / K-quant weights round to bfloat16 in registers (QR_F16 keeps the generic path);
     * bfloat16 rows are already the model dtype's values */
    if ((m->type == QP_Q4_0 || m->type == QP_Q8_0) && wround != QR_F16) return QK_EXACT32;
    if (m->type == QP_BF16 && wround != QR_F16 && m->k % 32 == 0) return QK_EXACT32;
    if ((m->type == QP_Q4_K || m->type == QP_Q5_K || m->type == QP_Q6_K) && wround != QR_F16) return QK_KQUANT;
    if (m->type >= QP_INT4 && (m->gk % 16 == 0) && m->k % 16 == 0 && !m->big && (m->k + m->gk - 1) / m->gk <= QP_NG_MAX)
        return QK_SCALED;
#endif
    (void)wround;
    return QK_GENERIC;
}

int qp_row_kernel(const qp_mat *m, int wround) { return row_kernel(m, wround); }

static void rows_any(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy, int wround) {
    switch (row_kernel(m, wround)) {
        case QK_FAST: fast_rows(m, in, r0, r1, xm, y, ldy); return;
        case QK_INT: int_rows(m, in, r0, r1, xm, y, ldy); return;
#ifdef QP_AVX512
        case QK_EXACT32: {
            /* Q4_0 / Q8_0 weights are never subnormal (an f16 scale times a small integer): the
             * AVX512-BF16 conversion rounds them as round_bf16 does */
#if defined(__AVX512BF16__)
            const int bf = QR_BF16_NORMAL;
#else
            const int bf = QR_BF16;
#endif
            exact_rows_32(m, in, r0, r1, xm, y, ldy, m->type != QP_BF16 && wround == QR_BF16 ? bf : QR_NONE);
            return;
        }
        case QK_KQUANT:
            /* K-quant weights are f16 scales times small integers, less f16 minimums times small
             * integers: zero or at least 2^-24 in magnitude, never subnormal */
            if (wround != QR_BF16) kq_rows(m, in, r0, r1, xm, y, ldy);
#if defined(__AVX512BF16__)
            else kq_rows_bf16n(m, in, r0, r1, xm, y, ldy);
#else
            else kq_rows_bf16(m, in, r0, r1, xm, y, ldy);
#endif
            return;
        case QK_SCALED: {
            const int simple = !m->z && !(m->gmode == QG_AFTER && m->gs != 1.f) && !m->nan;
            const int p32 = simple && wround == QR_NONE, p16 = simple && wround == QR_BF16;
#if defined(__AVX512BF16__)
            const int p16n = p16 && !m->tiny;
#else
            const int p16n = 0;
#endif
            switch (m->type) {
                case QP_INT8: (p32 ? plain_int8 : p16n ? plain_int8_bf16n : p16 ? plain_int8_bf16 : fused_int8)(m, in, r0, r1, xm, y, ldy, wround); break;
                case QP_INT4: (p32 ? plain_int4 : p16n ? plain_int4_bf16n : p16 ? plain_int4_bf16 : fused_int4)(m, in, r0, r1, xm, y, ldy, wround); break;
                case QP_FP8: (p32 ? plain_fp8 : p16n ? plain_fp8_bf16n : p16 ? plain_fp8_bf16 : fused_fp8)(m, in, r0, r1, xm, y, ldy, wround); break;
                default: (p32 ? plain_fp4 : p16n ? plain_fp4_bf16n : p16 ? plain_fp4_bf16 : fused_fp4)(m, in, r0, r1, xm, y, ldy, wround); break;
            }
            return;
        }
#endif
        default: generic_rows(m, in, r0, r1, xm, y, ldy, wround);
    }
}

/* ---- validation: the C code trusts a qp_mat only after this --------------------------------- */

static int mat_ok(const qp_mat *m) {
    int64_t e, b;
    if (!m || !qp_form_info(m->type, &e, &b) || m->n <= 0 || m->k <= 0 || !m->w) return 0;
    if (m->k % (e > 2 ? e : QK)) return 0;
    if (m->act.kind < QA_NONE || m->act.kind > QA_MXFP4) return 0;
    if (m->ldw < m->k / e * b) return 0;
    if (m->type >= QP_INT4) {
        if (!m->s || m->gk <= 0 || m->gn <= 0 || m->lds < 0 || m->sdt < QS_F32 || m->sdt > QS_E4M3) return 0;
        if (m->gk < m->k && m->gk % 16) return 0;
        if (is_int_path(m) && (!m->rowsum || (m->act.epi == QE_STATIC && (!m->bias || !m->os)) || !is_int8_act(m->act.kind)))
            return 0;
        if (m->gmode < QG_AFTER || m->gmode > QG_OVER || (m->zi8 && !m->z)) return 0;
    }
    if (m->mode == 1 && !is_fast(m) && !is_ggml_block(m->type)) return 0;
    return 1;
}

/* ---- entry points ------------------------------------------------------------------------- */

int qp_check(const qp_mat *m) { return mat_ok(m) ? 0 : -1; }

/* rows [r0, r1) of m, exactly decoded (rounded to the model dtype: wround), into out (ldo apart) */
int qp_dequant(const qp_mat *m, int64_t r0, int64_t r1, float *out, int64_t ldo, int wround) {
    if (!mat_ok(m) || r0 < 0 || r1 > m->n || r0 > r1) return -1;
    const int64_t seg = seg_len(m), K = m->k;
    #pragma omp parallel for schedule(static) if ((r1 - r0) * K >= 1 << 16)
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c0 = 0; c0 < K; c0 += seg) deq_seg(m, r, c0, seg, out + (r - r0) * ldo + c0, wround);
    return 0;
}

/* activations as weight m's exact product sees them: M rows of K floats -> float rows */
int qp_act_rows(const qp_mat *m, int64_t M, const float *x, int64_t ldx, float *out) {
    if (!mat_ok(m) || M <= 0) return -1;
    qp_mat f = *m;
    f.act.epi = QE_FLOAT;  /* the float form of integer-path activations: (q - o) * s */
    f.mode = 0;
    qp_scratch sc;
    if (!scratch_alloc(&sc, M, m->k)) return -2;
    qp_in in;
    prepare(&f, M, m->k, x, ldx, &sc, &in);
    for (int64_t i = 0; i < M; i++) memcpy(out + i * m->k, in.x + i * in.ldx, sizeof(float) * (size_t)m->k);
    scratch_free(&sc);
    return 0;
}

#define MIN_TASK_BYTES (8 * 1024)

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int64_t row_bytes(const qp_mat *m) {
    int64_t e, b;
    qp_form_info(m->type, &e, &b);
    return m->k / e * b;
}

/* y[yr[g] + i, yc[g] + j] = sum_c x'[xr[g] + i, c] * W_g[j, c]   (i < xm[g], j < n of mats[g]),
 * x' = x as mats[g]'s activation quantization and mode make it. One call covers a linear, sibling
 * projections of one input (side by side in y), the row groups of routed experts, and per-head
 * stacks. All mats have K inputs. */
int qp_gemm(const qp_mat *const *mats, int G, int64_t M, int64_t K, const float *x, int64_t ldx,
            const int64_t *xr, const int64_t *xm, const int64_t *yr, const int64_t *yc, float *y, int64_t ldy, int wround) {
    if (G <= 0 || M <= 0 || K <= 0) return -1;
    for (int g = 0; g < G; g++)
        if (!mat_ok(mats[g]) || mats[g]->k != K || xr[g] < 0 || xm[g] < 1 || xr[g] + xm[g] > M) return -1;
    /* one prepared input per distinct activation treatment, shared by the groups that use it */
    int *which = (int *)malloc(sizeof(int) * (size_t)G), *rep = (int *)malloc(sizeof(int) * (size_t)G);
    qp_scratch *sc = (qp_scratch *)calloc((size_t)G, sizeof(qp_scratch));
    qp_in *ins = (qp_in *)calloc((size_t)G, sizeof(qp_in));
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(G + 1)), *rows_per = (int64_t *)malloc(sizeof(int64_t) * (size_t)G);
    int nin = 0, rc = 0;
    if (!which || !rep || !sc || !ins || !first || !rows_per) { rc = -2; goto done; }
    for (int g = 0; g < G; g++) {
        int j = 0;
        while (j < nin && !same_input(mats[rep[j]], mats[g])) j++;
        if (j == nin) {
            if (!scratch_alloc(&sc[nin], M, K)) { rc = -2; goto done; }
            prepare(mats[g], M, K, x, ldx, &sc[nin], &ins[nin]);
            rep[nin++] = g;
        }
        which[g] = j;
    }
    int64_t total_bytes = 0, total = 0;
    for (int g = 0; g < G; g++) total_bytes += mats[g]->n * row_bytes(mats[g]) * (xm[g] < MT ? 1 : xm[g] / MT);
    int threads = max_threads();
    int64_t task_bytes = total_bytes / (4 * threads);
    if (task_bytes < MIN_TASK_BYTES) task_bytes = MIN_TASK_BYTES;
    for (int g = 0; g < G; g++) {
        int64_t per_row = row_bytes(mats[g]) * (xm[g] < MT ? 1 : xm[g] / MT);
        int64_t r = (task_bytes / per_row + RT - 1) / RT * RT;
        rows_per[g] = r < RT ? RT : r;
        first[g] = total;
        total += (mats[g]->n + rows_per[g] - 1) / rows_per[g];
    }
    first[G] = total;
    #pragma omp parallel for schedule(dynamic, 1) if (threads > 1 && total > 1 && total_bytes >= 2 * MIN_TASK_BYTES)
    for (int64_t t = 0; t < total; t++) {
        int g = 0;
        while (first[g + 1] <= t) g++;
        int64_t r0 = (t - first[g]) * rows_per[g], r1 = r0 + rows_per[g];
        if (r1 > mats[g]->n) r1 = mats[g]->n;
        qp_in in = ins[which[g]];
        in.x += xr[g] * in.ldx;
        if (in.u8) { in.u8 += xr[g] * K; in.xs += xr[g]; in.xo += xr[g]; }
        if (in.q8) { in.q8 += xr[g] * K; in.d8 += xr[g] * (K / QK); }
        rows_any(mats[g], &in, r0, r1, (int)xm[g], y + yr[g] * ldy + yc[g] + r0, ldy, wround);
    }
done:
    for (int i = 0; i < nin; i++) scratch_free(&sc[i]);
    free(which); free(rep); free(sc); free(ins); free(first); free(rows_per);
    return rc;
}

/* ---- gated MLP over few rows: dense MLPs, shared experts, a step's routed experts ----------- */

static inline float silu(float v) { return v / (1.f + expf(-v)); }

/* float32 dot product in 64 lanes (the reduction order is fixed, so results do not depend on
 * the thread that computes them) */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#ifdef QP_AVX512
    __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps(), c3 = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        c0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), c0);
        c1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), c1);
        c2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), c2);
        c3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), c3);
    }
    for (; i + 16 <= n; i += 16) c0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), c0);
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
#else
    float acc[8] = {0.f};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; j++) s += acc[j];
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[i] += a * x[i] */
static inline void axpy_f32(float a, const float *x, float *y, int64_t n) {
    int64_t i = 0;
#ifdef QP_AVX512
    const __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

#ifdef QP_AVX512
/* e^x for 16 floats: x = n ln2 + r (Cody-Waite), e^r by its degree-6 Taylor-Horner polynomial on
 * |r| <= ln2 / 2 (relative error below 2 ulp), times 2^n; overflow to inf, underflow to 0 */
static inline __m512 exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.72283f), lo = _mm512_set1_ps(-103.97208f);
    __mmask16 big = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), small = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    __m512 y = _mm512_scalef_ps(p, n);
    y = _mm512_mask_blend_ps(big, y, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(small, y, _mm512_setzero_ps());
}
#endif

/* g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u over n values (NaN propagates) */
static void silu_mul(float *g, const float *u, int64_t n) {
    int64_t i = 0;
#ifdef QP_AVX512
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(g + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) g[i] = silu(g[i]) * u[i];
}

/* out[prow[p]] = sum over pairs p (in order) of pw[p] * down_e(silu(gate_e x) * up_e x), x = row
 * prow[p] of x, e = pe[p]; pairs must come grouped by expert (pe non-decreasing). gate / up / down:
 * E experts' mats (gate / up: I x H; down: H x I). A row no pair names is set to zero. */
int qp_mlp(const qp_mat *const *gate, const qp_mat *const *up, const qp_mat *const *down, int E,
           int64_t M, const float *x, int64_t ldx, int P, const int32_t *pe, const int32_t *prow, const float *pw,
           float *out, int64_t ldo, int wround) {
    if (E <= 0 || P <= 0 || M <= 0) return -1;
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
    prepare(gate[0], P, H, xg, H, &sx, &inx);
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
            in.x += start[e] * in.ldx;
            if (in.u8) { in.u8 += start[e] * H; in.xs += start[e]; in.xo += start[e]; }
            if (in.q8) { in.q8 += start[e] * H; in.d8 += start[e] * (H / QK); }
            rows_any(is_up ? up[e] : gate[e], &in, r0, r1, (int)n, (is_up ? hu : hg) + start[e] * I + r0, I, wround);
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            float *g = hg + p * I, *u = hu + p * I;
            silu_mul(g, u, I);
        }
        #pragma omp single
        prepare(down[0], P, I, hg, I, &sh, &inh);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < E * per_h; t++) {
            int64_t e = t / per_h, r0 = (t % per_h) * rd, r1 = r0 + rd > H ? H : r0 + rd;
            int64_t n = start[e + 1] - start[e];
            if (n == 0) continue;
            qp_in in = inh;
            in.x += start[e] * in.ldx;
            if (in.u8) { in.u8 += start[e] * I; in.xs += start[e]; in.xo += start[e]; }
            if (in.q8) { in.q8 += start[e] * I; in.d8 += start[e] * (I / QK); }
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

/* ---- one MLA decode step (absorbed form) for B sequences at one position --------------------- */

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
} qp_mla;

static inline float norm_w(const qp_mla *m, const void *w, int64_t i) {
    return m->norm_bf16 ? bits_f32((uint32_t)((const uint16_t *)w)[i] << 16) : ((const float *)w)[i];
}

static void rms_norm_row(const qp_mla *m, float *x, int64_t n, const void *w, float eps) {
    float ss = dot_f32(x, x, n);
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = norm_w(m, w, i) * (x[i] * r);
}

static void rope_row(const float *x, const float *rot, int64_t d, float *out) {
    for (int64_t j = 0; j < d; j++) {
        float acc = 0.f;
        for (int64_t i = 0; i < d; i++) acc += x[i] * rot[i * d + j];
        out[j] = acc;
    }
}

/* a transposed product over rows [r0, r0 + n) of m: y[c] = sum_j a[j] * W[r0 + j, c] (exact weights) */
static void rows_t(const qp_mat *m, int64_t r0, int64_t n, const float *a, float *y, int wround) {
    const int64_t K = m->k, seg = seg_len(m);
    float buf[QKK];
    for (int64_t c = 0; c < K; c++) y[c] = 0.f;
    for (int64_t j = 0; j < n; j++)
        for (int64_t c0 = 0; c0 < K; c0 += seg) {
            deq_seg(m, r0 + j, c0, seg, buf, wround);
            for (int64_t c = 0; c < seg; c++) y[c0 + c] += a[j] * buf[c];
        }
}

/* one matrix's rows [0, n) times B prepared rows, tasks inside an open parallel region */
static void par_rows(const qp_mat *m, const qp_in *in, int64_t B, float *y, int64_t ldy, int wround) {
    const int64_t n = m->n, step = 4 * RT;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < (n + step - 1) / step; t++) {
        int64_t r0 = t * step, r1 = r0 + step > n ? n : r0 + step;
        rows_any(m, in, r0, r1, (int)B, y + r0, ldy, wround);
    }
}

static int mla_ok(const qp_mla *m) {
    const int64_t qh = m->nope + m->rope;
    if (m->H <= 0 || m->kv_lora <= 0 || m->rope <= 0 || m->nope <= 0 || m->v <= 0 || m->nh <= 0) return 0;
    if (!mat_ok(m->kv_a) || m->kv_a->n != m->kv_lora + m->rope || m->kv_a->k != m->H) return 0;
    if (m->q_a) {
        if (!mat_ok(m->q_a) || m->q_a->n != m->q_lora || m->q_a->k != m->H) return 0;
        if (!mat_ok(m->q_b) || m->q_b->n != m->nh * qh || m->q_b->k != m->q_lora) return 0;
    } else if (!mat_ok(m->q_b) || m->q_b->n != m->nh * qh || m->q_b->k != m->H) return 0;
    if (m->kv_dense) {
        if (!mat_ok(m->kv_b) || m->kv_b->n != m->nh * (m->nope + m->v) || m->kv_b->k != m->kv_lora) return 0;
    } else {
        for (int64_t h = 0; h < m->nh; h++)
            if (!mat_ok(m->k_b[h]) || m->k_b[h]->n != m->kv_lora || m->k_b[h]->k != m->nope
                || !mat_ok(m->v_b[h]) || m->v_b[h]->n != m->v || m->v_b[h]->k != m->kv_lora
                || !same_input(m->k_b[0], m->k_b[h]) || !same_input(m->v_b[0], m->v_b[h])) return 0;
    }
    if (!mat_ok(m->o) || m->o->n != m->H || m->o->k != m->nh * m->v) return 0;
    if (m->g && (!mat_ok(m->g) || m->g->n != m->nh * m->v || m->g->k != m->H)) return 0;
    return m->q_a_norm && m->kv_a_norm;
}

/* B rows x [B, H] at one position: qcat [B, nh, kv_lora + rope] = (q_nope absorbed through W_UK ‖
 * roped q_rope), kvrow [B, kv_lora + rope] = (normed latent ‖ roped key), gate [B, nh * v] (when g).
 * rot: B rotation matrices [rope, rope] (roped = x @ rot). */
int qp_mla_pre(const qp_mla *m, int64_t B, const float *x, const float *rot, float *qcat, float *kvrow, float *gate, int wround) {
    if (!mla_ok(m) || B <= 0 || (m->g && !gate)) return -1;
    const int64_t H = m->H, ql = m->q_a ? m->q_lora : 0, kl = m->kv_lora, rp = m->rope, np_ = m->nope, nh = m->nh;
    const int64_t qh = np_ + rp, qrows = nh * qh, qin = m->q_a ? ql : H;
    float *qa = (float *)malloc(sizeof(float) * (size_t)(B * (ql + kl + rp + qrows + nh * np_) + 1));
    qp_scratch s[5];
    int ok[5] = {0, 0, 0, 0, 0}, rc = 0;
    ok[0] = scratch_alloc(&s[0], B, H);
    ok[1] = scratch_alloc(&s[1], B, H);
    ok[2] = scratch_alloc(&s[2], B, H);
    ok[3] = scratch_alloc(&s[3], B, qin);
    ok[4] = scratch_alloc(&s[4], B * nh, np_);
    for (int i = 0; i < 5; i++) if (!ok[i]) rc = -2;
    if (!qa || rc) { rc = -2; goto done; }
    float *kva = qa + B * ql, *qb = kva + B * (kl + rp), *qn = qb + B * qrows;
    qp_in ikv, iqa, ig, iq, ik;
    prepare(m->kv_a, B, H, x, H, &s[0], &ikv);
    if (m->q_a) { if (same_input(m->q_a, m->kv_a)) iqa = ikv; else prepare(m->q_a, B, H, x, H, &s[1], &iqa); }
    if (m->g) prepare(m->g, B, H, x, H, &s[2], &ig);
    #pragma omp parallel
    {
        if (m->q_a) par_rows(m->q_a, &iqa, B, qa, ql, wround);
        par_rows(m->kv_a, &ikv, B, kva, kl + rp, wround);
        if (m->g) par_rows(m->g, &ig, B, gate, nh * m->v, wround);
        #pragma omp single
        {
            for (int64_t b = 0; b < B; b++) {
                float *kv = kvrow + b * (kl + rp);
                if (m->q_a) rms_norm_row(m, qa + b * ql, ql, m->q_a_norm, m->eps_q);
                memcpy(kv, kva + b * (kl + rp), sizeof(float) * (size_t)kl);
                rms_norm_row(m, kv, kl, m->kv_a_norm, m->eps_kv);
                rope_row(kva + b * (kl + rp) + kl, rot + b * rp * rp, rp, kv + kl);
            }
            prepare(m->q_b, B, qin, m->q_a ? qa : x, m->q_a ? ql : H, &s[3], &iq);
        }
        par_rows(m->q_b, &iq, B, qb, qrows, wround);
        if (!m->kv_dense) {
            /* every head's q_nope as the k_b stack's products want it (one scheme: one treatment) */
            #pragma omp single
            {
                for (int64_t t = 0; t < B * nh; t++)
                    memcpy(qn + t * np_, qb + (t / nh) * qrows + (t % nh) * qh, sizeof(float) * (size_t)np_);
                prepare(m->k_b[0], B * nh, np_, qn, np_, &s[4], &ik);
            }
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * nh; t++) {
            int64_t b = t / nh, h = t % nh;
            const float *qp = qb + b * qrows + h * qh;
            float *dst = qcat + t * (kl + rp);
            if (m->kv_dense) rows_t(m->kv_b, h * (np_ + m->v), np_, qp, dst, wround);
            else {
                qp_in in = ik;
                in.x += t * in.ldx;
                if (in.q8) { in.q8 += t * np_; in.d8 += t * (np_ / QK); }
                if (in.u8) { in.u8 += t * np_; in.xs += t; in.xo += t; }
                rows_any(m->k_b[h], &in, 0, kl, 1, dst, 0, wround);
            }
            rope_row(qp + np_, rot + b * rp * rp, rp, dst + kl);
        }
    }
done:
    for (int i = 0; i < 5; i++) if (ok[i]) scratch_free(&s[i]);
    free(qa);
    return rc;
}

/* attention of every head of each row b on its n cached tokens (latent row j of b at lat + b * lds_b
 * + j * ld_lat, its roped key at kr + b * krs_b + j * ld_kr, in elements; lat_bf16: the cache holds
 * bfloat16), each head's output through W_UV, the output gate, then o_proj: out [B, H]. */
int qp_mla_post(const qp_mla *m, int64_t B, const float *qcat, const void *lat, int64_t ld_lat, int64_t lds_b,
                const void *kr, int64_t ld_kr, int64_t krs_b, int64_t n, int lat_bf16, const float *gate,
                float *out, int wround) {
    if (!mla_ok(m) || B <= 0 || n <= 0) return -1;
    const int64_t H = m->H, kl = m->kv_lora, rp = m->rope, nh = m->nh, vd = m->v;
    /* the latent as kv_b's activation quantization makes it: the expanded form quantizes kv_b's
     * input (the latent, per token), so the absorbed form attends on the quantized rows */
    const int latent_act = m->kv_dense && m->kv_b->act.kind != QA_NONE;
    /* float32 cache rows without a quantization to apply are read in place; otherwise copied */
    const int copy = lat_bf16 || latent_act;
    float *lf = (float *)malloc(sizeof(float) * (size_t)(copy ? B * n * (kl + rp) : 1));
    float *sc = (float *)malloc(sizeof(float) * (size_t)(B * nh * (n + kl + vd)));
    qp_scratch so, sl, sv;
    int oo = scratch_alloc(&so, B, nh * vd), ol_ = latent_act ? scratch_alloc(&sl, n, kl) : 0;
    int ov_ = !m->kv_dense ? scratch_alloc(&sv, B * nh, kl) : 0;
    int rc = 0;
    if (!lf || !sc || !oo || (latent_act && !ol_) || (!m->kv_dense && !ov_)) { rc = -2; goto done; }
    /* float copies of the cached rows: [B, n, kl + rp] (latent ‖ key) */
    for (int64_t b = 0; b < B && copy; b++) {
        for (int64_t j = 0; j < n; j++) {
            float *dst = lf + (b * n + j) * (kl + rp);
            if (lat_bf16) {
                const uint16_t *src = (const uint16_t *)lat + b * lds_b + j * ld_lat;
                const uint16_t *ks = (const uint16_t *)kr + b * krs_b + j * ld_kr;
                for (int64_t i = 0; i < kl; i++) dst[i] = bits_f32((uint32_t)src[i] << 16);
                for (int64_t i = 0; i < rp; i++) dst[kl + i] = bits_f32((uint32_t)ks[i] << 16);
            } else {
                memcpy(dst, (const float *)lat + b * lds_b + j * ld_lat, sizeof(float) * (size_t)kl);
                memcpy(dst + kl, (const float *)kr + b * krs_b + j * ld_kr, sizeof(float) * (size_t)rp);
            }
        }
        if (latent_act) {
            qp_in in;
            qp_mat kq = *m->kv_b;
            kq.act.epi = QE_FLOAT;  /* the float rows (q - o) * s, also for an integer-product form */
            kq.mode = 0;
            prepare(&kq, n, kl, lf + b * n * (kl + rp), kl + rp, &sl, &in);
            for (int64_t j = 0; j < n; j++)
                memcpy(lf + (b * n + j) * (kl + rp), in.x + j * in.ldx, sizeof(float) * (size_t)kl);
        }
    }
    float *ol = sc + B * nh * n, *ov = ol + B * nh * kl;
    qp_in io, iv;
    qp_mat vb;
    if (m->kv_dense) { vb = *m->kv_b; vb.act.kind = QA_NONE; vb.act.epi = QE_FLOAT; }  /* latent quantized above */
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * nh; t++) {
            const int64_t b = t / nh;
            const float *q = qcat + t * (kl + rp);
            const float *lb = copy ? lf + b * n * (kl + rp) : (const float *)lat + b * lds_b;
            const float *kb = copy ? lb + kl : (const float *)kr + b * krs_b;
            const int64_t ldl = copy ? kl + rp : ld_lat, ldk = copy ? kl + rp : ld_kr;
            float *s = sc + t * n, mx = -INFINITY, sum = 0.f;
            for (int64_t j = 0; j < n; j++) {
                const float a = dot_f32(q, lb + j * ldl, kl), c = dot_f32(q + kl, kb + j * ldk, rp);
                s[j] = a * m->scale + c * m->scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            for (int64_t j = 0; j < n; j++) { s[j] = expf(s[j] - mx); sum += s[j]; }
            float inv = 1.f / sum, *o = ol + t * kl;
            for (int64_t i = 0; i < kl; i++) o[i] = 0.f;
            for (int64_t j = 0; j < n; j++) axpy_f32(s[j] * inv, lb + j * ldl, o, kl);
        }
        if (!m->kv_dense) {
            #pragma omp single
            prepare(m->v_b[0], B * nh, kl, ol, kl, &sv, &iv);
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * nh; t++) {
            const int64_t h = t % nh;
            float *dst = ov + t * vd;
            if (m->kv_dense) {
                qp_in in;
                memset(&in, 0, sizeof in);
                in.x = ol + t * kl; in.ldx = kl;
                const int64_t r0 = h * (m->nope + vd) + m->nope;
                rows_any(&vb, &in, r0, r0 + vd, 1, dst, 0, wround);
            } else {
                qp_in in = iv;
                in.x += t * in.ldx;
                if (in.q8) { in.q8 += t * kl; in.d8 += t * (kl / QK); }
                if (in.u8) { in.u8 += t * kl; in.xs += t; in.xo += t; }
                rows_any(m->v_b[h], &in, 0, vd, 1, dst, 0, wround);
            }
            if (gate) {
                const float *gg = gate + t * vd;
                for (int64_t i = 0; i < vd; i++) dst[i] *= 1.f / (1.f + expf(-gg[i]));
            }
        }
        #pragma omp single
        prepare(m->o, B, nh * vd, ov, nh * vd, &so, &io);
        par_rows(m->o, &io, B, out, H, wround);
    }
done:
    if (oo) scratch_free(&so);
    if (ol_) scratch_free(&sl);
    if (ov_) scratch_free(&sv);
    free(lf); free(sc);
    return rc;
}

/* One whole decode step for B sequences at position pos: qp_mla_pre, the token's latent and key
 * written into each sequence's cache row pos (float32, or bfloat16 rounded to nearest even, as
 * torch's conversion), then qp_mla_post over the pos + 1 cached tokens. */
int qp_mla_step(const qp_mla *m, int64_t B, const float *x, const float *rot, void *lat, int64_t ld_lat, int64_t lds_b,
                void *kr, int64_t ld_kr, int64_t krs_b, int64_t pos, int lat_bf16, float *out, int wround) {
    if (!mla_ok(m) || B <= 0 || pos < 0) return -1;
    const int64_t kl = m->kv_lora, rp = m->rope, gw = m->g ? m->nh * m->v : 0;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * (m->nh * (kl + rp) + kl + rp + gw) + 1));
    if (!buf) return -2;
    float *qcat = buf, *kvrow = qcat + B * m->nh * (kl + rp), *gate = kvrow + B * (kl + rp);
    int rc = qp_mla_pre(m, B, x, rot, qcat, kvrow, m->g ? gate : NULL, wround);
    if (rc == 0) {
        for (int64_t b = 0; b < B; b++) {
            const float *row = kvrow + b * (kl + rp);
            if (lat_bf16) {
                uint16_t *l = (uint16_t *)lat + b * lds_b + pos * ld_lat, *k = (uint16_t *)kr + b * krs_b + pos * ld_kr;
                for (int64_t i = 0; i < kl; i++) l[i] = (uint16_t)(f32_bits(round_bf16(row[i])) >> 16);
                for (int64_t i = 0; i < rp; i++) k[i] = (uint16_t)(f32_bits(round_bf16(row[kl + i])) >> 16);
            } else {
                memcpy((float *)lat + b * lds_b + pos * ld_lat, row, sizeof(float) * (size_t)kl);
                memcpy((float *)kr + b * krs_b + pos * ld_kr, row + kl, sizeof(float) * (size_t)rp);
            }
        }
        rc = qp_mla_post(m, B, qcat, lat, ld_lat, lds_b, kr, ld_kr, krs_b, pos + 1, lat_bf16, m->g ? gate : NULL, out, wround);
    }
    free(buf);
    return rc;
}


/* ---- one decode step of the whole decoder stack ------------------------------------------------
 * Every layer of a DeepSeek-V3-shaped stack for B sequences at one position in one call: input
 * norm, the absorbed MLA step (qp_mla_step, appending to the layer's cache), residual, post-
 * attention norm, the dense gated MLP or the MoE (sigmoid router with the correction bias and
 * group-limited top-k, the routed experts and the shared experts through qp_mlp), residual; then
 * the final norm. The arithmetic is the per-layer steps' own, in their order (a float32 model): the
 * choice of experts is route_one's (scores float32 sigmoids, the biased choice and the weights in
 * double, ties to the lower id), each token's experts summed in ascending id order. */

typedef struct {
    const qp_mla *mla;
    const void *attn_norm, *ffn_norm;  /* [H], f32 or bf16 (norm_bf16) */
    int32_t norm_bf16;
    float eps;
    int32_t E;                         /* routed experts; 0: a dense MLP (gate / up / down [0]) */
    int32_t top_k, n_group, topk_group, norm_topk;
    float scaling;
    const float *router;               /* [E, H] float32 */
    const float *bias;                 /* [E] float32, or NULL */
    const qp_mat *const *gate;
    const qp_mat *const *up;
    const qp_mat *const *down;
    const qp_mat *sg, *su, *sd;        /* shared experts, or NULL */
} qp_layer;

/* RMSNorm of one row as RMSNorm.forward computes it: float32 statistics; in a bfloat16 model
 * (round) the normalized row is rounded to bfloat16, then the product with the weight */
static void norm_into(const float *x, float *o, int64_t n, const void *w, int bf16, float eps, int round) {
    float ss = dot_f32(x, x, n);
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) {
        float wi = bf16 ? bits_f32((uint32_t)((const uint16_t *)w)[i] << 16) : ((const float *)w)[i];
        o[i] = round ? round_bf16(wi * round_bf16(x[i] * r)) : wi * (x[i] * r);
    }
}

/* x = x + a, both rounded to bfloat16 first in a bfloat16 model (a module's output, then the sum) */
static void add_rows(float *x, float *a, int64_t n, int round) {
    if (round) for (int64_t j = 0; j < n; j++) x[j] = round_bf16(x[j] + round_bf16(a[j]));
    else for (int64_t j = 0; j < n; j++) x[j] = x[j] + a[j];
}

static int layer_ok(const qp_layer *l, int64_t H) {
    if (!l->mla || !mla_ok(l->mla) || l->mla->H != H || !l->attn_norm || !l->ffn_norm) return 0;
    if (!l->gate || !l->up || !l->down) return 0;
    const int E = l->E > 0 ? l->E : 1;
    for (int e = 0; e < E; e++)
        if (!l->gate[e] || !l->up[e] || !l->down[e] || !mat_ok(l->gate[e]) || l->gate[e]->k != H || l->down[e]->n != H)
            return 0;
    if (l->E > 0) {
        if (!l->router || l->top_k < 1 || l->top_k > l->E || l->n_group < 1 || l->E % l->n_group
            || l->topk_group < 1 || l->topk_group > l->n_group
            || l->top_k > l->topk_group * (l->E / l->n_group)) return 0;
        if (l->sg && (!l->su || !l->sd || !mat_ok(l->sg) || l->sg->k != H || l->sd->n != H)) return 0;
    }
    return 1;
}

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

/* the MoE of one layer for B normed rows h [B, H]: out [B, H] = routed (+ shared) */
static int moe_rows(const qp_layer *l, int64_t B, int64_t H, const float *h, float *out, float *tmp, int wround) {
    const int E = l->E, K = l->top_k;
    const int64_t P = B * K;
    double *sc = (double *)malloc(sizeof(double) * (size_t)(2 * E));
    int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)(P * 3 + E + 1));
    float *ws = (float *)malloc(sizeof(float) * (size_t)(P * 2));
    const qp_mat **mats = (const qp_mat **)malloc(sizeof(qp_mat *) * (size_t)(3 * (P + 1)));
    int rc = 0;
    if (!sc || !ids || !ws || !mats) { rc = -2; goto done; }
    int32_t *pe = ids + P, *prow = pe + P, *slot = prow + P;
    float *pw = ws + P;
    for (int64_t b = 0; b < B; b++) route_row(l, h + b * H, H, sc, sc + E, ids + b * K, ws + b * K);
    /* pairs grouped by expert (ascending id), rows ascending within one expert */
    for (int e = 0; e < E; e++) slot[e] = -1;
    int used = 0;
    int64_t p = 0;
    for (int e = 0; e < E; e++) {
        for (int64_t b = 0; b < B; b++)
            for (int j = 0; j < K; j++)
                if (ids[b * K + j] == e) {
                    if (slot[e] < 0) {
                        slot[e] = used;
                        mats[used] = l->gate[e]; mats[P + 1 + used] = l->up[e]; mats[2 * (P + 1) + used] = l->down[e];
                        used++;
                    }
                    pe[p] = slot[e]; prow[p] = (int32_t)b; pw[p] = ws[b * K + j]; p++;
                }
    }
    /* the shared experts as one more expert of the same call when they are shaped and quantized as
     * the routed ones, weight 1 for every row, after the routed pairs: each row's sum is then
     * (routed sum) + 1 * shared, the two-call result bit for bit, in one parallel region */
    if (l->sg && wround == QR_NONE && l->sg->n == l->gate[0]->n && l->sd->k == l->down[0]->k) {
        mats[used] = l->sg; mats[P + 1 + used] = l->su; mats[2 * (P + 1) + used] = l->sd;
        int32_t *pe2 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * (p + B)));
        float *pw2 = (float *)malloc(sizeof(float) * (size_t)(p + B));
        if (!pe2 || !pw2) { free(pe2); free(pw2); rc = -2; goto done; }
        int32_t *prow2 = pe2 + p + B;
        memcpy(pe2, pe, sizeof(int32_t) * (size_t)p); memcpy(prow2, prow, sizeof(int32_t) * (size_t)p);
        memcpy(pw2, pw, sizeof(float) * (size_t)p);
        for (int64_t b = 0; b < B; b++) { pe2[p + b] = used; prow2[p + b] = (int32_t)b; pw2[p + b] = 1.f; }
        rc = qp_mlp(mats, mats + (P + 1), mats + 2 * (P + 1), used + 1, B, h, H, (int)(p + B), pe2, prow2, pw2, out, H, wround);
        free(pe2); free(pw2);
        if (rc != -3) goto done;  /* -3: the shared experts quantize their inputs otherwise: two calls */
    }
    rc = qp_mlp(mats, mats + (P + 1), mats + 2 * (P + 1), used, B, h, H, (int)p, pe, prow, pw, out, H, wround);
    if (rc == 0 && l->sg) {
        const qp_mat *g1[1] = {l->sg}, *u1[1] = {l->su}, *d1[1] = {l->sd};
        for (int64_t b = 0; b < B; b++) { pe[b] = 0; prow[b] = (int32_t)b; pw[b] = 1.f; }
        rc = qp_mlp(g1, u1, d1, 1, B, h, H, (int)B, pe, prow, pw, tmp, H, wround);
        if (rc == 0 && wround == QR_BF16)  /* each module's output in the model dtype, then their sum */
            for (int64_t i = 0; i < B * H; i++) out[i] = round_bf16(round_bf16(out[i]) + round_bf16(tmp[i]));
        else if (rc == 0)
            for (int64_t i = 0; i < B * H; i++) out[i] = out[i] + tmp[i];
    }
done:
    free(sc); free(ids); free(ws); free(mats);
    return rc;
}

/* the whole stack for B rows x [B, H] (the embeddings; overwritten by the residual stream) at
 * position pos of every sequence: layer i's latent / key rows at lat[i] / kr[i] (strides as in
 * qp_mla_step, the same for every layer); rot [B, rope, rope]; out [B, H] = the final norm of the
 * last residual. */
static int qp_model_step(const qp_layer *layers, int L, int64_t H, int64_t B, float *x, const float *rot,
                  void *const *lat, void *const *kr, int64_t ld_lat, int64_t lds_b, int64_t ld_kr, int64_t krs_b,
                  int64_t pos, int lat_bf16, const void *fnorm, int fnorm_bf16, float feps, float *out, int wround) {
    if (L <= 0 || H <= 0 || B <= 0 || pos < 0 || !fnorm || (wround != QR_NONE && wround != QR_BF16)) return -1;
    const int rnd = wround == QR_BF16;  /* a bfloat16 model: x holds bfloat16 values */
    for (int i = 0; i < L; i++) {
        if (!layer_ok(&layers[i], H) || !lat[i] || !kr[i]) return -1;
        if (layers[i].E > 1024 || layers[i].n_group > 1024) return -1;
    }
    float *h = (float *)malloc(sizeof(float) * (size_t)(3 * B * H));
    if (!h) return -2;
    float *a = h + B * H, *t = a + B * H;
    int rc = 0;
    for (int i = 0; i < L && rc == 0; i++) {
        const qp_layer *l = &layers[i];
        for (int64_t b = 0; b < B; b++) norm_into(x + b * H, h + b * H, H, l->attn_norm, l->norm_bf16, l->eps, rnd);
        rc = qp_mla_step(l->mla, B, h, rot, lat[i], ld_lat, lds_b, kr[i], ld_kr, krs_b, pos, lat_bf16, a, wround);
        if (rc) break;
        add_rows(x, a, B * H, rnd);
        for (int64_t b = 0; b < B; b++) norm_into(x + b * H, h + b * H, H, l->ffn_norm, l->norm_bf16, l->eps, rnd);
        if (l->E > 0) rc = moe_rows(l, B, H, h, a, t, wround);
        else {
            int32_t *pe = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * B));
            float *pw = (float *)malloc(sizeof(float) * (size_t)B);
            if (!pe || !pw) rc = -2;
            else {
                for (int64_t b = 0; b < B; b++) { pe[b] = 0; pe[B + b] = (int32_t)b; pw[b] = 1.f; }
                rc = qp_mlp(l->gate, l->up, l->down, 1, B, h, H, (int)B, pe, pe + B, pw, a, H, wround);
            }
            free(pe); free(pw);
        }
        if (rc) break;
        add_rows(x, a, B * H, rnd);
    }
    if (rc == 0)
        for (int64_t b = 0; b < B; b++) norm_into(x + b * H, out + b * H, H, fnorm, fnorm_bf16, feps, rnd);
    free(h);
    return rc;
}

/* ---- one decode step from token ids to logits ---------------------------------------------------
 * qp_model_step with the embedding lookup before it and the LM head after it, so that a decode
 * step crosses from Python into C once: x [B, H] = rows ids of emb exactly decoded (rounded to the
 * model dtype, as the embedding's own lookup; emb NULL: x holds the embeddings already), the stack
 * into hid [B, H], then logits [B, head->n] = hid through head (a bfloat16 model: rounded to
 * bfloat16, as the head's output in the model dtype; head NULL: no logits) and, when best is given,
 * each row's greedy pick best[b] as torch.argmax takes it (the first NaN, else the first largest).
 * Every argument is checked before any cache row is written; -4: a token id outside the embedding. */
int qp_decode_step(const qp_layer *layers, int L, int64_t H, int64_t B, const int64_t *ids, const qp_mat *emb,
                   float *x, const float *rot, void *const *lat, void *const *kr, int64_t ld_lat, int64_t lds_b,
                   int64_t ld_kr, int64_t krs_b, int64_t pos, int lat_bf16, const void *fnorm, int fnorm_bf16,
                   float feps, float *hid, const qp_mat *head, float *logits, int64_t *best, int wround) {
    if (B <= 0 || H <= 0 || (wround != QR_NONE && wround != QR_BF16)) return -1;
    if (emb) {
        if (!ids || !mat_ok(emb) || emb->k != H) return -1;
        for (int64_t b = 0; b < B; b++)
            if (ids[b] < 0 || ids[b] >= emb->n) return -4;
    }
    if (head && (!logits || !mat_ok(head) || head->k != H)) return -1;
    if (emb) {
        const int64_t seg = seg_len(emb);
        for (int64_t b = 0; b < B; b++)
            for (int64_t c0 = 0; c0 < H; c0 += seg) deq_seg(emb, ids[b], c0, seg, x + b * H + c0, wround);
    }
    int rc = qp_model_step(layers, L, H, B, x, rot, lat, kr, ld_lat, lds_b, ld_kr, krs_b, pos, lat_bf16,
                           fnorm, fnorm_bf16, feps, hid, wround);
    if (rc || !head) return rc;
    const int64_t zero = 0;
    rc = qp_gemm(&head, 1, B, H, hid, H, &zero, &B, &zero, &zero, logits, head->n, wround);
    if (rc == 0 && wround == QR_BF16)
        for (int64_t i = 0; i < B * head->n; i++) logits[i] = round_bf16(logits[i]);
    if (rc == 0 && best)
        for (int64_t b = 0; b < B; b++) {
            const float *v = logits + b * head->n;
            int64_t at = 0;
            for (int64_t i = 0; i < head->n; i++) {
                if (v[i] != v[i]) { at = i; break; }
                if (v[i] > v[at]) at = i;
            }
            best[b] = at;
        }
    return rc;
}
