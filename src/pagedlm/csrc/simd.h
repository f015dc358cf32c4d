// The x86 intrinsics the kernels use. Normally <immintrin.h>. A build with PAGEDLM_EMULATE_AVX512 on a CPU without
// AVX-512 (tests only: cbuild's "avx512-emulated" variant) takes the AVX-512 intrinsics from SIMDe's portable
// implementations (Debian's libsimde-dev) and declares the AVX-512 features present, so the kernels' AVX-512 VNNI and
// BF16 paths compile and run, slowly, on any x86-64 CPU and can be checked against the other builds. What SIMDe
// lacks is defined below from the instruction's documented semantics; inline asm gives way to intrinsics where
// PAGEDLM_EMULATED_AVX512 is set.
#pragma once

#if defined(PAGEDLM_EMULATE_AVX512) && !defined(__AVX512F__)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#undef _mm512_madd_epi16  // SIMDe's alias takes the masked form's four arguments
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

#include <cmath>
#include <cstdint>
#include <climits>
#include <cstring>

namespace pagedlm_emulated {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);
  } else if (exp == 31) {
    uint32_t bits = 0x7f800000u | (man << 13);
    std::memcpy(&f, &bits, 4);
  } else {
    uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &bits, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // vcvtneps2bf16: nearest even; a NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

}  // namespace pagedlm_emulated

inline __m512 _pagedlm_mm512_cvtph_ps(__m256i h) {
  alignas(32) uint16_t in[16];
  alignas(64) float out[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(in), h);
  for (int i = 0; i < 16; ++i) out[i] = pagedlm_emulated::half_to_float(in[i]);
  return _mm512_load_ps(out);
}
#define _mm512_cvtph_ps(h) _pagedlm_mm512_cvtph_ps(h)

inline __m256bh _pagedlm_mm512_cvtneps_pbh(__m512 a) {
  alignas(64) float in[16];
  simde__m256bh out;
  uint16_t bits[16];
  _mm512_store_ps(in, a);
  for (int i = 0; i < 16; ++i) bits[i] = pagedlm_emulated::float_to_bf16(in[i]);
  std::memcpy(&out, bits, sizeof(bits));
  return out;
}
#define _mm512_cvtneps_pbh(a) _pagedlm_mm512_cvtneps_pbh(a)

inline __m512 _pagedlm_mm512_shuffle_f32x4(__m512 a, __m512 b, int imm) {
  alignas(64) float fa[16], fb[16], out[16];
  _mm512_store_ps(fa, a);
  _mm512_store_ps(fb, b);
  for (int lane = 0; lane < 4; ++lane)
    std::memcpy(out + 4 * lane, (lane < 2 ? fa : fb) + 4 * ((imm >> (2 * lane)) & 3), 16);
  return _mm512_load_ps(out);
}
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm) _pagedlm_mm512_shuffle_f32x4(a, b, imm)

inline __m512i _pagedlm_mm512_cvtepu16_epi32(__m256i a) {
  alignas(32) uint16_t in[16];
  alignas(64) int32_t out[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(in), a);
  for (int i = 0; i < 16; ++i) out[i] = in[i];
  return _mm512_load_si512(out);
}
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) _pagedlm_mm512_cvtepu16_epi32(a)

#define PAGEDLM_EMU_LANES(name, ret, in_t, in_n, out_t, load_in, store_out, body)         \
  inline ret name(in_t a) {                                                                  \
    alignas(64) in_n src[64 / sizeof(in_n)];                                                 \
    alignas(64) out_t dst[16];                                                               \
    load_in;                                                                                 \
    for (int i = 0; i < 16; ++i) dst[i] = body;                                              \
    store_out;                                                                               \
  }
PAGEDLM_EMU_LANES(_pagedlm_mm512_cvtepi32_ps, __m512, __m512i, int32_t, float,
                  _mm512_store_si512(src, a), return _mm512_load_ps(dst), float(src[i]))
PAGEDLM_EMU_LANES(_pagedlm_mm512_cvtps_epi32, __m512i, __m512, float, int32_t,
                  _mm512_store_ps(src, a), return _mm512_load_si512(dst), int32_t(std::nearbyint(src[i])))
PAGEDLM_EMU_LANES(_pagedlm_mm512_cvtepi8_epi32, __m512i, __m128i, int8_t, int32_t,
                  _mm_store_si128(reinterpret_cast<__m128i*>(src), a), return _mm512_load_si512(dst), src[i])
PAGEDLM_EMU_LANES(_pagedlm_mm512_cvtepu8_epi32, __m512i, __m128i, uint8_t, int32_t,
                  _mm_store_si128(reinterpret_cast<__m128i*>(src), a), return _mm512_load_si512(dst), src[i])
#undef PAGEDLM_EMU_LANES
#define _mm512_cvtepi32_ps(a) _pagedlm_mm512_cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) _pagedlm_mm512_cvtps_epi32(a)
#define _mm512_cvtepi8_epi32(a) _pagedlm_mm512_cvtepi8_epi32(a)
#define _mm512_cvtepu8_epi32(a) _pagedlm_mm512_cvtepu8_epi32(a)

inline __m512 _pagedlm_mm512_mask_loadu_ps(__m512 src, __mmask16 k, const void* p) {
  alignas(64) float out[16];
  _mm512_store_ps(out, src);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(out + i, static_cast<const float*>(p) + i, 4);
  return _mm512_load_ps(out);
}
#define _mm512_mask_loadu_ps(src, k, p) _pagedlm_mm512_mask_loadu_ps(src, k, p)

inline int _pagedlm_mm512_mask_reduce_min_epi32(__mmask16 k, __m512i a) {
  alignas(64) int32_t v[16];
  _mm512_store_si512(v, a);
  int32_t m = INT32_MAX;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) m = v[i] < m ? v[i] : m;
  return m;
}
#define _mm512_mask_reduce_min_epi32(k, a) _pagedlm_mm512_mask_reduce_min_epi32(k, a)

inline int _pagedlm_mm512_reduce_add_epi32(__m512i a) {
  alignas(64) int32_t v[16];
  _mm512_store_si512(v, a);
  uint32_t s = 0;
  for (int i = 0; i < 16; ++i) s += uint32_t(v[i]);
  return int32_t(s);
}
#define _mm512_reduce_add_epi32(a) _pagedlm_mm512_reduce_add_epi32(a)

// GCC's order: halves of 256 bits, then of 128, then lanes (2, 3) onto (0, 1), then lane 1 onto lane 0.
template <class Op>
inline float _pagedlm_reduce_ps(__m512 a, Op op) {
  alignas(64) float v[16];
  _mm512_store_ps(v, a);
  float t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = op(v[8 + i], v[i]);
  for (int i = 0; i < 4; ++i) t6[i] = op(t3[4 + i], t3[i]);
  return op(op(t6[0], t6[2]), op(t6[1], t6[3]));
}
#define _mm512_reduce_add_ps(a) _pagedlm_reduce_ps(a, [](float x, float y) { return x + y; })
#define _mm512_reduce_max_ps(a) _pagedlm_reduce_ps(a, [](float x, float y) { return x > y ? x : y; })

#undef _knot_mask16
#define _knot_mask16(k) __mmask16(~(k))

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VNNI__ 1
#define __AVX512BF16__ 1
#define PAGEDLM_EMULATED_AVX512 1
#elif defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
