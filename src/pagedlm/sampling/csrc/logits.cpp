// Row reductions of the sampler over fp32 logits [N, V]: the greedy token (the first index of each row's
// maximum, as torch.argmax) and the log-sum-exp (max + log(sum(exp(x - max)))), in two passes over each row
// instead of torch's separate argmax, max and exp-sum kernels. Rows in parallel (csrc/pool.h); AVX-512, AVX2 + FMA or
// portable loops by the build's ISA. Plain C ABI, loaded with ctypes by sampling/logits_kernel.py.
#include <cmath>
#include <cstdint>
#include "../../csrc/pagedlm.h"
#include "../../csrc/simd_exp.h"
#include "../../csrc/pool.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
using pagedlm_simd::exp_ps;
#endif

// The first index of the row's maximum, or -1 where the row holds a NaN (the caller then defers to torch).
int64_t row_argmax(const float* x, int64_t V, float* max_out) {
  int64_t i = 0, best = 0;
  float m = -INFINITY;
  bool nan = false;
#if defined(__AVX512F__)
  if (V >= 16) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __m512i iv = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = 0;
    for (; i + 16 <= V; i += 16) {  // per lane: the first index of its maximum (strictly greater replaces)
      const __m512 v = _mm512_loadu_ps(x + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);
      mv = _mm512_mask_mov_ps(mv, gt, v);
      iv = _mm512_mask_mov_epi32(iv, gt, cur);
      cur = _mm512_add_epi32(cur, step);
    }
    nan = unordered != 0;
    m = _mm512_reduce_max_ps(mv);
    // The smallest index among the lanes holding the maximum (-inf everywhere: index 0).
    best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(mv, _mm512_set1_ps(m), _CMP_EQ_OQ), iv);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (V >= 8) {
    __m256 mv = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    __m256i iv = _mm256_setzero_si256(), cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, mv, _CMP_GT_OQ);
      mv = _mm256_blendv_ps(mv, v, gt);
      iv = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(iv), _mm256_castsi256_ps(cur), gt));
      cur = _mm256_add_epi32(cur, step);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float mvs[8];
    alignas(32) int32_t ivs[8];
    _mm256_store_ps(mvs, mv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ivs), iv);
    m = mvs[0], best = ivs[0];
    for (int l = 1; l < 8; ++l)
      if (mvs[l] > m || (mvs[l] == m && ivs[l] < best)) m = mvs[l], best = ivs[l];
  }
#endif
  for (; i < V; ++i) {  // the tail (or the whole row, portable): first index wins
    if (x[i] != x[i]) nan = true;
    if (x[i] > m) m = x[i], best = i;
  }
  *max_out = m;
  return nan ? -1 : best;
}

// sum(exp(x - m)) over the row: 16 (or 8) lane sums, then the tail.
float row_sum_exp(const float* x, int64_t V, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) acc = _mm512_add_ps(acc, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
  alignas(32) float a[8];
  _mm256_store_ps(a, acc);
  for (float v : a) sum += v;
#endif
  double tail = 0.0;  // the portable build sums whole rows here: in double, as accurate as the vector lanes
  for (; i < V; ++i) tail += std::exp(x[i] - m);
  return float(sum + tail);
}

}  // namespace

extern "C" {

// x: [N, V] fp32, rows ld floats apart. tokens[n]: the first index of row n's maximum; lse[n]: its log-sum-exp.
// Returns PAGEDLM_OK, or PAGEDLM_UNSUPPORTED where a row holds a NaN or its maximum is +-inf (then tokens and lse
// are incomplete and the caller takes torch's path, whose conventions for those rows it keeps).
int pagedlm_argmax_logsumexp(const float* x, int64_t N, int64_t V, int64_t ld, int64_t* tokens, float* lse,
                             int nthreads) {
  if (N < 0 || V < 1 || ld < V) return PAGEDLM_UNSUPPORTED;
  if (nthreads < 1) nthreads = default_threads();
  std::atomic<int> bad{0};
  parallel_for(N, nthreads, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* row = x + n * ld;
      float m;
      const int64_t t = row_argmax(row, V, &m);
      if (t < 0 || !std::isfinite(m)) { bad.store(1, std::memory_order_relaxed); continue; }
      tokens[n] = t;
      lse[n] = m + std::log(row_sum_exp(row, V, m));
    }
  });
  return bad.load() ? PAGEDLM_UNSUPPORTED : PAGEDLM_OK;
}

// Which loops this build compiled: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (portable).
int pagedlm_logits_isa() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__) && defined(__FMA__)
  return 256;
#else
  return 0;
#endif
}
}
