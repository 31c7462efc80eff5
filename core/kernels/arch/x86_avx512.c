/* AVX512 kernels: the fast VNNI tile, exact Q4_0 / Q8_0 / bfloat16 tiles, K-quant rows, the fused
 * scaled-form rows (INT4 / INT8 / FP8 / FP4) and the generic kernel's 512-bit sums. Included by
 * qp_kernels.c; compiled only where QP_AVX512 (QP_VNNI512) holds. */

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

#if defined(__AVX512BF16__)
/* the exact tile of a bfloat16 model on bfloat16 pairs (in->xb): each block's 32 weights rounded
 * to bfloat16 into one register (Q4_0: its 16-value table rounded, duplicated to 32 words and
 * looked up by vpermw, which reads an index's low 5 bits: the stray fifth bit of a low nibble's
 * byte picks the copy; Q8_0: both halves rounded by one conversion; bfloat16 rows: the stored
 * words), then one vdpbf16ps per x row where the float32 tile makes two FMAs. The weights are
 * exact_tile_32_bf16n's; the sums differ from its in order only. */
static inline __attribute__((always_inline)) void exact_tile_32_dp(const qp_mat *m, const qp_in *in, int64_t r, int i0,
                                                                  const int rt, const int mt, float *y, int64_t ldy) {
    const int type = m->type, size = type == QP_Q4_0 ? 18 : type == QP_Q8_0 ? 34 : 64;
    const int64_t nb = m->k / QK, ldw = m->ldw, ldxb = in->ldxb;
    const uint16_t *xb = in->xb + (int64_t)i0 * ldxb;
    const __m512 base = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    /* one or two x rows: two sums per row and x row (alternate blocks), so that the pair
     * instructions' latency overlaps */
    const int two = mt <= 2;
    __m512 acc0[RT][MT], acc1[RT][MT];
    for (int a = 0; a < rt; a++) for (int i = 0; i < mt; i++) acc0[a][i] = acc1[a][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[RT];
        for (int a = 0; a < rt; a++) {
            const uint8_t *blk = m->w + (r + a) * ldw + b * size;
            _mm_prefetch((const char *)(blk + RT * ldw), _MM_HINT_T1);
            if (type == QP_BF16) {
                w[a] = _mm512_loadu_si512((const void *)blk);
            } else {
                uint16_t h;
                memcpy(&h, blk, 2);
                const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)h));  /* exact */
                if (type == QP_Q4_0) {
                    const __m512 tab = _mm512_mul_ps(d, base);
                    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2));
                    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_srli_epi16(q, 4), q));
                    w[a] = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(tab, tab));
                } else {
                    const __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
                    const __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
                    w[a] = pair_words(lo, hi);
                }
            }
        }
        if (two && (b & 1)) {
            for (int i = 0; i < mt; i++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + i * ldxb + b * QK));
                for (int a = 0; a < rt; a++) acc1[a][i] = _mm512_dpbf16_ps(acc1[a][i], (__m512bh)w[a], xv);
            }
        } else {
            for (int i = 0; i < mt; i++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + i * ldxb + b * QK));
                for (int a = 0; a < rt; a++) acc0[a][i] = _mm512_dpbf16_ps(acc0[a][i], (__m512bh)w[a], xv);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int a = 0; a < rt; a++)
            y[(int64_t)(i0 + i) * ldy + r + a] = _mm512_reduce_add_ps(two ? _mm512_add_ps(acc0[a][i], acc1[a][i]) : acc0[a][i]);
}
#endif

/* wround: how the Q4_0 / Q8_0 weights are rounded (QR_NONE / QR_BF16 / QR_BF16_NORMAL; bfloat16
 * rows take QR_NONE: their values are already bfloat16). Where the input has bfloat16 pairs (a
 * bfloat16 model) and the weights round to normal bfloat16 values (Q4_0 / Q8_0 always; bfloat16
 * rows unless m->tiny), the pair tile. */
static void exact_rows_32(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy,
                          int wround) {
#if defined(__AVX512BF16__)
    if (in->xb && (wround == QR_BF16_NORMAL || (m->type == QP_BF16 && !m->tiny))) {
        __atomic_fetch_add(&qp_pair_count, 1, __ATOMIC_RELAXED);
        y -= r0;
        for (int64_t r = r0; r < r1; r += RT) {
            int rt = r1 - r < RT ? (int)(r1 - r) : RT;
            for (int i0 = 0; i0 < xm; i0 += MT) {
                int mt = xm - i0 < MT ? xm - i0 : MT;
                QP_TILE(exact_tile_32_dp, m, in, r, i0, rt, mt, y, ldy);
            }
        }
        return;
    }
#endif
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

#ifdef QP_AVX512
/* generic_rows on AVX512: each row's segments decoded into a buffer, multiplied into float32 sums in 2 x 16 lanes */
static void generic_rows512(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy, int wround) {
    y -= r0;
    const int64_t K = m->k, seg = seg_len(m);
    float buf[QKK] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        for (int i0 = 0; i0 < xm; i0 += MT) {
            int mt = xm - i0 < MT ? xm - i0 : MT;
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
        }
    }
}
#endif

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
#if defined(__AVX512BF16__)
/* 32 nibbles (16 bytes at element i of a packed row, element order) as vpermw indices: the low 5
 * bits of each word hold the nibble and a stray fifth bit, which a table duplicated to 32 words
 * ignores */
static inline __m512i idx32w(const uint8_t *row, int64_t i) {
#if defined(__AVX512VBMI__)
    /* word j's low byte = byte j / 2 (vpermb, the high bytes zeroed), shifted right by 4 for odd j */
    const __m512i sel = _mm512_set_epi8(0, 15, 0, 15, 0, 14, 0, 14, 0, 13, 0, 13, 0, 12, 0, 12, 0, 11, 0, 11, 0, 10, 0, 10,
                                        0, 9, 0, 9, 0, 8, 0, 8, 0, 7, 0, 7, 0, 6, 0, 6, 0, 5, 0, 5, 0, 4, 0, 4,
                                        0, 3, 0, 3, 0, 2, 0, 2, 0, 1, 0, 1, 0, 0, 0, 0);
    const __m512i sh = _mm512_set1_epi32(4 << 16);
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row + i / 2)));
    return _mm512_srlv_epi16(_mm512_maskz_permutexvar_epi8(0x5555555555555555ull, sel, b), sh);
#else
    const __m128i b = _mm_loadu_si128((const __m128i *)(row + i / 2)), h = _mm_srli_epi16(b, 4);
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(b, h), _mm_unpacklo_epi8(b, h)));
#endif
}
/* The scaled forms of a bfloat16 model on bfloat16 pairs (in->xb; weights known normal or zero:
 * !m->tiny): each 32 weights decoded and scaled as QP_SCALE16 does (float32), rounded to bfloat16
 * by one conversion (INT4 / FP4 with groups a multiple of 32: the group's 16-value table rounded,
 * duplicated and looked up by vpermw), then one vdpbf16ps per x row into one sum per row and x
 * row. Groups a multiple of 32, or of 16 (NVFP4: two groups a step). The same weights as the
 * float32-sum kernels above, the sums in another order. A tile: rt rows from r, mt x rows from i0. */
#define QP_PAIR_SCALED(NAME, RAWI, ANY, TAB, BASE)                                                  \
static inline __attribute__((always_inline)) void NAME##_tile(const qp_mat *m, const qp_in *in, int64_t r, int i0, \
                                                             const int rt, const int mt, float *y, int64_t ldy) { \
    const int64_t K = m->k, gk = m->gk, ldw = m->ldw, ldxb = in->ldxb;                              \
    const void *zp = ANY ? m->z : NULL;                                                             \
    const float gs = m->gs;                                                                         \
    const int has_g = ANY && m->gmode == QG_AFTER && gs != 1.f, nan = ANY && m->nan, wround = 0;    \
    const __m512 lut = _mm512_loadu_ps(E2M1), vg = _mm512_set1_ps(gs);                            \
    const int64_t ng = (K + gk - 1) / gk;                                                           \
    const uint16_t *xb = in->xb + (int64_t)i0 * ldxb;                                               \
    float svz[2 * RT][ng];  /* the rows' scales and zero points (ng <= QP_NG_MAX) */               \
    (void)lut; (void)nan; (void)wround;                                                             \
    for (int a = 0; a < rt; a++) row_scales(m, r + a, ng, svz[a], svz[RT + a]);                      \
    /* one or two x rows: two sums per row and x row (alternate 32-steps), so that the pair      \
     * instructions' latency overlaps */                                                            \
    const int two = mt <= 2;                                                                        \
    __m512 acc0[RT][MT], acc1[RT][MT];                                                              \
    for (int a = 0; a < rt; a++) for (int i = 0; i < mt; i++) acc0[a][i] = acc1[a][i] = _mm512_setzero_ps(); \
    int64_t j = 0, gnext = 0;  /* the step's group, where the next group begins */                  \
    __m512i tb[RT];                                                                                 \
    for (int64_t i = 0; i < K; i += 32) {                                                           \
        if (gk == 16) j = i >> 4;                                                                   \
        else if (i == gnext) {                                                                      \
            j = i ? j + 1 : 0;                                                                      \
            gnext += gk;                                                                            \
            if (TAB) for (int a = 0; a < rt; a++) {                                                 \
                const __m512 vs = _mm512_set1_ps(svz[a][j]), vz = _mm512_set1_ps(zp ? svz[RT + a][j] : 0.f); \
                __m512 tab;                                                                         \
                (void)vz;                                                                           \
                QP_SCALE16(BASE, tab)                                                               \
                tb[a] = (__m512i)_mm512_cvtne2ps_pbh(tab, tab);                                     \
            }                                                                                       \
        }                                                                                           \
        __m512i w[RT];                                                                              \
        for (int a = 0; a < rt; a++) {                                                              \
            const uint8_t *restrict row = m->w + (r + a) * ldw;                                     \
            if (i0 == 0) _mm_prefetch((const char *)(row + RT * ldw) + i, _MM_HINT_T1);              \
            if (TAB && gk != 16) { w[a] = _mm512_permutexvar_epi16(idx32w(row, i), tb[a]); continue; } \
            __m512 v0, v1;                                                                          \
            { const __m512 vs = _mm512_set1_ps(svz[a][j]), vz = _mm512_set1_ps(zp ? svz[RT + a][j] : 0.f); \
              (void)vz; QP_SCALE16(RAWI(i), v0) }                                                   \
            { const int64_t j1 = gk == 16 ? j + 1 : j;                                              \
              const __m512 vs = _mm512_set1_ps(svz[a][j1]), vz = _mm512_set1_ps(zp ? svz[RT + a][j1] : 0.f); \
              (void)vz; QP_SCALE16(RAWI(i + 16), v1) }                                              \
            w[a] = pair_words(v0, v1);                                                              \
        }                                                                                           \
        if (two && ((i >> 5) & 1)) {                                                                \
            for (int ii = 0; ii < mt; ii++) {                                                       \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + ii * ldxb + i)); \
                for (int a = 0; a < rt; a++) acc1[a][ii] = _mm512_dpbf16_ps(acc1[a][ii], (__m512bh)w[a], xv); \
            }                                                                                       \
        } else {                                                                                    \
            for (int ii = 0; ii < mt; ii++) {                                                       \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + ii * ldxb + i)); \
                for (int a = 0; a < rt; a++) acc0[a][ii] = _mm512_dpbf16_ps(acc0[a][ii], (__m512bh)w[a], xv); \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    for (int ii = 0; ii < mt; ii++)                                                                 \
        for (int a = 0; a < rt; a++)                                                                \
            y[(int64_t)(i0 + ii) * ldy + r + a] = _mm512_reduce_add_ps(two ? _mm512_add_ps(acc0[a][ii], acc1[a][ii]) : acc0[a][ii]); \
}                                                                                                   \
static void NAME(const qp_mat *m, const qp_in *in, int64_t r0, int64_t r1, int xm, float *y, int64_t ldy) { \
    y -= r0;                                                                                        \
    for (int64_t r = r0; r < r1; r += RT) {                                                         \
        const int rt = r1 - r < RT ? (int)(r1 - r) : RT;                                            \
        for (int i0 = 0; i0 < xm; i0 += MT) {                                                       \
            const int mt = xm - i0 < MT ? xm - i0 : MT;                                             \
            QP_TILE(NAME##_tile, m, in, r, i0, rt, mt, y, ldy);                                     \
        }                                                                                           \
    }                                                                                               \
}
QP_PAIR_SCALED(pair_int8, RAW_INT8, 1, 0, lut)
QP_PAIR_SCALED(pair_int4, RAW_INT4, 1, 1, INT4_BASE)
QP_PAIR_SCALED(pair_fp8, RAW_FP8, 1, 0, lut)
QP_PAIR_SCALED(pair_fp4, RAW_FP4, 1, 1, lut)
QP_PAIR_SCALED(pair_plain_int8, RAW_INT8, 0, 0, lut)
QP_PAIR_SCALED(pair_plain_int4, RAW_INT4, 0, 1, INT4_BASE)
QP_PAIR_SCALED(pair_plain_fp8, RAW_FP8, 0, 0, lut)
QP_PAIR_SCALED(pair_plain_fp4, RAW_FP4, 0, 1, lut)
#undef QP_PAIR_SCALED
#endif
#undef QP_SCALE16
#endif

#ifdef QP_VNNI512
/* Fast Q4_K / Q5_K / Q6_K against q8_K activation blocks (ggml's vec_dot_q*_K_q8_K arithmetic):
 * each super-block's codes as unsigned bytes in element order (Q6_K: q + 32), four registers of 64;
 * vpmaddubsw multiplies them by the signed x codes into 16-bit pair sums (at most 2 * 63 * 127, no
 * saturation), vpdpwssd multiplies those by the sub-block scales (16-bit words) into int32 lanes:
 * the exact sumi of llama.cpp's kernels; Q6_K's offset is -32 * sum scale * bsum (one more vpdpwssd
 * on the x block's bsums), Q4_K / Q5_K's mins sum min * bsum (the same, on the 8 mins). Then
 * d * dx * sumi (less dmin * dx * summ) into float32 lanes. A weight row's super-blocks are decoded
 * KQ_CH at a time into a buffer shared by every x row (a prompt reads and decodes each block once
 * per RT rows); each (weight row, x row)'s lane sums over a chunk are reduced and added to the
 * chunks before, the same operations whatever the number of x rows. */
#define KQ_CH 8
typedef struct { __m512i w[4], sc[4], mn; float d, dm; } kq8_blk;

static inline __attribute__((always_inline)) void kq8_decode(const int type, const uint8_t *b, kq8_blk *o) {
    const __m512i m4 = _mm512_set1_epi8(15);
    if (type == QP_Q6_K) {
        o->d = f16_to_f32(b + 208);
        o->dm = 0.f;
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        const __m512i s = _mm512_castsi256_si512(s16);
        /* register k holds values [64k, 64k + 64): words 8g .. 8g + 7 are sub-block 4k + g */
        for (int k = 0; k < 4; k++) {
            const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * k)),
                                                 _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                                                    15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
            o->sc[k] = _mm512_permutexvar_epi16(idx, s);
        }
        o->mn = _mm512_zextsi256_si512(_mm256_mullo_epi16(s16, _mm256_set1_epi16(-32)));
        const __m512i m3 = _mm512_set1_epi8(3);
        const __m512i ca = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        const __m512i cb = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
        for (int h = 0; h < 2; h++) {
            const __m512i L = _mm512_loadu_si512((const void *)(b + 64 * h));
            const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            o->w[2 * h] = _mm512_or_si512(_mm512_and_si512(L, m4),
                                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, ca), m3), 4));
            o->w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                              _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, cb), m3), 4));
        }
        return;
    }
    o->d = f16_to_f32(b);
    o->dm = f16_to_f32(b + 2);
    /* the 8 six-bit scales to bytes 0-7 and the 8 mins to bytes 8-15 (scale_min_k4's values) */
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t aux = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = aux;
    u[0] &= 0x3f3f3f3fu;
    const __m512i sm = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)u)));
    const __m512i w32 = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                         15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* register k: words 0-15 sub-block 2k, 16-31 sub-block 2k + 1; the mins: word w (< 16) min w / 2 */
    for (int k = 0; k < 4; k++)
        o->sc[k] = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16((short)(2 * k)), _mm512_srli_epi16(w32, 4)), sm);
    o->mn = _mm512_maskz_permutexvar_epi16(0xFFFFu, _mm512_add_epi16(_mm512_set1_epi16(8), _mm512_srli_epi16(w32, 1)), sm);
    const int five = type == QP_Q5_K;
    const uint8_t *qs = b + (five ? 48 : 16);
    const __m512i c4 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i H = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))) : _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
        __m512i w = _mm512_and_si512(_mm512_srlv_epi16(q, c4), m4);
        if (five) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * k))), _mm256_set1_epi8((char)(1 << (2 * k + 1))), 1);
            w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(H, bit), w, _mm512_set1_epi8(16));
        }
        o->w[k] = w;
    }
}

/* one tile: rt weight rows (their nc decoded super-blocks in buf, KQ_CH apart) times mt x rows from
 * i0, super-blocks sb0 .. sb0 + nc; first: the chunk's sums are stored, else added */
static inline __attribute__((always_inline)) void kq8_tile512(const kq8_blk *buf, const int nc, const qp_in *in, const int64_t K,
                                                             const int64_t sb0, const int q6, int64_t r, int i0, const int rt,
                                                             const int mt, float *y, int64_t ldy, const int first) {
    const int64_t nsb = K / QKK;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[RT][MT];
    for (int a = 0; a < rt; a++) for (int i = 0; i < mt; i++) acc[a][i] = _mm512_setzero_ps();
    for (int c = 0; c < nc; c++) {
        const int64_t sb = sb0 + c;
        for (int a = 0; a < rt; a++) {
            const kq8_blk *w = buf + a * KQ_CH + c;
            for (int i = 0; i < mt; i++) {
                const int64_t xi = i0 + i;
                const int8_t *xq = in->q8 + xi * K + sb * QKK;
                const __m512i bsv = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(in->bs + xi * (K / 16) + sb * 16)));
                const float dx = in->d8[xi * nsb + sb];
                __m512i s0 = _mm512_dpwssd_epi32(zero, _mm512_maddubs_epi16(w->w[0], _mm512_loadu_si512((const void *)xq)), w->sc[0]);
                __m512i s1 = _mm512_dpwssd_epi32(zero, _mm512_maddubs_epi16(w->w[1], _mm512_loadu_si512((const void *)(xq + 64))), w->sc[1]);
                s0 = _mm512_dpwssd_epi32(s0, _mm512_maddubs_epi16(w->w[2], _mm512_loadu_si512((const void *)(xq + 128))), w->sc[2]);
                s1 = _mm512_dpwssd_epi32(s1, _mm512_maddubs_epi16(w->w[3], _mm512_loadu_si512((const void *)(xq + 192))), w->sc[3]);
                if (q6) s1 = _mm512_dpwssd_epi32(s1, bsv, w->mn);
                const __m512i sumi = _mm512_add_epi32(s0, s1);
                acc[a][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(w->d * dx), acc[a][i]);
                if (!q6) {
                    const __m512i summ = _mm512_dpwssd_epi32(zero, bsv, w->mn);
                    acc[a][i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_set1_ps(w->dm * dx), acc[a][i]);
                }
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int a = 0; a < rt; a++) {
            const float v = _mm512_reduce_add_ps(acc[a][i]);
            float *o = y + (int64_t)(i0 + i) * ldy + r + a;
            *o = first ? v : *o + v;
        }
}

#define KQ8_TILE(Q6)                                                                                \
    do {                                                                                            \
        if (rt == RT && mt == MT) kq8_tile512(buf, nc, in, K, c0, Q6, r, i0, RT, MT, y, ldy, c0 == 0); \
        else if (rt == RT && mt == 1) kq8_tile512(buf, nc, in, K, c0, Q6, r, i0, RT, 1, y, ldy, c0 == 0); \
        else if (rt == RT && mt == 2) kq8_tile512(buf, nc, in, K, c0, Q6, r, i0, RT, 2, y, ldy, c0 == 0); \
        else if (rt == RT && mt == 3) kq8_tile512(buf, nc, in, K, c0, Q6, r, i0, RT, 3, y, ldy, c0 == 0); \
        else kq8_tile512(buf, nc, in, K, c0, Q6, r, i0, rt, mt, y, ldy, c0 == 0);                  \
    } while (0)

/* rows [r, r + rt) (rt <= RT) of a fast K-quant matrix against xm q8_K x rows */
static void fast_k_rows512(const qp_mat *m, const qp_in *in, int64_t r, int rt, int xm, float *y, int64_t ldy) {
    const int type = m->type;
    const int64_t K = m->k, nsb = K / QKK, bsize = type == QP_Q4_K ? 144 : type == QP_Q5_K ? 176 : 210;
    kq8_blk buf[RT * KQ_CH];
    for (int64_t c0 = 0; c0 < nsb; c0 += KQ_CH) {
        const int nc = nsb - c0 < KQ_CH ? (int)(nsb - c0) : KQ_CH;
        for (int a = 0; a < rt; a++)
            for (int c = 0; c < nc; c++) {
                const uint8_t *b = m->w + (r + a) * m->ldw + (c0 + c) * bsize;
                for (int64_t o = 0; o < bsize; o += 64) _mm_prefetch((const char *)(b + RT * m->ldw + o), _MM_HINT_T1);
                if (type == QP_Q6_K) kq8_decode(QP_Q6_K, b, &buf[a * KQ_CH + c]);
                else if (type == QP_Q5_K) kq8_decode(QP_Q5_K, b, &buf[a * KQ_CH + c]);
                else kq8_decode(QP_Q4_K, b, &buf[a * KQ_CH + c]);
            }
        for (int i0 = 0; i0 < xm; i0 += MT) {
            const int mt = xm - i0 < MT ? xm - i0 : MT;
            if (type == QP_Q6_K) KQ8_TILE(1);
            else KQ8_TILE(0);
        }
    }
}
#undef KQ8_TILE
#endif
