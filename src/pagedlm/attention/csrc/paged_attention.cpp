// Paged attention for CPUs: reads K/V in place from the scattered cache blocks (no gather), GQA without
// repeating K/V, decode and prefill chunks, fp32 and bf16 (math in fp32), online softmax, OpenMP.
// K/V caches may also be quantized (int8 or fp8 e4m3 values, each (token, kv head) entry followed by its fp32
// scale, see kvcache/quant.py); tiles are then dequantized once into fp32 scratch, as bf16 ones are converted.
// Plain C ABI (no torch headers) so it compiles in about a second; loaded with ctypes by cpu_kernel.py.
//
// Work item = (sequence, tile of query tokens, range of keys). Its rows are the tile's tokens x all heads
// (at most MAX_ROWS), so each cached token's K/V row [kv_heads, D] is streamed once per item and shared by
// the G query heads of each kv head. When there are too few items for the threads, key ranges are split
// (flash-decoding) and the partial softmax states merged afterwards.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <algorithm>
#include <type_traits>
#include <vector>
#include <omp.h>
#include "../../csrc/pagedlm.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// exp of 8 floats (Cephes' polynomial after a two-part ln 2 range reduction, within 2 ulp of expf);
// inputs below -87.3 (and -inf) give exactly 0.
inline __m256 exp_ps(__m256 x) {
  const __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero_below, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// y[i] = exp(x[i]) for n values, in place.
inline void exp_inplace(float* x, int n) {
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_ps(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

constexpr int KT = 16;        // keys per inner tile (never crossing a block)
constexpr int MAX_ROWS = 64;  // query rows (tokens x heads) per work item

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
enum KVKind { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };
constexpr int KV_SCALE_BYTES = 4;

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
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 16)
  for (int t = 0; t < T; ++t) {
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
}

// One item: rows r = token * H + head. Writes unnormalized acc [rows, D] plus running max m and sum l.
// A token's K/V for all kv heads are contiguous in the cache ([.., KVH, D]), so they are streamed once.
// Tokens [slot, slot + n) of a cache as fp32 rows [n, KVH * D] in `buf`.
template <int D>
void load_rows(const Args& a, const void* cache, int64_t slot, int n, float* buf) {
  const int KVD = a.KVH * D;
  if (a.kv_kind == KV_BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(cache) + slot * KVD;
    for (int e = 0; e < n * KVD; ++e) buf[e] = to_f(src[e]);
    return;
  }
  constexpr int E = D + KV_SCALE_BYTES;  // quantized entry: D values, then the fp32 scale
  const uint8_t* src = static_cast<const uint8_t*>(cache) + slot * a.KVH * E;
  for (int t = 0; t < n * a.KVH; ++t) {
    const uint8_t* e = src + int64_t(t) * E;
    float sc;
    std::memcpy(&sc, e + D, KV_SCALE_BYTES);
    float* dst = buf + int64_t(t) * D;
    if (a.kv_kind == KV_INT8) {
      const int8_t* qv = reinterpret_cast<const int8_t*>(e);
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = float(qv[d]) * sc;
    } else {
      for (int d = 0; d < D; ++d) dst[d] = kFp8.v[e[d]] * sc;
    }
  }
}

template <typename T, int D>
void run_item(const Args& a, const Item& it, const T* q, const void* kc, const void* vc,
              float* acc, float* m, float* l) {
  const int H = a.H, G = a.H / a.KVH, KVD = a.KVH * D;
  const int q0 = a.qsl[it.seq], qlen = a.qsl[it.seq + 1] - q0, slen = a.seq_lens[it.seq];
  const int t0 = it.tile * a.qt, nrows = std::min(a.qt, qlen - t0) * H;
  const int32_t* table = a.tables + int64_t(it.seq) * a.max_blocks;
  alignas(64) float qf[MAX_ROWS][D];
  alignas(64) float s[MAX_ROWS][KT];
  int qpos[MAX_ROWS];
  for (int r = 0; r < nrows; ++r) {
    const T* src = q + (int64_t(q0 + t0) * H + r) * D;
    for (int d = 0; d < D; ++d) qf[r][d] = to_f(src[d]) * a.scale;
    qpos[r] = slen - qlen + t0 + r / H;
    m[r] = -INFINITY; l[r] = 0.f;
    for (int d = 0; d < D; ++d) acc[r * D + d] = 0.f;
  }
  const bool f32 = a.kv_kind == KV_F32;
  std::vector<float> kbuf(f32 ? 0 : size_t(KT) * KVD), vbuf(f32 ? 0 : size_t(KT) * KVD);
  for (int pos = it.lo; pos < it.hi;) {
    const int blk = pos / a.BS, off = pos % a.BS;
    const int n = std::min(std::min(KT, a.BS - off), it.hi - pos);
    const int64_t slot = int64_t(table[blk]) * a.BS + off;
    if (pos + n < it.hi) {  // the next tile's K/V rows are scattered and cold (the weights evicted them): prefetch
      const int npos = pos + n, nn = std::min(std::min(KT, a.BS - npos % a.BS), it.hi - npos);
      const int64_t nslot = int64_t(table[npos / a.BS]) * a.BS + npos % a.BS;
      const int64_t row = a.kv_kind == KV_F32    ? int64_t(KVD) * 4
                          : a.kv_kind == KV_BF16 ? int64_t(KVD) * 2
                                                 : int64_t(a.KVH) * (D + KV_SCALE_BYTES);
      const char* kp = static_cast<const char*>(kc) + nslot * row;
      const char* vp = static_cast<const char*>(vc) + nslot * row;
      for (int64_t b = 0; b < nn * row; b += 64) {
        __builtin_prefetch(kp + b);
        __builtin_prefetch(vp + b);
      }
    }
    // Rows that see part of this tile: [r_lo, r_hi) (query positions grow with r).
    int r_lo = 0, r_hi = nrows;
    while (r_lo < nrows && qpos[r_lo] < pos) ++r_lo;
    if (a.window > 0)
      while (r_hi > r_lo && pos + n - 1 <= qpos[r_hi - 1] - a.window) --r_hi;
    if (r_lo >= r_hi) { pos += n; continue; }
    // The tile's K/V rows [n, KVH * D]: in place for fp32, converted once otherwise.
    const float *kt, *vt;
    if (f32) {
      kt = static_cast<const float*>(kc) + slot * KVD;
      vt = static_cast<const float*>(vc) + slot * KVD;
    } else {
      load_rows<D>(a, kc, slot, n, kbuf.data());
      load_rows<D>(a, vc, slot, n, vbuf.data());
      kt = kbuf.data(); vt = vbuf.data();
    }
    for (int r = r_lo; r < r_hi; ++r) {
      const int kvh = (r % H) / G, p = qpos[r];
      const float* qr = qf[r];
      const float* kh = kt + kvh * D;
      int j = 0;
      for (; j + 4 <= n; j += 4) {  // four independent dot products at a time
        const float *k0 = kh + j * KVD, *k1 = k0 + KVD, *k2 = k1 + KVD, *k3 = k2 + KVD;
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int d = 0; d < D; ++d) {
          d0 += qr[d] * k0[d]; d1 += qr[d] * k1[d]; d2 += qr[d] * k2[d]; d3 += qr[d] * k3[d];
        }
        s[r][j] = d0; s[r][j + 1] = d1; s[r][j + 2] = d2; s[r][j + 3] = d3;
      }
      for (; j < n; ++j) {
        const float* k0 = kh + j * KVD;
        float d0 = 0.f;
#pragma omp simd reduction(+ : d0)
        for (int d = 0; d < D; ++d) d0 += qr[d] * k0[d];
        s[r][j] = d0;
      }
      float mt = m[r];
      for (int jj = 0; jj < n; ++jj) {  // mask, then online softmax
        const int kp = pos + jj;
        if (kp > p || (a.window > 0 && kp <= p - a.window)) s[r][jj] = -INFINITY;
        mt = std::max(mt, s[r][jj]);
      }
      const float alpha = std::exp(m[r] - mt);  // m = -inf -> 0
      float sum = 0.f;
      for (int jj = 0; jj < n; ++jj) s[r][jj] -= mt;
      exp_inplace(s[r], n);
      for (int jj = 0; jj < n; ++jj) sum += s[r][jj];
      l[r] = l[r] * alpha + sum;
      m[r] = mt;
      alignas(64) float o[D];  // acc row kept in registers across the tile's keys
      float* ar = acc + r * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] = ar[d] * alpha;
      const float* vh = vt + kvh * D;
      for (int jj = 0; jj < n; ++jj) {
        const float pj = s[r][jj];
        const float* v0 = vh + jj * KVD;
#pragma omp simd
        for (int d = 0; d < D; ++d) o[d] += pj * v0[d];
      }
#pragma omp simd
      for (int d = 0; d < D; ++d) ar[d] = o[d];
    }
    pos += n;
  }
}

template <typename T, int D>
void paged_attention(const T* q, const void* kc, const void* vc, T* out, Args a, int num_seqs, int nthreads) {
  const int qt = a.qt = std::max(1, MAX_ROWS / a.H);
  // One item per (seq, query tile); split key ranges (flash-decoding) when there are too few items.
  int64_t base_items = 0;
  for (int i = 0; i < num_seqs; ++i) base_items += (a.qsl[i + 1] - a.qsl[i] + qt - 1) / qt;
  const int64_t target = 4 * int64_t(nthreads);
  const int min_part = 128;
  std::vector<Item> items;
  std::vector<int> first;  // first item of each (seq, tile), plus a sentinel
  for (int i = 0; i < num_seqs; ++i) {
    const int qlen = a.qsl[i + 1] - a.qsl[i], slen = a.seq_lens[i];
    for (int tile = 0; tile * qt < qlen; ++tile) {
      const int first_pos = slen - qlen + tile * qt;
      const int hi = std::min(slen, first_pos + qt);
      const int lo = a.window > 0 ? std::max(0, first_pos - a.window + 1) : 0;
      int parts = 1;
      if (base_items < target)
        parts = std::max(1, std::min(int((target + base_items - 1) / base_items), (hi - lo) / min_part));
      const int chunk = ((hi - lo + parts - 1) / parts + KT - 1) / KT * KT;
      first.push_back(int(items.size()));
      for (int start = lo; start < hi; start += chunk) items.push_back({i, tile, start, std::min(hi, start + chunk)});
    }
  }
  first.push_back(int(items.size()));
  const int64_t nitems = int64_t(items.size());
  const int rows = qt * a.H;
  std::vector<int> group_of(nitems);
  for (int gi = 0; gi + 1 < int(first.size()); ++gi)
    for (int k = first[gi]; k < first[gi + 1]; ++k) group_of[k] = gi;
  // Partial states, uninitialized (each item initializes its rows): [item, rows, D] and [item, {m, l}, rows].
  std::unique_ptr<float[]> acc(new float[size_t(nitems) * rows * D]), ml(new float[size_t(nitems) * rows * 2]);

  // Writes rows of (seq, tile) from the partial states of items k0..k1 (one item: just normalizes).
  auto finish = [&](int k0, int k1) {
    const Item& it = items[k0];
    const int qlen = a.qsl[it.seq + 1] - a.qsl[it.seq];
    const int nrows = std::min(qt, qlen - it.tile * qt) * a.H;
    for (int r = 0; r < nrows; ++r) {
      float mmax = -INFINITY;
      for (int k = k0; k < k1; ++k) mmax = std::max(mmax, ml[size_t(k) * rows * 2 + r]);
      alignas(64) float o[D] = {0};
      float lsum = 0.f;
      for (int k = k0; k < k1; ++k) {
        const float mk = ml[size_t(k) * rows * 2 + r];
        if (mk == -INFINITY) continue;
        const float w = std::exp(mk - mmax);
        lsum += w * ml[size_t(k) * rows * 2 + rows + r];
        const float* ak = acc.get() + (size_t(k) * rows + r) * D;
        for (int d = 0; d < D; ++d) o[d] += w * ak[d];
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      T* dst = out + (int64_t(a.qsl[it.seq] + it.tile * qt) * a.H + r) * D;
      for (int d = 0; d < D; ++d) from_f(o[d] * inv, dst + d);
    }
  };

  // One parallel region (a second one costs a barrier); groups split over several items are merged after it,
  // serially: splitting only happens when there are few groups.
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t k = 0; k < nitems; ++k) {
    float* mk = ml.get() + size_t(k) * rows * 2;
    run_item<T, D>(a, items[k], q, kc, vc, acc.get() + size_t(k) * rows * D, mk, mk + rows);
    const int gi = group_of[k];
    if (first[gi + 1] - first[gi] == 1) finish(int(k), int(k) + 1);
  }
  for (int gi = 0; gi + 1 < int(first.size()); ++gi)
    if (first[gi + 1] - first[gi] > 1) finish(first[gi], first[gi + 1]);
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
    default: return PAGEDLM_UNSUPPORTED;
  }
}

}  // namespace

extern "C" {

// q, out: [num_tokens, H, D]; k_cache, v_cache: [num_blocks, BS, KVH, D]; block_tables: [num_seqs, max_blocks]
// int32; seq_lens: [num_seqs] int32; query_start_loc: [num_seqs + 1] int32. dtype (of q and out): 0 = fp32,
// 1 = bf16; kv_dtype: a KVKind (int8/fp8 caches are [num_blocks, BS, KVH, D + 4] bytes). window <= 0: no sliding
// window. Needs H <= 64 and H % KVH == 0. Returns PAGEDLM_OK, or a PagedlmStatus (having read nothing out of range
// and written nothing): an unsupported head_dim or dtype, a bad batch layout or block id (check_batch).
int pagedlm_paged_attention(int dtype, int kv_dtype, const void* q, const void* k_cache, const void* v_cache,
                            void* out,
                            const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                            const int32_t* query_start_loc, int num_seqs, int num_tokens, int H, int KVH, int D,
                            int BS, int num_blocks, float scale, int window, int nthreads) {
  if (kv_dtype < KV_F32 || kv_dtype > KV_FP8 || (kv_dtype == KV_F32 && dtype != 0)) return PAGEDLM_UNSUPPORTED;
  Args a{H, KVH, D, BS, max_blocks, window, 1, kv_dtype, scale, block_tables, seq_lens, query_start_loc};
  if (const int rc = check_batch(a, num_seqs, num_tokens, num_blocks)) return rc;
  if (nthreads < 1) nthreads = omp_get_max_threads();
  if (dtype == 0) return dispatch<float>(q, k_cache, v_cache, out, a, num_seqs, nthreads);
  if (dtype == 1) return dispatch<uint16_t>(q, k_cache, v_cache, out, a, num_seqs, nthreads);
  return PAGEDLM_UNSUPPORTED;
}

// Fused decode helper: rope_write_kv over T tokens into an fp32 cache of num_slots (blocks x BS) token rows.
// Returns PAGEDLM_BAD_SLOT, having changed nothing, if a slot is outside the cache.
int pagedlm_rope_write_kv(float* qkv, const float* cos, const float* sin, int T, int H, int KVH, int D,
                          const int64_t* slots, float* k_cache, float* v_cache, int64_t num_slots, int nthreads) {
  if (const int rc = check_slots(slots, T, num_slots)) return rc;
  rope_write_kv(qkv, cos, sin, T, H, KVH, D, slots, k_cache, v_cache, nthreads);
  return PAGEDLM_OK;
}
}
