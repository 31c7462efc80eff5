/* Portable scalar code: the forms' facts, scalar conversions, ggml block decoders (bit-exact with gguf-py). */

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

/* ---- scalar conversions ------------------------------------------------------------------- */

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    float hw;
    if (f16_to_f32_hw(h, &hw)) return hw;
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
    float hw;
    if (round_f16_hw(f, &hw)) return hw;
    /* portable: through the nearest representable half by scaling (finite values) */
    if (!isfinite(f)) return f;
    float a = fabsf(f);
    if (a >= 65520.f) return copysignf(INFINITY, f);
    if (a < 0x1p-14f) return copysignf(rintf(a * 0x1p24f) * 0x1p-24f, f);
    uint32_t b = f32_bits(f);
    b = (b + 0xfffu + ((b >> 13) & 1u)) & 0xffffe000u;
    return bits_f32(b);
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

