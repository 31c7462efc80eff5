/* quantplug-expert-pack native ggml kernels: Q4_0 / Q8_0 matrix-vector products on the packed
 * GGUF blocks, and their exact dequantization.
 *
 * Built on first use by native.py (the system C compiler, -O3 -march=native -fopenmp, cached per
 * source hash, compiler and CPU); loaded with ctypes. Plain C with a C ABI: no Python or torch
 * headers. OpenMP is the one torch itself uses: a library whose soname is libgomp.so.1 is already
 * loaded in the process, so these loops share torch's thread pool and torch.set_num_threads.
 *
 * Block layouts (ggml-org/llama.cpp ggml/src/ggml-common.h):
 *   Q4_0: 18 bytes = d (f16), qs[16]: x_j = d * ((qs[j] & 15) - 8), x_{j+16} = d * ((qs[j] >> 4) - 8)
 *   Q8_0: 34 bytes = d (f16), qs[32] int8: x_j = d * qs[j]
 *   Q2_K / Q3_K / Q4_K / Q5_K / Q6_K: super-blocks of 256 (84 / 110 / 144 / 176 / 210 bytes), dequantized as gguf-py does
 *   (deq_q4_k_sb etc.; the build passes -ffp-contract=off so "d * q - m" is never fused); matrix
 *   products on them always take the exact path (there is no int8-block form of their scales).
 *
 * Type codes: 0 Q4_0, 1 Q8_0, 2 float32 rows (MLA K/V copies only), 3 Q4_K, 4 Q5_K, 5 Q6_K,
 * 6 Q2_K, 7 Q3_K.
 *
 * qpk_gemm computes, for each group g:
 *   y[yr[g] + i, yc[g] + j] = sum_k x[xr[g] + i, k] * W_g[j, k]   (i < xm[g], j < n[g])
 * with W_g the packed rows at w[g]. One call covers a linear (G = 1), sibling projections of one
 * input (gate + up: G = 2, the same x rows, side by side in y), and a decode step's routed experts
 * (one group per expert). mode 0 "exact": the weights dequantized exactly (d * q in float32, as
 * gguf-py) and multiplied into float32 sums (order of the sum differs from a BLAS matmul; nothing
 * else). mode 1 "fast": llama.cpp's CPU path: each x row quantized to Q8_0-style int8 blocks
 * (scale amax / 127, float32 here, f16 in llama.cpp), integer block dot products, float32 sums.
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

#define QK 32
#define QKK 256

static inline int is_k(int t) { return t >= 3 && t <= 7; }
static inline int known(int t) { return t == 0 || t == 1 || is_k(t); }
static inline int64_t blk_elems(int t) { return is_k(t) ? QKK : t == 2 ? 1 : QK; }
static inline int64_t blk_bytes(int t) {
    switch (t) {
        case 0: return 18; case 1: return 34; case 2: return 4; case 3: return 144; case 4: return 176;
        case 5: return 210; case 6: return 84; default: return 110;
    }
}

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

int qpk_version(void) { return 1; }

/* Which SIMD path this build took: 3 AVX512-VNNI, 2 AVX2, 0 portable C. */
int qpk_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512F__)
    return 3;
#elif defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}

/* ---- exact dequantization (bit-exact with gguf-py: d * q in float32, no FMA) ---------------- */

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
static void deq_q4_k_sb(const uint8_t *b, float *o) {
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
static void deq_q5_k_sb(const uint8_t *b, float *o) {
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
static void deq_q6_k_sb(const uint8_t *b, float *o) {
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
            for (int half = 0; half < 2; half++) {  /* 16 values of one sub-block: one scale, one shift */
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
            for (int half = 0; half < 2; half++) {  /* 16 values of one sub-block */
                const int s = 8 * h + 2 * k + half, sh = 2 * k, bit = 4 * h + k;
                const float a = dl[s];
                const uint8_t *q = qs + 32 * h + 16 * half, *m = hm + 16 * half;
                float *y = o + 16 * s;
                for (int l = 0; l < 16; l++)
                    y[l] = (float)(((q[l] >> sh) & 3) - (((m[l] >> bit) & 1) ? 0 : 4)) * a;
            }
}

static void deq_block(int type, const uint8_t *b, float *o) {
    switch (type) {
        case 0: deq_q4_0_block(b, o); break;
        case 1: deq_q8_0_block(b, o); break;
        case 3: deq_q4_k_sb(b, o); break;
        case 4: deq_q5_k_sb(b, o); break;
        case 5: deq_q6_k_sb(b, o); break;
        case 6: deq_q2_k_sb(b, o); break;
        default: deq_q3_k_sb(b, o); break;
    }
}

/* nblocks blocks of type (0 Q4_0, 1 Q8_0, 3 Q4_K, 4 Q5_K, 5 Q6_K, 6 Q2_K, 7 Q3_K) from src into dst */
int qpk_dequantize(int type, int64_t nblocks, const uint8_t *src, float *dst) {
    if (!known(type)) return -1;
    const int64_t size = blk_bytes(type), n = blk_elems(type);
    #pragma omp parallel for schedule(static) if (nblocks * n >= 4096 * QK)
    for (int64_t i = 0; i < nblocks; i++) deq_block(type, src + i * size, dst + i * n);
    return 0;
}

/* ---- activations for the fast mode ------------------------------------------------------- */

/* One row of K floats -> int8 blocks q and their scales d.
 * A block holding a NaN or an infinity gets scale NaN, so every output it touches is NaN, as a
 * float matmul would give (never a finite number made from garbage codes). */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d) {
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
}

/* ---- block dot products ------------------------------------------------------------------- */

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
#endif

#define MT 4  /* x rows per pass over the weights */
#define RT 4  /* weight rows per pass over x */
#ifndef PF_AHEAD
#define PF_AHEAD 2048  /* bytes of a weight row prefetched ahead of the block in use */
#endif

#if defined(__AVX2__)
/* one block of RT weight rows as signed int8 codes (Q4_0: q - 8) */
static inline __m256i codes(int type, const uint8_t *blk) {
    if (type == 0) {
        __m128i qv = _mm_loadu_si128((const __m128i *)(blk + 2)), m = _mm_set1_epi8(15);
        __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qv, 4), m), _mm_and_si128(qv, m));
        return _mm256_sub_epi8(u, _mm256_set1_epi8(8));
    }
    return _mm256_loadu_si256((const __m256i *)(blk + 2));
}
#endif

/* fast: rows [r0, r1) of one packed matrix against xm quantized x rows (weights signed int8
 * codes v, x int8: dot = sum |v| * sign(x, v), llama.cpp's trick for an unsigned x signed product) */
static void fast_rows(int type, int64_t nb, const uint8_t *w, int64_t r0, int64_t r1, int xm,
                      const int8_t *xq, const float *xd, float *y, int64_t ldy) {
    const int size = type == 0 ? 18 : 34;
    for (int64_t r = r0; r < r1; r += RT) {
        int rt = r1 - r < RT ? (int)(r1 - r) : RT;
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
#if defined(__AVX2__)
            __m256 acc[RT][MT];
            for (int a = 0; a < RT; a++) for (int i = 0; i < MT; i++) acc[a][i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m256i v[RT], u[RT];
                float dw[RT];
                for (int a = 0; a < rt; a++) {
                    const uint8_t *blk = w + (r + a) * nb * size + b * size;
                    _mm_prefetch((const char *)(blk + PF_AHEAD), _MM_HINT_T0);
                    dw[a] = f16_to_f32(blk);
                    v[a] = codes(type, blk);
                    u[a] = _mm256_sign_epi8(v[a], v[a]);
                }
                for (int i = 0; i < mt; i++) {
                    int64_t xi = (int64_t)(i0 + i);
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + xi * nb * QK + b * QK));
                    float xdb = xd[xi * nb + b];
                    for (int a = 0; a < rt; a++) {
                        __m256i d = dot_u8s8(u[a], _mm256_sign_epi8(xv, v[a]));
                        acc[a][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(dw[a] * xdb), acc[a][i]);
                    }
                }
            }
            for (int i = 0; i < mt; i++)
                for (int a = 0; a < rt; a++) y[(int64_t)(i0 + i) * ldy + r + a] = hsum256(acc[a][i]);
#else
            for (int a = 0; a < rt; a++) {
                const uint8_t *wr = w + (r + a) * nb * size;
                for (int i = 0; i < mt; i++) {
                    int64_t xi = (int64_t)(i0 + i);
                    float acc = 0.f;
                    for (int64_t b = 0; b < nb; b++) {
                        const uint8_t *blk = wr + b * size;
                        const int8_t *xb = xq + xi * nb * QK + b * QK;
                        int32_t dot = 0;
                        if (type == 0) {
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

#if defined(__AVX512F__)
/* one block's 32 exact weights (d * q, float32, no FMA) in two registers */
static inline void deq_block512(int type, const uint8_t *blk, __m512 *lo, __m512 *hi) {
    __m512 d = _mm512_set1_ps(f16_to_f32(blk));
    __m128i l, h;
    if (type == 0) {
        __m128i qv = _mm_loadu_si128((const __m128i *)(blk + 2));
        __m128i m = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
        l = _mm_sub_epi8(_mm_and_si128(qv, m), eight);
        h = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qv, 4), m), eight);
    } else {
        l = _mm_loadu_si128((const __m128i *)(blk + 2));
        h = _mm_loadu_si128((const __m128i *)(blk + 18));
    }
    *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l)));
    *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h)));
}
#endif

/* exact: rows [r0, r1) against xm float32 x rows: each weight is d * q exactly (as gguf-py), the
 * products summed in float32 (fused multiply-add, as BLAS does) */
static void exact_rows(int type, int64_t nb, const uint8_t *w, int64_t r0, int64_t r1, int xm,
                       const float *x, int64_t ldx, float *y, int64_t ldy) {
    const int size = type == 0 ? 18 : 34;
    for (int64_t r = r0; r < r1; r += RT) {
        int rt = r1 - r < RT ? (int)(r1 - r) : RT;
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
#if defined(__AVX512F__)
            __m512 acc[RT][MT];
            for (int a = 0; a < RT; a++) for (int i = 0; i < MT; i++) acc[a][i] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m512 lo[RT], hi[RT];
                for (int a = 0; a < rt; a++) {
                    const uint8_t *blk = w + (r + a) * nb * size + b * size;
                    _mm_prefetch((const char *)(blk + PF_AHEAD), _MM_HINT_T0);
                    deq_block512(type, blk, &lo[a], &hi[a]);
                }
                for (int i = 0; i < mt; i++) {
                    const float *xb = x + (int64_t)(i0 + i) * ldx + b * QK;
                    __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
                    for (int a = 0; a < rt; a++)
                        acc[a][i] = _mm512_fmadd_ps(hi[a], x1, _mm512_fmadd_ps(lo[a], x0, acc[a][i]));
                }
            }
            for (int i = 0; i < mt; i++)
                for (int a = 0; a < rt; a++) y[(int64_t)(i0 + i) * ldy + r + a] = _mm512_reduce_add_ps(acc[a][i]);
#else
            float wf[QK];
            for (int a = 0; a < rt; a++) {
                const uint8_t *wr = w + (r + a) * nb * size;
                for (int i = 0; i < mt; i++) {
                    const float *xr_ = x + (int64_t)(i0 + i) * ldx;
                    float acc[8] = {0.f};
                    for (int64_t b = 0; b < nb; b++) {
                        if (type == 0) deq_q4_0_block(wr + b * size, wf); else deq_q8_0_block(wr + b * size, wf);
                        for (int j = 0; j < QK; j++) acc[j & 7] += wf[j] * xr_[b * QK + j];
                    }
                    float s = 0.f;
                    for (int j = 0; j < 8; j++) s += acc[j];
                    y[(int64_t)(i0 + i) * ldy + r + a] = s;
                }
            }
#endif
        }
    }
}

/* exact, K-quants: rows [r0, r1) against xm float32 x rows, each super-block dequantized once
 * per row (into 256 floats on the stack) and multiplied into float32 sums */
static void exact_rows_k(int type, int64_t nsb, const uint8_t *w, int64_t r0, int64_t r1, int xm,
                         const float *x, int64_t ldx, float *y, int64_t ldy) {
    const int64_t size = blk_bytes(type);
    float wf[QKK];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nsb * size;
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
#if defined(__AVX512F__)
            __m512 acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nsb; b++) {
                _mm_prefetch((const char *)(wr + b * size + PF_AHEAD), _MM_HINT_T0);
                deq_block(type, wr + b * size, wf);
                for (int i = 0; i < mt; i++) {
                    const float *xb = x + (int64_t)(i0 + i) * ldx + b * QKK;
                    for (int j = 0; j < QKK; j += 16)
                        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(wf + j), _mm512_loadu_ps(xb + j), acc[i]);
                }
            }
            for (int i = 0; i < mt; i++) y[(int64_t)(i0 + i) * ldy + r] = _mm512_reduce_add_ps(acc[i]);
#else
            float acc[MT][8];
            memset(acc, 0, sizeof acc);
            for (int64_t b = 0; b < nsb; b++) {
                deq_block(type, wr + b * size, wf);
                for (int i = 0; i < mt; i++) {
                    const float *xb = x + (int64_t)(i0 + i) * ldx + b * QKK;
                    for (int j = 0; j < QKK; j++) acc[i][j & 7] += wf[j] * xb[j];
                }
            }
            for (int i = 0; i < mt; i++) {
                float sum = 0.f;
                for (int j = 0; j < 8; j++) sum += acc[i][j];
                y[(int64_t)(i0 + i) * ldy + r] = sum;
            }
#endif
        }
    }
}

/* rows [r0, r1) of a packed matrix of any native type with K inputs: K-quants exact always; the
 * 32-blocks fast (x as int8 blocks) or exact by mode */
static void rows_any(int type, int mode, int64_t K, const uint8_t *w, int64_t r0, int64_t r1, int xm,
                     const float *x, int64_t ldx, const int8_t *xq, const float *xd, float *y, int64_t ldy) {
    if (is_k(type)) exact_rows_k(type, K / QKK, w, r0, r1, xm, x, ldx, y, ldy);
    else if (mode == 1) fast_rows(type, K / QK, w, r0, r1, xm, xq, xd, y, ldy);
    else exact_rows(type, K / QK, w, r0, r1, xm, x, ldx, y, ldy);
}

/* Least weight bytes per parallel task: a task must outweigh its scheduling. */
#define MIN_TASK_BYTES (8 * 1024)

int qpk_gemm(int type, int mode, int64_t M, int64_t K, const float *x, int64_t ldx,
             int G, const uint8_t *const *w, const int64_t *n, const int64_t *xr, const int64_t *xm,
             const int64_t *yr, const int64_t *yc, float *y, int64_t ldy) {
    if (!known(type) || (mode != 0 && mode != 1) || K <= 0 || K % blk_elems(type) || M <= 0 || G <= 0) return -1;
    const int64_t nb = K / blk_elems(type);
    const int64_t size = blk_bytes(type);
    int8_t *xq = NULL; float *xd = NULL;
    const int64_t nbq = K / QK;  /* activation blocks (fast mode) */
    if (is_k(type)) mode = 0;    /* no int8-block form: the exact path */
    if (mode == 1) {
        xq = (int8_t *)malloc((size_t)(M * K));
        xd = (float *)malloc(sizeof(float) * (size_t)(M * nbq));
        if (!xq || !xd) { free(xq); free(xd); return -2; }
        for (int64_t i = 0; i < M; i++) quantize_row(x + i * ldx, K, xq + i * K, xd + i * nbq);
    }
    /* tasks: (group, block of rows); about 4 per thread, at least RT rows and 8 KiB of weights each */
    int64_t total_bytes = 0, total = 0;
    for (int g = 0; g < G; g++) total_bytes += n[g] * nb * size * (xm[g] < MT ? 1 : xm[g] / MT);
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int64_t task_bytes = total_bytes / (4 * threads);
    if (task_bytes < MIN_TASK_BYTES) task_bytes = MIN_TASK_BYTES;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(G + 1)), *rows_per = (int64_t *)malloc(sizeof(int64_t) * (size_t)G);
    if (!first || !rows_per) { free(first); free(rows_per); free(xq); free(xd); return -2; }
    for (int g = 0; g < G; g++) {
        int64_t per_row = nb * size * (xm[g] < MT ? 1 : xm[g] / MT);
        int64_t r = (task_bytes / per_row + RT - 1) / RT * RT;
        rows_per[g] = r < RT ? RT : r;
        first[g] = total;
        total += (n[g] + rows_per[g] - 1) / rows_per[g];
    }
    first[G] = total;
    #pragma omp parallel for schedule(dynamic, 1) if (threads > 1 && total > 1 && total_bytes >= 2 * MIN_TASK_BYTES)
    for (int64_t t = 0; t < total; t++) {
        int g = 0;
        while (first[g + 1] <= t) g++;
        int64_t r0 = (t - first[g]) * rows_per[g], r1 = r0 + rows_per[g];
        if (r1 > n[g]) r1 = n[g];
        float *yg = y + yr[g] * ldy + yc[g];
        rows_any(type, mode, K, w[g], r0, r1, (int)xm[g], x + xr[g] * ldx, ldx,
                 mode == 1 ? xq + xr[g] * K : NULL, mode == 1 ? xd + xr[g] * nbq : NULL, yg, ldy);
    }
    free(first); free(rows_per); free(xq); free(xd);
    return 0;
}

/* ---- a gated MLP for one token (a decode step's routed experts, or one plain MLP) ----------- */

static inline float silu(float v) { return v / (1.f + expf(-v)); }

/* out[H] = sum over e (in order) of wt[e] * down_e(silu(gate_e x) * up_e x); wt NULL: weight 1.
 * gate_e / up_e: I rows of H / 32 blocks (types tg, tu); down_e: H rows of I / 32 blocks (td).
 * One parallel region: gate and up rows of every expert, then each expert's product (quantized
 * to int8 blocks in fast mode), then the down rows, then the weighted sum. */
int qpk_mlp_one(int tg, int tu, int td, int mode, int64_t H, int64_t I, const float *x, int E,
                const uint8_t *const *gate, const uint8_t *const *up, const uint8_t *const *down,
                const float *wt, float *out) {
    if (!known(tg) || !known(tu) || !known(td) || (mode != 0 && mode != 1)) return -1;
    if (H <= 0 || I <= 0 || H % QK || I % QK || H % blk_elems(tg) || H % blk_elems(tu) || I % blk_elems(td) || E <= 0)
        return -1;
    const int64_t nbh = H / QK, nbi = I / QK;
    const int64_t sg = blk_bytes(tg) * QK / blk_elems(tg), su = blk_bytes(tu) * QK / blk_elems(tu),
                  sd = blk_bytes(td) * QK / blk_elems(td);  /* bytes per 32 weights */
    float *hg = (float *)malloc(sizeof(float) * (size_t)(2 * E * I + E * H));
    int8_t *q = (int8_t *)malloc((size_t)(H + E * I));
    float *qd = (float *)malloc(sizeof(float) * (size_t)(nbh + E * nbi));
    if (!hg || !q || !qd) { free(hg); free(q); free(qd); return -2; }
    float *hu = hg + E * I, *yd = hu + E * I;
    int8_t *hq = q + H;
    float *hd = qd + nbh;
    if (mode == 1) quantize_row(x, H, q, qd);
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* rows per task: about 4 tasks per thread over each stage, a multiple of RT */
    int64_t rg = (2 * E * I) / (4 * threads), rd = (E * H) / (4 * threads);
    rg = rg < RT ? RT : (rg + RT - 1) / RT * RT;
    rd = rd < RT ? RT : (rd + RT - 1) / RT * RT;
    const int64_t per_i = (I + rg - 1) / rg, per_h = (H + rd - 1) / rd;
    const int64_t bytes = E * (I * nbh * (sg + su) + H * nbi * sd);
    #pragma omp parallel if (threads > 1 && bytes >= 4 * MIN_TASK_BYTES)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < 2 * E * per_i; t++) {
            int64_t e = t / (2 * per_i), rest = t % (2 * per_i);
            int is_up = rest >= per_i;
            int64_t r0 = (rest % per_i) * rg, r1 = r0 + rg > I ? I : r0 + rg;
            const uint8_t *w = is_up ? up[e] : gate[e];
            int ty = is_up ? tu : tg;
            float *y = (is_up ? hu : hg) + e * I;
            rows_any(ty, mode, H, w, r0, r1, 1, x, 0, q, qd, y, 0);
        }
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < E; e++) {
            float *g = hg + e * I, *u = hu + e * I;
            for (int64_t i = 0; i < I; i++) g[i] = silu(g[i]) * u[i];
            if (mode == 1) quantize_row(g, I, hq + e * I, hd + e * nbi);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < E * per_h; t++) {
            int64_t e = t / per_h, r0 = (t % per_h) * rd, r1 = r0 + rd > H ? H : r0 + rd;
            rows_any(td, mode, I, down[e], r0, r1, 1, hg + e * I, 0, hq + e * I, hd + e * nbi, yd + e * H, 0);
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < H; r++) {
            float acc = (wt ? wt[0] : 1.f) * yd[r];
            for (int e = 1; e < E; e++) acc += (wt ? wt[e] : 1.f) * yd[e * H + r];
            out[r] = acc;
        }
    }
    free(hg); free(q); free(qd);
    return 0;
}

/* ---- one MLA decode step (absorbed form), for one token of one sequence -------------------- */

/* Matrices: type 0 Q4_0, 1 Q8_0 (packed rows), 2 float32 rows. Per-head stacks (k_b, v_b) are
 * `heads` matrices `stride` bytes apart. */
typedef struct {
    int mode;                                 /* 0 exact, 1 fast */
    int64_t H, q_lora, kv_lora, rope, nope, v, nh;
    float eps_q, eps_kv, scale;
    const uint8_t *q_a; int t_q_a;            /* [q_lora, H] */
    const uint8_t *kv_a; int t_kv_a;          /* [kv_lora + rope, H] */
    const float *q_a_norm, *kv_a_norm;        /* [q_lora], [kv_lora] */
    const uint8_t *q_b; int t_q_b;            /* [nh * (nope + rope), q_lora] */
    const uint8_t *k_b; int t_k_b; int64_t s_k_b;   /* per head [kv_lora, nope] */
    const uint8_t *v_b; int t_v_b; int64_t s_v_b;   /* per head [v, kv_lora] */
    const uint8_t *o; int t_o;                /* [H, nh * v] */
    const float *rot;                         /* [rope, rope]: roped = x @ rot */
    int kv_mode;                              /* the K/V stacks' own mode (their scheme's kernels) */
} qpk_mla;

/* a row-major matrix's rows [r0, r1) times x (K values): packed types through the block kernels
 * (fast: x given as int8 blocks too), float32 rows as plain dots */
static void mat_rows(int type, int mode, const uint8_t *w, int64_t K, int64_t r0, int64_t r1, const float *x,
                     const int8_t *xq, const float *xd, float *y) {
    if (type == 2) {
        const float *wf = (const float *)w;
        for (int64_t r = r0; r < r1; r++) {
            const float *row = wf + r * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += row[k] * x[k];
            y[r] = acc;
        }
    } else rows_any(type, mode, K, w, r0, r1, 1, x, 0, xq, xd, y, 0);
}

static void rms_norm_row(float *x, int64_t n, const float *w, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * w[i];
}

static void rope_row(const float *x, const float *rot, int64_t d, float *out) {
    for (int64_t j = 0; j < d; j++) {
        float acc = 0.f;
        for (int64_t i = 0; i < d; i++) acc += x[i] * rot[i * d + j];
        out[j] = acc;
    }
}

/* a parallel-for over [0, n) rows of one matrix in RT-row tasks (inside a parallel region) */
#define ROWS_FOR(n, body)                                                   \
    _Pragma("omp for schedule(dynamic, 1)")                                 \
    for (int64_t t_ = 0; t_ < ((n) + 4 * RT - 1) / (4 * RT); t_++) {        \
        int64_t r0 = t_ * 4 * RT, r1 = r0 + 4 * RT > (n) ? (n) : r0 + 4 * RT; \
        body;                                                               \
    }

static int threads_for(int64_t bytes) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    return bytes >= 4 * MIN_TASK_BYTES ? threads : 1;
}

static int64_t mat_bytes(int type, int64_t rows, int64_t K) {
    return rows * (K / blk_elems(type) * blk_bytes(type));
}

/* q_a / kv_a, the norms, q_b, rope and the absorption of each head's q_nope through k_b:
 * qcat [nh, kv_lora + rope] = (q_nope k_b ‖ roped q_rope); kvrow [kv_lora + rope] = (normed latent ‖ roped key) */
int qpk_mla_pre(const qpk_mla *m, const float *x, float *qcat, float *kvrow) {
    const int64_t H = m->H, ql = m->q_lora, kl = m->kv_lora, rp = m->rope, np_ = m->nope, nh = m->nh;
    const int64_t qh = np_ + rp, qrows = nh * qh;
    float *qa = (float *)malloc(sizeof(float) * (size_t)(ql + kl + rp + qrows));
    int8_t *q8 = (int8_t *)malloc((size_t)(H + ql + nh * np_));
    float *d8 = (float *)malloc(sizeof(float) * (size_t)((H + ql + nh * np_) / QK + 1));
    if (!qa || !q8 || !d8) { free(qa); free(q8); free(d8); return -2; }
    float *kva = qa + ql, *qb = kva + kl + rp;
    int8_t *xq = q8, *qq = q8 + H, *pq = qq + ql;
    float *xd = d8, *qd = d8 + H / QK, *pd = qd + ql / QK;
    const int fast = m->mode == 1;
    if (fast) quantize_row(x, H, xq, xd);
    int64_t bytes = mat_bytes(m->t_q_a, ql, H) + mat_bytes(m->t_kv_a, kl + rp, H) + mat_bytes(m->t_q_b, qrows, ql);
    #pragma omp parallel num_threads(threads_for(bytes))
    {
        ROWS_FOR(ql + kl + rp, {
            if (r0 < ql) mat_rows(m->t_q_a, m->mode, m->q_a, H, r0, r1 < ql ? r1 : ql, x, xq, xd, qa);
            if (r1 > ql) mat_rows(m->t_kv_a, m->mode, m->kv_a, H, (r0 > ql ? r0 : ql) - ql, r1 - ql, x, xq, xd, kva);
        })
        #pragma omp single
        {
            rms_norm_row(qa, ql, m->q_a_norm, m->eps_q);
            if (fast) quantize_row(qa, ql, qq, qd);
            for (int64_t i = 0; i < kl; i++) kvrow[i] = kva[i];
            rms_norm_row(kvrow, kl, m->kv_a_norm, m->eps_kv);
            rope_row(kva + kl, m->rot, rp, kvrow + kl);
        }
        ROWS_FOR(qrows, mat_rows(m->t_q_b, m->mode, m->q_b, ql, r0, r1, qa, qq, qd, qb))
        #pragma omp for schedule(static)
        for (int64_t h = 0; h < nh; h++) {
            const float *qp = qb + h * qh;
            float *dst = qcat + h * (kl + rp);
            const uint8_t *kb = m->k_b + h * m->s_k_b;
            if (m->kv_mode == 1 && m->t_k_b != 2) quantize_row(qp, np_, pq + h * np_, pd + h * (np_ / QK));
            mat_rows(m->t_k_b, m->kv_mode, kb, np_, 0, kl, qp, pq + h * np_, pd + h * (np_ / QK), dst);
            rope_row(qp + np_, m->rot, rp, dst + kl);
        }
    }
    free(qa); free(q8); free(d8);
    return 0;
}

/* attention of every head on the n cached tokens (latent rows lat, ld_lat apart; roped keys kr,
 * ld_kr apart), each head's output through v_b, then o_proj: out [H] */
int qpk_mla_post(const qpk_mla *m, const float *qcat, const float *lat, int64_t ld_lat, const float *kr, int64_t ld_kr,
                 int64_t n, float *out) {
    const int64_t H = m->H, kl = m->kv_lora, rp = m->rope, nh = m->nh, vd = m->v;
    float *sc = (float *)malloc(sizeof(float) * (size_t)(nh * n + nh * kl + nh * vd));
    int8_t *q8 = (int8_t *)malloc((size_t)(nh * kl + nh * vd));
    float *d8 = (float *)malloc(sizeof(float) * (size_t)((nh * kl + nh * vd) / QK + 1));
    if (!sc || !q8 || !d8) { free(sc); free(q8); free(d8); return -2; }
    float *ol = sc + nh * n, *ov = ol + nh * kl;
    int8_t *lq = q8, *vq = q8 + nh * kl;
    float *ld = d8, *vdd = d8 + nh * kl / QK;
    const int fast = m->mode == 1;
    int64_t bytes = mat_bytes(m->t_o, H, nh * vd) + n * (kl + rp) * 4 * nh / 4;
    #pragma omp parallel num_threads(threads_for(bytes))
    {
        #pragma omp for schedule(static)
        for (int64_t h = 0; h < nh; h++) {
            const float *q = qcat + h * (kl + rp);
            float *s = sc + h * n, mx = -INFINITY, sum = 0.f;
            for (int64_t j = 0; j < n; j++) {
                const float *lj = lat + j * ld_lat, *kj = kr + j * ld_kr;
                float a = 0.f, b = 0.f;
                for (int64_t i = 0; i < kl; i++) a += q[i] * lj[i];
                for (int64_t i = 0; i < rp; i++) b += q[kl + i] * kj[i];
                s[j] = a * m->scale + b * m->scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            for (int64_t j = 0; j < n; j++) { s[j] = expf(s[j] - mx); sum += s[j]; }
            float inv = 1.f / sum, *o = ol + h * kl;
            for (int64_t i = 0; i < kl; i++) o[i] = 0.f;
            for (int64_t j = 0; j < n; j++) {
                const float p = s[j] * inv, *lj = lat + j * ld_lat;
                for (int64_t i = 0; i < kl; i++) o[i] += p * lj[i];
            }
            if (m->kv_mode == 1 && m->t_v_b != 2) quantize_row(o, kl, lq + h * kl, ld + h * (kl / QK));
            mat_rows(m->t_v_b, m->kv_mode, m->v_b + h * m->s_v_b, kl, 0, vd, o, lq + h * kl, ld + h * (kl / QK),
                     ov + h * vd);
        }
        #pragma omp single
        if (fast) quantize_row(ov, nh * vd, vq, vdd);
        ROWS_FOR(H, mat_rows(m->t_o, m->mode, m->o, nh * vd, r0, r1, ov, vq, vdd, out))
    }
    free(sc); free(q8); free(d8);
    return 0;
}
