// Paged attention for CPUs: reads K/V in place from the scattered cache blocks (no gather), GQA without
// repeating K/V, decode and prefill chunks, fp32 and bf16 (math in fp32), online softmax, threads from csrc/pool.h.
// K/V caches may also be quantized (int8 or fp8 e4m3 values, each (token, kv head) entry followed by its fp32
// scale, see kvcache/quant.py); tiles are then dequantized once into fp32 scratch, as bf16 ones are converted
// (except on AVX512-BF16 builds, which read bf16 tiles in place with vdpbf16ps).
// Plain C ABI (no torch headers) so it compiles in about a second; loaded with ctypes by cpu_kernel.py.
//
// Work item = (sequence, tile of query tokens, range of keys). Its rows are the tile's tokens x all heads
// (at most MAX_ROWS), so each cached token's K/V row [kv_heads, D] is streamed once per item and shared by
// the G query heads of each kv head. Key ranges are split at fixed positions (every SPLIT keys: flash-decoding)
// and the partial softmax states merged in order, and key tiles and their chunks start on fixed grids, so a row's
// result depends on its own keys only, never on the batch around it: a decode row equals the same row computed
// beside other rows of its sequence (a verify step's draft tokens) or beside other sequences. Each thread runs its
// share of the items in order and loads the next tile's K/V (cold: the weights evicted them) while it runs the
// current one, across item boundaries.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>
#include "../../csrc/pagedlm.h"
#include "../../csrc/simd_exp.h"
#include "../../csrc/pool.h"
#include "../../csrc/touch.h"
#if defined(__AVX2__) && defined(__FMA__)
#include "../../csrc/simd.h"
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
using pagedlm_simd::exp_ps;
#endif
using pagedlm_touch::touch_lines;

// y[i] = exp(x[i]) for n values, in place.
inline void exp_inplace(float* x, int n) {
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_ps(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

constexpr int KT = 16;        // keys per inner tile (never crossing a block)
constexpr int CH = 4;         // tiles per chunk: the online softmax's step (KT * CH keys)
constexpr int MAX_ROWS = 64;  // query rows (tokens x heads) per work item
constexpr int SPLIT = 256;    // key ranges split at multiples of this (a multiple of KT)

inline float to_f(float x) { return x; }
inline float to_f(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_f(float x, float* out) { *out = x; }
inline void from_f(float x, uint16_t* out) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { *out = 0x7fc0; return; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  *out = uint16_t(u >> 16);
}

struct Item { int seq, tile, lo, hi; };  // query tokens [tile*qt, +qt) of seq, keys [lo, hi)

// The cache dtypes and the quantized entry's scale size, as kvcache/format.py numbers them.
enum KVKind { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3, KV_F16 = 4 };
constexpr int KV_SCALE_BYTES = 4;

// IEEE half <-> float, as torch converts them (round to nearest even), except that values beyond the half range
// saturate to +-65504 instead of becoming infinities (kvcache/quant.py clamps the same way before converting).
inline float half_to_f(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (e == 0x1f) u = sign | 0x7f800000u | (mant << 13);  // inf, NaN
  else if (e) u = sign | ((e + 112) << 23) | (mant << 13);
  else if (mant == 0) u = sign;
  else {  // subnormal: mant x 2^-24
    const float f = float(mant) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f_to_half(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7bffu);  // rounds past 65504: saturate
  if (a < 0x38800000u) {  // below the smallest normal half: a multiple of 2^-24, rounded to nearest even
    float f;
    std::memcpy(&f, &a, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(f * 16777216.0f)));
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return uint16_t(sign | ((r - (112u << 23)) >> 13));
}
// x[0, n) as halves (f_to_half's values).
inline void store_half(const float* x, uint16_t* out, int n) {
  int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 hi = _mm256_set1_ps(65504.f), lo = _mm256_set1_ps(-65504.f);
  for (; i + 8 <= n; i += 8) {  // min/max return their second operand for a NaN: NaN stays NaN
    const __m256 v = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(x + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) out[i] = f_to_half(x[i]);
}

// fp8 e4m3 (finite, no infinities; 0x7f/0xff are NaN) to float, by table.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, e = (b >> 3) & 0xf, m = b & 7;
      float x = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
      if (e == 15 && m == 7) x = NAN;
      v[b] = sign ? -x : x;
    }
  }
};
const Fp8Table kFp8;

struct Args {
  int H, KVH, D, BS, max_blocks, window, qt, kv_kind;
  float scale;
  const int32_t *tables, *seq_lens, *qsl;
};

// Validates a batch before anything is read: H and KVH fit the kernel, query_start_loc runs from 0 to num_tokens
// without going down, each sequence holds its query tokens and its table row covers its length, and every table
// entry the kernel will read (from the first query's window to the last token) is a block of the cache.
int check_batch(const Args& a, int num_seqs, int num_tokens, int num_blocks) {
  if (a.H < 1 || a.KVH < 1 || a.H > MAX_ROWS || a.H % a.KVH || a.BS < 1) return PAGEDLM_UNSUPPORTED;
  if (num_seqs < 0 || a.max_blocks < 0 || a.qsl[0] != 0 || a.qsl[num_seqs] != num_tokens) return PAGEDLM_BAD_BATCH;
  for (int i = 0; i < num_seqs; ++i) {
    const int qlen = a.qsl[i + 1] - a.qsl[i], slen = a.seq_lens[i];
    if (qlen < 0 || slen < qlen) return PAGEDLM_BAD_BATCH;
    if (qlen == 0) continue;
    const int last = (slen - 1) / a.BS;
    if (last >= a.max_blocks) return PAGEDLM_BAD_BATCH;
    const int lo = a.window > 0 ? std::max(0, slen - qlen - a.window + 1) : 0;
    const int32_t* table = a.tables + int64_t(i) * a.max_blocks;
    for (int b = lo / a.BS; b <= last; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return PAGEDLM_BAD_BLOCK;
  }
  return PAGEDLM_OK;
}

// Every slot to be written is one of the cache's num_slots.
int check_slots(const int64_t* slots, int T, int64_t num_slots) {
  for (int t = 0; t < T; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return PAGEDLM_BAD_SLOT;
  return PAGEDLM_OK;
}

// Rotates the q and k heads of each token's fused qkv row in place (rotate-half RoPE with that token's cos/sin
// rows [D/2]) and writes its k and v heads to the fp32 cache at slots[t] (with a null k_cache it only rotates).
// Same arithmetic as HF's `x * cos + rotate_half(x) * sin` (separate multiplies and adds, no FMA contraction).
// Slots unchecked: see pagedlm_rope_write_kv.
__attribute__((optimize("fp-contract=off")))
void rope_write_kv(float* qkv, const float* cos, const float* sin, int T, int H, int KVH, int D,
                   const int64_t* slots, float* k_cache, float* v_cache, int nthreads) {
  const int half = D / 2, row = (H + 2 * KVH) * D, kvd = KVH * D;
  parallel_for(T, T > 16 ? nthreads : 1, 1, [&](int64_t t0, int64_t t1) {
  for (int t = int(t0); t < t1; ++t) {
    float* r = qkv + int64_t(t) * row;
    const float *c = cos + int64_t(t) * half, *s = sin + int64_t(t) * half;
    for (int h = 0; h < H + KVH; ++h) {
      float* x = r + h * D;
      for (int i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
        x[i] = a - b;
        x[i + half] = e + f;
      }
    }
    if (k_cache == nullptr) continue;  // rotate only: the caller writes K/V itself
    std::memcpy(k_cache + slots[t] * kvd, r + H * D, sizeof(float) * kvd);
    std::memcpy(v_cache + slots[t] * kvd, r + (H + KVH) * D, sizeof(float) * kvd);
  }
  });
}

// ---- the inner loop, one path per ISA level ------------------------------------------------------------------
// Keys go in tiles (KT keys, never crossing a block) and tiles in chunks (CH tiles, ending on a fixed grid of keys);
// the online softmax steps once per chunk (its max, sum and the accumulators' rescaling: 1.2-1.35x the kernel's
// speed over a step per tile at 4k keys). Per chunk and kv head, the query rows of that head are taken RB at a
// time ("a row block"): each K and V row is loaded once per block, not once per row. Scores: a row's partial dot
// products with 4 keys are accumulated as vectors (lanes = d), then reduced together by a shuffle tree that leaves
// key j in lane j (one tree per L keys, instead of one horizontal sum per dot product). P.V: the block's output
// rows stay in registers over the chunk's keys.
// The AVX-512 (__AVX512F__) and AVX2+FMA paths share that code through AttnSimd; the portable path (no AVX2) is
// plain loops. All compute the same sums in fp32 (in different orders), under the same tests.
#if defined(__AVX512F__)
#define PAGEDLM_ATTN_ISA 512
struct AttnSimd {
  static constexpr int L = 16;  // lanes: floats per vector, and keys per reduction tree
  static constexpr int RB = 4;  // rows per block (a 1B kv head's 8 q heads as 4 + 4, not 3 + 3 + 2: 1.02-1.06x)
  static constexpr int ACC = 16;  // P.V accumulators per block
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  // Pass p of a tree reduces keys p, p + 4, p + 8, p + 12 (so that the tree ends with key j in lane j).
  static constexpr int key(int p, int i) { return p + 4 * i; }
  // 4 keys' partial vectors -> one vector whose 128-bit lane i holds 4 partial sums of key i.
  static V group(V a, V b, V c, V d) {
    const V ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    const V cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  }
  // The 4 passes' groups -> the 16 keys' dot products, key j in lane j.
  static V finish(const V* g) {
    const V wx = _mm512_add_ps(_mm512_unpacklo_ps(g[0], g[1]), _mm512_unpackhi_ps(g[0], g[1]));
    const V yz = _mm512_add_ps(_mm512_unpacklo_ps(g[2], g[3]), _mm512_unpackhi_ps(g[2], g[3]));
    const __m512d a = _mm512_castps_pd(wx), b = _mm512_castps_pd(yz);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDLM_ATTN_ISA 256
struct AttnSimd {
  static constexpr int L = 8;
  static constexpr int RB = 2;  // 16 ymm registers: 4 keys x 2 rows of accumulators, the 4 key vectors
  static constexpr int ACC = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static constexpr int key(int p, int i) { return 4 * p + i; }
  // -> [a b c d (2 partial sums each) | a b c d (the other 2)]
  static V group(V a, V b, V c, V d) { return _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d)); }
  static V finish(const V* g) {
    return _mm256_add_ps(_mm256_permute2f128_ps(g[0], g[1], 0x20), _mm256_permute2f128_ps(g[0], g[1], 0x31));
  }
};
#else
#define PAGEDLM_ATTN_ISA 0
#endif

alignas(64) const float kZeroRow[256] = {};  // stands in for the keys past a partial tile

// s[r][j] = q[r] . k[j] for the R rows of a block and j < KT (0 for j >= n); k rows ldk floats apart.
template <int D, int R>
void qk_block(const float* const* qp, const float* k, int64_t ldk, int n, float* const* sp) {
#if PAGEDLM_ATTN_ISA
  using S = AttnSimd;
  using V = S::V;
  constexpr int L = S::L, C = D / L, NG = L / 4;
  for (int j0 = 0; j0 < KT; j0 += L) {
    if (j0 >= n) {
      for (int r = 0; r < R; ++r) S::store(sp[r] + j0, S::zero());
      continue;
    }
    V g[R][NG];
    for (int p = 0; p < NG; ++p) {
      const float* kr[4];
      for (int i = 0; i < 4; ++i) {
        const int j = j0 + S::key(p, i);
        kr[i] = j < n ? k + j * ldk : kZeroRow;
      }
      V acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = S::zero();
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const V k0 = S::load(kr[0] + c * L), k1 = S::load(kr[1] + c * L), k2 = S::load(kr[2] + c * L),
                k3 = S::load(kr[3] + c * L);
        for (int r = 0; r < R; ++r) {
          const V qv = S::load(qp[r] + c * L);
          acc[r][0] = S::fma(qv, k0, acc[r][0]);
          acc[r][1] = S::fma(qv, k1, acc[r][1]);
          acc[r][2] = S::fma(qv, k2, acc[r][2]);
          acc[r][3] = S::fma(qv, k3, acc[r][3]);
        }
      }
      for (int r = 0; r < R; ++r) g[r][p] = S::group(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
    for (int r = 0; r < R; ++r) S::store(sp[r] + j0, S::finish(g[r]));
  }
#else
  for (int r = 0; r < R; ++r) {
    const float* qr = qp[r];
    float* sr = sp[r];
    int j = 0;
    for (; j + 4 <= n; j += 4) {  // four independent dot products at a time
      const float *k0 = k + j * ldk, *k1 = k0 + ldk, *k2 = k1 + ldk, *k3 = k2 + ldk;
      float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
      for (int d = 0; d < D; ++d) {
        d0 += qr[d] * k0[d]; d1 += qr[d] * k1[d]; d2 += qr[d] * k2[d]; d3 += qr[d] * k3[d];
      }
      sr[j] = d0; sr[j + 1] = d1; sr[j + 2] = d2; sr[j + 3] = d3;
    }
    for (; j < n; ++j) {
      const float* k0 = k + j * ldk;
      float d0 = 0.f;
#pragma omp simd reduction(+ : d0)
      for (int d = 0; d < D; ++d) d0 += qr[d] * k0[d];
      sr[j] = d0;
    }
    for (; j < KT; ++j) sr[j] = 0.f;
  }
#endif
}

#if PAGEDLM_ATTN_ISA
// The largest divisor of C not above w (P.V's accumulator width in vectors).
constexpr int divisor_at_most(int C, int w) { return w <= 1 ? 1 : C % w == 0 ? w : divisor_at_most(C, w - 1); }
#endif

// o[r] = o[r] * alpha[r] + sum_t sum_{j < n[t]} p[r][t * KT + j] v_t[j] for the R rows of a block over the nt
// tiles of a chunk; V rows ldv floats apart.
template <int D, int R>
void pv_chunk(float* const* op, const float* alpha, const float* const* pp, const float* const* vt, int64_t ldv,
              const int* n, int nt) {
#if PAGEDLM_ATTN_ISA
  using S = AttnSimd;
  using V = S::V;
  constexpr int L = S::L, C = D / L, W = divisor_at_most(C, S::ACC / R);
  for (int c0 = 0; c0 < C; c0 += W) {
    V o[R][W];
    for (int r = 0; r < R; ++r) {
      const V a = S::set1(alpha[r]);
      for (int w = 0; w < W; ++w) o[r][w] = S::mul(S::load(op[r] + (c0 + w) * L), a);
    }
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < n[t]; ++j) {
        const float* vj = vt[t] + j * ldv + c0 * L;
        V vv[W];
        for (int w = 0; w < W; ++w) vv[w] = S::load(vj + w * L);
        for (int r = 0; r < R; ++r) {
          const V p = S::set1(pp[r][t * KT + j]);
          for (int w = 0; w < W; ++w) o[r][w] = S::fma(p, vv[w], o[r][w]);
        }
      }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) S::store(op[r] + (c0 + w) * L, o[r][w]);
  }
#else
  for (int r = 0; r < R; ++r) {
    alignas(64) float o[D];  // the row kept in registers across the chunk's keys
    float* ar = op[r];
    const float al = alpha[r];
#pragma omp simd
    for (int d = 0; d < D; ++d) o[d] = ar[d] * al;
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < n[t]; ++j) {
        const float pj = pp[r][t * KT + j];
        const float* vj = vt[t] + j * ldv;
#pragma omp simd
        for (int d = 0; d < D; ++d) o[d] += pj * vj[d];
      }
#pragma omp simd
    for (int d = 0; d < D; ++d) ar[d] = o[d];
  }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDLM_ATTN_BF16_DOT 1
// bf16 caches on CPUs with AVX512-BF16: K and V are read in place, as bf16, by vdpbf16ps (two products per fp32
// lane), instead of being converted to fp32 scratch per tile. Both operands of a bf16 product must be bf16, so the
// fp32 queries and probabilities are split into hi + lo bf16 parts (x = hi + lo to 16 significant bits; the
// products are exact and the sums fp32), which keeps the results within ~1e-5 of the fp32 paths.
alignas(64) const uint16_t kZeroRow16[256] = {};

inline __m512 bf16_to_f32(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }
inline __m512i load16(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline __m512 dot2(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// x[0, n) -> hi, lo with hi = bf16(x), lo = bf16(x - hi); n a multiple of 16.
inline void split_bf16(const float* x, int n, uint16_t* hi, uint16_t* lo) {
  for (int i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, bf16_to_f32(h)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), l);
  }
}

// qk_block over a bf16 K tile in place (rows ldk elements apart), queries given as hi/lo bf16 rows.
template <int D, int R>
void qk_block_bf16(const uint16_t* const* qh, const uint16_t* const* ql, const uint16_t* k, int64_t ldk, int n,
                   float* const* sp) {
  using S = AttnSimd;
  using V = S::V;
  static_assert(KT == S::L, "one reduction tree per tile");
  constexpr int C = D / 32;  // 32 bf16 per vector
  V g[R][4];
  for (int p = 0; p < 4; ++p) {
    const uint16_t* kr[4];
    for (int i = 0; i < 4; ++i) {
      const int j = S::key(p, i);
      kr[i] = j < n ? k + j * ldk : kZeroRow16;
    }
    V acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = S::zero();
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i k0 = load16(kr[0] + c * 32), k1 = load16(kr[1] + c * 32), k2 = load16(kr[2] + c * 32),
                    k3 = load16(kr[3] + c * 32);
      for (int r = 0; r < R; ++r) {
        const __m512i h = load16(qh[r] + c * 32), lo = load16(ql[r] + c * 32);
        acc[r][0] = dot2(dot2(acc[r][0], h, k0), lo, k0);
        acc[r][1] = dot2(dot2(acc[r][1], h, k1), lo, k1);
        acc[r][2] = dot2(dot2(acc[r][2], h, k2), lo, k2);
        acc[r][3] = dot2(dot2(acc[r][3], h, k3), lo, k3);
      }
    }
    for (int r = 0; r < R; ++r) g[r][p] = S::group(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
  }
  for (int r = 0; r < R; ++r) S::store(sp[r], S::finish(g[r]));
}

// pv_chunk over bf16 V tiles in place. Keys go in pairs: unpacking rows j and j + 1 interleaves them into
// (v_j[d], v_j+1[d]) lanes, which vdpbf16ps multiplies by the pair (p_j, p_j+1); unpacklo/hi cover d in the order
// kLoIdx/kHiIdx name, so the accumulators are permuted from and back to o's order around the tile.
template <int D, int R>
void pv_chunk_bf16(float* const* op, const float* alpha, const float* const* pp, const uint16_t* const* vt,
                   int64_t ldv, const int* n, int nt) {
  using V = __m512;
  constexpr int C = D / 32, W = divisor_at_most(C, 8 / R);
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi_idx = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i out0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i out1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  alignas(64) uint32_t ph[R][CH * KT / 2], pl[R][CH * KT / 2];  // (p_j, p_j+1) as bf16 pairs, hi and lo parts
  for (int r = 0; r < R; ++r) split_bf16(pp[r], nt * KT, reinterpret_cast<uint16_t*>(ph[r]),
                                         reinterpret_cast<uint16_t*>(pl[r]));
  for (int c0 = 0; c0 < C; c0 += W) {
    V o[R][W][2];
    for (int r = 0; r < R; ++r) {
      const V a = _mm512_set1_ps(alpha[r]);
      for (int w = 0; w < W; ++w) {
        const V x0 = _mm512_loadu_ps(op[r] + (c0 + w) * 32), x1 = _mm512_loadu_ps(op[r] + (c0 + w) * 32 + 16);
        o[r][w][0] = _mm512_mul_ps(_mm512_permutex2var_ps(x0, lo_idx, x1), a);
        o[r][w][1] = _mm512_mul_ps(_mm512_permutex2var_ps(x0, hi_idx, x1), a);
      }
    }
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < n[t]; j += 2) {
        const uint16_t* v0 = vt[t] + j * ldv + (c0 * 32);
        const uint16_t* v1 = j + 1 < n[t] ? v0 + ldv : kZeroRow16;  // past n: p is 0, the slot may be garbage
        __m512i u[W][2];
        for (int w = 0; w < W; ++w) {
          const __m512i a = load16(v0 + w * 32), b = load16(v1 + w * 32);
          u[w][0] = _mm512_unpacklo_epi16(a, b);
          u[w][1] = _mm512_unpackhi_epi16(a, b);
        }
        const int jp = (t * KT + j) / 2;
        for (int r = 0; r < R; ++r) {
          const __m512i h = _mm512_set1_epi32(int(ph[r][jp])), lo = _mm512_set1_epi32(int(pl[r][jp]));
          for (int w = 0; w < W; ++w)
            for (int x = 0; x < 2; ++x) o[r][w][x] = dot2(dot2(o[r][w][x], h, u[w][x]), lo, u[w][x]);
        }
      }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) {
        _mm512_storeu_ps(op[r] + (c0 + w) * 32, _mm512_permutex2var_ps(o[r][w][0], out0, o[r][w][1]));
        _mm512_storeu_ps(op[r] + (c0 + w) * 32 + 16, _mm512_permutex2var_ps(o[r][w][0], out1, o[r][w][1]));
      }
  }
}
#else
#define PAGEDLM_ATTN_BF16_DOT 0
#endif

// Online softmax over one row's chunk scores: tile t's keys are s[t * KT + j] for j < n[t], at positions
// tpos[t] + j; those outside [lo, hi] and the lanes j >= n[t] are masked (at least one key is not). s becomes
// exp(s - m_new) (0 where masked), m and l are updated; returns the factor exp(m_old - m_new) for the row's
// accumulator.
inline float softmax_chunk(float* s, const int* tpos, const int* n, int nt, int lo, int hi, float& m, float& l) {
#if defined(__AVX512F__)
  static_assert(KT == 16, "one vector of 16 keys");
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i lov = _mm512_set1_epi32(lo), hiv = _mm512_set1_epi32(hi);
  __m512 x[CH];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int t = 0; t < nt; ++t) {
    const __m512i kp = _mm512_add_epi32(_mm512_set1_epi32(tpos[t]), lane);
    const __mmask16 ok = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(n[t]), lane) &
                         _mm512_cmpge_epi32_mask(kp, lov) & _mm512_cmple_epi32_mask(kp, hiv);
    x[t] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), ok, s + t * KT);
    mx = _mm512_max_ps(mx, x[t]);
  }
  const float mt = std::max(m, _mm512_reduce_max_ps(mx));
  const __m512 mv = _mm512_set1_ps(mt);
  __m512 sv = _mm512_setzero_ps();
  for (int t = 0; t < nt; ++t) {
    const __m512 e = exp_ps(_mm512_sub_ps(x[t], mv));
    _mm512_storeu_ps(s + t * KT, e);
    sv = _mm512_add_ps(sv, e);
  }
  const float sum = _mm512_reduce_add_ps(sv);
#elif defined(__AVX2__) && defined(__FMA__)
  static_assert(KT == 16, "two vectors of 8 keys");
  const __m256i lane0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane1 = _mm256_add_epi32(lane0, _mm256_set1_epi32(8));
  const __m256i lo1 = _mm256_set1_epi32(lo - 1), hi1 = _mm256_set1_epi32(hi + 1);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 x[CH][2];
  __m256 mx = ninf;
  for (int t = 0; t < nt; ++t) {
    const __m256i nv = _mm256_set1_epi32(n[t]), pv = _mm256_set1_epi32(tpos[t]);
    for (int h = 0; h < 2; ++h) {
      const __m256i ln = h ? lane1 : lane0, kp = _mm256_add_epi32(pv, ln);
      const __m256i ok = _mm256_and_si256(_mm256_and_si256(_mm256_cmpgt_epi32(kp, lo1), _mm256_cmpgt_epi32(hi1, kp)),
                                          _mm256_cmpgt_epi32(nv, ln));
      x[t][h] = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + t * KT + 8 * h), _mm256_castsi256_ps(ok));
      mx = _mm256_max_ps(mx, x[t][h]);
    }
  }
  __m128 hm = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  hm = _mm_max_ps(hm, _mm_movehl_ps(hm, hm));
  hm = _mm_max_ss(hm, _mm_shuffle_ps(hm, hm, 1));
  const float mt = std::max(m, _mm_cvtss_f32(hm));
  const __m256 mv = _mm256_set1_ps(mt);
  __m256 sv = _mm256_setzero_ps();
  for (int t = 0; t < nt; ++t)
    for (int h = 0; h < 2; ++h) {
      const __m256 e = exp_ps(_mm256_sub_ps(x[t][h], mv));
      _mm256_storeu_ps(s + t * KT + 8 * h, e);
      sv = _mm256_add_ps(sv, e);
    }
  __m128 hs = _mm_add_ps(_mm256_castps256_ps128(sv), _mm256_extractf128_ps(sv, 1));
  hs = _mm_add_ps(hs, _mm_movehl_ps(hs, hs));
  hs = _mm_add_ss(hs, _mm_shuffle_ps(hs, hs, 1));
  const float sum = _mm_cvtss_f32(hs);
#else
  float mt = m;
  for (int t = 0; t < nt; ++t)
    for (int j = 0; j < KT; ++j) {
      const int p = tpos[t] + j;
      float& x = s[t * KT + j];
      if (j >= n[t] || p < lo || p > hi) x = -INFINITY;
      mt = std::max(mt, x);
    }
  for (int j = 0; j < nt * KT; ++j) s[j] -= mt;
  exp_inplace(s, nt * KT);
  float sum = 0.f;
  for (int j = 0; j < nt * KT; ++j) sum += s[j];
#endif
  const float alpha = std::exp(m - mt);  // m = -inf -> 0
  l = l * alpha + sum;
  m = mt;
  return alpha;
}

// Tokens [slot, slot + n) of kv head kvh of a bf16, fp16 or quantized cache as fp32 rows [n, D] in `buf`.
template <int D>
void load_head(const Args& a, const void* cache, int64_t slot, int n, int kvh, float* buf) {
  const int KVD = a.KVH * D;
  if (a.kv_kind == KV_F16) {
    for (int t = 0; t < n; ++t) {
      const uint16_t* src = static_cast<const uint16_t*>(cache) + (slot + t) * KVD + kvh * D;
      float* dst = buf + t * D;
#if defined(__AVX512F__)
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      for (int d = 0; d < D; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
#else
      for (int d = 0; d < D; ++d) dst[d] = half_to_f(src[d]);
#endif
    }
    return;
  }
  if (a.kv_kind == KV_BF16) {
    for (int t = 0; t < n; ++t) {
      const uint16_t* src = static_cast<const uint16_t*>(cache) + (slot + t) * KVD + kvh * D;
      float* dst = buf + t * D;
#if defined(__AVX512F__)
      for (int d = 0; d < D; d += 16) {
        const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d)));
        _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (int d = 0; d < D; d += 8) {
        const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
      }
#else
      for (int d = 0; d < D; ++d) dst[d] = to_f(src[d]);
#endif
    }
    return;
  }
  constexpr int E = D + KV_SCALE_BYTES;  // quantized entry: D values, then the fp32 scale
  const uint8_t* src = static_cast<const uint8_t*>(cache) + (slot * a.KVH + kvh) * E;
  for (int t = 0; t < n; ++t) {
    const uint8_t* e = src + int64_t(t) * a.KVH * E;
    float sc;
    std::memcpy(&sc, e + D, KV_SCALE_BYTES);
    float* dst = buf + t * D;
    if (a.kv_kind == KV_INT8) {
#if defined(__AVX512F__)
      const __m512 sv = _mm512_set1_ps(sc);
      for (int d = 0; d < D; d += 16) {
        const __m512i i = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e + d)));
        _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(i), sv));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 sv = _mm256_set1_ps(sc);
      for (int d = 0; d < D; d += 8) {
        const __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e + d)));
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(i), sv));
      }
#else
      const int8_t* qv = reinterpret_cast<const int8_t*>(e);
      for (int d = 0; d < D; ++d) dst[d] = float(qv[d]) * sc;
#endif
    } else {
      for (int d = 0; d < D; ++d) dst[d] = kFp8.v[e[d]] * sc;
    }
  }
}

// One kv head's K/V rows over one key tile, ld elements apart: fp32 (in place, or converted into scratch), or
// bf16 in place for the vdpbf16ps loops (then q16 holds the queries' hi/lo bf16 rows).
struct HeadTile {
  const float *k, *v;
  const uint16_t *k16, *v16;
  int64_t ld;
};

// The tiles of one chunk: up to CH tiles of consecutive keys, tile t at positions pos[t] .. pos[t] + n[t] - 1.
struct Chunk {
  int nt, pos[CH], n[CH];
  int64_t slot[CH];
};

// One row block of a kv head over one chunk (its tiles h[0, c.nt)): scores, mask + online softmax, P.V.
template <int D, int R>
void block_chunk(const Args& a, const int* rows, const int* qpos, float (*qf)[D], uint16_t (*q16)[2][D],
                 float (*s)[CH * KT], float* acc, float* m, float* l, const HeadTile* h, const Chunk& c) {
  const float* qp[R];
  float *sp[R], *op[R];
  float alpha[R];
  for (int i = 0; i < R; ++i) { qp[i] = qf[rows[i]]; sp[i] = s[rows[i]]; op[i] = acc + rows[i] * D; }
  for (int t = 0; t < c.nt; ++t) {
    float* st[R];
    for (int i = 0; i < R; ++i) st[i] = sp[i] + t * KT;
#if PAGEDLM_ATTN_BF16_DOT
    if constexpr (D % 32 == 0) {
      if (h[t].k16) {
        const uint16_t *qh[R], *ql[R];
        for (int i = 0; i < R; ++i) { qh[i] = q16[rows[i]][0]; ql[i] = q16[rows[i]][1]; }
        qk_block_bf16<D, R>(qh, ql, h[t].k16, h[t].ld, c.n[t], st);
        continue;
      }
    }
#endif
    qk_block<D, R>(qp, h[t].k, h[t].ld, c.n[t], st);
  }
  const int last = c.pos[c.nt - 1] + c.n[c.nt - 1] - 1;
  for (int i = 0; i < R; ++i) {
    const int r = rows[i], p = qpos[r];
    const int lo = a.window > 0 ? std::max(c.pos[0], p - a.window + 1) : c.pos[0];
    alpha[i] = softmax_chunk(sp[i], c.pos, c.n, c.nt, lo, std::min(p, last), m[r], l[r]);
  }
#if PAGEDLM_ATTN_BF16_DOT
  if constexpr (D % 32 == 0) {
    if (h[0].v16) {
      const uint16_t* vt[CH];
      for (int t = 0; t < c.nt; ++t) vt[t] = h[t].v16;
      pv_chunk_bf16<D, R>(op, alpha, sp, vt, h[0].ld, c.n, c.nt);
      return;
    }
  }
#endif
  const float* vt[CH];
  for (int t = 0; t < c.nt; ++t) vt[t] = h[t].v;
  pv_chunk<D, R>(op, alpha, sp, vt, h[0].ld, c.n, c.nt);
}

#if PAGEDLM_ATTN_ISA
constexpr int ROW_BLOCK = AttnSimd::RB;
#else
constexpr int ROW_BLOCK = 4;
#endif

// The bytes of one cached token's K (or V) row for all kv heads.
inline int64_t kv_row_bytes(const Args& a) {
  const int KVD = a.KVH * a.D;
  return a.kv_kind == KV_F32 ? int64_t(KVD) * 4
         : a.kv_kind == KV_BF16 || a.kv_kind == KV_F16 ? int64_t(KVD) * 2
                                                       : int64_t(a.KVH) * (a.D + KV_SCALE_BYTES);
}

inline void prefetch_lines(const char* k, const char* v, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(k + o, 0, 2);
    __builtin_prefetch(v + o, 0, 2);
  }
}

// The K/V bytes of the k-th tile after the one at `pos` of item `it` (k = 0: that tile), continuing into `next`
// (whose tiles start at next->lo): {k row, v row, bytes}, or bytes = 0 past the end.
struct TileSpan { const char *k, *v; int64_t bytes; };
inline TileSpan tile_after(const Args& a, const void* kc, const void* vc, const Item& it, const Item* next, int pos,
                           int k) {
  const Item* cur = &it;
  int p = pos;
  for (int step = 0; step < k; ++step) {
    p += std::min(KT, a.BS - p % a.BS);
    if (p >= cur->hi) {
      if (cur != &it || !next) return {nullptr, nullptr, 0};
      cur = next;
      p = next->lo;
    }
  }
  const int32_t* table = a.tables + int64_t(cur->seq) * a.max_blocks;
  const int64_t row = kv_row_bytes(a), off = (int64_t(table[p / a.BS]) * a.BS + p % a.BS) * row;
  const int n = std::min(std::min(KT, a.BS - p % a.BS), cur->hi - p);
  return {static_cast<const char*>(kc) + off, static_cast<const char*>(vc) + off, n * row};
}

// One item: rows r = token * H + head. Writes unnormalized acc [rows, D] plus running max m and sum l.
// A token's K/V for all kv heads are contiguous in the cache ([.., KVH, D]); each tile of them is read once.
template <typename T, int D>
void run_item(const Args& a, const Item& it, const T* q, const void* kc, const void* vc,
              float* acc, float* m, float* l, bool warm, const Item* next) {
  const int H = a.H, G = a.H / a.KVH, KVD = a.KVH * D;
  const int q0 = a.qsl[it.seq], qlen = a.qsl[it.seq + 1] - q0, slen = a.seq_lens[it.seq];
  const int t0 = it.tile * a.qt, nrows = std::min(a.qt, qlen - t0) * H;
  const int32_t* table = a.tables + int64_t(it.seq) * a.max_blocks;
  alignas(64) float qf[MAX_ROWS][D];
  alignas(64) float s[MAX_ROWS][CH * KT];
  alignas(64) float kbuf[CH][KT * D], vbuf[CH][KT * D];
  int qpos[MAX_ROWS];
  // bf16 caches are read in place by the vdpbf16ps loops where the build has them.
  constexpr bool kBf16Dot = PAGEDLM_ATTN_BF16_DOT && D % 32 == 0;
  const bool bf16_dot = kBf16Dot && a.kv_kind == KV_BF16;
  alignas(64) uint16_t q16[kBf16Dot ? MAX_ROWS : 1][2][D];
  for (int r = 0; r < nrows; ++r) {
    const T* src = q + (int64_t(q0 + t0) * H + r) * D;
    for (int d = 0; d < D; ++d) qf[r][d] = to_f(src[d]) * a.scale;
    qpos[r] = slen - qlen + t0 + r / H;
    m[r] = -INFINITY; l[r] = 0.f;
    for (int d = 0; d < D; ++d) acc[r * D + d] = 0.f;
#if PAGEDLM_ATTN_BF16_DOT
    if (bf16_dot) split_bf16(qf[r], D, q16[r][0], q16[r][1]);
#endif
  }
  const bool f32 = a.kv_kind == KV_F32;
  const int grid = CH * std::min(KT, a.BS);  // chunks end at multiples of this: each holds at most CH tiles
  for (int pos = it.lo; pos < it.hi;) {
    Chunk c{};
    for (; c.nt == 0 || (pos < it.hi && pos % grid); ++c.nt) {
      const int off = pos % a.BS, n = std::min(std::min(KT, a.BS - off), it.hi - pos);
      // K/V rows are scattered and cold (the weights evicted them): load the next tile's (this item's, or the
      // next item's first) while this chunk runs, and prefetch the one after it.
      if (pos == it.lo && !warm) {
        const TileSpan t = tile_after(a, kc, vc, it, next, pos, 0);
        touch_lines(t.k, t.v, t.bytes);
      }
      const TileSpan t1 = tile_after(a, kc, vc, it, next, pos, 1), t2 = tile_after(a, kc, vc, it, next, pos, 2);
      touch_lines(t1.k, t1.v, t1.bytes);
      prefetch_lines(t2.k, t2.v, t2.bytes);
      c.pos[c.nt] = pos;
      c.n[c.nt] = n;
      c.slot[c.nt] = int64_t(table[pos / a.BS]) * a.BS + off;
      pos += n;
    }
    // Rows that see part of this chunk: [r_lo, r_hi) (query positions grow with r).
    const int first = c.pos[0], last = pos - 1;
    int r_lo = 0, r_hi = nrows;
    while (r_lo < nrows && qpos[r_lo] < first) ++r_lo;
    if (a.window > 0)
      while (r_hi > r_lo && last <= qpos[r_hi - 1] - a.window) --r_hi;
    if (r_lo >= r_hi) continue;
    for (int kvh = 0; kvh < a.KVH; ++kvh) {
      int rows[MAX_ROWS], nr = 0;  // this kv head's rows among [r_lo, r_hi)
      for (int t = r_lo / H; t * H < r_hi; ++t)
        for (int g = 0; g < G; ++g) {
          const int r = t * H + kvh * G + g;
          if (r >= r_lo && r < r_hi) rows[nr++] = r;
        }
      if (nr == 0) continue;
      // The head's K/V rows [n, D] per tile: in place for fp32 (and bf16 with vdpbf16ps), converted once otherwise.
      HeadTile h[CH]{};
      for (int t = 0; t < c.nt; ++t) {
        if (f32) {
          h[t].k = static_cast<const float*>(kc) + c.slot[t] * KVD + kvh * D;
          h[t].v = static_cast<const float*>(vc) + c.slot[t] * KVD + kvh * D;
          h[t].ld = KVD;
        } else if (bf16_dot) {
          h[t].k16 = static_cast<const uint16_t*>(kc) + c.slot[t] * KVD + kvh * D;
          h[t].v16 = static_cast<const uint16_t*>(vc) + c.slot[t] * KVD + kvh * D;
          h[t].ld = KVD;
        } else {
          load_head<D>(a, kc, c.slot[t], c.n[t], kvh, kbuf[t]);
          load_head<D>(a, vc, c.slot[t], c.n[t], kvh, vbuf[t]);
          h[t].k = kbuf[t]; h[t].v = vbuf[t]; h[t].ld = D;
        }
      }
      for (int i = 0; i < nr; i += ROW_BLOCK) {
        const int* br = rows + i;
        switch (std::min(ROW_BLOCK, nr - i)) {
          case 1: block_chunk<D, 1>(a, br, qpos, qf, q16, s, acc, m, l, h, c); break;
          case 2: block_chunk<D, 2>(a, br, qpos, qf, q16, s, acc, m, l, h, c); break;
          case 3: block_chunk<D, 3>(a, br, qpos, qf, q16, s, acc, m, l, h, c); break;
          default: block_chunk<D, ROW_BLOCK < 4 ? ROW_BLOCK : 4>(a, br, qpos, qf, q16, s, acc, m, l, h, c);
        }
      }
    }
  }
}

// The first key of a tile at or before `lo`: tiles start at a part's start and a block's, and then every KT keys.
inline int tile_floor(int lo, int BS) {
  const int base = std::max(lo / SPLIT * SPLIT, lo / BS * BS);
  return base + (lo - base) / KT * KT;
}

template <typename T, int D>
void paged_attention(const T* q, const void* kc, const void* vc, T* out, Args a, int num_seqs, int nthreads) {
  const int qt = a.qt = std::max(1, MAX_ROWS / a.H);
  // One item per (seq, query tile, SPLIT keys); a window's first keys widen to a tile's start (masked per row).
  std::vector<Item> items;
  std::vector<int> first;  // first item of each (seq, tile), plus a sentinel
  for (int i = 0; i < num_seqs; ++i) {
    const int qlen = a.qsl[i + 1] - a.qsl[i], slen = a.seq_lens[i];
    for (int tile = 0; tile * qt < qlen; ++tile) {
      const int first_pos = slen - qlen + tile * qt;
      const int hi = std::min(slen, first_pos + qt);
      const int lo = a.window > 0 ? tile_floor(std::max(0, first_pos - a.window + 1), a.BS) : 0;
      first.push_back(int(items.size()));
      for (int start = lo; start < hi;) {
        const int end = std::min(hi, (start / SPLIT + 1) * SPLIT);
        items.push_back({i, tile, start, end});
        start = end;
      }
    }
  }
  first.push_back(int(items.size()));
  const int64_t nitems = int64_t(items.size());
  const int rows = qt * a.H;
  const int ngroups = int(first.size()) - 1;
  std::vector<int> group_of(nitems);
  std::unique_ptr<std::atomic<int>[]> pending(new std::atomic<int>[std::max(ngroups, 1)]);
  for (int gi = 0; gi < ngroups; ++gi) {
    pending[gi].store(first[gi + 1] - first[gi], std::memory_order_relaxed);
    for (int k = first[gi]; k < first[gi + 1]; ++k) group_of[k] = gi;
  }
  // Partial states, uninitialized (each item initializes its rows): [item, rows, D] and [item, {m, l}, rows].
  thread_local std::vector<float> acc_buf, ml_buf;  // kept between calls (grow-only): no page faults per call
  acc_buf.resize(size_t(nitems) * rows * D);
  ml_buf.resize(size_t(nitems) * rows * 2);
  float *const acc_p = acc_buf.data(), *const ml_p = ml_buf.data();

  // Writes rows of (seq, tile) from the partial states of items k0..k1, merged in order (one item: normalizes).
  auto finish = [&](int k0, int k1) {
    const Item& it = items[k0];
    const int qlen = a.qsl[it.seq + 1] - a.qsl[it.seq];
    const int nrows = std::min(qt, qlen - it.tile * qt) * a.H;
    for (int r = 0; r < nrows; ++r) {
      float mmax = -INFINITY;
      for (int k = k0; k < k1; ++k) mmax = std::max(mmax, ml_p[size_t(k) * rows * 2 + r]);
      alignas(64) float o[D] = {0};
      float lsum = 0.f;
      for (int k = k0; k < k1; ++k) {
        const float mk = ml_p[size_t(k) * rows * 2 + r];
        if (mk == -INFINITY) continue;
        const float w = std::exp(mk - mmax);
        lsum += w * ml_p[size_t(k) * rows * 2 + rows + r];
        const float* ak = acc_p + (size_t(k) * rows + r) * D;
        for (int d = 0; d < D; ++d) o[d] += w * ak[d];
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      T* dst = out + (int64_t(a.qsl[it.seq] + it.tile * qt) * a.H + r) * D;
      for (int d = 0; d < D; ++d) from_f(o[d] * inv, dst + d);
    }
  };

  // One parallel loop (a second one costs a wait): the thread that runs a (seq, tile)'s last item merges it.
  // A thread takes its share of the items in order, so while it runs item k it prefetches item k + 1's K/V, and
  // item k + 1 is warm if the same thread ran item k just before (in this call).
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  parallel_for(nitems, nthreads, 1, [&](int64_t k0, int64_t k1) {
    thread_local uint64_t last_call = 0;
    thread_local int64_t last_item = -1;
    for (int64_t k = k0; k < k1; ++k) {
      const bool warm = last_call == call && last_item == k - 1;
      float* mk = ml_p + size_t(k) * rows * 2;
      run_item<T, D>(a, items[k], q, kc, vc, acc_p + size_t(k) * rows * D, mk, mk + rows, warm,
                     k + 1 < nitems ? &items[k + 1] : nullptr);
      last_call = call;
      last_item = k;
      const int gi = group_of[k];
      if (pending[gi].fetch_sub(1, std::memory_order_acq_rel) == 1) finish(first[gi], first[gi + 1]);
    }
  });
}

template <typename T>
int dispatch(const void* q, const void* kc, const void* vc, void* out, const Args& a, int num_seqs, int nthreads) {
  auto run = [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    paged_attention<T, D>(static_cast<const T*>(q), kc, vc, static_cast<T*>(out), a, num_seqs, nthreads);
    return 0;
  };
  switch (a.D) {
    case 16: return run(std::integral_constant<int, 16>{});
    case 32: return run(std::integral_constant<int, 32>{});
    case 64: return run(std::integral_constant<int, 64>{});
    case 80: return run(std::integral_constant<int, 80>{});
    case 96: return run(std::integral_constant<int, 96>{});
    case 128: return run(std::integral_constant<int, 128>{});
    case 256: return run(std::integral_constant<int, 256>{});
    default: return PAGEDLM_UNSUPPORTED;
  }
}

}  // namespace

extern "C" {

// q, out: [num_tokens, H, D]; k_cache, v_cache: [num_blocks, BS, KVH, D]; block_tables: [num_seqs, max_blocks]
// int32; seq_lens: [num_seqs] int32; query_start_loc: [num_seqs + 1] int32. dtype (of q and out): 0 = fp32,
// 1 = bf16; kv_dtype: a KVKind (fp16 caches as bf16 ones; int8/fp8 caches are [num_blocks, BS, KVH, D + 4] bytes). window <= 0: no sliding
// window. Needs H <= 64 and H % KVH == 0. Returns PAGEDLM_OK, or a PagedlmStatus (having read nothing out of range
// and written nothing): an unsupported head_dim or dtype, a bad batch layout or block id (check_batch).
int pagedlm_paged_attention(int dtype, int kv_dtype, const void* q, const void* k_cache, const void* v_cache,
                            void* out,
                            const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                            const int32_t* query_start_loc, int num_seqs, int num_tokens, int H, int KVH, int D,
                            int BS, int num_blocks, float scale, int window, int nthreads) {
  if (kv_dtype < KV_F32 || kv_dtype > KV_F16 || (kv_dtype == KV_F32 && dtype != 0)) return PAGEDLM_UNSUPPORTED;
  Args a{H, KVH, D, BS, max_blocks, window, 1, kv_dtype, scale, block_tables, seq_lens, query_start_loc};
  if (const int rc = check_batch(a, num_seqs, num_tokens, num_blocks)) return rc;
  if (nthreads < 1) nthreads = default_threads();
  if (dtype == 0) return dispatch<float>(q, k_cache, v_cache, out, a, num_seqs, nthreads);
  if (dtype == 1) return dispatch<uint16_t>(q, k_cache, v_cache, out, a, num_seqs, nthreads);
  return PAGEDLM_UNSUPPORTED;
}

// Which inner loop this build compiled: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (portable).
int pagedlm_attention_isa() { return PAGEDLM_ATTN_ISA; }

// Whether bf16 caches are read in place by the vdpbf16ps loops (AVX512-BF16 builds; head_dim a multiple of 32).
int pagedlm_attention_bf16_dot() { return PAGEDLM_ATTN_BF16_DOT; }

// Fused decode helper: rope_write_kv over T tokens into an fp32 cache of num_slots (blocks x BS) token rows.
// Returns PAGEDLM_BAD_SLOT, having changed nothing, if a slot is outside the cache.
int pagedlm_rope_write_kv(float* qkv, const float* cos, const float* sin, int T, int H, int KVH, int D,
                          const int64_t* slots, float* k_cache, float* v_cache, int64_t num_slots, int nthreads) {
  if (const int rc = check_slots(slots, T, num_slots)) return rc;
  rope_write_kv(qkv, cos, sin, T, H, KVH, D, slots, k_cache, v_cache, nthreads);
  return PAGEDLM_OK;
}
}
