// GGUF's 2- to 8-bit block formats multiplied as the file stores them (no requantization): Q8_0, Q5_0, Q5_K, Q6_K,
// Q3_K, Q2_K, IQ4_NL and IQ4_XS, in x16 layouts like int4's (quant_linear.cpp's top comment: per tile of 16 output
// rows and 32-value block, chunk c = 0..3 holding, for row j, bytes 4c..4c+3 of that row's 16 nibble bytes, inputs 4c + i in the low
// nibbles and 16 + 4c + i in the high ones; Q8_0: the int8 x16 layout, 8 chunks of 4 values). Per tile and block:
//   Q8_0  codes 512 B (int8); scales fp16 d [nblk, 16]                         w = d * q
//   Q5_0  codes 256 B, planes 64 B (the 5th bit); scales fp16 d [nblk, 16]      w = d * (q - 16)
//   Q5_K  codes 256 B, planes 64 B; scales fp16 (d, dmin) [nblk / 8, 2, 16]; aux (sc, m) bytes [nblk, 2, 16]
//                                                                               w = (d * sc) * q - dmin * m
//   Q6_K  codes 256 B, planes 128 B (bits 4-5); scales fp16 d [nblk / 8, 16]; aux int8 sc of inputs 0-15 and 16-31
//         [nblk, 2, 16]                                                         w = (d * sc) * (q - 32)
//   Q3_K  codes 128 B (2-bit), planes 64 B (the 3rd bit); scales and aux as Q6_K's  w = (d * sc) * (q - 4)
//   Q2_K  codes 128 B (2-bit, Q3_K's layout); scales fp16 (d, dmin) [nblk / 8, 2, 16]; aux (sc, m) 4-bit values of
//         inputs 0-15 and 16-31 [nblk, 2 halves, 2, 16]                            w = (d * sc) * q - dmin * m
//   IQ4_NL codes 256 B (indices into kIq4 of 16 int8 values); scales fp16 d [nblk, 16]  w = d * kIq4[q]
//   IQ4_XS codes 256 B; scales fp16 d [nblk / 8, 16]; aux int8 sc [nblk, 16]        w = (d * sc) * kIq4[q]
// Planes, per chunk c and half h (rows 8h .. 8h + 7) of a block, for register byte p = 4 * (j % 8) + i (as the
// codes' 32 bytes of that chunk and half are ordered): Q5, 8 bytes: bit p of the first 32-bit word is the 5th bit
// of input 4c + i, bit p of the second that of input 16 + 4c + i; Q6_K, 16 bytes: byte p % 16 holds in bits 2f..2f+1
// the high bits of field f = (p >= 16) for input 4c + i and f = 2 + (p >= 16) for input 16 + 4c + i. Q3_K's planes
// are Q5's (the 3rd bit), its codes 2 bits: byte 64g + 4j + i of a block holds, from bit 0, the codes of inputs
// 4g + i, 4(g + 2) + i, 16 + 4g + i and 16 + 4(g + 2) + i (g = 0, 1), so chunk c is field c / 2 of group c % 2.
// Q8_0's and Q5_0's activations are Q8 per 32-value block (quantize_act) and every path computes each block's exact
// integer dot products, then the same fp32 operations: f = fma(dot, scale * d_x, f). The K-quants' activations are
// Q8 per 256 values (llama.cpp's Q8_K), so a super-block reduces in integers: Q5_K as Q4_K (q4k_rows: sums of sc x
// dot and of m x the activations' block sums, then Q4KSuper's finish), Q6_K and Q3_K the sum of sc x dot over their
// 16 half-blocks, then q6k_finish. On AVX-512 VNNI machines the products run gguf_x16_rows16, q5k_rows16 and q6k_rows16
// (16 outputs a pass, vpdpbusd: 2.6-3.6x the AVX2 code's rate at 8-256 rows on a Zen 4, 1.2-1.3x at one row of cold
// weights), but Q8_0's single rows, which take a VNNI kernel of their own (gguf_q8_0_row_tiles); elsewhere AVX2's
// gguf_x16_rows, compiled per kind.
#pragma once

#include <atomic>

enum GgufKind {
  GK_Q8_0 = 0, GK_Q5_0 = 1, GK_Q5_K = 2, GK_Q6_K = 3, GK_Q3_K = 4, GK_IQ4_NL = 5, GK_IQ4_XS = 6, GK_Q2_K = 7
};

// The K-quants (IQ4_XS too): super-blocks of 256 values, activations quantized per 256.
constexpr bool gguf_super(int kind) {
  return kind == GK_Q5_K || kind == GK_Q6_K || kind == GK_Q3_K || kind == GK_IQ4_XS || kind == GK_Q2_K;
}
// 2-bit codes (Q3_K's third bit in planes).
constexpr bool gguf_2bit(int kind) { return kind == GK_Q3_K || kind == GK_Q2_K; }
// Q6_K's shape: an fp16 d per super-block, an int8 scale per 16 values (Q3_K) or per 32 (IQ4_XS, both halves').
constexpr bool gguf_q6_shaped(int kind) { return kind == GK_Q6_K || kind == GK_Q3_K || kind == GK_IQ4_XS; }
constexpr bool gguf_iq4(int kind) { return kind == GK_IQ4_NL || kind == GK_IQ4_XS; }
// IQ4's 16 non-uniform values (llama.cpp's kvalues_iq4nl).
constexpr int8_t kIq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// A Q6_K output's super-block: is the sum of its 16 half-blocks' scale x dot (exact), dw its fp16 d, a the
// activations' scale; every build's fp32 operations.
inline float q6k_finish(int32_t is, float dw, float a, float f) { return std::fma(float(is) * dw, a, f); }

struct GgufX16 {
  int kind, nblk;
  const uint8_t* codes;
  const uint8_t* planes;
  const uint16_t* scales;
  const uint8_t* aux;

  int code_bytes() const { return kind == GK_Q8_0 ? 512 : gguf_2bit(kind) ? 128 : 256; }
  int plane_bytes() const {
    return kind == GK_Q6_K ? 128 : kind == GK_Q8_0 || kind == GK_Q2_K || gguf_iq4(kind) ? 0 : 64;
  }
  int aux_bytes() const {  // per block of a tile
    return kind == GK_IQ4_XS ? 16 : kind == GK_Q2_K ? 64 : gguf_super(kind) ? 32 : 0;
  }
  int scales_per_tile() const {
    return kind == GK_Q5_K || kind == GK_Q2_K ? nblk / 8 * 32 : gguf_q6_shaped(kind) ? nblk / 8 * 16 : nblk * 16;
  }
  // Q2_K's 4-bit scale and minimum of block b's inputs 0-15 (half 0) or 16-31 (half 1) for row j
  int q2_scale(int b, int half, int j) const { return aux[b * 64 + 32 * half + j]; }
  int q2_min(int b, int half, int j) const { return aux[b * 64 + 32 * half + 16 + j]; }
  bool split() const { return gguf_q6_shaped(kind); }  // two scales per block
  int q6_scale(int b, int half, int j) const {
    return int8_t(kind == GK_IQ4_XS ? aux[b * 16 + j] : aux[b * 32 + 16 * half + j]);
  }
  KScales kscales() const { return {scales, aux, nblk}; }  // Q5_K's: Q4_K's layout (q4k_rows)

  GgufX16 tile(int t) const {
    return {kind, nblk, codes + int64_t(t) * nblk * code_bytes(),
            planes ? planes + int64_t(t) * nblk * plane_bytes() : nullptr,
            scales + int64_t(t) * scales_per_tile(), aux ? aux + int64_t(t) * nblk * aux_bytes() : nullptr};
  }

  // The code of input v (0..31) of block b for row j (0..15) of this tile, as it multiplies the activation: Q8_0's
  // q, Q5_0's q - 16, Q5_K's q (0..31), Q6_K's q - 32, Q3_K's q - 4, IQ4's kIq4[q].
  int code(int b, int j, int v) const {
    const int c = (v % 16) / 4, i = v % 4, hi = v >= 16, h = j / 8, p = 4 * (j % 8) + i;
    if (kind == GK_Q8_0) return int8_t(codes[int64_t(b) * 512 + 64 * (v / 4) + 4 * j + i]);
    const uint8_t nib = gguf_2bit(kind) ? uint8_t(codes[int64_t(b) * 128 + 64 * (c % 2) + 4 * j + i] >> (2 * (c / 2)))
                                        : codes[int64_t(b) * 256 + 64 * c + 4 * j + i];
    int q = gguf_2bit(kind) ? (nib >> (4 * hi)) & 3 : hi ? nib >> 4 : nib & 0x0f;
    if (kind == GK_Q2_K) return q;
    if (gguf_iq4(kind)) return kIq4[q];
    if (kind == GK_Q6_K) {
      const uint8_t pb = planes[int64_t(b) * 128 + (2 * c + h) * 16 + p % 16];
      const int f = 2 * hi + (p >= 16);
      return (q | ((pb >> (2 * f)) & 3) << 4) - 32;
    }
    uint32_t bits;
    std::memcpy(&bits, planes + int64_t(b) * 64 + (2 * c + h) * 8 + 4 * hi, 4);
    if (kind == GK_Q3_K) return (q | int((bits >> p) & 1) << 2) - 4;
    q |= int((bits >> p) & 1) << 4;
    return kind == GK_Q5_0 ? q - 16 : q;
  }
  // The fp32 scale of block b's inputs 0-15 (half 0) or 16-31 (half 1) for row j, and its minimum (Q5_K).
  float scale(int b, int half, int j) const {
    switch (kind) {
      case GK_Q5_K: return half_to_float(scales[(b / 8) * 32 + j]) * float(aux[b * 32 + j]);
      case GK_Q2_K: return half_to_float(scales[(b / 8) * 32 + j]) * float(q2_scale(b, half, j));
      case GK_Q6_K:
      case GK_Q3_K:
      case GK_IQ4_XS: return half_to_float(scales[(b / 8) * 16 + j]) * float(q6_scale(b, half, j));
      default: return half_to_float(scales[b * 16 + j]);
    }
  }
  float min(int b, int j) const { return -(half_to_float(scales[(b / 8) * 32 + 16 + j]) * float(aux[b * 32 + 16 + j])); }
  float weight(int b, int j, int v) const {  // the dequantized weight, as gguf-py computes it
    const int q = code(b, j, v);
    if (kind == GK_Q5_K) return scale(b, 0, j) * float(q) - (-min(b, j));
    if (kind == GK_Q2_K)
      return scale(b, v >= 16, j) * float(q) - half_to_float(scales[(b / 8) * 32 + 16 + j]) * float(q2_min(b, v >= 16, j));
    return scale(b, v >= 16, j) * float(q);
  }

#ifdef PAGEDLM_AVX2
  // Chunk c, half h of block b as int8 multipliers of inputs 4c + i (lo) and 16 + 4c + i (hi): the codes as code()
  // gives them (Q5_K's unsigned, 0..31).
  template <int KIND>
  void load8(int b, int c, int h, __m256i& lo, __m256i& hi) const {
    if constexpr (KIND == GK_Q8_0) {
      const uint8_t* p = codes + int64_t(b) * 512 + 32 * h;
      lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c));
      hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * (c + 4)));
      return;
    }
    if constexpr (KIND == GK_Q2_K) {  // unsigned, 0..3
      const __m256i v = _mm256_srl_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + int64_t(b) * 128 + 64 * (c % 2) + 32 * h)),
          _mm_cvtsi32_si128(2 * (c / 2)));
      const __m256i m3 = _mm256_set1_epi8(3);
      lo = _mm256_and_si256(v, m3);
      hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m3);
      return;
    }
    if constexpr (KIND == GK_Q3_K) {
      const __m128i shift = _mm_cvtsi32_si128(2 * (c / 2));
      const __m256i v = _mm256_srl_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + int64_t(b) * 128 + 64 * (c % 2) + 32 * h)), shift);
      const __m256i m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(4);
      const uint8_t* pl = planes + int64_t(b) * 64 + (2 * c + h) * 8;
      lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v, m3), _mm256_srli_epi16(bit4(pl), 2)), off);
      hi = _mm256_sub_epi8(
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m3), _mm256_srli_epi16(bit4(pl + 4), 2)), off);
      return;
    }
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + int64_t(b) * 256 + 64 * c + 32 * h));
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    lo = _mm256_and_si256(v, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if constexpr (gguf_iq4(KIND)) {
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4)));
      lo = _mm256_shuffle_epi8(table, lo);
      hi = _mm256_shuffle_epi8(table, hi);
      return;
    }
    if constexpr (KIND == GK_Q6_K) {
      const __m256i pb = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + int64_t(b) * 128 + (2 * c + h) * 16)));
      const __m256i t = _mm256_srlv_epi32(pb, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
      const __m256i off = _mm256_set1_epi8(32);
      lo = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(t, 4), m30)), off);
      hi = _mm256_sub_epi8(_mm256_or_si256(hi, _mm256_and_si256(t, m30)), off);
      return;
    }
    const uint8_t* pl = planes + int64_t(b) * 64 + (2 * c + h) * 8;
    lo = _mm256_or_si256(lo, bit4(pl));
    hi = _mm256_or_si256(hi, bit4(pl + 4));
    if constexpr (KIND == GK_Q5_0) {
      lo = _mm256_sub_epi8(lo, _mm256_set1_epi8(16));
      hi = _mm256_sub_epi8(hi, _mm256_set1_epi8(16));
    }
  }
  // 0x10 in byte p where bit p of the 32-bit word at p is set.
  static __m256i bit4(const uint8_t* p) {
    int32_t bits;
    std::memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits), _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                    0x0303030303030303LL));
    const __m256i sel = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(0x10));
  }
  // 8 int32 lanes as int16 pairs (both halves the lane's value, which fits 16 bits): vpmaddwd's multipliers.
  static __m256i pairs16(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
  }
  // Q6_K's int8 scales of block b's inputs 0-15 (half 0) or 16-31 (half 1), rows 8h .. 8h + 7, as int16 pairs.
  __m256i scale_pairs8(int b, int half, int h) const {
    const uint8_t* p = aux + b * 32 + 16 * half + 8 * h;
    return pairs16(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // Q8_0's and Q5_0's scales of block b for the 8 rows of half h.
  __m256 scales8(int b, int h) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * 16 + 8 * h)));
  }
  // IQ4_XS's int8 scales of block b, rows 8h .. 8h + 7, as int32.
  __m256i iq4xs_scales8(int b, int h) const {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(aux + b * 16 + 8 * h)));
  }
  // Q5_K's 6-bit scales of block b, rows 8h .. 8h + 7, as int16 pairs.
  __m256i q5k_scale_pairs8(int b, int h) const { return pairs16(bytes8(aux + b * 32 + 8 * h)); }
#endif
#ifdef PAGEDLM_AVX512_VNNI
  // Block b's codes for the tile's 16 rows as vpdpbusd's unsigned multipliers, q[c] of inputs 4c..4c+3 (c = 0..7):
  // Q8_0's q + 128, Q5_0's and Q5_K's q (0..31), Q6_K's q (0..63), Q3_K's q (0..7), IQ4's kIq4[q] + 128. The dot then lacks
  // kKindOffset<KIND> times the activations' sum (of each half for Q6_K and Q3_K).
  template <int KIND>
  void load16(int b, __m512i* q) const {
    if constexpr (KIND == GK_Q8_0) {
      const __m512i flip = _mm512_set1_epi8(char(0x80));
      for (int c = 0; c < 8; ++c) q[c] = _mm512_xor_si512(_mm512_loadu_si512(codes + int64_t(b) * 512 + 64 * c), flip);
      return;
    }
    if constexpr (gguf_2bit(KIND)) {
      const __m512i m3 = _mm512_set1_epi8(3), bit = _mm512_set1_epi8(0x04);
      for (int g = 0; g < 2; ++g) {
        const __m512i v = _mm512_loadu_si512(codes + int64_t(b) * 128 + 64 * g);
        q[g] = _mm512_and_si512(v, m3);
        q[g + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 2), m3);
        q[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m3);
        q[g + 6] = _mm512_and_si512(_mm512_srli_epi16(v, 6), m3);
      }
      if constexpr (KIND == GK_Q2_K) return;
      for (int c = 0; c < 4; ++c) {  // Q5's planes (below), the 3rd bit
        uint32_t w[4];
        std::memcpy(w, planes + int64_t(b) * 64 + 16 * c, 16);
        q[c] = _mm512_or_si512(q[c], _mm512_maskz_mov_epi8(w[0] | uint64_t(w[2]) << 32, bit));
        q[4 + c] = _mm512_or_si512(q[4 + c], _mm512_maskz_mov_epi8(w[1] | uint64_t(w[3]) << 32, bit));
      }
      return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(codes + int64_t(b) * 256 + 64 * c);
      q[c] = _mm512_and_si512(v, m4);
      q[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      if constexpr (gguf_iq4(KIND)) {  // kIq4 + 128, each lane's table the same
        const __m512i table = _mm512_xor_si512(
            _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4))), _mm512_set1_epi8(char(0x80)));
        q[c] = _mm512_shuffle_epi8(table, q[c]);
        q[4 + c] = _mm512_shuffle_epi8(table, q[4 + c]);
      } else if constexpr (KIND == GK_Q6_K) {  // byte 32h + p: plane byte (2c + h) * 16 + p % 16, fields shifted by p >= 16
        const __m256i pb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes + int64_t(b) * 128 + 32 * c));
        const __m512i z =
            _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(pb));
        const __m512i t = _mm512_srlv_epi32(z, _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2));
        const __m512i m30 = _mm512_set1_epi8(0x30);
        q[c] = _mm512_or_si512(q[c], _mm512_and_si512(_mm512_slli_epi32(t, 4), m30));
        q[4 + c] = _mm512_or_si512(q[4 + c], _mm512_and_si512(t, m30));
      } else {  // Q5: bit 32h + p of (lo, hi) is bit p of word (2c + h) * 8 (+ 4 for hi)
        const uint8_t* pl = planes + int64_t(b) * 64 + 16 * c;
        uint32_t w[4];
        std::memcpy(w, pl, 16);
        const __m512i bit = _mm512_set1_epi8(0x10);
        q[c] = _mm512_or_si512(q[c], _mm512_maskz_mov_epi8(w[0] | uint64_t(w[2]) << 32, bit));
        q[4 + c] = _mm512_or_si512(q[4 + c], _mm512_maskz_mov_epi8(w[1] | uint64_t(w[3]) << 32, bit));
      }
    }
  }
  // Q8_0's and Q5_0's scales of block b for the tile's 16 rows.
  __m512 scales16(int b) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + b * 16)));
  }
#endif
};

#ifdef PAGEDLM_AVX2
constexpr int PF_BLOCKS = 8;  // blocks ahead that gguf_x16_rows prefetches (2 KB of 4-bit codes)

// f(std::integral_constant<int, kind>): the AVX2 kernels take the kind at compile time.
template <class F>
void with_kind(int kind, F&& f) {
  switch (kind) {
    case GK_Q8_0: return f(std::integral_constant<int, GK_Q8_0>{});
    case GK_Q5_0: return f(std::integral_constant<int, GK_Q5_0>{});
    case GK_Q5_K: return f(std::integral_constant<int, GK_Q5_K>{});
    case GK_Q3_K: return f(std::integral_constant<int, GK_Q3_K>{});
    case GK_IQ4_NL: return f(std::integral_constant<int, GK_IQ4_NL>{});
    case GK_IQ4_XS: return f(std::integral_constant<int, GK_IQ4_XS>{});
    case GK_Q2_K: return f(std::integral_constant<int, GK_Q2_K>{});
    default: return f(std::integral_constant<int, GK_Q6_K>{});
  }
}

// Rows m0 + i0 .. m0 + i0 + R of x against H halves of tile n0 / 16 from half h0, over blocks b0 .. b1 (K-quants:
// whole super-blocks), the outputs' partial sums continuing from y (b0 > 0). vpmaddubsw over |w| and x with w's sign
// (pair sums in 16 bits: |w| <= 16 for Q5_0, 32 for Q6_K, 31 for Q5_K's unsigned codes, the K-quants' halves
// accumulating apart; Q8_0's go to 32 bits at once; Q5_K's codes, unsigned, need no sign). bpair: Q5_K's
// (quantize_act's), else unused.
template <int KIND, int R, int H>
void gguf_x16_rows(const GgufX16& w, const int8_t* xq, const float* d, const int32_t* bpair, float* y, int N, int n0,
                   int m0, int i0, int h0, int b0, int b1) {
  const int nblk = w.nblk;
  // wide: products that may pass 16 bits over a block (|w| up to 127) go to 32 bits at once
  constexpr bool wide = KIND == GK_Q8_0 || gguf_iq4(KIND), q5k = KIND == GK_Q5_K, q2k = KIND == GK_Q2_K;
  constexpr bool split = KIND == GK_Q6_K || KIND == GK_Q3_K || q5k || q2k, iq4xs = KIND == GK_IQ4_XS;
  constexpr bool uns = q5k || q2k;  // unsigned codes: no sign trick
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xg = xq + int64_t(m0) * nblk * 32;
  const float* dg = d + int64_t(m0) * nblk;
  __m256 f[R][H];
  __m256i is[R][H], ms[R][H];  // the K-quants' super-block sums (ms: Q2_K's minimums x the halves' sums)
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) {
      f[i][h] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + int64_t(m0 + i0 + i) * N + n0 + 8 * (h0 + h));
      is[i][h] = ms[i][h] = _mm256_setzero_si256();
    }
  for (int b = b0; b < b1; ++b) {
    if (i0 == 0 && h0 == 0) {  // the block PF_BLOCKS ahead, every line of its codes and high bits
      prefetch_lines(w.codes + int64_t(b + PF_BLOCKS) * w.code_bytes(), w.code_bytes());
      if (w.planes) prefetch_lines(w.planes + int64_t(b + PF_BLOCKS) * w.plane_bytes(), w.plane_bytes());
    }
    const int8_t* xb = xg + int64_t(b) * 256 + 32 * i0;
    __m256i a0[R][H], a1[R][H];  // 16-bit pair sums (a1: the K-quants' second half), or Q8_0's 32-bit sums in a0
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h) a0[i][h] = a1[i][h] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i xl[R], xh[R];
      for (int i = 0; i < R; ++i) xl[i] = bcast4(xb + 32 * i + 4 * c), xh[i] = bcast4(xb + 32 * i + 16 + 4 * c);
      for (int h = 0; h < H; ++h) {
        __m256i lo, hi;
        w.load8<KIND>(b, c, h0 + h, lo, hi);
        const __m256i al = uns ? lo : _mm256_abs_epi8(lo), ah = uns ? hi : _mm256_abs_epi8(hi);
        for (int i = 0; i < R; ++i) {
          const __m256i pl = _mm256_maddubs_epi16(al, uns ? xl[i] : _mm256_sign_epi8(xl[i], lo));
          const __m256i ph = _mm256_maddubs_epi16(ah, uns ? xh[i] : _mm256_sign_epi8(xh[i], hi));
          if constexpr (wide) {
            a0[i][h] = _mm256_add_epi32(a0[i][h], _mm256_add_epi32(_mm256_madd_epi16(pl, ones),
                                                                   _mm256_madd_epi16(ph, ones)));
          } else if constexpr (split) {
            a0[i][h] = _mm256_add_epi16(a0[i][h], pl);
            a1[i][h] = _mm256_add_epi16(a1[i][h], ph);
          } else {
            a0[i][h] = _mm256_add_epi16(a0[i][h], _mm256_add_epi16(pl, ph));
          }
          keep_chain(a0[i][h]);
          if constexpr (split) keep_chain(a1[i][h]);
        }
      }
    }
    const float* db = dg + int64_t(b) * 8 + i0;
    for (int h = 0; h < H; ++h) {
      if constexpr (q5k) {  // as q4k_rows_avx2: sc x the block's dot in integers, Q4KSuper8 at the super-block's end
        const __m256i sc = w.q5k_scale_pairs8(b, h0 + h);
        for (int i = 0; i < R; ++i)
          is[i][h] = _mm256_add_epi32(is[i][h], _mm256_add_epi32(_mm256_madd_epi16(a0[i][h], sc),
                                                                 _mm256_madd_epi16(a1[i][h], sc)));
        if (b % 8 == 7) {
          const Q4KSuper8 sup(w.kscales(), b / 8, 8 * (h0 + h));
          const int32_t* pg = bpair + int64_t(m0) * (nblk / 2) + int64_t(b / 8) * 32 + i0;
          for (int i = 0; i < R; ++i) {
            f[i][h] = sup.finish(is[i][h], pg + i, db[i], f[i][h]);
            is[i][h] = _mm256_setzero_si256();
          }
        }
      } else if constexpr (q2k) {  // sc x the halves' dots and m x their activation sums (bpair: hsum); q4k_finish
        const uint8_t* a = w.aux + b * 64 + 8 * (h0 + h);
        const __m256i sc0 = GgufX16::pairs16(bytes8(a)), sc1 = GgufX16::pairs16(bytes8(a + 32));
        const __m256i mn0 = bytes8(a + 16), mn1 = bytes8(a + 48);
        const int32_t* hs = bpair + 2 * (int64_t(m0) * nblk + int64_t(b) * 8 + i0);
        for (int i = 0; i < R; ++i) {
          is[i][h] = _mm256_add_epi32(is[i][h], _mm256_add_epi32(_mm256_madd_epi16(a0[i][h], sc0),
                                                                 _mm256_madd_epi16(a1[i][h], sc1)));
          ms[i][h] = _mm256_add_epi32(ms[i][h], _mm256_add_epi32(_mm256_mullo_epi32(mn0, _mm256_set1_epi32(hs[2 * i])),
                                                                 _mm256_mullo_epi32(mn1, _mm256_set1_epi32(hs[2 * i + 1]))));
        }
        if (b % 8 == 7) {
          const uint16_t* dd = w.scales + (b / 8) * 32 + 8 * (h0 + h);
          const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd)));
          const __m256 nmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd + 16))),
                                            _mm256_set1_ps(-0.f));
          for (int i = 0; i < R; ++i) {
            const __m256 inner = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[i][h]), dw,
                                                 _mm256_mul_ps(_mm256_cvtepi32_ps(ms[i][h]), nmin));
            f[i][h] = _mm256_fmadd_ps(inner, _mm256_set1_ps(db[i]), f[i][h]);
            is[i][h] = ms[i][h] = _mm256_setzero_si256();
          }
        }
      } else if constexpr (iq4xs) {  // the block's dot times its scale, in integers; q6k_finish per super-block
        const __m256i sc = w.iq4xs_scales8(b, h0 + h);
        for (int i = 0; i < R; ++i) is[i][h] = _mm256_add_epi32(is[i][h], _mm256_mullo_epi32(a0[i][h], sc));
        if (b % 8 == 7) {
          const __m256 dw = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + (b / 8) * 16 + 8 * (h0 + h))));
          for (int i = 0; i < R; ++i) {
            f[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(is[i][h]), dw), _mm256_set1_ps(db[i]), f[i][h]);
            is[i][h] = _mm256_setzero_si256();
          }
        }
      } else if constexpr (split) {  // Q6_K, Q3_K: the halves' pair sums times their scales, in integers
        const __m256i sc0 = w.scale_pairs8(b, 0, h0 + h), sc1 = w.scale_pairs8(b, 1, h0 + h);
        for (int i = 0; i < R; ++i)
          is[i][h] = _mm256_add_epi32(is[i][h], _mm256_add_epi32(_mm256_madd_epi16(a0[i][h], sc0),
                                                                 _mm256_madd_epi16(a1[i][h], sc1)));
        if (b % 8 == 7) {  // q6k_finish
          const __m256 dw = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + (b / 8) * 16 + 8 * (h0 + h))));
          for (int i = 0; i < R; ++i) {
            f[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(is[i][h]), dw), _mm256_set1_ps(db[i]), f[i][h]);
            is[i][h] = _mm256_setzero_si256();
          }
        }
      } else {
        const __m256 s0 = w.scales8(b, h0 + h);
        for (int i = 0; i < R; ++i) {
          const __m256i dot = wide ? a0[i][h] : _mm256_madd_epi16(a0[i][h], ones);
          f[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s0, _mm256_set1_ps(db[i])), f[i][h]);
        }
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(y + int64_t(m0 + i0 + i) * N + n0 + 8 * (h0 + h), f[i][h]);
}
#endif

#ifdef PAGEDLM_AVX512_VNNI
std::atomic<int64_t> gguf_vnni_products{0};  // products that ran gguf_x16_rows16 (tests see the path)

template <int KIND>
constexpr int kKindOffset = KIND == GK_Q8_0 || gguf_iq4(KIND) ? 128 : KIND == GK_Q6_K ? 32 : KIND == GK_Q3_K ? 4 : 16;

// 16 int32 lanes of a and b (each within int16) as int16 pairs (a, b): vpmaddwd's operands.
inline __m512i pair16(__m512i a, __m512i b) {
  return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(b, 16));
}

// The sum of four vpdpbusd of codes q[c0..c0+3] with the activations at xb + 4 * c0, from `init`.
inline __m512i dot_chunks4(__m512i init, const __m512i* q, const int8_t* xb) {
  for (int c = 0; c < 4; ++c) init = dpbusd_bcast(init, q[c], xb + 4 * c);
  return init;
}

// Rows m0 .. m0 + R of x (R <= 8, one packed group) against the 16 rows of tile n0 / 16 in one pass over its blocks,
// with AVX-512 VNNI: per block the exact integer dots the AVX2 code forms (vpdpbusd on load16's codes, less the
// offset times the activations' sum), then its fp32 operations in its order, so the results are gguf_x16_tile's in
// every build. Q8_0 and Q5_0 (the K-quants: q5k_rows16, q6k_rows16). Inlined: as a function of its own, GCC 12 kept
// the accumulators on the stack too (a store per row and block), 5-8% slower at 8-256 rows.
template <int KIND, int R>
__attribute__((always_inline)) inline void gguf_x16_rows16(const GgufX16& w, const int8_t* xq, const float* d,
                                                           const int32_t* bsum, float* y, int N, int n0, int m0) {
  const int nblk = w.nblk;
  const int64_t g0 = int64_t(m0) * nblk;  // this row group's blocks: xq [nblk, 8, 32], d / bsum [nblk, 8]
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  for (int b = 0; b < nblk; ++b) {
    if (m0 == 0) {
      prefetch_lines(w.codes + int64_t(b + PF_BLOCKS) * w.code_bytes(), w.code_bytes());
      if constexpr (KIND != GK_Q8_0 && !gguf_iq4(KIND))
        prefetch_lines(w.planes + int64_t(b + PF_BLOCKS) * w.plane_bytes(), w.plane_bytes());
    }
    __m512i q[8];
    w.load16<KIND>(b, q);
    const __m512 s0 = w.scales16(b);
    const int8_t* xb = xq + (g0 + int64_t(b) * 8) * 32;
    const int64_t mb = g0 + int64_t(b) * 8;
    for (int i = 0; i < R; ++i) {
      const int8_t* xi = xb + 32 * i;
      const __m512 dv = _mm512_set1_ps(d[mb + i]);
      const __m512i init = _mm512_set1_epi32(-kKindOffset<KIND> * bsum[mb + i]);
      const __m512i dot =
          _mm512_add_epi32(dot_chunks4(init, q, xi), dot_chunks4(_mm512_setzero_si512(), q + 4, xi + 16));
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s0, dv), f[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + int64_t(m0 + i) * N + n0, f[i]);
}

// Q5_K: q4k_rows with load16's 5-bit codes (the same scale layout, activations per 256 values and their bpair).
template <int R>
void q5k_rows16(const GgufX16& w, const int8_t* xq, const float* d, const int32_t* bpair, float* y, int N, int n0,
                int m0) {
  auto codes = [&](int b, __m512i* q) {
    if (m0 == 0) {
      prefetch_lines(w.codes + int64_t(b + PF_BLOCKS) * 256, 256);
      prefetch_lines(w.planes + int64_t(b + PF_BLOCKS) * 64, 64);
    }
    w.load16<GK_Q5_K>(b, q);
  };
  q4k_rows_of<R>(xq, d, bpair, codes, w.kscales(), y, w.nblk * 32, N, n0, m0);
}

// Q6_K and Q3_K: rows m0 .. m0 + R (activations per 256 values) against tile n0 / 16, each super-block reduced in
// integers: per block the two halves' exact dots (vpdpbusd on q, chains starting from hoff's -kKindOffset x the
// halves' sums) times their int8 scales, summed over the super-block; then its fp32 operations (q6k_finish's), as
// every build does.
template <int KIND, int R>
void q6k_rows16(const GgufX16& w, const int8_t* xq, const float* d, const int32_t* hoff, float* y, int N, int n0,
                int m0) {
  const int64_t g0 = int64_t(m0) * w.nblk;
  auto sc = [&](int b, int h) {
    const uint8_t* p = KIND == GK_IQ4_XS ? w.aux + b * 16 : w.aux + b * 32 + 16 * h;
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  auto add = [&](int b, __m512i* is) {
    if (m0 == 0) {
      prefetch_lines(w.codes + int64_t(b + PF_BLOCKS) * w.code_bytes(), w.code_bytes());
      if constexpr (KIND != GK_IQ4_XS)
        prefetch_lines(w.planes + int64_t(b + PF_BLOCKS) * w.plane_bytes(), w.plane_bytes());
    }
    __m512i q[8];
    w.load16<KIND>(b, q);
    const __m512i sc0 = sc(b, 0), sc1 = KIND == GK_IQ4_XS ? sc0 : sc(b, 1);
    const __m512i scp = KIND == GK_Q3_K ? pair16(sc0, sc1) : sc0;  // Q3_K's pair of scales, for vpmaddwd
    const int64_t mb = g0 + int64_t(b) * 8;
    for (int i = 0; i < R; ++i) {
      const int8_t* xi = xq + (mb + i) * 32;
      const __m512i d0 = dot_chunks4(_mm512_set1_epi32(hoff[2 * (mb + i)]), q, xi);
      const __m512i d1 = dot_chunks4(_mm512_set1_epi32(hoff[2 * (mb + i) + 1]), q + 4, xi + 16);
      if constexpr (KIND == GK_IQ4_XS)  // one scale a block
        is[i] = _mm512_add_epi32(is[i], _mm512_mullo_epi32(_mm512_add_epi32(d0, d1), sc0));
      else if constexpr (KIND == GK_Q3_K)  // |d| <= 16 x 4 x 127: both halves' products in one vpmaddwd
        is[i] = _mm512_add_epi32(is[i], _mm512_madd_epi16(pair16(d0, d1), scp));
      else
        is[i] = _mm512_add_epi32(is[i], _mm512_add_epi32(_mm512_mullo_epi32(d0, sc0), _mm512_mullo_epi32(d1, sc1)));
    }
  };
  auto finish = [&](int s0, const __m512i* is, __m512* f) {  // q6k_finish
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + (s0 / 8) * 16)));
    for (int i = 0; i < R; ++i)
      f[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(is[i]), dw), _mm512_set1_ps(d[g0 + int64_t(s0) * 8 + i]),
                             f[i]);
  };
  ksuper_rows<R>(w.nblk, add, finish, y, N, n0, m0);
}

// Q2_K: per block the two halves' dots of the unsigned codes times their scales, and their minimums times the
// halves' activation sums (hsum: [nblk, 8, 2] per row group), each summed over the super-block in integers; then
// q4k_finish's fp32 operations, as every build does.
template <int R>
void q2k_rows16(const GgufX16& w, const int8_t* xq, const float* d, const int32_t* hsum, float* y, int N, int n0,
                int m0) {
  const int64_t g0 = int64_t(m0) * w.nblk;
  __m512i ms[R];
  for (int i = 0; i < R; ++i) ms[i] = _mm512_setzero_si512();
  auto bytes16 = [&](int b, int at) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.aux + b * 64 + at)));
  };
  auto add = [&](int b, __m512i* is) {
    if (m0 == 0) prefetch_lines(w.codes + int64_t(b + PF_BLOCKS) * 128, 128);
    __m512i q[8];
    w.load16<GK_Q2_K>(b, q);
    // int16 pairs for vpmaddwd: the halves' dots (|d| <= 16 x 3 x 127) by their scales, their activation sums
    // (|s| <= 16 x 127) by their minimums
    const __m512i scp = pair16(bytes16(b, 0), bytes16(b, 32)), mnp = pair16(bytes16(b, 16), bytes16(b, 48));
    const int64_t mb = g0 + int64_t(b) * 8;
    for (int i = 0; i < R; ++i) {
      const int8_t* xi = xq + (mb + i) * 32;
      const __m512i d0 = dot_chunks4(_mm512_setzero_si512(), q, xi);
      const __m512i d1 = dot_chunks4(_mm512_setzero_si512(), q + 4, xi + 16);
      const int32_t* hs = hsum + 2 * (mb + i);
      is[i] = _mm512_add_epi32(is[i], _mm512_madd_epi16(pair16(d0, d1), scp));
      ms[i] = _mm512_add_epi32(ms[i], _mm512_madd_epi16(mnp, _mm512_set1_epi32((hs[0] & 0xffff) | hs[1] * 65536)));
    }
  };
  auto finish = [&](int s0, const __m512i* is, __m512* f) {  // q4k_finish
    const uint16_t* dd = w.scales + (s0 / 8) * 32;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd)));
    const __m512 nmin = _mm512_xor_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + 16))),
                                      _mm512_set1_ps(-0.f));
    for (int i = 0; i < R; ++i) {
      const __m512 inner = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i]), dw, _mm512_mul_ps(_mm512_cvtepi32_ps(ms[i]), nmin));
      f[i] = _mm512_fmadd_ps(inner, _mm512_set1_ps(d[g0 + int64_t(s0) * 8 + i]), f[i]);
      ms[i] = _mm512_setzero_si512();
    }
  };
  ksuper_rows<R>(w.nblk, add, finish, y, N, n0, m0);
}

template <int KIND>
void gguf_x16_tile16(const GgufX16& w, const int8_t* xq, const float* d, const int32_t* bsum, const int32_t* hoff,
                     float* y, int M, int N, int n0) {
  for_row_groups(M, [&](auto r, int m0) {
    constexpr int R = decltype(r)::value;
    if constexpr (gguf_q6_shaped(KIND)) q6k_rows16<KIND, R>(w, xq, d, hoff, y, N, n0, m0);
    else if constexpr (KIND == GK_Q2_K) q2k_rows16<R>(w, xq, d, hoff, y, N, n0, m0);
    else if constexpr (KIND == GK_Q5_K) q5k_rows16<R>(w, xq, d, bsum, y, N, n0, m0);
    else gguf_x16_rows16<KIND, R>(w, xq, d, bsum, y, N, n0, m0);
  });
}
#endif

// Tile t of a GGUF x16 weight against every row of x (packed activations, blocks of 32; the K-quants' per 256
// values): bsum their block sums (Q5_K: quantize_act's bpair); hoff, per block [nblk, 8, 2]: for Q6_K, Q3_K and
// IQ4_XS on AVX-512 VNNI -kKindOffset x the sum of its first and of its last 16 activations, read by the dot
// products' first instruction as a broadcast from memory, with no integer work per row; for Q2_K (every build) those
// two sums, which its minimums multiply.
void gguf_x16_tile(const GgufX16& weights, const int8_t* xq, const float* d, const int32_t* bsum, const int32_t* hoff,
                   float* y, int M, int N, int t) {
  const GgufX16 w = weights.tile(t);
  const int nblk = w.nblk, n0 = t * X16;
#ifdef PAGEDLM_AVX512_VNNI
  (void)nblk;
  switch (w.kind) {
    case GK_Q8_0: return gguf_x16_tile16<GK_Q8_0>(w, xq, d, bsum, hoff, y, M, N, n0);
    case GK_Q5_0: return gguf_x16_tile16<GK_Q5_0>(w, xq, d, bsum, hoff, y, M, N, n0);
    case GK_Q5_K: return gguf_x16_tile16<GK_Q5_K>(w, xq, d, bsum, hoff, y, M, N, n0);
    case GK_Q3_K: return gguf_x16_tile16<GK_Q3_K>(w, xq, d, bsum, hoff, y, M, N, n0);
    case GK_IQ4_NL: return gguf_x16_tile16<GK_IQ4_NL>(w, xq, d, bsum, hoff, y, M, N, n0);
    case GK_IQ4_XS: return gguf_x16_tile16<GK_IQ4_XS>(w, xq, d, bsum, hoff, y, M, N, n0);
    case GK_Q2_K: return gguf_x16_tile16<GK_Q2_K>(w, xq, d, bsum, hoff, y, M, N, n0);
    default: return gguf_x16_tile16<GK_Q6_K>(w, xq, d, bsum, hoff, y, M, N, n0);
  }
#elif defined(PAGEDLM_AVX2)
  if (w.kind == GK_Q2_K) bsum = hoff;  // its halves' activation sums
  with_kind(w.kind, [&](auto k) {
    constexpr int KIND = decltype(k)::value;
    for_row_groups(M, [&](auto r, int m0) {
      constexpr int R = decltype(r)::value;
      if constexpr (R == 1) {
        gguf_x16_rows<KIND, 1, 2>(w, xq, d, bsum, y, N, n0, m0, 0, 0, 0, nblk);  // one pass over the tile
      } else {
        for (int b0 = 0; b0 < nblk; b0 += X16_CHUNK) {
          const int b1 = std::min(nblk, b0 + X16_CHUNK);
          for (int h = 0; h < 2; ++h) {
            if constexpr (R > 4) {
              gguf_x16_rows<KIND, 4, 1>(w, xq, d, bsum, y, N, n0, m0, 0, h, b0, b1);
              gguf_x16_rows<KIND, R - 4, 1>(w, xq, d, bsum, y, N, n0, m0, 4, h, b0, b1);
            } else {
              gguf_x16_rows<KIND, R, 1>(w, xq, d, bsum, y, N, n0, m0, 0, h, b0, b1);
            }
          }
        }
      }
    });
  });
#else
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < X16; ++j) {
      float f = 0.f;
      int32_t is = 0, ms = 0;  // the K-quants' super-block sums
      for (int b = 0; b < nblk; ++b) {
        const int8_t* xb = xq + kPack8.xq(m, b, nblk);
        const int64_t mb = kPack8.blk(m, b, nblk);
        int dot[2] = {0, 0};
        for (int v = 0; v < 32; ++v) dot[v >= 16] += w.code(b, j, v) * xb[v];
        if (w.kind == GK_Q2_K) {
          is += w.q2_scale(b, 0, j) * dot[0] + w.q2_scale(b, 1, j) * dot[1];
          ms += w.q2_min(b, 0, j) * hoff[2 * mb] + w.q2_min(b, 1, j) * hoff[2 * mb + 1];
          if (b % 8 == 7) {
            const uint16_t* dd = w.scales + (b / 8) * 32;
            f = q4k_finish(is, ms, half_to_float(dd[j]), half_to_float(dd[16 + j]), d[mb], f), is = ms = 0;
          }
        } else if (w.kind == GK_Q5_K) {  // as q4k_tile
          is += int(w.aux[b * 32 + j]) * (dot[0] + dot[1]);
          ms += int(w.aux[b * 32 + 16 + j]) * bpair_sum(bsum[kPack8.blk(m, b / 2, nblk / 2)], b);
          if (b % 8 == 7) {
            const uint16_t* dd = w.scales + (b / 8) * 32;
            f = q4k_finish(is, ms, half_to_float(dd[j]), half_to_float(dd[16 + j]), d[mb], f), is = ms = 0;
          }
        } else if (w.split()) {
          is += w.q6_scale(b, 0, j) * dot[0] + w.q6_scale(b, 1, j) * dot[1];
          if (b % 8 == 7) f = q6k_finish(is, half_to_float(w.scales[(b / 8) * 16 + j]), d[mb], f), is = 0;
        } else {
          f = std::fma(float(dot[0] + dot[1]), w.scale(b, 0, j) * d[mb], f);
        }
      }
      y[int64_t(m) * N + n0 + j] = f;
    }
#endif
  (void)hoff;
  (void)bsum;
}

#ifdef PAGEDLM_AVX2
// One row of x against tiles t and t + 1, X16_CHUNK blocks of each in turn: two memory streams per core, as
// int4x16_row_tiles reads. Each tile's sums continue through y, so the results are gguf_x16_tile's.
void gguf_x16_row_pair(const GgufX16& weights, const int8_t* xq, const float* d, const int32_t* bsum, float* y, int N,
                       int t) {
  const GgufX16 w[2] = {weights.tile(t), weights.tile(t + 1)};
  with_kind(weights.kind, [&](auto k) {
    for (int b0 = 0; b0 < weights.nblk; b0 += X16_CHUNK)
      for (int u = 0; u < 2; ++u)
        gguf_x16_rows<decltype(k)::value, 1, 2>(w[u], xq, d, bsum, y, N, (t + u) * X16, 0, 0, 0, b0,
                                                std::min(weights.nblk, b0 + X16_CHUNK));
  });
}
#endif

#ifdef PAGEDLM_AVX512_VNNI
// Q8_0, one row of x against T tiles, blocks interleaved (int8x16_row_tiles with Q8_0's fp16 scale per block):
// vpdpbusd on q + 128, less 128 * the block's activation sum, is the exact integer dot product the AVX2 code forms,
// followed by the same fp32 operations, so the results are gguf_x16_tile's.
template <int T>
void gguf_q8_0_row_tiles(const GgufX16& weights, const int8_t* xq, const float* d, const int32_t* bsum, float* y,
                         int t) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  GgufX16 w[T];
  __m512 f[T];
  for (int u = 0; u < T; ++u) w[u] = weights.tile(t + u), f[u] = _mm512_setzero_ps();
  for (int b = 0; b < weights.nblk; ++b) {
    const int64_t mb = int64_t(b) * 8;
    const __m512i corr = _mm512_set1_epi32(128 * bsum[mb]);
    const __m512 dx = _mm512_set1_ps(d[mb]);
    for (int u = 0; u < T; ++u) {
      const uint8_t* wb = w[u].codes + int64_t(b) * 512;
      prefetch_lines(wb + PF_BLOCKS * 512, 512);
      __m512i q[8];
      for (int c = 0; c < 8; ++c) q[c] = _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * c), flip);
      const __m512i dot = _mm512_sub_epi32(dot_block32(q, xq + mb * 32), corr);
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[u].scales + b * 16)));
      f[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, dx), f[u]);
    }
  }
  for (int u = 0; u < T; ++u) _mm512_storeu_ps(y + (t + u) * X16, f[u]);
}
#endif

// Tile t of a GGUF x16 weight dequantized to rows of w [N, K] (fp32, or bf16 rounded to nearest even).
template <class Out>
void gguf_x16_dequant_tile(const GgufX16& weights, int K, int t, Out* w) {
  const GgufX16 g = weights.tile(t);
  for (int j = 0; j < X16; ++j) {
    Out* wj = w + (int64_t(t) * X16 + j) * K;
    for (int b = 0; b < g.nblk; ++b)
      for (int v = 0; v < 32; ++v) {
        const float f = g.weight(b, j, v);
        if constexpr (std::is_same_v<Out, uint16_t>) wj[b * 32 + v] = float_to_bf16(f);
        else wj[b * 32 + v] = f;
      }
  }
}

// One block of 32 values of a GGUF row: its codes (Q8_0: int8; else unsigned, the 5th / 6th bits included) and the
// scale words GgufX16 keeps for it. Returns false for an unknown kind.
struct RawBlock {
  int8_t q8[32];
  uint8_t q[32];
  uint16_t d, dmin;  // fp16 as stored
  uint8_t sc[2], m;  // Q5_K: sc[0], m (6-bit); Q6_K, Q3_K: sc[0], sc[1] (int8 bits); IQ4_XS: sc[0]
};

inline int gguf_block_bytes(int kind) {  // per 32 values (K-quants: per super-block of 256)
  switch (kind) {
    case GK_Q8_0: return 34;
    case GK_Q5_0: return 22;
    case GK_Q5_K: return 176;
    case GK_Q6_K: return 210;
    case GK_Q3_K: return 110;
    case GK_IQ4_NL: return 18;
    case GK_IQ4_XS: return 136;
    case GK_Q2_K: return 84;
    default: return 0;
  }
}

// Block b (of 32 values) of a raw GGUF row.
inline void gguf_read_block(int kind, const uint8_t* row, int b, RawBlock& o) {
  switch (kind) {
    case GK_Q8_0: {
      const uint8_t* blk = row + int64_t(b) * 34;
      std::memcpy(&o.d, blk, 2);
      std::memcpy(o.q8, blk + 2, 32);
      return;
    }
    case GK_Q5_0: {
      const uint8_t* blk = row + int64_t(b) * 22;
      uint32_t qh;
      std::memcpy(&o.d, blk, 2);
      std::memcpy(&qh, blk + 2, 4);
      for (int v = 0; v < 32; ++v) {
        const uint8_t byte = blk[6 + v % 16];
        o.q[v] = uint8_t(((v < 16 ? byte : byte >> 4) & 0x0f) | ((qh >> v) & 1) << 4);
      }
      return;
    }
    case GK_Q5_K: {
      const uint8_t* sb = row + int64_t(b / 8) * 176;
      const int k = b % 8;
      const uint8_t* s = sb + 4;
      std::memcpy(&o.d, sb, 2);
      std::memcpy(&o.dmin, sb + 2, 2);
      o.sc[0] = k < 4 ? s[k] & 63 : (s[k + 4] & 0x0f) | ((s[k - 4] >> 6) << 4);
      o.m = k < 4 ? s[k + 4] & 63 : (s[k + 4] >> 4) | ((s[k] >> 6) << 4);
      const uint8_t *qh = sb + 16, *qs = sb + 48 + 32 * (k / 2);
      for (int l = 0; l < 32; ++l) o.q[l] = uint8_t(((qs[l] >> (4 * (k % 2))) & 0x0f) | ((qh[l] >> k) & 1) << 4);
      return;
    }
    case GK_Q6_K: {
      const uint8_t* sb = row + int64_t(b / 8) * 210;
      const int k = b % 8, n = k / 4, s = k % 4;
      const uint8_t *ql = sb, *qh = sb + 128, *sc = sb + 192;
      std::memcpy(&o.d, sb + 208, 2);
      o.sc[0] = sc[8 * n + 2 * s];
      o.sc[1] = sc[8 * n + 2 * s + 1];
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo = (ql[64 * n + l + 32 * (s % 2)] >> (4 * (s / 2))) & 0x0f;
        o.q[l] = uint8_t(lo | ((qh[32 * n + l] >> (2 * s)) & 3) << 4);
      }
      return;
    }
    case GK_Q3_K: {  // hmask[32], qs[64], 12 bytes of 6-bit scales (+32), d; the 3rd bit set means no -4
      const uint8_t* sb = row + int64_t(b / 8) * 110;
      const int k = b % 8;
      const uint8_t *hm = sb, *qs = sb + 32 + 32 * (k / 4), *s = sb + 96;
      std::memcpy(&o.d, sb + 108, 2);
      for (int half = 0; half < 2; ++half) {
        const int i = 2 * k + half;
        const int lo4 = i < 8 ? s[i] & 0x0f : s[i - 8] >> 4, hi2 = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        o.sc[half] = uint8_t(int8_t((lo4 | hi2 << 4) - 32));
      }
      for (int l = 0; l < 32; ++l) o.q[l] = uint8_t(((qs[l] >> (2 * (k % 4))) & 3) | ((hm[l] >> k) & 1) << 2);
      return;
    }
    case GK_Q2_K: {  // 16 bytes of (sc | m << 4) per 16 values, qs[64] (Q3_K's order), d, dmin
      const uint8_t* sb = row + int64_t(b / 8) * 84;
      const int k = b % 8;
      const uint8_t* qs = sb + 16 + 32 * (k / 4);
      std::memcpy(&o.d, sb + 80, 2);
      std::memcpy(&o.dmin, sb + 82, 2);
      o.sc[0] = sb[2 * k], o.sc[1] = sb[2 * k + 1];  // both nibbles: write_row splits them
      for (int l = 0; l < 32; ++l) o.q[l] = (qs[l] >> (2 * (k % 4))) & 3;
      return;
    }
    case GK_IQ4_NL:
    case GK_IQ4_XS: {  // IQ4_XS: d, 2 bytes of the scales' high bits, 4 of their low nibbles, 128 of codes
      const uint8_t* qs;
      if (kind == GK_IQ4_NL) {
        std::memcpy(&o.d, row + int64_t(b) * 18, 2);
        qs = row + int64_t(b) * 18 + 2;
      } else {
        const uint8_t* sb = row + int64_t(b / 8) * 136;
        const int k = b % 8;
        uint16_t high;
        std::memcpy(&o.d, sb, 2);
        std::memcpy(&high, sb + 2, 2);
        o.sc[0] = uint8_t(int8_t((((sb[4 + k / 2] >> (4 * (k % 2))) & 0x0f) | ((high >> (2 * k)) & 3) << 4) - 32));
        qs = sb + 8 + 16 * k;
      }
      for (int l = 0; l < 32; ++l) o.q[l] = l < 16 ? qs[l] & 0x0f : qs[l - 16] >> 4;
      return;
    }
  }
}

// Row `dst` (tile t = dst / 16, j = dst % 16) of a GGUF x16 weight written from raw row `row`: codes and scale
// words are the row's own bytes; the plane bits it shares a byte with other rows are OR-ed in (planes start zeroed).
inline void gguf_write_row(const GgufX16& g, const uint8_t* row, int64_t dst) {
  const int64_t t = dst / X16;
  const int j = int(dst % X16), nblk = g.nblk, h = j / 8;
  const GgufX16 w = g.tile(int(t));
  uint8_t* codes = const_cast<uint8_t*>(w.codes);
  uint8_t* planes = const_cast<uint8_t*>(w.planes);
  uint16_t* scales = const_cast<uint16_t*>(w.scales);
  uint8_t* aux = const_cast<uint8_t*>(w.aux);
  RawBlock o;
  for (int b = 0; b < nblk; ++b) {
    gguf_read_block(g.kind, row, b, o);
    switch (g.kind) {
      case GK_Q8_0:
        for (int v = 0; v < 32; ++v) codes[int64_t(b) * 512 + 64 * (v / 4) + 4 * j + v % 4] = uint8_t(o.q8[v]);
        scales[b * 16 + j] = o.d;
        continue;
      case GK_Q5_0:
      case GK_IQ4_NL: scales[b * 16 + j] = o.d; break;
      case GK_IQ4_XS:
        if (b % 8 == 0) scales[(b / 8) * 16 + j] = o.d;
        aux[b * 16 + j] = o.sc[0];
        break;
      case GK_Q2_K:
        if (b % 8 == 0) scales[(b / 8) * 32 + j] = o.d, scales[(b / 8) * 32 + 16 + j] = o.dmin;
        for (int half = 0; half < 2; ++half) {
          aux[b * 64 + 32 * half + j] = o.sc[half] & 0x0f;
          aux[b * 64 + 32 * half + 16 + j] = o.sc[half] >> 4;
        }
        break;
      case GK_Q5_K:
        if (b % 8 == 0) scales[(b / 8) * 32 + j] = o.d, scales[(b / 8) * 32 + 16 + j] = o.dmin;
        aux[b * 32 + j] = o.sc[0];
        aux[b * 32 + 16 + j] = o.m;
        break;
      case GK_Q6_K:
      case GK_Q3_K:
        if (b % 8 == 0) scales[(b / 8) * 16 + j] = o.d;
        aux[b * 32 + j] = o.sc[0];
        aux[b * 32 + 16 + j] = o.sc[1];
        break;
    }
    if (gguf_2bit(g.kind)) {
      for (int grp = 0; grp < 2; ++grp)
        for (int i = 0; i < 4; ++i) {
          const uint8_t* q = o.q + 4 * grp + i;  // inputs 4g + i, 4(g + 2) + i, 16 + 4g + i, 16 + 4(g + 2) + i
          codes[int64_t(b) * 128 + 64 * grp + 4 * j + i] =
              uint8_t((q[0] & 3) | (q[8] & 3) << 2 | (q[16] & 3) << 4 | (q[24] & 3) << 6);
        }
      if (!planes) continue;  // Q2_K
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 4; ++i) {
          const int p = 4 * (j % 8) + i;
          uint8_t* word = planes + int64_t(b) * 64 + (2 * c + h) * 8;
          __atomic_fetch_or(word + p / 8, uint8_t(((o.q[4 * c + i] >> 2) & 1) << (p % 8)), __ATOMIC_RELAXED);
          __atomic_fetch_or(word + 4 + p / 8, uint8_t(((o.q[16 + 4 * c + i] >> 2) & 1) << (p % 8)), __ATOMIC_RELAXED);
        }
      continue;
    }
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 4; ++i) {
        const uint8_t ql = o.q[4 * c + i], qh = o.q[16 + 4 * c + i];
        codes[int64_t(b) * 256 + 64 * c + 4 * j + i] = uint8_t((ql & 0x0f) | (qh & 0x0f) << 4);
        if (!planes) continue;  // IQ4: 4-bit indices
        const int p = 4 * (j % 8) + i;
        if (g.kind == GK_Q6_K) {
          uint8_t* pb = planes + int64_t(b) * 128 + (2 * c + h) * 16 + p % 16;
          const int f = p >= 16;
          __atomic_fetch_or(pb, uint8_t((ql >> 4) << (2 * f) | (qh >> 4) << (2 * (2 + f))), __ATOMIC_RELAXED);
        } else {
          uint8_t* word = planes + int64_t(b) * 64 + (2 * c + h) * 8;
          __atomic_fetch_or(word + p / 8, uint8_t(((ql >> 4) & 1) << (p % 8)), __ATOMIC_RELAXED);
          __atomic_fetch_or(word + 4 + p / 8, uint8_t(((qh >> 4) & 1) << (p % 8)), __ATOMIC_RELAXED);
        }
      }
  }
}
