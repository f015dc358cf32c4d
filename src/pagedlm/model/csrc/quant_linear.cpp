// Weight-only quantized linear layers for CPUs: y[M, N] = x[M, K] @ W^T with W kept quantized in memory and
// dequantized in registers, so small-M products (decode) stream 1/4 (int8) or about 1/6 (int4) of the fp32
// bytes. Activations and accumulation are fp32. Plain C ABI, loaded with ctypes by model/quant/.
//
// int8: q [N, K] int8, one fp32 scale per output row:            W[n, k] = q[n, k] * s[n]
//       Packed (when N % 4 == 0 and K % 16 == 0): rows 4t..4t+3 form tile t, stored as K/16 chunks of 64 bytes,
//       chunk c = weights k = 16c..16c+15 of row 4t, then of rows 4t+1, 4t+2, 4t+3. A tile is then one sequential
//       stream instead of four interleaved ones: 1.3x the bandwidth on a 2-core EPYC (about 20 against 15 GB/s).
// int4: per output row, groups of G (a multiple of 32) inputs with an fp16 scale and minimum:
//       W[n, k] = q[n, k] * scale[n, k / G] + min[n, k / G], q in 0..15, packed 32 values per 16 bytes:
//       byte j of a 32-value chunk holds value j in its low nibble and value j + 16 in its high nibble.
//       Its activations are quantized per 32-value block to int8 (quantize_act), as llama.cpp pairs Q4_1
//       weights with Q8_1 activations, so blocks reduce with integer dot products: y = Q8(x) @ W^T. Converting
//       4-bit codes to fp32 instead was compute-bound at half the speed of the int8 path on 2 AVX2 cores.
//       Layout "x16" (int4_x16_layout; chosen where the CPU has AVX-512 VNNI and N % 16 == 0): the same bytes
//       reordered so that 16 output rows are read together, one column per 32-bit lane of a 512-bit register:
//       tile t = output rows 16t..16t+15; per 32-value block b of the inputs 256 bytes, chunk c (0..3) of 64
//       bytes holding, for row 16t + j, bytes 4c..4c+3 of that row's block (inputs 32b + 4c + i in the low
//       nibbles, 32b + 16 + 4c + i in the high ones); scales and minimums [N / 16, K / G, 16]. A vpdpbusd then
//       multiplies four inputs of 16 rows with one broadcast of four quantized activations, with no horizontal
//       sums; each of up to X16_ROWS rows of x reuses the unpacked codes. Per output: over blocks in order
//       f = fma(float(dot_b), scale_g * d_b, f), and at the end of each group f = fma(min_g, gsum_g, f).
//       GGUF Q4_K (INT4_X16_K) takes activations with one scale per 256 values and reduces each super-block in
//       integers first: see q4k_rows.
// int8 "x16" (where the CPU has AVX-512 VNNI and N % 16 == 0, K % 32 == 0): the same int8 values reordered as
//       int4's x16 layout orders its bytes: per tile of 16 rows and 32-value block 512 bytes, chunk c (0..7) holding
//       bytes 4c..4c+3 of each row's block. Activations are then quantized per 32-value block as for int4 (so this
//       layout computes y = Q8(x) @ W^T); vpdpbusd takes the weights as u8 (q + 128, corrected by 128 * the
//       block's activation sum). Per output: over blocks in order f = fma(float(dot_b), d_b, f); y = f * s.
// bf16 "x16" (bf16 checkpoints; where the CPU has AVX512-BF16): see pagedlm_linear_bf16_x16's section.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "../../csrc/pool.h"
#include "../../csrc/pagedlm.h"
#include "../../csrc/touch.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "../../csrc/simd.h"
#define PAGEDLM_AVX2 1
#endif
#if defined(PAGEDLM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDLM_AVX512_VNNI 1
#endif
#if defined(PAGEDLM_AVX512_VNNI) && defined(__AVX512BF16__)
#define PAGEDLM_AVX512_BF16 1
#endif

namespace {

using pagedlm_touch::touch_lines;

constexpr int NT = 4;  // output rows per tile: their weights are read once for every row of x
constexpr int PF_TILES = 8;
constexpr int PF_BYTES = 2048;  // prefetch distance in a packed stream

// One-row products (decode) read x16 tiles in pairs, two memory streams per core (int4x16_row_tiles,
// int8x16_row_tiles, gguf_q8_0_row_tiles, gguf_x16_row_pair), where that reads faster: a 2-core Sapphire Rapids
// decodes 1.13-1.18x as fast with pairs. A 2-core Zen 4 decodes a 1B Q4_K_M 1.13-1.16x as fast with one tile
// at a time, so pairs are off on AMD CPUs. The results are the same either way; pagedlm_row_pairs sets it.
#if defined(__x86_64__) || defined(__i386__)
std::atomic<int> row_pairs{[] {
  __builtin_cpu_init();  // this runs among the library's constructors
  return !__builtin_cpu_is("amd");
}()};
#else
std::atomic<int> row_pairs{1};
#endif
std::atomic<int64_t> row_pair_passes{0};  // passes over a weight that read its tiles in pairs (tests see the path)
std::atomic<int64_t> q8_0_row_passes{0};  // one-row passes over a GGUF Q8_0 weight by gguf_q8_0_row_tiles

// Whether a pass of `rows` rows reads tile pairs (counted once per pass, before its loops).
inline bool pairs_at(int rows) {
  const bool on = rows == 1 && row_pairs.load(std::memory_order_relaxed);
  if (on) row_pair_passes.fetch_add(1, std::memory_order_relaxed);
  return on;
}

// Software prefetches of every 64-byte line of [p, p + bytes): on a Zen 3 a stream whose every other line alone is
// prefetched reads at half the rate of one prefetched in full (its hardware prefetchers do not fill the gaps).
inline void prefetch_lines(const void* p, int bytes) {
  for (int o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, 3);
}

inline float half_to_float(uint16_t h) {
#ifdef PAGEDLM_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) { u = sign; }
    else {  // subnormal
      int e = -1; uint32_t m = man;
      do { ++e; m <<= 1; } while (!(m & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (m & 0x3ff) << 13;
    }
  } else if (exp == 31) { u = sign | 0x7f800000u | man << 13; }
  else { u = sign | (exp + 127 - 15) << 23 | man << 13; }
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}

#ifdef PAGEDLM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Rows n0 .. n0+nt of the int8 product for every row of x (nt <= NT).
void int8_tile(const float* x, const int8_t* q, const float* s, float* y, int M, int K, int N, int n0, int nt) {
  for (int m = 0; m < M; ++m) {
    const float* xm = x + int64_t(m) * K;
    float out[NT] = {0.f, 0.f, 0.f, 0.f};
    int k = 0;
#ifdef PAGEDLM_AVX2
    if (nt == NT) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      const int8_t *q0 = q + int64_t(n0) * K, *q1 = q0 + K, *q2 = q1 + K, *q3 = q2 + K;
      for (; k + 16 <= K; k += 16) {  // two independent chains per row hide the FMA latency
        if ((k & 63) == 0) {  // software prefetch, one line per row, PF_TILES tiles ahead: +35-50% from DRAM
          const char* p = reinterpret_cast<const char*>(q0 + k) + PF_TILES * NT * int64_t(K);
          _mm_prefetch(p, _MM_HINT_T0); _mm_prefetch(p + K, _MM_HINT_T0);
          _mm_prefetch(p + 2 * K, _MM_HINT_T0); _mm_prefetch(p + 3 * K, _MM_HINT_T0);
        }
        const __m256 xv = _mm256_loadu_ps(xm + k), xw = _mm256_loadu_ps(xm + k + 8);
        a0 = _mm256_fmadd_ps(load_i8(q0 + k), xv, a0);
        a1 = _mm256_fmadd_ps(load_i8(q1 + k), xv, a1);
        a2 = _mm256_fmadd_ps(load_i8(q2 + k), xv, a2);
        a3 = _mm256_fmadd_ps(load_i8(q3 + k), xv, a3);
        b0 = _mm256_fmadd_ps(load_i8(q0 + k + 8), xw, b0);
        b1 = _mm256_fmadd_ps(load_i8(q1 + k + 8), xw, b1);
        b2 = _mm256_fmadd_ps(load_i8(q2 + k + 8), xw, b2);
        b3 = _mm256_fmadd_ps(load_i8(q3 + k + 8), xw, b3);
      }
      for (; k + 8 <= K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xm + k);
        a0 = _mm256_fmadd_ps(load_i8(q0 + k), xv, a0);
        a1 = _mm256_fmadd_ps(load_i8(q1 + k), xv, a1);
        a2 = _mm256_fmadd_ps(load_i8(q2 + k), xv, a2);
        a3 = _mm256_fmadd_ps(load_i8(q3 + k), xv, a3);
      }
      out[0] = hsum(_mm256_add_ps(a0, b0)); out[1] = hsum(_mm256_add_ps(a1, b1));
      out[2] = hsum(_mm256_add_ps(a2, b2)); out[3] = hsum(_mm256_add_ps(a3, b3));
    }
#endif
    for (int j = 0; j < nt; ++j) {
      const int8_t* qj = q + int64_t(n0 + j) * K;
      float acc = out[j];
      for (int kk = (nt == NT ? k : 0); kk < K; ++kk) acc += float(qj[kk]) * xm[kk];
      y[int64_t(m) * N + n0 + j] = acc * s[n0 + j];
    }
  }
}

// Tile n0 / 4 of a packed int8 weight (see the top), for every row of x.
void int8p_tile(const float* x, const int8_t* q, const float* s, float* y, int M, int K, int N, int n0) {
  const int8_t* tile = q + int64_t(n0) * K;
  for (int m = 0; m < M; ++m) {
    const float* xm = x + int64_t(m) * K;
    float out[NT];
#ifdef PAGEDLM_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const int8_t* p = tile;
    for (int k = 0; k < K; k += 16, p += 64) {
      if (m == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + PF_BYTES, _MM_HINT_T0);
      const __m256 xv = _mm256_loadu_ps(xm + k), xw = _mm256_loadu_ps(xm + k + 8);
      a0 = _mm256_fmadd_ps(load_i8(p), xv, a0);
      b0 = _mm256_fmadd_ps(load_i8(p + 8), xw, b0);
      a1 = _mm256_fmadd_ps(load_i8(p + 16), xv, a1);
      b1 = _mm256_fmadd_ps(load_i8(p + 24), xw, b1);
      a2 = _mm256_fmadd_ps(load_i8(p + 32), xv, a2);
      b2 = _mm256_fmadd_ps(load_i8(p + 40), xw, b2);
      a3 = _mm256_fmadd_ps(load_i8(p + 48), xv, a3);
      b3 = _mm256_fmadd_ps(load_i8(p + 56), xw, b3);
    }
    out[0] = hsum(_mm256_add_ps(a0, b0)); out[1] = hsum(_mm256_add_ps(a1, b1));
    out[2] = hsum(_mm256_add_ps(a2, b2)); out[3] = hsum(_mm256_add_ps(a3, b3));
#else
    for (int r = 0; r < NT; ++r) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += float(tile[(k / 16) * 64 + r * 16 + k % 16]) * xm[k];
      out[r] = acc;
    }
#endif
    for (int r = 0; r < NT; ++r) y[int64_t(m) * N + n0 + r] = out[r] * s[n0 + r];
  }
}

// The 4 rows of packed tile n0 / 4 dequantized to fp32, [4, K].
void dequant_int8p_tile(const int8_t* q, const float* s, int K, int n0, float* w) {
  const int8_t* tile = q + int64_t(n0) * K;
  for (int c = 0; c < K / 16; ++c)
    for (int r = 0; r < NT; ++r) {
      const int8_t* src = tile + c * 64 + r * 16;
      float* dst = w + int64_t(r) * K + c * 16;
      const float sr = s[n0 + r];
      for (int i = 0; i < 16; ++i) dst[i] = float(src[i]) * sr;
    }
}

// Activations of the int4 product, quantized like llama.cpp's Q8 blocks: each 32-value block of a row of x
// becomes int8 values xq with one scale d = max|x| / 127 (xq = round-half-even(x / d); d = 1 for a zero block).
// With sblk = 8 (Q4_K and Q6_K, as llama.cpp's Q8_K) the 8 blocks of each 256 values share one scale, the max
// over all 256, stored in each block's slot of d.
// gsum[m * ngroups + g] = sum of the quantized values of group g, d * xq (what the group's minimum multiplies).
// bpair (Q4_K, Q5_K) holds two consecutive blocks' integer sums as int16 halves, low = even block: [M, K/64].
// Where quantize_act puts row m's block b (and its scale, block sum and group sums). By rows: xq [M, K], d and bsum
// [M, K/32], gsum [M, K/G]. Packed for the x16 kernels (shift 3): rows in groups of 8, each block of a group's 8
// rows contiguous (xq [M/8, K/32, 8, 32], d and bsum [M/8, K/32, 8], gsum [M/8, K/G, 8], bpair [M/8, K/64, 8]; M
// rounded up to 8), so that a row group's activations for one block are one 256-byte run and the kernel addresses
// all 8 rows from one pointer; for the AMX kernels (shift 4) the same in groups of 16 rows, a block's A tile.
struct ActLayout {
  int shift;  // log2 of the rows per packed group (0: by rows)
  int64_t blk(int m, int b, int nblk) const {
    return ((int64_t(m >> shift) * nblk + b) << shift) + (m & ((1 << shift) - 1));
  }
  int64_t xq(int m, int b, int nblk) const { return blk(m, b, nblk) * 32; }
  int group() const { return 1 << shift; }
};

inline int64_t rows_allocated(int M, int group) { return (int64_t(M) + group - 1) / group * group; }

// max |x| over n values (a multiple of 32).
inline float block_amax(const float* xb, int n) {
#ifdef PAGEDLM_AVX2
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + i), absmask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xb[i]));
  return amax;
#endif
}

// qb = round-half-even(xb / db) for a 32-value block; returns their sum.
inline int quantize_block(const float* xb, float db, int8_t* qb) {
#ifdef PAGEDLM_AVX2  // the same values as the scalar code: IEEE division, rounding half to even
  const __m256 dv = _mm256_set1_ps(db);
  __m256i isum = _mm256_setzero_si256(), qi[4];
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xb + 8 * i), dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    isum = _mm256_add_epi32(isum, qi[i]);
  }
  // |q| <= 127: the saturating packs are exact; they interleave 4-value groups per 128-bit lane, undone by the
  // permutation
  const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
#else
  int sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = int(std::nearbyint(xb[i] / db));
    qb[i] = int8_t(v);
    sum += v;
  }
  return sum;
#endif
}

void quantize_act(const float* x, int M, int K, int G, int8_t* xq, float* d, float* gsum, int nthreads,
                  int32_t* bsum = nullptr, ActLayout lay = {0}, int sblk = 1, int32_t* bpair = nullptr) {
  const int nblk = K / 32, bpg = G / 32;
  // Packed rows in whole groups of 8 per chunk: a group's rows share cache lines.
  parallel_for(M, int64_t(M) * K >= 8192 ? nthreads : 1, std::max(8, lay.group()), [&](int64_t m0, int64_t m1) {
  for (int m = int(m0); m < m1; ++m) {
    const float* xm = x + int64_t(m) * K;
    int prev = 0;  // the even block's sum, for bpair
    for (int s0 = 0; s0 < nblk; s0 += sblk) {
      const float amax = block_amax(xm + s0 * 32, 32 * sblk);
      const float db = amax > 0.f ? amax / 127.f : 1.f;
      for (int b = s0; b < s0 + sblk; ++b) {
        const int sum = quantize_block(xm + b * 32, db, xq + lay.xq(m, b, nblk));
        d[lay.blk(m, b, nblk)] = db;
        if (bsum != nullptr) bsum[lay.blk(m, b, nblk)] = sum;
        if (bpair != nullptr && b % 2 == 1)  // |sum| <= 32 x 127: exact in int16
          bpair[lay.blk(m, b / 2, nblk / 2)] = int32_t((uint32_t(prev) & 0xffffu) | (uint32_t(sum) << 16));
        prev = sum;
        float& gs = gsum[lay.blk(m, b / bpg, nblk / bpg)];
        gs = std::fma(db, float(sum), b % bpg == 0 ? 0.f : gs);  // one rounding in every build (no contraction)
      }
    }
  }
  });
}

#ifdef PAGEDLM_AVX2
// Sum of each group of four adjacent u8 x s8 products, as 8 int32 lanes (exact: |w * x| sums stay far below
// int16 limits, so the maddubs route does not saturate and all three give the same integers).
inline __m256i dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

// R rows m0 .. m0+R of x against output row n (codes qn, per-block weight scales sf): each 32-value block of
// codes is unpacked once and multiplied with the R rows' quantized activations. Per row, even and odd blocks go
// to two accumulators, summed at the end: the same arithmetic whatever R is, so a row's result does not depend
// on the rows batched with it.
template <int R>
void int4_rows(const int8_t* xq, const float* d, const uint8_t* qn, const uint16_t* sn, const float* sf, float* c,
               float* acc, int K, int m0, bool prefetch) {
  const int nblk = K / 32;
  for (int i = 0; i < R; ++i) {  // c[i][b] = d_b * scale of block b, for row m0 + i
    const float* dm = d + int64_t(m0 + i) * nblk;
    float* ci = c + int64_t(i) * nblk;
    int b = 0;
    if (sn != nullptr) {  // G = 32: one fp16 scale per block, converted here eight at a time
      for (; b + 8 <= nblk; b += 8) {
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sn + b)));
        _mm256_storeu_ps(ci + b, _mm256_mul_ps(sv, _mm256_loadu_ps(dm + b)));
      }
      for (; b < nblk; ++b) ci[b] = half_to_float(sn[b]) * dm[b];
    } else {
      for (; b < nblk; ++b) ci[b] = sf[b] * dm[b];
    }
  }
  const __m128i lo_mask = _mm_set1_epi8(0x0f);
  __m256 a0[R], a1[R];
  for (int i = 0; i < R; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  int b = 0;
  for (; b + 2 <= nblk; b += 2) {
    if (prefetch && (b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(qn + b * 16) + PF_BYTES, _MM_HINT_T0);
    const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * 16));
    const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * 16 + 16));
    const __m256i w0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r0, 4), lo_mask), _mm_and_si128(r0, lo_mask));
    const __m256i w1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r1, 4), lo_mask), _mm_and_si128(r1, lo_mask));
    for (int i = 0; i < R; ++i) {
      const int8_t* xm = xq + int64_t(m0 + i) * K + b * 32;
      const float* ci = c + int64_t(i) * nblk + b;
      const __m256i d0 = dot_u8s8(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm)));
      const __m256i d1 = dot_u8s8(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 32)));
      a0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_broadcast_ss(ci), a0[i]);
      a1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_broadcast_ss(ci + 1), a1[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    acc[i] = hsum(_mm256_add_ps(a0[i], a1[i]));
    const int8_t* xm = xq + int64_t(m0 + i) * K;
    for (int bb = b; bb < nblk; ++bb) {
      int dot = 0;
      for (int t = 0; t < 16; ++t) {
        const uint8_t v = qn[bb * 16 + t];
        dot += int(v & 0x0f) * xm[bb * 32 + t] + int(v >> 4) * xm[bb * 32 + 16 + t];
      }
      acc[i] += float(dot) * c[int64_t(i) * nblk + bb];
    }
  }
}
#endif

constexpr int INT4_ROWS = 4;  // rows of x that share one unpacking of a weight row

// Rows n0 .. n0+nt of the int4 product over quantized activations: per 32-value block an integer dot product of
// the 4-bit codes with xq (VNNI's vpdpbusd where the CPU has it, else vpmaddubsw) times d_b * scale_g; plus
// sum_g min_g * gsum_g. Rows of x go through in groups of INT4_ROWS, sharing each unpacked block of codes.
// scratch: int4_scratch_floats(K, G) floats of the calling thread.
inline size_t int4_scratch_floats(int K, int G) { return size_t(K / 32) * (1 + INT4_ROWS) + K / G; }

void int4_tile(const int8_t* xq, const float* d, const float* gsum, const uint8_t* q, const uint16_t* sc,
               const uint16_t* mn, float* y, int M, int K, int N, int G, int n0, int nt, float* scratch) {
  const int nblk = K / 32, bpg = G / 32, ngroups = K / G, row_bytes = K / 2;
  // The output row's per-block scale and per-group minimum as fp32; c: d_b * scale per block of each row of x.
  float *sf = scratch, *c = sf + nblk, *mf = c + size_t(INT4_ROWS) * nblk;
  for (int j = 0; j < nt; ++j) {
    const int n = n0 + j;
    const uint8_t* qn = q + int64_t(n) * row_bytes;
    const uint16_t *sn = sc + int64_t(n) * ngroups, *mnn = mn + int64_t(n) * ngroups;
#ifdef PAGEDLM_AVX2
    const bool fp16_direct = bpg == 1;  // the usual G = 32: scales and minimums converted where they are used
#else
    const bool fp16_direct = false;
#endif
    if (!fp16_direct)
      for (int g = 0; g < ngroups; ++g) {
        mf[g] = half_to_float(mnn[g]);
        const float sg = half_to_float(sn[g]);
        for (int b = g * bpg; b < (g + 1) * bpg; ++b) sf[b] = sg;
      }
    for (int m0 = 0; m0 < M; m0 += INT4_ROWS) {
      const int rows = std::min(INT4_ROWS, M - m0);
      float acc[INT4_ROWS];
#ifdef PAGEDLM_AVX2
      const bool pf = m0 == 0;
      switch (rows) {
        case 4: int4_rows<4>(xq, d, qn, fp16_direct ? sn : nullptr, sf, c, acc, K, m0, pf); break;
        case 3: int4_rows<3>(xq, d, qn, fp16_direct ? sn : nullptr, sf, c, acc, K, m0, pf); break;
        case 2: int4_rows<2>(xq, d, qn, fp16_direct ? sn : nullptr, sf, c, acc, K, m0, pf); break;
        default: int4_rows<1>(xq, d, qn, fp16_direct ? sn : nullptr, sf, c, acc, K, m0, pf); break;
      }
#else
      for (int i = 0; i < rows; ++i) {
        const int8_t* xm = xq + int64_t(m0 + i) * K;
        acc[i] = 0.f;
        for (int b = 0; b < nblk; ++b) {
          int dot = 0;
          for (int t = 0; t < 16; ++t) {
            const uint8_t v = qn[b * 16 + t];
            dot += int(v & 0x0f) * xm[b * 32 + t] + int(v >> 4) * xm[b * 32 + 16 + t];
          }
          acc[i] += float(dot) * (sf[b] * d[int64_t(m0 + i) * nblk + b]);
        }
      }
#endif
      for (int i = 0; i < rows; ++i) {
        const float* gm = gsum + int64_t(m0 + i) * ngroups;
        float mins = 0.f;
        int g = 0;
#ifdef PAGEDLM_AVX2
        if (fp16_direct) {
          __m256 mv = _mm256_setzero_ps();
          for (; g + 8 <= ngroups; g += 8) {
            const __m256 mnv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mnn + g)));
            mv = _mm256_fmadd_ps(mnv, _mm256_loadu_ps(gm + g), mv);
          }
          mins = hsum(mv);
          for (; g < ngroups; ++g) mins += half_to_float(mnn[g]) * gm[g];
        }
#endif
        for (; g < ngroups; ++g) mins += mf[g] * gm[g];
        y[int64_t(m0 + i) * N + n] = acc[i] + mins;
      }
    }
  }
}

constexpr int X16 = 16;       // output rows per tile of the x16 layout
constexpr ActLayout kPack8{3}, kPack16{4};  // the x16 kernels' activations: VNNI, AMX
constexpr int X16_ROWS = 8;   // rows of x that share one unpacking of a tile's block
constexpr int X16_BLOCK = 256;  // bytes per tile and 32-value block
constexpr int X16_MBLOCK = 256;  // rows of x per pass over all tiles

// Calls rows(std::integral_constant<int, R>{}, m0) for rows m0 .. m0+R of M: R = X16_ROWS but for the last group.
template <class F>
inline void for_row_groups(int M, F rows) {
  for (int m0 = 0; m0 < M; m0 += X16_ROWS) {
    switch (std::min(X16_ROWS, M - m0)) {
      case 8: rows(std::integral_constant<int, 8>{}, m0); break;
      case 7: rows(std::integral_constant<int, 7>{}, m0); break;
      case 6: rows(std::integral_constant<int, 6>{}, m0); break;
      case 5: rows(std::integral_constant<int, 5>{}, m0); break;
      case 4: rows(std::integral_constant<int, 4>{}, m0); break;
      case 3: rows(std::integral_constant<int, 3>{}, m0); break;
      case 2: rows(std::integral_constant<int, 2>{}, m0); break;
      default: rows(std::integral_constant<int, 1>{}, m0); break;
    }
  }
}

// The scales of an int4 x16 tile's blocks: weight = code * scale + minimum per group of G inputs (G = 32 for the
// GGUF formats). Each kind gives the same fp32 scale and minimum in scalar code (scale, min) and for 8 or 16 outputs
// at once (load8, load16), so every build computes the same products.
// F16Scales: an fp16 scale and minimum per group ([N/16, K/G, 16] each; Q4_1 and quantize_int4's), or no minimums
// (m null: GGUF Q4_0, whose minimum is -8 * scale, exact in fp32).
struct F16Scales {
  const uint16_t *s, *m;
  int ngroups, bpg;  // groups per row, blocks per group
  static constexpr bool offset8 = false;

  F16Scales tile(int t) const {
    const int64_t at = int64_t(t) * ngroups * X16;
    return {s + at, m ? m + at : nullptr, ngroups, bpg};
  }
  float scale(int g, int j) const { return half_to_float(s[g * X16 + j]); }
  float min(int g, int j) const { return m ? half_to_float(m[g * X16 + j]) : scale(g, j) * -8.f; }
#ifdef PAGEDLM_AVX2
  void load8(int g, int h, __m256& sc, __m256& mn) const {
    sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + int64_t(g) * X16 + 8 * h)));
    mn = m ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + int64_t(g) * X16 + 8 * h)))
           : _mm256_mul_ps(sc, _mm256_set1_ps(-8.f));
  }
#endif
#ifdef PAGEDLM_AVX512_VNNI
  void load16(int g, __m512& sc, __m512& mn) const {
    sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + int64_t(g) * X16)));
    mn = m ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + int64_t(g) * X16)))
           : _mm512_mul_ps(sc, _mm512_set1_ps(-8.f));
  }
#endif
};

// Q40Scales: GGUF Q4_0's, weight = (code - 8) * scale (no minimums). The products subtract 8 x the activations'
// integer sum (bsum) from each block's integer dot product, then scale it: one fp32 operation fewer per row and block
// than a minimum's FMA, and the exact product of the dequantized weights with the quantized activations.
struct Q40Scales : F16Scales {
  static constexpr bool offset8 = true;
  Q40Scales tile(int t) const { return {F16Scales::tile(t)}; }
};

// KScales (GGUF Q4_K): per super-block of 256 inputs an fp16 d and dmin (dd: [N/16, K/256, 2, 16], d then dmin),
// per 32-value block b a 6-bit scale and minimum held as bytes (sm: [N/16, K/32, 2, 16]): scale = d * sc and
// minimum = -(dmin * m), each one fp32 product, as llama.cpp dequantizes them. The products (q4k_rows) use the
// integers sc and m themselves.
struct KScales {
  const uint16_t* dd;
  const uint8_t* sm;
  int nblk;
  static constexpr int bpg = 1;
  static constexpr bool offset8 = false;

  KScales tile(int t) const { return {dd + int64_t(t) * (nblk / 8) * 2 * X16, sm + int64_t(t) * nblk * 2 * X16, nblk}; }
  float scale(int b, int j) const { return half_to_float(dd[(b / 8) * 2 * X16 + j]) * float(sm[b * 2 * X16 + j]); }
  float min(int b, int j) const {
    return -(half_to_float(dd[(b / 8) * 2 * X16 + X16 + j]) * float(sm[b * 2 * X16 + X16 + j]));
  }
#ifdef PAGEDLM_AVX2
  void load8(int b, int h, __m256& sc, __m256& mn) const {
    const uint16_t* d = dd + int64_t(b / 8) * 2 * X16 + 8 * h;
    const uint8_t* q = sm + int64_t(b) * 2 * X16 + 8 * h;
    auto bytes = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d))), bytes(q));
    mn = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + X16))),
                                     bytes(q + X16)),
                       _mm256_set1_ps(-0.f));
  }
#endif
#ifdef PAGEDLM_AVX512_VNNI
  void load16(int b, __m512& sc, __m512& mn) const {
    const uint16_t* d = dd + int64_t(b / 8) * 2 * X16;
    const uint8_t* q = sm + int64_t(b) * 2 * X16;
    auto bytes = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    sc = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d))), bytes(q));
    mn = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + X16))), bytes(q + X16))),
        _mm512_set1_epi32(int(0x80000000u))));
  }
#endif
};

constexpr int X16_CHUNK = 16;  // blocks (4 KB of codes) per pass of the chunked kernels: read once from memory

#ifdef PAGEDLM_AVX2
// Keeps an accumulator in a register here. Integer sums reassociate, and GCC 12 turns a block's chain of adds into
// a tree over all of its products: more live values than AVX2's 16 registers, spilled to the stack. This and the
// row pairs below: Q4_0 and Q4_K 1.3-1.45x on a Zen 3, 1.27-1.36x on a Zen 4 at -march=haswell.
inline void keep_chain(__m256i& v) { asm("" : "+x"(v)); }

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Q4KSuper for outputs o .. o + 7 of a tile's super-block s (AVX2): the same integers and fp32 operations.
struct Q4KSuper8 {
  __m256i mp[4];
  __m256 d, nmin;
  Q4KSuper8(const KScales& sc, int s, int o) {
    const uint8_t* sm = sc.sm + int64_t(s) * 8 * 2 * X16 + X16 + o;
    for (int k = 0; k < 4; ++k)
      mp[k] = _mm256_or_si256(bytes8(sm + 2 * k * 2 * X16), _mm256_slli_epi32(bytes8(sm + (2 * k + 1) * 2 * X16), 16));
    const uint16_t* dd = sc.dd + int64_t(s) * 2 * X16 + o;
    d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd)));
    nmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd + X16))),
                         _mm256_set1_ps(-0.f));
  }
  __m256 finish(__m256i isum, const int32_t* bp, float a, __m256 f) const {
    __m256i ms = _mm256_madd_epi16(mp[0], _mm256_set1_epi32(bp[0]));
    for (int k = 1; k < 4; ++k) ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mp[k], _mm256_set1_epi32(bp[8 * k])));
    const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, _mm256_mul_ps(_mm256_cvtepi32_ps(ms), nmin));
    return _mm256_fmadd_ps(t, _mm256_set1_ps(a), f);
  }
};
#endif

#ifdef PAGEDLM_AVX512_VNNI
// acc += (u8 codes w) . (four s8 activations at p, broadcast to every lane), with the broadcast embedded in the
// instruction's memory operand (compilers emit a separate vpbroadcastd for the intrinsic, 1.x slower here).
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
#ifdef PAGEDLM_EMULATED_AVX512
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
#else
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
#endif
}

// The 32-value block's dot products for 16 outputs: w[c] holds inputs 4c..4c+3 of each output (u8), xb the block's
// 32 activations (s8). Two chains of four (integer sums: the order does not change the result).
inline __m512i dot_block32(const __m512i* w, const int8_t* xb) {
  __m512i a0 = dpbusd_bcast(_mm512_setzero_si512(), w[0], xb);
  __m512i a1 = dpbusd_bcast(_mm512_setzero_si512(), w[1], xb + 4);
  for (int c = 2; c < 8; c += 2) {
    a0 = dpbusd_bcast(a0, w[c], xb + 4 * c);
    a1 = dpbusd_bcast(a1, w[c + 1], xb + 4 * c + 4);
  }
  return _mm512_add_epi32(a0, a1);
}

// An int4 x16 block's 256 bytes as 8 registers of codes: w[c] low nibbles of chunk c, w[4 + c] its high ones.
inline void unpack_block(const uint8_t* wb, __m512i w[8]) {
  const __m512i lo = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(wb + 64 * c);
    w[c] = _mm512_and_si512(v, lo);
    w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
  }
}

// Rows m0 .. m0+R of x (m0 a multiple of 8; activations packed, see ActLayout) against tile t (16 outputs):
// y[m, 16t .. 16t+15].
template <int R, class S>
void int4x16_rows(const int8_t* xq, const float* d, const float* gsum, const int32_t* bsum, const uint8_t* qt,
                  const S& sc, float* y, int K, int N, int n0, int m0, bool prefetch) {
  const int nblk = K / 32, bpg = sc.bpg, ngroups = nblk / bpg;
  const int8_t* xg = xq + int64_t(m0) * K;  // this row group's blocks: [nblk, 8, 32]
  const float *dg = d + int64_t(m0) * nblk, *gg = gsum + int64_t(m0) * ngroups;
  const int32_t* bg = S::offset8 ? bsum + int64_t(m0) * nblk : nullptr;
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  __m512 s = _mm512_setzero_ps(), mn = s;
  for (int b = 0, g = 0, in_group = 0; b < nblk; ++b) {
    const uint8_t* wb = qt + int64_t(b) * X16_BLOCK;
    // every line (not every other one): 1.1-1.25x the decode rate of a 1B model on a 2-core Zen 4
    if (prefetch) prefetch_lines(wb + PF_BYTES, X16_BLOCK);
    __m512i w[8];
    unpack_block(wb, w);
    if (in_group == 0) sc.load16(g, s, mn);
    const bool group_end = ++in_group == bpg;
    const int8_t* xb = xg + int64_t(b) * 256;
    const float* db = dg + int64_t(b) * 8;
    for (int i = 0; i < R; ++i) {
      __m512i dot = dot_block32(w, xb + 32 * i);
      if constexpr (S::offset8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * bg[int64_t(b) * 8 + i]));
      const __m512 cs = _mm512_mul_ps(s, _mm512_set1_ps(db[i]));
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), cs, f[i]);
      if (!S::offset8 && group_end) f[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(gg[int64_t(g) * 8 + i]), f[i]);
    }
    if (group_end) in_group = 0, ++g;
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + int64_t(m0 + i) * N + n0, f[i]);
}

// Q4_K's products (every build) take activations with one scale a per super-block of 256 values (quantize_act's
// sblk = 8, llama.cpp's Q8_K), so a super-block's 8 blocks reduce in integers. Per output and super-block:
//   isum = sum_b sc_b * dot_b, msum = sum_b m_b * bsum_b            (exact in int32)
//   t = fma(float(isum), d, float(msum) * -dmin), f = fma(t, a, f)
// Two fp32 operations per row and super-block where per-block activation scales took four per block: the fp32 work
// shares the pipes that run vpdpbusd. msum pairs blocks: bpair (quantize_act) holds two blocks' sums as int16.
#ifdef PAGEDLM_AVX512_VNNI
// acc += pairs of int16 (w) x the pair of int16 at p, broadcast (as dpbusd_bcast).
inline __m512i dpwssd_bcast(__m512i acc, __m512i w, const int32_t* p) {
#ifdef PAGEDLM_EMULATED_AVX512
  return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(*p));
#else
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
  return acc;
#endif
}

// A tile's super-block s: its minimums as int16 pairs (lane j of mp[k]: m of blocks 2k and 2k + 1 of output j), d
// and -dmin.
struct Q4KSuper {
  __m512i mp[4];
  __m512 d, nmin;
  Q4KSuper(const KScales& sc, int s) {
    const uint8_t* sm = sc.sm + int64_t(s) * 8 * 2 * X16 + X16;
    auto mins = [&](int b) {
      return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + b * 2 * X16)));
    };
    for (int k = 0; k < 4; ++k) mp[k] = _mm512_or_si512(mins(2 * k), _mm512_slli_epi32(mins(2 * k + 1), 16));
    const uint16_t* dd = sc.dd + int64_t(s) * 2 * X16;
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd)));
    nmin = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + X16)))),
        _mm512_set1_epi32(int(0x80000000u))));
  }
  // f + a * (isum * d - msum * dmin) for one row: bp its pairs of block sums (stride 8: packed rows), a its scale.
  __m512 finish(__m512i isum, const int32_t* bp, float a, __m512 f) const {
    __m512i ms = dpwssd_bcast(_mm512_setzero_si512(), mp[0], bp);
    for (int k = 1; k < 4; ++k) ms = dpwssd_bcast(ms, mp[k], bp + 8 * k);
    const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, _mm512_mul_ps(_mm512_cvtepi32_ps(ms), nmin));
    return _mm512_fmadd_ps(t, _mm512_set1_ps(a), f);
  }
};

// isum += sc_b * the block's dot products for 16 outputs.
inline __m512i q4k_block(__m512i isum, const __m512i* w, const int8_t* xb, __m512i scb) {
  return _mm512_add_epi32(isum, _mm512_mullo_epi32(dot_block32(w, xb), scb));
}

inline __m512i block_scales(const KScales& sc, int b) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc.sm + int64_t(b) * 2 * X16)));
}

// The K-quants' row kernels (AVX-512 VNNI): rows m0 .. m0 + R against one tile (16 outputs), super-block by
// super-block. add(b, is) adds block b's integer sums to is[0 .. R); finish(s0, is, f) folds the super-block from
// block s0 into f[0 .. R).
template <int R, class Add, class Finish>
inline void ksuper_rows(int nblk, Add&& add, Finish&& finish, float* y, int N, int n0, int m0) {
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  for (int s0 = 0; s0 < nblk; s0 += 8) {
    __m512i is[R];
    for (int i = 0; i < R; ++i) is[i] = _mm512_setzero_si512();
    for (int b = s0; b < s0 + 8; ++b) add(b, is);
    finish(s0, is, f);
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + int64_t(m0 + i) * N + n0, f[i]);
}

// Rows m0 .. m0+R of x (packed, with bpair) against a tile in Q4_K's scale layout (16 outputs): codes(b, w) puts
// block b's codes in w[0 .. 8) (Q4_K's nibbles; Q5_K's 5-bit codes, q5k_rows16).
template <int R, class Codes>
void q4k_rows_of(const int8_t* xq, const float* d, const int32_t* bpair, Codes&& codes, const KScales& sc, float* y,
                 int K, int N, int n0, int m0) {
  const int nblk = K / 32;
  const int8_t* xg = xq + int64_t(m0) * K;
  const float* dg = d + int64_t(m0) * nblk;
  const int32_t* pg = bpair + int64_t(m0) * (nblk / 2);
  auto add = [&](int b, __m512i* is) {
    __m512i w[8];
    codes(b, w);
    const __m512i scb = block_scales(sc, b);
    const int8_t* xb = xg + int64_t(b) * 256;
    __m512i a[R];
    for (int i = 0; i < R; ++i) a[i] = dpbusd_bcast(_mm512_setzero_si512(), w[0], xb + 32 * i);
    for (int c = 1; c < 8; ++c)
      for (int i = 0; i < R; ++i) a[i] = dpbusd_bcast(a[i], w[c], xb + 32 * i + 4 * c);
    for (int i = 0; i < R; ++i) is[i] = _mm512_add_epi32(is[i], _mm512_mullo_epi32(a[i], scb));
  };
  auto finish = [&](int s0, const __m512i* is, __m512* f) {
    const Q4KSuper sup(sc, s0 / 8);
    for (int i = 0; i < R; ++i) f[i] = sup.finish(is[i], pg + int64_t(s0 / 2) * 8 + i, dg[int64_t(s0) * 8 + i], f[i]);
  };
  ksuper_rows<R>(nblk, add, finish, y, N, n0, m0);
}

template <int R>
void q4k_rows(const int8_t* xq, const float* d, const int32_t* bpair, const uint8_t* qt, const KScales& sc, float* y,
              int K, int N, int n0, int m0, bool prefetch) {
  auto codes = [&](int b, __m512i* w) {
    const uint8_t* wb = qt + int64_t(b) * X16_BLOCK;
    if (prefetch) prefetch_lines(wb + PF_BYTES, X16_BLOCK);
    unpack_block(wb, w);
  };
  q4k_rows_of<R>(xq, d, bpair, codes, sc, y, K, N, n0, m0);
}

// One row of x against T Q4_K tiles, their blocks interleaved (as int4x16_row_tiles): q4k_rows<1>'s operations.
template <int T>
void q4k_row_tiles(const int8_t* xq, const float* d, const int32_t* bpair, const uint8_t* q, const KScales& scales,
                   float* y, int K, int t) {
  const int nblk = K / 32;
  const uint8_t* qt[T];
  KScales sc[T];
  __m512 f[T];
  for (int u = 0; u < T; ++u) {
    qt[u] = q + int64_t(t + u) * nblk * X16_BLOCK;
    sc[u] = scales.tile(t + u);
    f[u] = _mm512_setzero_ps();
  }
  for (int s0 = 0; s0 < nblk; s0 += 8) {
    __m512i is[T];
    for (int u = 0; u < T; ++u) is[u] = _mm512_setzero_si512();
    for (int b = s0; b < s0 + 8; ++b)
      for (int u = 0; u < T; ++u) {
        const uint8_t* wb = qt[u] + int64_t(b) * X16_BLOCK;
        prefetch_lines(wb + PF_BYTES, X16_BLOCK);
        __m512i w[8];
        unpack_block(wb, w);
        is[u] = q4k_block(is[u], w, xq + int64_t(b) * 256, block_scales(sc[u], b));
      }
    for (int u = 0; u < T; ++u)
      f[u] = Q4KSuper(sc[u], s0 / 8).finish(is[u], bpair + int64_t(s0 / 2) * 8, d[int64_t(s0) * 8], f[u]);
  }
  for (int u = 0; u < T; ++u) _mm512_storeu_ps(y + int64_t(t + u) * X16, f[u]);
}
#endif

// One row of x (a decode step) against T tiles at once, their blocks interleaved: T memory streams per core, where
// int4x16_rows<1> reads one (two streams read 1.13-1.18x the bytes per second of one on a 2-core Sapphire Rapids).
// Each tile's operations are int4x16_rows<1>'s, in the same order, so the results are bit-identical.
template <int T, class S>
void int4x16_row_tiles(const int8_t* xq, const float* d, const float* gsum, const int32_t* bsum, const uint8_t* q,
                       const S& scales, float* y, int K, int N, int t) {
  const int nblk = K / 32, bpg = scales.bpg;
  const uint8_t* qt[T];
  S sc[T];
  __m512 f[T], s[T], mn[T];
  for (int u = 0; u < T; ++u) {
    qt[u] = q + int64_t(t + u) * nblk * X16_BLOCK;
    sc[u] = scales.tile(t + u);
    f[u] = s[u] = mn[u] = _mm512_setzero_ps();
  }
  for (int b = 0, g = 0, in_group = 0; b < nblk; ++b) {
    const bool group_start = in_group == 0, group_end = ++in_group == bpg;
    const int8_t* xb = xq + int64_t(b) * 256;
    const __m512 db = _mm512_set1_ps(d[int64_t(b) * 8]);
    for (int u = 0; u < T; ++u) {
      const uint8_t* wb = qt[u] + int64_t(b) * X16_BLOCK;
      prefetch_lines(wb + PF_BYTES, X16_BLOCK);
      __m512i w[8];
      unpack_block(wb, w);
      if (group_start) sc[u].load16(g, s[u], mn[u]);
      __m512i dot = dot_block32(w, xb);
      if constexpr (S::offset8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * bsum[int64_t(b) * 8]));
      f[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[u], db), f[u]);
      if (!S::offset8 && group_end) f[u] = _mm512_fmadd_ps(mn[u], _mm512_set1_ps(gsum[int64_t(g) * 8]), f[u]);
    }
    if (group_end) in_group = 0, ++g;
  }
  for (int u = 0; u < T; ++u) _mm512_storeu_ps(y + int64_t(t + u) * X16, f[u]);
}
#elif defined(PAGEDLM_AVX2)

// The AVX2 form of int4x16_rows. vpmaddubsw sums pairs of code x activation products into 16-bit lanes, which hold
// a whole 32-value block's partial sums exactly (codes 0..15, |activations| <= 127: at most 8 x 2 x 15 x 127 =
// 30,480), then vpmaddwd sums them into the block's integer dot products: the same integers as vpdpbusd, in the
// same fp32 operations, so the results are bit-identical to the AVX-512 build.
// Rows m0 + i0 .. m0 + i0 + R (R <= 2) against all 16 outputs of the tile in one pass over its blocks, both halves
// of each 64-byte chunk as they arrive: one sequential stream per tile (1.5x the rate of two half passes at one
// row). The first pair of a group (i0 = 0) prefetches the tile.
template <int R, class S>
void int4x16_full_rows(const int8_t* xq, const float* d, const float* gsum, const int32_t* bsum, const uint8_t* qt,
                       const S& sc, float* y, int K, int N, int n0, int m0, int i0 = 0) {
  const int nblk = K / 32, bpg = sc.bpg, ngroups = nblk / bpg;
  const int8_t* xg = xq + int64_t(m0) * K + 32 * i0;
  const float *dg = d + int64_t(m0) * nblk + i0, *gg = gsum + int64_t(m0) * ngroups + i0;
  const int32_t* bg = S::offset8 ? bsum + int64_t(m0) * nblk + i0 : nullptr;
  const __m256i lo = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 f[R][2];
  for (int i = 0; i < R; ++i) f[i][0] = f[i][1] = _mm256_setzero_ps();
  __m256 s[2], mn[2];
  for (int b = 0, g = 0, in_group = 0; b < nblk; ++b) {
    const uint8_t* wb = qt + int64_t(b) * X16_BLOCK;
    // Every line: 2x the single-core stream rate of every other one.
    if (i0 == 0) prefetch_lines(wb + PF_BYTES, X16_BLOCK);
    if (in_group == 0) sc.load8(g, 0, s[0], mn[0]), sc.load8(g, 1, s[1], mn[1]);
    const bool group_end = ++in_group == bpg;
    const int8_t* xb = xg + int64_t(b) * 256;
    __m256i acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i xl[R], xh[R];
      for (int i = 0; i < R; ++i) xl[i] = bcast4(xb + 32 * i + 4 * c), xh[i] = bcast4(xb + 32 * i + 16 + 4 * c);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32 * h));
        const __m256i wl = _mm256_and_si256(v, lo), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
        for (int i = 0; i < R; ++i) {
          acc[i][h] = _mm256_add_epi16(acc[i][h], _mm256_maddubs_epi16(wl, xl[i]));
          acc[i][h] = _mm256_add_epi16(acc[i][h], _mm256_maddubs_epi16(wh, xh[i]));
          keep_chain(acc[i][h]);
        }
      }
    }
    const float* db = dg + int64_t(b) * 8;
    for (int i = 0; i < R; ++i) {
      const __m256 dv = _mm256_set1_ps(db[i]);
      for (int h = 0; h < 2; ++h) {
        const __m256 cs = _mm256_mul_ps(s[h], dv);
        __m256i dot = _mm256_madd_epi16(acc[i][h], ones);
        if constexpr (S::offset8) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * bg[int64_t(b) * 8 + i]));
        f[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), cs, f[i][h]);
        if (!S::offset8 && group_end)
          f[i][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(gg[int64_t(g) * 8 + i]), f[i][h]);
      }
    }
    if (group_end) in_group = 0, ++g;
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + int64_t(m0 + i0 + i) * N + n0 + 8 * h, f[i][h]);
}

// Rows m0 .. m0+R of x (R <= 8, one packed group) against tile n0 / 16: two rows a pass over all 16 outputs (the
// tile read once per pair, from L1 after the first; 1.12-1.35x the former four rows over one half of the outputs,
// whose accumulators and activations did not fit AVX2's 16 registers).
template <int R, class S>
void int4x16_rows(const int8_t* xq, const float* d, const float* gsum, const int32_t* bsum, const uint8_t* qt,
                  const S& sc, float* y, int K, int N, int n0, int m0) {
  for (int i = 0; i + 2 <= R; i += 2) int4x16_full_rows<2>(xq, d, gsum, bsum, qt, sc, y, K, N, n0, m0, i);
  if constexpr (R % 2 == 1) int4x16_full_rows<1>(xq, d, gsum, bsum, qt, sc, y, K, N, n0, m0, R - 1);
}

// The AVX2 form of q4k_rows: rows m0 + i0 .. m0 + i0 + R against H halves of the tile from half h0 (H = 2: all 16
// outputs in one pass, one sequential stream; H = 1: 8 outputs), over blocks b0 .. b1 (whole super-blocks); the
// outputs' partial sums continue from y where b0 > 0. The integers are vpdpbusd's and vpdpwssd's, so the results
// are the AVX-512 build's bits.
template <int R, int H>
void q4k_rows_avx2(const int8_t* xq, const float* d, const int32_t* bpair, const uint8_t* qt, const KScales& sc,
                   float* y, int K, int N, int n0, int m0, int i0, int h0, int b0, int b1, bool prefetch) {
  const int nblk = K / 32;
  const int8_t* xg = xq + int64_t(m0) * K;
  const float* dg = d + int64_t(m0) * nblk + i0;
  const int32_t* pg = bpair + int64_t(m0) * (nblk / 2) + i0;
  const __m256i lo = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  float* yh = y + int64_t(m0 + i0) * N + n0 + 8 * h0;
  __m256 f[R][H];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) f[i][h] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yh + int64_t(i) * N + 8 * h);
  for (int s0 = b0; s0 < b1; s0 += 8) {
    __m256i is[R][H];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h) is[i][h] = _mm256_setzero_si256();
    for (int b = s0; b < s0 + 8; ++b) {
      const uint8_t* wb = qt + int64_t(b) * X16_BLOCK;
      if (prefetch) prefetch_lines(wb + PF_BYTES, X16_BLOCK);
      const int8_t* xb = xg + int64_t(b) * 256 + 32 * i0;
      __m256i acc[R][H];
      for (int i = 0; i < R; ++i)
        for (int h = 0; h < H; ++h) acc[i][h] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256i xl[R], xh[R];
        for (int i = 0; i < R; ++i) xl[i] = bcast4(xb + 32 * i + 4 * c), xh[i] = bcast4(xb + 32 * i + 16 + 4 * c);
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32 * (h0 + h)));
          const __m256i wl = _mm256_and_si256(v, lo), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
          for (int i = 0; i < R; ++i) {
            acc[i][h] = _mm256_add_epi16(acc[i][h], _mm256_maddubs_epi16(wl, xl[i]));
            acc[i][h] = _mm256_add_epi16(acc[i][h], _mm256_maddubs_epi16(wh, xh[i]));
            keep_chain(acc[i][h]);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const __m256i scb = bytes8(sc.sm + int64_t(b) * 2 * X16 + 8 * (h0 + h));
        for (int i = 0; i < R; ++i)
          is[i][h] = _mm256_add_epi32(is[i][h], _mm256_mullo_epi32(_mm256_madd_epi16(acc[i][h], ones), scb));
      }
    }
    for (int h = 0; h < H; ++h) {
      const Q4KSuper8 sup(sc, s0 / 8, 8 * (h0 + h));
      for (int i = 0; i < R; ++i)
        f[i][h] = sup.finish(is[i][h], pg + int64_t(s0 / 2) * 8 + i, dg[int64_t(s0) * 8 + i], f[i][h]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(yh + int64_t(i) * N + 8 * h, f[i][h]);
}

// Rows m0 .. m0+R (R <= 8) against Q4_K tile qt: up to two rows in one pass, more as int4x16_rows splits them.
template <int R>
void q4k_rows(const int8_t* xq, const float* d, const int32_t* bpair, const uint8_t* qt, const KScales& sc, float* y,
              int K, int N, int n0, int m0) {
  if constexpr (R <= 2) {
    q4k_rows_avx2<R, 2>(xq, d, bpair, qt, sc, y, K, N, n0, m0, 0, 0, 0, K / 32, true);
  } else {
    const int nblk = K / 32;
    for (int b0 = 0; b0 < nblk; b0 += X16_CHUNK) {
      const int b1 = std::min(nblk, b0 + X16_CHUNK);
      for (int i = 0; i + 2 <= R; i += 2)
        q4k_rows_avx2<2, 2>(xq, d, bpair, qt, sc, y, K, N, n0, m0, i, 0, b0, b1, i == 0);
      if constexpr (R % 2 == 1) q4k_rows_avx2<1, 2>(xq, d, bpair, qt, sc, y, K, N, n0, m0, R - 1, 0, b0, b1, false);
    }
  }
}
#endif

// Output j's integer dot product of an int4 x16 block wb with 32 quantized activations xb (the portable builds).
inline int x16_block_dot(const uint8_t* wb, const int8_t* xb, int j) {
  int dot = 0;
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 4; ++i) {
      const uint8_t v = wb[64 * c + 4 * j + i];
      dot += int(v & 0x0f) * xb[4 * c + i] + int(v >> 4) * xb[16 + 4 * c + i];
    }
  return dot;
}

// Block b's integer sum from quantize_act's bpair word of its pair of blocks.
inline int bpair_sum(int32_t pair, int b) {
  return b % 2 == 0 ? int16_t(pair & 0xffff) : int16_t(uint32_t(pair) >> 16);
}

// Q4KSuper::finish for one output (the portable builds): d, dmin the super-block's, a the activations' scale.
inline float q4k_finish(int32_t isum, int32_t msum, float d, float dmin, float a, float f) {
  return std::fma(std::fma(float(isum), d, float(msum) * -dmin), a, f);
}

// Q4_K tile qt (outputs n0 .. n0+15), every row of x (bpair: quantize_act's); see q4k_rows. Builds with neither
// AVX-512 VNNI nor AVX2: the same integers and fp32 operations in scalar code.
void q4k_tile(const int8_t* xq, const float* d, const int32_t* bpair, const uint8_t* qt, const KScales& sc, float* y,
              int M, int K, int N, int n0) {
#ifdef PAGEDLM_AVX512_VNNI
  for_row_groups(M, [&](auto r, int m0) {
    q4k_rows<decltype(r)::value>(xq, d, bpair, qt, sc, y, K, N, n0, m0, m0 == 0);
  });
#elif defined(PAGEDLM_AVX2)
  for_row_groups(M, [&](auto r, int m0) { q4k_rows<decltype(r)::value>(xq, d, bpair, qt, sc, y, K, N, n0, m0); });
#else
  const int nblk = K / 32;
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < X16; ++j) {
      float f = 0.f;
      for (int s0 = 0; s0 < nblk; s0 += 8) {
        int32_t isum = 0, msum = 0;
        for (int b = s0; b < s0 + 8; ++b) {
          const int dot = x16_block_dot(qt + int64_t(b) * X16_BLOCK, xq + kPack8.xq(m, b, nblk), j);
          isum += int(sc.sm[int64_t(b) * 2 * X16 + j]) * dot;
          msum += int(sc.sm[int64_t(b) * 2 * X16 + X16 + j]) * bpair_sum(bpair[kPack8.blk(m, b / 2, nblk / 2)], b);
        }
        const uint16_t* dd = sc.dd + int64_t(s0 / 8) * 2 * X16;
        f = q4k_finish(isum, msum, half_to_float(dd[j]), half_to_float(dd[X16 + j]), d[kPack8.blk(m, s0, nblk)], f);
      }
      y[int64_t(m) * N + n0 + j] = f;
    }
#endif
}

// The x16 product for tile t, every row of x. Builds with neither AVX-512 VNNI nor AVX2: the same arithmetic
// in scalar code (std::fma rounds as vfmadd does), so every build gives the same results for this layout.
template <class S>
void int4x16_tile(const int8_t* xq, const float* d, const float* gsum, const int32_t* bsum, const uint8_t* q,
                  const S& scales, float* y, int M, int K, int N, int t) {
  const int nblk = K / 32, bpg = scales.bpg, ngroups = nblk / bpg, n0 = t * X16;
  const uint8_t* qt = q + int64_t(t) * nblk * X16_BLOCK;
  const S sc = scales.tile(t);
  if constexpr (std::is_same_v<S, KScales>) {
    q4k_tile(xq, d, bsum, qt, sc, y, M, K, N, n0);
    return;
  }
#ifdef PAGEDLM_AVX512_VNNI
  for_row_groups(M, [&](auto r, int m0) {
    int4x16_rows<decltype(r)::value>(xq, d, gsum, bsum, qt, sc, y, K, N, n0, m0, m0 == 0);
  });
#elif defined(PAGEDLM_AVX2)
  for_row_groups(M, [&](auto r, int m0) {
    int4x16_rows<decltype(r)::value>(xq, d, gsum, bsum, qt, sc, y, K, N, n0, m0);
  });
#else
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < X16; ++j) {
      float f = 0.f;
      for (int b = 0; b < nblk; ++b) {
        int dot = x16_block_dot(qt + int64_t(b) * X16_BLOCK, xq + kPack8.xq(m, b, nblk), j);
        const int g = b / bpg;
        if constexpr (S::offset8) dot -= 8 * bsum[kPack8.blk(m, b, nblk)];
        const float cs = sc.scale(g, j) * d[kPack8.blk(m, b, nblk)];
        f = std::fma(float(dot), cs, f);
        if (!S::offset8 && (b + 1) % bpg == 0) f = std::fma(sc.min(g, j), gsum[kPack8.blk(m, g, ngroups)], f);
      }
      y[int64_t(m) * N + n0 + j] = f;
    }
#endif
}

constexpr int X16_BLOCK8 = 512;  // bytes per tile and 32-value block of the int8 x16 layout

#ifdef PAGEDLM_AVX512_VNNI
template <int R>
void int8x16_rows(const int8_t* xq, const float* d, const int32_t* bsum, const int8_t* qt, const float* s, float* y,
                  int K, int N, int n0, int m0) {
  const int nblk = K / 32;
  const __m512i flip = _mm512_set1_epi8(char(0x80));  // s8 -> u8: q + 128
  const int8_t* xg = xq + int64_t(m0) * K;  // this row group's blocks, packed as in int4x16_rows
  const float* dg = d + int64_t(m0) * nblk;
  const int32_t* sg = bsum + int64_t(m0) * nblk;
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  for (int b = 0; b < nblk; ++b) {
    const int8_t* wb = qt + int64_t(b) * X16_BLOCK8;
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * c), flip);
    for (int i = 0; i < R; ++i) {
      const int64_t mb = int64_t(b) * 8 + i;
      const __m512i dot = _mm512_sub_epi32(dot_block32(w, xg + mb * 32), _mm512_set1_epi32(128 * sg[mb]));
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(dg[mb]), f[i]);
    }
  }
  const __m512 sv = _mm512_loadu_ps(s + n0);
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + int64_t(m0 + i) * N + n0, _mm512_mul_ps(f[i], sv));
}

// One row of x against T tiles at once, blocks interleaved (T streams per core, as int4x16_row_tiles); each tile's
// operations are int8x16_rows<1>'s, in the same order.
template <int T>
void int8x16_row_tiles(const int8_t* xq, const float* d, const int32_t* bsum, const int8_t* q, const float* s,
                       float* y, int K, int n0) {
  const int nblk = K / 32;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int8_t* qt[T];
  __m512 f[T];
  for (int u = 0; u < T; ++u) qt[u] = q + int64_t(n0 / X16 + u) * nblk * X16_BLOCK8, f[u] = _mm512_setzero_ps();
  for (int b = 0; b < nblk; ++b) {
    const int64_t mb = int64_t(b) * 8;
    const __m512i corr = _mm512_set1_epi32(128 * bsum[mb]);
    const __m512 db = _mm512_set1_ps(d[mb]);
    for (int u = 0; u < T; ++u) {
      const int8_t* wb = qt[u] + int64_t(b) * X16_BLOCK8;
      __m512i w[8];
      for (int c = 0; c < 8; ++c) w[c] = _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * c), flip);
      const __m512i dot = _mm512_sub_epi32(dot_block32(w, xq + mb * 32), corr);
      f[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), db, f[u]);
    }
  }
  for (int u = 0; u < T; ++u)
    _mm512_storeu_ps(y + n0 + X16 * u, _mm512_mul_ps(f[u], _mm512_loadu_ps(s + n0 + X16 * u)));
}
#elif defined(PAGEDLM_AVX2)
// The AVX2 form of int8x16_rows: rows m0 + i0 .. m0 + i0 + R against H halves of tile n0 / 16 from half h0
// (outputs 16t + 8h .. 16t + 8h + 7, one per 32-bit lane). vpmaddubsw takes |w| (u8) and x with w's sign (|w| <= 128,
// |x| <= 127: pair sums fit 16 bits), vpmaddwd sums to 32 bits: the block's dot products are the integers vpdpbusd
// gives, in the same fp32 operations, so the results are bit-identical to the AVX-512 build.
template <int R, int H>
void int8x16_half_rows(const int8_t* xq, const float* d, const int8_t* qt, const float* s, float* y, int K, int N,
                       int n0, int m0, int i0, int h0) {
  const int nblk = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xg = xq + int64_t(m0) * K;
  const float* dg = d + int64_t(m0) * nblk;
  __m256 f[R][H];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) f[i][h] = _mm256_setzero_ps();
  for (int b = 0; b < nblk; ++b) {
    const int8_t* wb = qt + int64_t(b) * X16_BLOCK8 + 32 * h0;
    const int8_t* xb = xg + int64_t(b) * 256 + 32 * i0;
    __m256i acc[R][H];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h) acc[i][h] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      if (i0 == 0 && h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + 64 * c) + PF_BYTES, _MM_HINT_T0);
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32 * h));
        const __m256i aw = _mm256_abs_epi8(v);
        for (int i = 0; i < R; ++i) {
          const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xb + 32 * i + 4 * c), v));
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(p, ones));
          keep_chain(acc[i][h]);
        }
      }
    }
    const float* db = dg + int64_t(b) * 8 + i0;
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h)
        f[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), _mm256_set1_ps(db[i]), f[i][h]);
  }
  for (int h = 0; h < H; ++h) {
    const __m256 sv = _mm256_loadu_ps(s + n0 + 8 * (h0 + h));
    for (int i = 0; i < R; ++i)
      _mm256_storeu_ps(y + int64_t(m0 + i0 + i) * N + n0 + 8 * (h0 + h), _mm256_mul_ps(f[i][h], sv));
  }
}

// Rows m0 .. m0+R of x (one packed group): up to 2 rows against both halves of the tile in one pass, more rows 4 at a
// time per half (16 ymm registers).
template <int R>
void int8x16_rows(const int8_t* xq, const float* d, const int8_t* qt, const float* s, float* y, int K, int N, int n0,
                  int m0) {
  if constexpr (R <= 2) {
    int8x16_half_rows<R, 2>(xq, d, qt, s, y, K, N, n0, m0, 0, 0);
  } else {
    for (int h = 0; h < 2; ++h) {
      if constexpr (R > 4) {
        int8x16_half_rows<4, 1>(xq, d, qt, s, y, K, N, n0, m0, 0, h);
        int8x16_half_rows<R - 4, 1>(xq, d, qt, s, y, K, N, n0, m0, 4, h);
      } else {
        int8x16_half_rows<R, 1>(xq, d, qt, s, y, K, N, n0, m0, 0, h);
      }
    }
  }
}
#endif

// The int8 x16 product for tile n0 / 16, every row of x (scalar code without AVX-512 VNNI or AVX2: the same
// results).
void int8x16_tile(const int8_t* xq, const float* d, const int32_t* bsum, const int8_t* q, const float* s, float* y,
                  int M, int K, int N, int n0) {
  const int nblk = K / 32;
  const int8_t* qt = q + int64_t(n0 / X16) * nblk * X16_BLOCK8;
#ifdef PAGEDLM_AVX512_VNNI
  // The next tile's weights, loaded now where several row groups reuse this one's (one group streams them through
  // once, which the hardware prefetcher keeps up with): 64 rows of SmolLM2's LM head 4.2 -> 3.3 ms on a Zen 5.
  if (M > X16_ROWS && n0 + X16 < N) touch_lines(qt + int64_t(nblk) * X16_BLOCK8, int64_t(nblk) * X16_BLOCK8);
  for_row_groups(M, [&](auto r, int m0) { int8x16_rows<decltype(r)::value>(xq, d, bsum, qt, s, y, K, N, n0, m0); });
#elif defined(PAGEDLM_AVX2)
  (void)bsum;
  for_row_groups(M, [&](auto r, int m0) { int8x16_rows<decltype(r)::value>(xq, d, qt, s, y, K, N, n0, m0); });
#else
  (void)bsum;
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < X16; ++j) {
      float f = 0.f;
      for (int b = 0; b < nblk; ++b) {
        const int8_t* wb = qt + int64_t(b) * X16_BLOCK8;
        const int8_t* xb = xq + kPack8.xq(m, b, nblk);
        int dot = 0;
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i) dot += int(wb[64 * c + 4 * j + i]) * xb[4 * c + i];
        f = std::fma(float(dot), d[kPack8.blk(m, b, nblk)], f);
      }
      y[int64_t(m) * N + n0 + j] = f * s[n0 + j];
    }
#endif
}

// ---- bf16 weights in the x16 layout (y = bf16(x) @ W^T; needs N % 16 == 0 and K % 32 == 0) ------------------
// w [N/16, K/2, 16] uint32: per tile of 16 output rows and pair of inputs (2p, 2p+1), each row's two bf16 weights
// in one 32-bit lane (input 2p in the low half). Activations are rounded to bf16 (nearest even) and packed per group
// of 8 rows, [M/8, K/2, 8] uint32 (row i's pair p at p * 8 + i), so one embedded broadcast feeds a vdpbf16ps for 16
// outputs and all 8 rows are addressed off one pointer. Per output two fp32 chains, over the even and the odd pairs,
// each step adding the pair's two exact products (input 2p + 1 first, as vdpbf16ps does); y = chain 0 + chain 1.
// Builds without AVX512-BF16 compute the same sums in scalar code.
constexpr int BF16_ROWS = 8;  // rows of a packed activation group

inline uint16_t bf16_round(float f) {  // nearest even, a NaN stays a NaN (torch's .to(bfloat16))
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_value(uint32_t h) {
  const uint32_t u = h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x [M, K] fp32 -> xp [ceil(M / 8) * 8 rows] packed as above (rows past M zero).
void pack_bf16_act(const float* x, int M, int K, uint32_t* xp, int nthreads) {
  const int pairs = K / 2, Mr = int(rows_allocated(M, BF16_ROWS));
  parallel_for(Mr, int64_t(M) * K >= (1 << 16) ? nthreads : 1, BF16_ROWS, [&](int64_t m0, int64_t m1) {
  for (int m = int(m0); m < m1; ++m) {
    uint32_t* dst = xp + int64_t(m / BF16_ROWS) * pairs * BF16_ROWS + m % BF16_ROWS;
    if (m >= M) {
      for (int p = 0; p < pairs; ++p) dst[int64_t(p) * BF16_ROWS] = 0;
      continue;
    }
    const float* xm = x + int64_t(m) * K;
    int p = 0;
#ifdef PAGEDLM_AVX512_BF16
    alignas(32) uint32_t tmp[8];
    for (; p + 8 <= pairs; p += 8) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xm + 2 * p)));
      for (int i = 0; i < 8; ++i) dst[int64_t(p + i) * BF16_ROWS] = tmp[i];
    }
#endif
    for (; p < pairs; ++p)
      dst[int64_t(p) * BF16_ROWS] = bf16_round(xm[2 * p]) | uint32_t(bf16_round(xm[2 * p + 1])) << 16;
  }
  });
}

#ifdef PAGEDLM_AVX512_BF16
// acc += (16 rows' bf16 weight pairs w) . (the activation pair at p, broadcast), the broadcast embedded in the
// instruction's memory operand.
inline __m512 dpbf16_bcast(__m512 acc, __m512i w, const uint32_t* p) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(int(*p)));
}

// A full group of 8 rows against tile wt, as bf16x16_rows below, with the pair loop's vdpbf16ps in asm: broadcasts
// embedded in the memory operand (the intrinsics compile to a separate vpbroadcastd each) and the 16 accumulators
// named registers (arrays of them around asm went through the stack): about 2x the intrinsics' speed.
#define PAGEDLM_DP(c, off, w) "vdpbf16ps " #off "*4(%[x])%{1to16%}, %[" #w "], %[" #c "]\n\t"
void bf16x16_rows8(const uint32_t* xg, const uint32_t* wt, float* y, int K, int N, int n0, int m0, bool prefetch) {
  const int pairs = K / 2;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
  for (int p = 0; p < pairs; p += 2) {
    const uint32_t* w = wt + int64_t(p) * X16;
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w) + PF_BYTES, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + X16);
    const uint32_t* xp = xg + int64_t(p) * BF16_ROWS;
#ifdef PAGEDLM_EMULATED_AVX512
    __m512* const as[8] = {&a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7};
    __m512* const bs[8] = {&b0, &b1, &b2, &b3, &b4, &b5, &b6, &b7};
    for (int i = 0; i < 8; ++i) {
      *as[i] = dpbf16_bcast(*as[i], w0, xp + i);
      *bs[i] = dpbf16_bcast(*bs[i], w1, xp + BF16_ROWS + i);
    }
    continue;
#endif
    asm(PAGEDLM_DP(a0, 0, w0) PAGEDLM_DP(a1, 1, w0) PAGEDLM_DP(a2, 2, w0) PAGEDLM_DP(a3, 3, w0)
        PAGEDLM_DP(a4, 4, w0) PAGEDLM_DP(a5, 5, w0) PAGEDLM_DP(a6, 6, w0) PAGEDLM_DP(a7, 7, w0)
        : [a0] "+v"(a0), [a1] "+v"(a1), [a2] "+v"(a2), [a3] "+v"(a3), [a4] "+v"(a4), [a5] "+v"(a5),
          [a6] "+v"(a6), [a7] "+v"(a7)
        : [w0] "v"(w0), [x] "r"(xp), "m"(*reinterpret_cast<const uint32_t(*)[8]>(xp)));
    asm(PAGEDLM_DP(b0, 8, w1) PAGEDLM_DP(b1, 9, w1) PAGEDLM_DP(b2, 10, w1) PAGEDLM_DP(b3, 11, w1)
        PAGEDLM_DP(b4, 12, w1) PAGEDLM_DP(b5, 13, w1) PAGEDLM_DP(b6, 14, w1) PAGEDLM_DP(b7, 15, w1)
        : [b0] "+v"(b0), [b1] "+v"(b1), [b2] "+v"(b2), [b3] "+v"(b3), [b4] "+v"(b4), [b5] "+v"(b5),
          [b6] "+v"(b6), [b7] "+v"(b7)
        : [w1] "v"(w1), [x] "r"(xp), "m"(*reinterpret_cast<const uint32_t(*)[8]>(xp + BF16_ROWS)));
  }
  float* ym = y + int64_t(m0) * N + n0;
  const __m512 sums[8] = {_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1), _mm512_add_ps(a2, b2),
                          _mm512_add_ps(a3, b3), _mm512_add_ps(a4, b4), _mm512_add_ps(a5, b5),
                          _mm512_add_ps(a6, b6), _mm512_add_ps(a7, b7)};
  for (int i = 0; i < 8; ++i) _mm512_storeu_ps(ym + int64_t(i) * N, sums[i]);
}
#undef PAGEDLM_DP

// Rows m0 + i0 .. m0 + i0 + 3 of x (half of packed group xg) against two tiles, wt (outputs n0 ..) and wt2 (n0 + 16
// ..): each activation pair is broadcast into a register once for both tiles, 12 loads per 16 vdpbf16ps instead of
// 18. The same two chains per output as bf16x16_rows8, so the same results.
void bf16x16_rows4_tiles2(const uint32_t* xg, const uint32_t* wt, const uint32_t* wt2, float* y, int K, int N, int n0,
                          int m0, int i0) {
  const int pairs = K / 2;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, d0 = a0, d1 = a0, d2 = a0, d3 = a0;
  auto dp = [](__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); };
  for (int p = 0; p < pairs; p += 2) {
    const uint32_t *w = wt + int64_t(p) * X16, *v = wt2 + int64_t(p) * X16;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + X16);
    const __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + X16);
    const uint32_t* xp = xg + int64_t(p) * BF16_ROWS + i0;
    __m512i x = _mm512_set1_epi32(int(xp[0]));
    a0 = dp(a0, w0, x); c0 = dp(c0, v0, x);
    x = _mm512_set1_epi32(int(xp[1]));
    a1 = dp(a1, w0, x); c1 = dp(c1, v0, x);
    x = _mm512_set1_epi32(int(xp[2]));
    a2 = dp(a2, w0, x); c2 = dp(c2, v0, x);
    x = _mm512_set1_epi32(int(xp[3]));
    a3 = dp(a3, w0, x); c3 = dp(c3, v0, x);
    x = _mm512_set1_epi32(int(xp[BF16_ROWS]));
    b0 = dp(b0, w1, x); d0 = dp(d0, v1, x);
    x = _mm512_set1_epi32(int(xp[BF16_ROWS + 1]));
    b1 = dp(b1, w1, x); d1 = dp(d1, v1, x);
    x = _mm512_set1_epi32(int(xp[BF16_ROWS + 2]));
    b2 = dp(b2, w1, x); d2 = dp(d2, v1, x);
    x = _mm512_set1_epi32(int(xp[BF16_ROWS + 3]));
    b3 = dp(b3, w1, x); d3 = dp(d3, v1, x);
  }
  float* ym = y + int64_t(m0 + i0) * N + n0;
  _mm512_storeu_ps(ym, _mm512_add_ps(a0, b0));
  _mm512_storeu_ps(ym + N, _mm512_add_ps(a1, b1));
  _mm512_storeu_ps(ym + 2 * int64_t(N), _mm512_add_ps(a2, b2));
  _mm512_storeu_ps(ym + 3 * int64_t(N), _mm512_add_ps(a3, b3));
  _mm512_storeu_ps(ym + X16, _mm512_add_ps(c0, d0));
  _mm512_storeu_ps(ym + N + X16, _mm512_add_ps(c1, d1));
  _mm512_storeu_ps(ym + 2 * int64_t(N) + X16, _mm512_add_ps(c2, d2));
  _mm512_storeu_ps(ym + 3 * int64_t(N) + X16, _mm512_add_ps(c3, d3));
}

// Rows m0 .. m0+R of x (packed group xg) against tile wt (16 outputs): y[m, n0 .. n0+15].
template <int R>
void bf16x16_rows(const uint32_t* xg, const uint32_t* wt, float* y, int K, int N, int n0, int m0, bool prefetch) {
  const int pairs = K / 2;
  __m512 a[R], b[R];
  for (int i = 0; i < R; ++i) a[i] = b[i] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; p += 2) {
    const uint32_t* w = wt + int64_t(p) * X16;
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w) + PF_BYTES, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + X16);
    const uint32_t* xp = xg + int64_t(p) * BF16_ROWS;
    for (int i = 0; i < R; ++i) {
      a[i] = dpbf16_bcast(a[i], w0, xp + i);
      b[i] = dpbf16_bcast(b[i], w1, xp + BF16_ROWS + i);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + int64_t(m0 + i) * N + n0, _mm512_add_ps(a[i], b[i]));
}
#endif

#ifdef PAGEDLM_AVX512_BF16
// Tiles n0 / 16 and the next one, every row of xp: full groups 4 rows at a time for both tiles.
void bf16x16_tile(const uint32_t* xp, const uint32_t* w, float* y, int M, int K, int N, int n0);
void bf16x16_tiles2(const uint32_t* xp, const uint32_t* w, float* y, int M, int K, int N, int n0) {
  const int pairs = K / 2;
  const uint32_t* wt = w + int64_t(n0 / X16) * pairs * X16;
  const int full = M / BF16_ROWS * BF16_ROWS;
  for (int m0 = 0; m0 < full; m0 += BF16_ROWS)
    for (int i0 = 0; i0 < BF16_ROWS; i0 += 4)
      bf16x16_rows4_tiles2(xp + int64_t(m0) * pairs, wt, wt + int64_t(pairs) * X16, y, K, N, n0, m0, i0);
  if (full < M) {
    const int64_t off = int64_t(full) * pairs;  // the last, partial group: as bf16x16_tile runs it
    bf16x16_tile(xp + off, w, y + int64_t(full) * N, M - full, K, N, n0);
    bf16x16_tile(xp + off, w, y + int64_t(full) * N, M - full, K, N, n0 + X16);
  }
}
#endif

// The bf16 x16 product for tile n0 / 16, every row of the packed activations xp.
void bf16x16_tile(const uint32_t* xp, const uint32_t* w, float* y, int M, int K, int N, int n0) {
  const int pairs = K / 2;
  const uint32_t* wt = w + int64_t(n0 / X16) * pairs * X16;
#ifdef PAGEDLM_AVX512_BF16
  for_row_groups(M, [&](auto r, int m0) {
    constexpr int R = decltype(r)::value;
    if constexpr (R == BF16_ROWS) bf16x16_rows8(xp + int64_t(m0) * pairs, wt, y, K, N, n0, m0, m0 == 0);
    else bf16x16_rows<R>(xp + int64_t(m0) * pairs, wt, y, K, N, n0, m0, m0 == 0);
  });
#else
  for (int m = 0; m < M; ++m) {
    const uint32_t* xg = xp + int64_t(m / BF16_ROWS) * pairs * BF16_ROWS + m % BF16_ROWS;
    for (int j = 0; j < X16; ++j) {
      float c[2] = {0.f, 0.f};
      for (int p = 0; p < pairs; ++p) {
        const uint32_t wv = wt[int64_t(p) * X16 + j], xv = xg[int64_t(p) * BF16_ROWS];
        float& acc = c[p % 2];
        acc += bf16_value(wv >> 16) * bf16_value(xv >> 16);
        acc += bf16_value(wv & 0xffffu) * bf16_value(xv & 0xffffu);
      }
      y[int64_t(m) * N + n0 + j] = c[0] + c[1];
    }
  }
#endif
}

// The weights of rows n0 .. n0+nt dequantized to fp32, [nt, K].
void dequant_int8_rows(const int8_t* q, const float* s, int K, int n0, int nt, float* w) {
  for (int j = 0; j < nt; ++j) {
    const int8_t* qj = q + int64_t(n0 + j) * K;
    const float sj = s[n0 + j];
    for (int k = 0; k < K; ++k) w[int64_t(j) * K + k] = float(qj[k]) * sj;
  }
}

void dequant_int4_rows(const uint8_t* q, const uint16_t* sc, const uint16_t* mn, int K, int G, int n0, int nt,
                       float* w) {
  const int ngroups = K / G;
  for (int j = 0; j < nt; ++j) {
    const int n = n0 + j;
    const uint8_t* qn = q + int64_t(n) * (K / 2);
    float* wn = w + int64_t(j) * K;
    for (int c = 0; c < K; c += 32) {
      const float s = half_to_float(sc[int64_t(n) * ngroups + c / G]), m = half_to_float(mn[int64_t(n) * ngroups + c / G]);
      for (int i = 0; i < 16; ++i) {
        const uint8_t b = qn[c / 2 + i];
        wn[c + i] = float(b & 0x0f) * s + m;
        wn[c + 16 + i] = float(b >> 4) * s + m;
      }
    }
  }
}

inline uint16_t float_to_half(float f) {  // round to nearest even, as a float32 -> float16 cast does
#ifdef PAGEDLM_AVX2
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x; std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0);
  if (x >= 0x477ff000u) return sign | 0x7c00;  // rounds past 65504
  if (x < 0x38800000u) {  // a float16 subnormal, or zero
    if (x < 0x33000000u) return sign;
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const int shift = 126 - int(x >> 23);
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return uint16_t(sign | r);
  }
  return uint16_t(sign | ((x + 0xc8000fffu + ((x >> 13) & 1)) >> 13));
#endif
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite values: the dequantized weights)
  uint32_t u; std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// Row j of one x16 block (16 rows x 32 codes, qb) into wj[32]: code * s + m in fp32, bf16 rounded for Out = uint16_t.
template <class Out>
inline void x16_block_row(const uint8_t* qb, int j, float s, float m, Out* wj) {
  auto out = [](float v) {
    if constexpr (std::is_same_v<Out, uint16_t>) return float_to_bf16(v);
    else return v;
  };
  for (int c = 0; c < 4; ++c) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t v = qb[c * 64 + j * 4 + i];
      wj[4 * c + i] = out(float(v & 0x0f) * s + m);
      wj[16 + 4 * c + i] = out(float(v >> 4) * s + m);
    }
  }
}

// Tile t (rows 16t .. 16t+15) of an int4 x16 weight dequantized to rows of w [N, K], fp32 (Out = float) or bf16
// (Out = uint16_t): code * scale + minimum in fp32 (the scales' kind S gives both), bf16 rounded to nearest even.
template <class S, class Out>
void dequant_int4x16_tile(const uint8_t* q, const S& scales, int K, int t, Out* w) {
  const int nblocks = K / 32;
  const uint8_t* qt = q + int64_t(t) * 16 * (K / 2);
  const S sc = scales.tile(t);
  for (int b = 0; b < nblocks; ++b) {
    const uint8_t* qb = qt + int64_t(b) * 256;
    const int g = b / sc.bpg;
    for (int j = 0; j < 16; ++j) {
      const float s = sc.scale(g, j), m = sc.min(g, j);
      Out* wj = w + (int64_t(t) * 16 + j) * K + b * 32;
#ifdef PAGEDLM_AVX512_BF16
      if constexpr (std::is_same_v<Out, uint16_t>) {
        // The row's 16 bytes in their natural order (byte 4c + i from chunk c), nibbles widened to fp32, the same
        // mul and add as below (no fma), rounded to nearest even by vcvtneps2bf16.
        auto word = [&](int c) { int32_t v; std::memcpy(&v, qb + c * 64 + j * 4, 4); return v; };
        const __m128i bytes = _mm_set_epi32(word(3), word(2), word(1), word(0)), low = _mm_set1_epi8(0x0f);
        const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
        const __m128i halves[2] = {_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low)};
        for (int h = 0; h < 2; ++h) {
          const __m512 f = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[h])), vs), vm);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wj + 16 * h), (__m256i)_mm512_cvtneps_pbh(f));
        }
        continue;
      }
#endif
      x16_block_row(qb, j, s, m, wj);
    }
  }
}

// Rows ids[0 .. n) of an int4 x16 weight [N, K] into w [n, K] in fp32, as dequant_int4x16_tile writes them (an
// embedding table's rows). 0, or 2 if an id is outside 0 .. N - 1.
template <class S>
int dequant_int4x16_rows(const uint8_t* q, const S& scales, int K, int N, const int64_t* ids, int n, float* w,
                         int nthreads) {
  for (int r = 0; r < n; ++r)
    if (ids[r] < 0 || ids[r] >= N) return 2;
  parallel_for(n, int64_t(n) * K >= (1 << 16) ? nthreads : 1, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int t = int(ids[r] / 16), j = int(ids[r] % 16);
      const uint8_t* qt = q + int64_t(t) * 16 * (K / 2);
      const S sc = scales.tile(t);
      for (int b = 0; b < K / 32; ++b) {
        const int g = b / sc.bpg;
        x16_block_row(qt + int64_t(b) * 256, j, sc.scale(g, j), sc.min(g, j), w + r * K + b * 32);
      }
    }
  });
  return 0;
}

// y[:, n0 .. n0+nt] = x @ w^T for a dequantized tile w [nt, K] (kept in L1/L2 while all rows of x pass).
void dense_tile(const float* x, const float* w, float* y, int M, int K, int N, int n0, int nt) {
  int m = 0;
#ifdef PAGEDLM_AVX2
  if (nt == NT && K % 8 == 0) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    for (; m + 2 <= M; m += 2) {
      const float *xa = x + int64_t(m) * K, *xb = xa + K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int k = 0; k < K; k += 8) {
        const __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
        __m256 wv = _mm256_loadu_ps(w0 + k);
        a0 = _mm256_fmadd_ps(wv, va, a0); b0 = _mm256_fmadd_ps(wv, vb, b0);
        wv = _mm256_loadu_ps(w1 + k);
        a1 = _mm256_fmadd_ps(wv, va, a1); b1 = _mm256_fmadd_ps(wv, vb, b1);
        wv = _mm256_loadu_ps(w2 + k);
        a2 = _mm256_fmadd_ps(wv, va, a2); b2 = _mm256_fmadd_ps(wv, vb, b2);
        wv = _mm256_loadu_ps(w3 + k);
        a3 = _mm256_fmadd_ps(wv, va, a3); b3 = _mm256_fmadd_ps(wv, vb, b3);
      }
      float* ya = y + int64_t(m) * N + n0;
      float* yb = ya + N;
      ya[0] = hsum(a0); ya[1] = hsum(a1); ya[2] = hsum(a2); ya[3] = hsum(a3);
      yb[0] = hsum(b0); yb[1] = hsum(b1); yb[2] = hsum(b2); yb[3] = hsum(b3);
    }
  }
#endif
  for (; m < M; ++m)
    for (int j = 0; j < nt; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += x[int64_t(m) * K + k] * w[int64_t(j) * K + k];
      y[int64_t(m) * N + n0 + j] = acc;
    }
}

// Rows of x at which dequantizing a tile once beats converting the weights in registers for every row.
constexpr int BUFFERED_MIN_ROWS = 3;

}  // namespace

#include "gguf_x16.h"
#include "amx_x16.h"

// Layouts of int4 weights (the `layout` argument of the entry points below).
enum Int4Layout { INT4_ROW_LAYOUT = 0, INT4_X16 = 1, INT4_X16_K = 2 };

// Whether an int4 weight of this layout and shape can run: x16 needs N % 16 == 0; INT4_X16 takes fp16 scales and
// minimums per group of G (mins may be null: -8 * scale, GGUF Q4_0), INT4_X16_K Q4_K's scales (KScales: scales
// and mins point at its dd and sm arrays, G = 32, K % 256 == 0); INT4_ROW_LAYOUT needs mins.
inline bool int4_layout_ok(int layout, int K, int N, int G, const void* mins) {
  if (G % 32 != 0 || K % G != 0) return false;
  switch (layout) {
    case INT4_ROW_LAYOUT: return mins != nullptr;
    case INT4_X16: return N % X16 == 0;
    case INT4_X16_K: return N % X16 == 0 && G == 32 && K % 256 == 0 && mins != nullptr;
    default: return false;
  }
}

// Calls f(scales) with the scales of an x16 layout (F16Scales, Q40Scales or KScales).
template <class F>
inline void with_x16_scales(int layout, const void* scales, const void* mins, int K, int G, F&& f) {
  if (layout == INT4_X16_K)
    f(KScales{static_cast<const uint16_t*>(scales), static_cast<const uint8_t*>(mins), K / 32});
  else if (mins == nullptr)
    f(Q40Scales{{static_cast<const uint16_t*>(scales), nullptr, K / G, G / 32}});
  else
    f(F16Scales{static_cast<const uint16_t*>(scales), static_cast<const uint16_t*>(mins), K / G, G / 32});
}

// W [N, K] from an int4 x16 layout (an Int4Layout other than INT4_ROW_LAYOUT), in bf16 (large-M products dequantize
// into a scratch buffer per call and run a bf16 GEMM where no dense copy is kept) or fp32 (dense copies, references).
template <class Out>
int dequant_int4_x16(const uint8_t* q, const void* scales, const void* mins, Out* w, int K, int N, int G, int layout,
                     int nthreads) {
  if (layout == INT4_ROW_LAYOUT || !int4_layout_ok(layout, K, N, G, mins)) return 1;
  with_x16_scales(layout, scales, mins, K, G, [&](const auto& sc) {
    parallel_for(N / 16, nthreads, 1, [&](int64_t t0, int64_t t1) {
      for (int t = int(t0); t < t1; ++t) dequant_int4x16_tile(q, sc, K, t, w);
    });
  });
  return 0;
}

extern "C" {

// packed: q is in the packed layout (needs N % 4 == 0 and K % 16 == 0; returns 1 otherwise).
int pagedlm_linear_int8(const float* x, const int8_t* q, const float* s, float* y, int M, int K, int N, int packed,
                        int nthreads) {
  if (packed && (N % NT || K % 16)) return 1;
  const int tiles = (N + NT - 1) / NT;
  parallel_for(tiles, nthreads, 1, [&](int64_t t0, int64_t t1) {
    for (int t = int(t0); t < t1; ++t) {
      const int n0 = t * NT, nt = n0 + NT <= N ? NT : N - n0;
      if (M < BUFFERED_MIN_ROWS) {
        if (packed) int8p_tile(x, q, s, y, M, K, N, n0);
        else int8_tile(x, q, s, y, M, K, N, n0, nt);
        continue;
      }
      thread_local std::vector<float> w;
      w.resize(size_t(NT) * K);
      if (packed) dequant_int8p_tile(q, s, K, n0, w.data());
      else dequant_int8_rows(q, s, K, n0, nt, w.data());
      dense_tile(x, w.data(), y, M, K, N, n0, nt);
    }
  });
  return 0;
}

// layout: an Int4Layout; returns 1 where int4_layout_ok says no.
int pagedlm_linear_int4(const float* x, const uint8_t* q, const void* scales, const void* mins, float* y, int M,
                        int K, int N, int G, int layout, int nthreads) {
  if (!int4_layout_ok(layout, K, N, G, mins)) return 1;
  thread_local std::vector<int8_t> xq;  // kept between calls (grow-only): no page faults per call
  thread_local std::vector<float> d, gsum;
  // Q4_0 (no minimums): the offset's correction, see Q40Scales; Q4_K: pairs of block sums (bpair, see q4k_rows)
  thread_local std::vector<int32_t> bsum;
  const bool q4k = layout == INT4_X16_K;  // activations with one scale per 256 values, no AMX path
  const bool amx = layout == INT4_X16 && amx_use(M, 4);  // then every pass runs on AMX tiles
  const ActLayout lay = layout == INT4_ROW_LAYOUT ? ActLayout{0} : amx ? kPack16 : kPack8;
  const int64_t Mr = rows_allocated(M, lay.group());
  xq.resize(size_t(Mr) * K); d.resize(size_t(Mr) * (K / 32)); gsum.resize(size_t(Mr) * (K / G));
  if (mins == nullptr || q4k) bsum.resize(size_t(Mr) * (K / 32));
  // Pointers taken here: inside the loops' bodies the names would be each thread's own (empty) vectors.
  int8_t* const xqp = xq.data();
  float *const dp = d.data(), *const gp = gsum.data();
  int32_t* const bp = mins == nullptr || q4k ? bsum.data() : nullptr;
  if (q4k) quantize_act(x, M, K, G, xqp, dp, gp, nthreads, nullptr, lay, 8, bp);
  else quantize_act(x, M, K, G, xqp, dp, gp, nthreads, bp, lay);
  if (layout != INT4_ROW_LAYOUT) {
    // Big products in blocks of X16_MBLOCK rows, so a block's activations stay in cache while every tile (the
    // same tiles on the same thread each time) passes over them.
    const int nblk = K / 32, ngroups = K / G;
    with_x16_scales(layout, scales, mins, K, G, [&](const auto& sc) {
      for (int m0 = 0; m0 < M; m0 += X16_MBLOCK) {
        const int rows = std::min(X16_MBLOCK, M - m0);
        amx_products.fetch_add(amx, std::memory_order_relaxed);
        // This pass's rows: activations, their scales and sums, outputs.
        const int8_t* xm = xqp + int64_t(m0) * K;
        const float *dm = dp + int64_t(m0) * nblk, *gm = gp + int64_t(m0) * ngroups;
        const int32_t* bm = bp ? bp + int64_t(m0) * (q4k ? nblk / 2 : nblk) : nullptr;
        float* ym = y + int64_t(m0) * N;
#ifdef PAGEDLM_AVX512_VNNI
        const bool pairs = !amx && pairs_at(rows);
#endif
        parallel_for(N / X16, nthreads, rows == 1 ? 2 : 1, [&](int64_t t0, int64_t t1) {
          int t = int(t0);
#ifdef PAGEDLM_AMX
          if (amx) {
            int4x16_amx_tiles(xm, dm, gm, bm, q, sc, ym, rows, K, N, t, int(t1));
            return;
          }
#endif
#ifdef PAGEDLM_AVX512_VNNI
          for (; pairs && t + 2 <= t1; t += 2) {
            if constexpr (std::is_same_v<std::decay_t<decltype(sc)>, KScales>)
              q4k_row_tiles<2>(xm, dm, bm, q, sc, ym, K, t);
            else
              int4x16_row_tiles<2>(xm, dm, gm, bm, q, sc, ym, K, N, t);
          }
#endif
          for (; t < t1; ++t) int4x16_tile(xm, dm, gm, bm, q, sc, ym, rows, K, N, t);
        });
      }
    });
    return 0;
  }
  const uint16_t *sc16 = static_cast<const uint16_t*>(scales), *mn16 = static_cast<const uint16_t*>(mins);
  const int tiles = (N + NT - 1) / NT;
  parallel_for(tiles, nthreads, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scratch;
    scratch.resize(int4_scratch_floats(K, G));
    for (int t = int(t0); t < t1; ++t) {
      const int n0 = t * NT, nt = n0 + NT <= N ? NT : N - n0;
      int4_tile(xqp, dp, gp, q, sc16, mn16, y, M, K, N, G, n0, nt, scratch.data());
    }
  });
  return 0;
}

// y = Q8(x) @ W^T over int8 weights in the x16 layout (needs N % 16 == 0 and K % 32 == 0; returns 1 otherwise).
int pagedlm_linear_int8_x16(const float* x, const int8_t* q, const float* s, float* y, int M, int K, int N,
                            int nthreads) {
  if (N % X16 != 0 || K % 32 != 0) return 1;
  thread_local std::vector<int8_t> xq;  // kept between calls, as in pagedlm_linear_int4
  thread_local std::vector<float> d, gsum;
  thread_local std::vector<int32_t> bsum;
  const bool amx = amx_use(M, 8);
  const ActLayout lay = amx ? kPack16 : kPack8;
  const int64_t Mr = rows_allocated(M, lay.group());
  xq.resize(size_t(Mr) * K); d.resize(size_t(Mr) * (K / 32)); gsum.resize(size_t(Mr) * (K / 32));
  bsum.resize(size_t(Mr) * (K / 32));
  int8_t* const xqp = xq.data();
  float* const dp = d.data();
  int32_t* const bp = bsum.data();
  quantize_act(x, M, K, 32, xqp, dp, gsum.data(), nthreads, bp, lay);
  const int nblk = K / 32;
  for (int m0 = 0; m0 < M; m0 += X16_MBLOCK) {
    const int rows = std::min(X16_MBLOCK, M - m0);
    amx_products.fetch_add(amx, std::memory_order_relaxed);
    // This pass's rows: activations, their scales and sums, outputs.
    const int8_t* xm = xqp + int64_t(m0) * K;
    const float* dm = dp + int64_t(m0) * nblk;
    const int32_t* bm = bp + int64_t(m0) * nblk;
    float* ym = y + int64_t(m0) * N;
#ifdef PAGEDLM_AVX512_VNNI
    const bool pairs = !amx && pairs_at(rows);
#endif
    parallel_for(N / X16, nthreads, rows == 1 ? 2 : 1, [&](int64_t t0, int64_t t1) {
      int t = int(t0);
#ifdef PAGEDLM_AMX
      if (amx) {
        int8x16_amx_tiles(xm, dm, q, s, nullptr, ym, rows, K, N, t, int(t1));
        return;
      }
#endif
#ifdef PAGEDLM_AVX512_VNNI
      for (; pairs && t + 2 <= t1; t += 2) int8x16_row_tiles<2>(xm, dm, bm, q, s, ym, K, t * X16);
#endif
      for (; t < t1; ++t) int8x16_tile(xm, dm, bm, q, s, ym, rows, K, N, t * X16);
    });
  }
  return 0;
}

// y = bf16(x) @ W^T over bf16 weights in the x16 layout (needs N % 16 == 0 and K % 32 == 0; returns 1 otherwise).
int pagedlm_linear_bf16_x16(const float* x, const uint32_t* w, float* y, int M, int K, int N, int nthreads) {
  if (N % X16 != 0 || K % 32 != 0) return 1;
  thread_local std::vector<uint32_t> xp;  // kept between calls, as in pagedlm_linear_int4
  xp.resize(size_t(rows_allocated(M, BF16_ROWS)) * (K / 2));
  uint32_t* const xpp = xp.data();
  pack_bf16_act(x, M, K, xpp, nthreads);
  for (int m0 = 0; m0 < M; m0 += X16_MBLOCK) {
    const int rows = std::min(X16_MBLOCK, M - m0);
#ifdef PAGEDLM_AVX512_BF16
    if (rows >= BF16_ROWS && (N / X16) % 2 == 0) {  // tiles in pairs (see bf16x16_rows4_tiles2)
      parallel_for(N / X16 / 2, nthreads, 1, [&](int64_t t0, int64_t t1) {
        for (int t = int(t0); t < t1; ++t)
          bf16x16_tiles2(xpp + int64_t(m0) * (K / 2), w, y + int64_t(m0) * N, rows, K, N, 2 * t * X16);
      });
      continue;
    }
#endif
    parallel_for(N / X16, nthreads, 1, [&](int64_t t0, int64_t t1) {
      for (int t = int(t0); t < t1; ++t)
        bf16x16_tile(xpp + int64_t(m0) * (K / 2), w, y + int64_t(m0) * N, rows, K, N, t * X16);
    });
  }
  return 0;
}

// Whether products of several rows over the int4 / int8 x16 layouts and GGUF Q8_0 run on AMX tiles here: built with
// AMX-INT8, the tile state granted to this process, and not turned off (pagedlm_amx_enable).
int pagedlm_amx_native() { return amx_use(1 << 20, 4); }

// Turns the AMX paths on (1: products of enough rows, see AMX_MIN_ROWS_INT4), off (0: the VNNI code, the same results)
// or on for every row count (2: tests); returns the previous setting.
int pagedlm_amx_enable(int mode) { return amx_enabled.exchange(std::clamp(mode, 0, 2)); }

// One-row products read x16 tiles in pairs (1) or one at a time (0), see row_pairs; returns the previous setting.
int pagedlm_row_pairs(int mode) { return row_pairs.exchange(mode != 0); }

// Passes over a weight that read its tiles in pairs, in this process.
int64_t pagedlm_row_pair_passes() { return row_pair_passes.load(); }

// One-row passes over a GGUF Q8_0 weight that ran gguf_q8_0_row_tiles (in tile pairs or one at a time), in this
// process (0 in builds without AVX-512 VNNI).
int64_t pagedlm_q8_0_row_passes() { return q8_0_row_passes.load(); }

// Products that have run on AMX tiles in this process.
int64_t pagedlm_amx_products() { return amx_products.load(); }

// Products of a GGUF Q8_0 (several rows) / Q5_0 / Q5_K / Q6_K / Q3_K / Q2_K / IQ4 weight that ran the AVX-512 VNNI
// kernels (gguf_x16_rows16 and the K-quants' rows16; 0 in builds without them).
int64_t pagedlm_gguf_vnni_products() {
#ifdef PAGEDLM_AVX512_VNNI
  return gguf_vnni_products.load();
#else
  return 0;
#endif
}

// Whether this build multiplies bf16 weights with AVX512-BF16 (else portable code computes the same sums).
int pagedlm_bf16_x16_native() {
#ifdef PAGEDLM_AVX512_BF16
  return 1;
#else
  return 0;
#endif
}

// Whether this build runs the x16 layout of `bits`-bit weights in SIMD code (else portable code computes the same
// results): AVX-512 VNNI or AVX2.
int pagedlm_x16_native(int bits) {
#if defined(PAGEDLM_AVX512_VNNI)
  return bits == 4 || bits == 8;
#elif defined(PAGEDLM_AVX2)
  return bits == 4 || bits == 8;
#else
  return 0 * bits;
#endif
}

// W [N, K] in fp32 from the int8 / int4 layouts (for large-M products, which then run as a dense fp32 GEMM).
int pagedlm_dequant_int8(const int8_t* q, const float* s, float* w, int K, int N, int packed, int nthreads) {
  if (packed && (N % NT || K % 16)) return 1;
  if (packed) {
    parallel_for(N / NT, nthreads, 1, [&](int64_t t0, int64_t t1) {
      for (int t = int(t0); t < t1; ++t) dequant_int8p_tile(q, s, K, t * NT, w + int64_t(t) * NT * K);
    });
    return 0;
  }
  parallel_for(N, nthreads, 16, [&](int64_t n0, int64_t n1) {
    for (int n = int(n0); n < n1; ++n) dequant_int8_rows(q, s, K, n, 1, w + int64_t(n) * K);
  });
  return 0;
}

int pagedlm_dequant_int4(const uint8_t* q, const uint16_t* scales, const uint16_t* mins, float* w, int K, int N,
                         int G, int nthreads) {
  if (G % 32 != 0 || K % G != 0) return 1;
  parallel_for(N, nthreads, 16, [&](int64_t n0, int64_t n1) {
    for (int n = int(n0); n < n1; ++n) dequant_int4_rows(q, scales, mins, K, G, n, 1, w + int64_t(n) * K);
  });
  return 0;
}

int pagedlm_dequant_int4_x16_bf16(const uint8_t* q, const void* scales, const void* mins, uint16_t* w, int K, int N,
                                  int G, int layout, int nthreads) {
  return dequant_int4_x16(q, scales, mins, w, K, N, G, layout, nthreads);
}

int pagedlm_dequant_int4_x16(const uint8_t* q, const void* scales, const void* mins, float* w, int K, int N, int G,
                             int layout, int nthreads) {
  return dequant_int4_x16(q, scales, mins, w, K, N, G, layout, nthreads);
}

// Rows ids[0 .. n) of an int4 x16 weight (as pagedlm_dequant_int4_x16 takes it) into w [n, K] in fp32: 0, 1 for a
// layout or shape the x16 kernels do not take, 2 for an id outside 0 .. N - 1.
int pagedlm_int4_x16_rows(const uint8_t* q, const void* scales, const void* mins, int K, int N, int G, int layout,
                          const int64_t* ids, int n, float* w, int nthreads) {
  if (layout == INT4_ROW_LAYOUT || !int4_layout_ok(layout, K, N, G, mins)) return 1;
  int rc = 0;
  with_x16_scales(layout, scales, mins, K, G, [&](const auto& sc) {
    rc = dequant_int4x16_rows(q, sc, K, N, ids, n, w, nthreads);
  });
  return rc;
}

// GGUF Q4_0 (kind 0: fp16 d, 16 code bytes) / Q4_1 (kind 1: fp16 d, fp16 m, 16 code bytes) rows written straight
// into the int4 x16 layout (see the top of this file) as rows row0 .. row0 + rows of a weight of K inputs: source
// row perm[r] (perm may be null) becomes row row0 + r. The same codes, scales and minimums as Int4Blocks.from_gguf
// then quant.to_x16 (Q4_0's minimum -8 * d, rounded to fp16 as torch does, or none where mins is null), in one
// pass.
int pagedlm_gguf_q4_to_x16(const uint8_t* raw, int kind, int rows, int K, const int64_t* perm, int row0,
                           uint8_t* codes, uint16_t* scales, uint16_t* mins, int nthreads) {
  if (K % 32 || (kind != 0 && kind != 1)) return 1;
  const int nblocks = K / 32, head = kind == 0 ? 2 : 4, bsize = head + 16;
  parallel_for(rows, nthreads, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = raw + (perm ? perm[r] : r) * int64_t(nblocks) * bsize;
      const int64_t dst = row0 + r, t = dst / 16, j = dst % 16;
      for (int b = 0; b < nblocks; ++b) {
        const uint8_t* blk = src + int64_t(b) * bsize;
        uint16_t d, m;
        std::memcpy(&d, blk, 2);
        if (kind == 1) std::memcpy(&m, blk + 2, 2);
        else m = float_to_half(half_to_float(d) * -8.0f);
        const int64_t at = (t * nblocks + b) * 16 + j;
        scales[at] = d;
        if (mins != nullptr) mins[at] = m;
        uint8_t* out = codes + (t * nblocks + b) * 256 + j * 4;
        for (int c = 0; c < 4; ++c) std::memcpy(out + c * 64, blk + head + 4 * c, 4);
      }
    }
  });
  return 0;
}

// GGUF Q4_K rows (super-blocks of 256 values, 144 bytes: fp16 d and dmin, 12 bytes of 6-bit scales and minimums
// for its 8 blocks, 4 runs of 32 code bytes, run i holding block 2i in its low nibbles and 2i + 1 in its high ones)
// written into the x16 layout with KScales (INT4_X16_K): codes as int4 x16, dd [N/16, K/256, 2, 16] (d, dmin as
// stored), sm [N/16, K/32, 2, 16] (the 6-bit scale and minimum as bytes). Rows as pagedlm_gguf_q4_to_x16's.
int pagedlm_gguf_q4_k_to_x16(const uint8_t* raw, int rows, int K, const int64_t* perm, int row0, uint8_t* codes,
                             uint16_t* dd, uint8_t* sm, int nthreads) {
  if (K % 256) return 1;
  const int nsuper = K / 256, nblocks = K / 32;
  parallel_for(rows, nthreads, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = raw + (perm ? perm[r] : r) * int64_t(nsuper) * 144;
      const int64_t dst = row0 + r, t = dst / 16, j = dst % 16;
      for (int u = 0; u < nsuper; ++u) {
        const uint8_t* sb = src + int64_t(u) * 144;
        const uint8_t* q = sb + 4;  // the 12 bytes of scales and minimums
        std::memcpy(dd + ((t * nsuper + u) * 2 + 0) * 16 + j, sb, 2);
        std::memcpy(dd + ((t * nsuper + u) * 2 + 1) * 16 + j, sb + 2, 2);
        for (int k = 0; k < 8; ++k) {
          const uint8_t sc = k < 4 ? q[k] & 63 : (q[k + 4] & 0x0f) | ((q[k - 4] >> 6) << 4);
          const uint8_t mn = k < 4 ? q[k + 4] & 63 : (q[k + 4] >> 4) | ((q[k] >> 6) << 4);
          const int b = u * 8 + k;
          sm[((t * nblocks + b) * 2 + 0) * 16 + j] = sc;
          sm[((t * nblocks + b) * 2 + 1) * 16 + j] = mn;
          const uint8_t* run = sb + 16 + 32 * (k / 2);
          const int shift = 4 * (k % 2);
          uint8_t bytes[16];  // value i in the low nibble of byte i, value 16 + i in the high one
          for (int i = 0; i < 16; ++i)
            bytes[i] = uint8_t(((run[i] >> shift) & 0x0f) | (((run[16 + i] >> shift) & 0x0f) << 4));
          uint8_t* out = codes + (t * nblocks + b) * 256 + j * 4;
          for (int c = 0; c < 4; ++c) std::memcpy(out + c * 64, bytes + 4 * c, 4);
        }
      }
    }
  });
  return 0;
}

// GGUF Q8_0 rows (fp16 d, 32 int8 codes per block: value d * q) requantized to int8 per row as quant.quantize_int8
// does (s = max(max|v| / 127, 1e-12), q = clamp(round_half_even(v / s), -127, 127)): q [rows, K] by rows, s [rows].
int pagedlm_gguf_q8_0_to_int8(const uint8_t* raw, int rows, int K, int8_t* q, float* s, int nthreads) {
  if (K % 32) return 1;
  const int nblocks = K / 32;
  parallel_for(rows, nthreads, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> v(K);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = raw + r * int64_t(nblocks) * 34;
      float amax = 0.0f;
      for (int b = 0; b < nblocks; ++b) {
        uint16_t dh;
        std::memcpy(&dh, src + b * 34, 2);
        const float d = half_to_float(dh);
        const int8_t* qs = reinterpret_cast<const int8_t*>(src + b * 34 + 2);
        for (int i = 0; i < 32; ++i) {
          v[b * 32 + i] = d * float(qs[i]);
          amax = std::max(amax, std::fabs(v[b * 32 + i]));
        }
      }
      const float sr = std::max(amax / 127.0f, 1e-12f);
      s[r] = sr;
      for (int k = 0; k < K; ++k) {
        q[r * K + k] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(v[k] / sr))));
      }
    }
  });
  return 0;
}

// ---- GGUF Q8_0 / Q5_0 / Q5_K / Q6_K in their x16 layouts (gguf_x16.h) --------------------------------------
// kind: a GgufKind; K % 32 == 0 (K-quants: % 256), N % 16 == 0; planes / aux as the kind has them (else null).

static bool gguf_shape_ok(int kind, int K, int N) {
  if (kind < GK_Q8_0 || kind > GK_Q2_K || K <= 0 || N % X16 != 0) return false;
  return gguf_super(kind) ? K % 256 == 0 : K % 32 == 0;
}

// Raw GGUF rows of `kind` written into the x16 layout as rows row0 .. row0 + rows (source row perm[r], perm may
// be null), as pagedlm_gguf_q4_to_x16 does for int4; planes must be zeroed beforehand.
int pagedlm_gguf_to_x16(const uint8_t* raw, int kind, int rows, int K, const int64_t* perm, int row0, uint8_t* codes,
                        uint8_t* planes, uint16_t* scales, uint8_t* aux, int nthreads) {
  if (!gguf_shape_ok(kind, K, X16)) return 1;
  const int64_t row_bytes = int64_t(gguf_super(kind) ? K / 256 : K / 32) * gguf_block_bytes(kind);
  const GgufX16 g{kind, K / 32, codes, planes, scales, aux};
  parallel_for(rows, nthreads, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gguf_write_row(g, raw + (perm ? perm[r] : r) * row_bytes, row0 + r);
  });
  return 0;
}

int pagedlm_linear_gguf(const float* x, int kind, const uint8_t* codes, const uint8_t* planes, const uint16_t* scales,
                        const uint8_t* aux, float* y, int M, int K, int N, int nthreads) {
  if (!gguf_shape_ok(kind, K, N)) return 1;
  thread_local std::vector<int8_t> xq;  // kept between calls, as in pagedlm_linear_int4
  thread_local std::vector<float> d, gsum;
  thread_local std::vector<int32_t> bsum;
  const int nblk = K / 32;
  const bool amx = kind == GK_Q8_0 && amx_use(M, 8);
  const ActLayout lay = amx ? kPack16 : kPack8;
  const int64_t Mr = rows_allocated(M, lay.group());
  xq.resize(size_t(Mr) * K); d.resize(size_t(Mr) * nblk); gsum.resize(size_t(Mr) * nblk); bsum.resize(size_t(Mr) * nblk);
  int8_t* const xqp = xq.data();
  float *const dp = d.data(), *const gp = gsum.data();
  int32_t* const bp = bsum.data();
  const bool q5k = kind == GK_Q5_K, ksuper = gguf_super(kind);  // activations per 256 values
  if (q5k) quantize_act(x, M, K, 32, xqp, dp, gp, nthreads, nullptr, lay, 8, bp);  // bp: pairs of block sums
  else if (ksuper) quantize_act(x, M, K, 32, xqp, dp, gp, nthreads, bp, lay, 8);
  else quantize_act(x, M, K, 32, xqp, dp, gp, nthreads, bp, lay);  // sblk a constant at each call
  int32_t* hp = nullptr;
  // Per block [.., 2]: Q2_K's sums of its halves' activations (for the minimums, every build), or on AVX-512 VNNI
  // the offsets of the Q6_K-shaped kinds' halves (q6k_rows16 corrects them apart).
  int32_t off = 0;
  if (kind == GK_Q2_K) off = -1;
#ifdef PAGEDLM_AVX512_VNNI
  if (gguf_q6_shaped(kind))
    off = kind == GK_Q6_K ? kKindOffset<GK_Q6_K> : kind == GK_Q3_K ? kKindOffset<GK_Q3_K> : kKindOffset<GK_IQ4_XS>;
#endif
  thread_local std::vector<int32_t> hoff;
  if (off) {
    hoff.resize(size_t(Mr) * nblk * 2);
    int32_t* const hop = hp = hoff.data();
    parallel_for(M, int64_t(M) * K >= 65536 ? nthreads : 1, 8, [&](int64_t m0, int64_t m1) {
      for (int m = int(m0); m < m1; ++m)
        for (int b = 0; b < nblk; ++b) {
          const int8_t* xb = xqp + lay.xq(m, b, nblk);
          int32_t sum = 0;
          for (int v = 0; v < 16; ++v) sum += xb[v];
          const int64_t at = lay.blk(m, b, nblk);
          hop[2 * at] = -off * sum;
          hop[2 * at + 1] = -off * (bp[at] - sum);
        }
    });
  }
#ifdef PAGEDLM_AVX512_VNNI
  gguf_vnni_products.fetch_add(!amx && (M > 1 || kind != GK_Q8_0), std::memory_order_relaxed);
#endif
  const GgufX16 g{kind, nblk, codes, planes, scales, aux};
  for (int m0 = 0; m0 < M; m0 += X16_MBLOCK) {
    const int rows = std::min(X16_MBLOCK, M - m0);
    amx_products.fetch_add(amx, std::memory_order_relaxed);
    // This pass's rows: activations, their scales and sums, outputs.
    const int8_t* xm = xqp + int64_t(m0) * K;
    const float* dm = dp + int64_t(m0) * nblk;
    const int32_t *bm = bp + int64_t(m0) * (q5k ? nblk / 2 : nblk), *hm = hp ? hp + int64_t(m0) * nblk * 2 : nullptr;
    float* ym = y + int64_t(m0) * N;
#if defined(PAGEDLM_AVX512_VNNI)
    const bool q8_0_rows = !amx && kind == GK_Q8_0 && rows == 1, pairs = q8_0_rows && pairs_at(rows);
    q8_0_row_passes.fetch_add(q8_0_rows, std::memory_order_relaxed);
#elif defined(PAGEDLM_AVX2)
    const bool pairs = pairs_at(rows);
#endif
    parallel_for(N / X16, nthreads, rows == 1 ? 2 : 1, [&](int64_t t0, int64_t t1) {
      int t = int(t0);
#ifdef PAGEDLM_AMX
      if (amx) {
        int8x16_amx_tiles(xm, dm, reinterpret_cast<const int8_t*>(codes), nullptr, scales, ym, rows, K, N, t,
                          int(t1));
        return;
      }
#endif
#ifdef PAGEDLM_AVX512_VNNI
      for (; pairs && t + 2 <= t1; t += 2) gguf_q8_0_row_tiles<2>(g, xm, dm, bm, ym, t);
      for (; q8_0_rows && t < t1; ++t) gguf_q8_0_row_tiles<1>(g, xm, dm, bm, ym, t);  // 1.13x gguf_x16_tile's rate
#endif
#if defined(PAGEDLM_AVX2) && !defined(PAGEDLM_AVX512_VNNI)
      for (; pairs && t + 2 <= t1; t += 2) gguf_x16_row_pair(g, xm, dm, kind == GK_Q2_K ? hm : bm, ym, N, t);
#endif
      for (; t < t1; ++t) gguf_x16_tile(g, xm, dm, bm, hm, ym, rows, N, t);
    });
  }
  return 0;
}

int pagedlm_dequant_gguf_x16(int kind, const uint8_t* codes, const uint8_t* planes, const uint16_t* scales,
                             const uint8_t* aux, float* w, int K, int N, int nthreads) {
  if (!gguf_shape_ok(kind, K, N)) return 1;
  const GgufX16 g{kind, K / 32, codes, planes, scales, aux};
  parallel_for(N / X16, nthreads, 1, [&](int64_t t0, int64_t t1) {
    for (int t = int(t0); t < t1; ++t) gguf_x16_dequant_tile(g, K, t, w);
  });
  return 0;
}

// Rows ids[0 .. n) of a GGUF x16 weight dequantized to out [n, K] (an embedding table's lookups). Returns 2 for
// an id outside 0 .. N.
int pagedlm_gguf_x16_rows(int kind, const uint8_t* codes, const uint8_t* planes, const uint16_t* scales,
                          const uint8_t* aux, int K, int N, const int64_t* ids, int n, float* out, int nthreads) {
  if (!gguf_shape_ok(kind, K, N)) return 1;
  for (int r = 0; r < n; ++r)
    if (ids[r] < 0 || ids[r] >= N) return 2;
  const GgufX16 g{kind, K / 32, codes, planes, scales, aux};
  parallel_for(n, n * int64_t(K) >= 65536 ? nthreads : 1, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const GgufX16 w = g.tile(int(ids[r] / X16));
      const int j = int(ids[r] % X16);
      for (int b = 0; b < g.nblk; ++b)
        for (int v = 0; v < 32; ++v) out[r * K + b * 32 + v] = w.weight(b, j, v);
    }
  });
  return 0;
}

int pagedlm_dequant_gguf_x16_bf16(int kind, const uint8_t* codes, const uint8_t* planes, const uint16_t* scales,
                                  const uint8_t* aux, uint16_t* w, int K, int N, int nthreads) {
  if (!gguf_shape_ok(kind, K, N)) return 1;
  const GgufX16 g{kind, K / 32, codes, planes, scales, aux};
  parallel_for(N / X16, nthreads, 1, [&](int64_t t0, int64_t t1) {
    for (int t = int(t0); t < t1; ++t) gguf_x16_dequant_tile(g, K, t, w);
  });
  return 0;
}

}  // extern "C"
