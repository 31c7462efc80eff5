/* F16C: scalar half <-> float conversions (an x86 extension; generic/scalar.c falls back to
 * bit manipulation without it) */
#if defined(__F16C__)
static inline float f16c_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline float f16c_round(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
#endif
