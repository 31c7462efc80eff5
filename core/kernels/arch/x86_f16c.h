/* F16C: scalar half <-> float conversions (an x86 extension). Each returns 1 with the result
 * where the build has it, else 0 (generic/scalar.c then converts by bit manipulation). */
#if defined(__F16C__)
static inline float f16c_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline float f16c_round(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
#endif

static inline int f16_to_f32_hw(uint16_t h, float *out) {
#if defined(__F16C__)
    *out = f16c_to_f32(h);
    return 1;
#else
    (void)h; (void)out;
    return 0;
#endif
}

static inline int round_f16_hw(float f, float *out) {
#if defined(__F16C__)
    *out = f16c_round(f);
    return 1;
#else
    (void)f; (void)out;
    return 0;
#endif
}
