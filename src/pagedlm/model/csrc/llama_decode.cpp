// The whole LLaMA decoder stack for a few new tokens (decode steps) in one call: per layer RMSNorm, fused QKV
// projection, RoPE + paged K/V write, paged attention, output projection + residual, RMSNorm, fused gate/up
// projection, SiLU * up, down projection + residual. It removes the ~40 torch ops (and their dispatch, dtype
// checks and temporaries) per layer that dominate a single-stream decode step on a CPU once the weights are
// quantized. Same arithmetic as the torch path except the order of sums inside RMSNorm and the exp in SiLU.
//
// One translation unit with the kernels it chains (their helpers live in anonymous namespaces).
#include "quant_linear.cpp"
#include "../../attention/csrc/paged_attention.cpp"

namespace {

enum LinearKind { LIN_F32T = 0, LIN_INT8 = 1, LIN_INT4 = 2, LIN_INT8_PACKED = 3, LIN_INT4_X16 = 4, LIN_INT8_X16 = 5 };

// A linear layer y = x @ W^T: fp32 stored transposed ([K, N], as layers.Linear keeps it on CPUs), or the
// int8 / int4 layouts of quant_linear.cpp.
struct Linear {
  int kind, K, N, G;
  const void *w, *scale, *mins;
};

struct Layer {
  const float *input_norm, *post_norm;  // [hidden]
  Linear qkv, o, gate_up, down;
  void *k_cache, *v_cache;  // [blocks, BS, KVH, D] fp32 or bf16, or [blocks, BS, KVH, D + 4] int8 entries (kv_kind)
};

struct Model {
  int num_layers, hidden, H, KVH, D, inter, BS, num_blocks, kv_kind;  // every layer's cache: num_blocks x BS tokens
  float eps;
  const Layer* layers;
  const float* final_norm;  // [hidden]
};

constexpr int CB = 64;  // output columns per work item of the transposed fp32 product (8 accumulators)

// y[M, N] = x[M, K] @ w[K, N] for w stored [K, N] (row k holds input k's weights for every output).
void linear_f32t(const float* x, const float* w, float* y, int M, int K, int N, int nthreads) {
  const int blocks = (N + CB - 1) / CB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int b = 0; b < blocks; ++b) {
    const int n0 = b * CB, nc = std::min(CB, N - n0);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + int64_t(m) * K;
      float* ym = y + int64_t(m) * N + n0;
#ifdef PAGEDLM_AVX2
      if (nc == CB) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int k = 0; k < K; ++k) {
          const float* wk = w + int64_t(k) * N + n0;
          if (m == 0) {
            _mm_prefetch(reinterpret_cast<const char*>(wk + 8 * int64_t(N)), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wk + 8 * int64_t(N) + 16), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wk + 8 * int64_t(N) + 32), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wk + 8 * int64_t(N) + 48), _MM_HINT_T0);
          }
          const __m256 xv = _mm256_set1_ps(xm[k]);
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wk + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(ym + 8 * i, a[i]);
        continue;
      }
#endif
      for (int j = 0; j < nc; ++j) ym[j] = 0.f;
      for (int k = 0; k < K; ++k) {
        const float xk = xm[k];
        const float* wk = w + int64_t(k) * N + n0;
        for (int j = 0; j < nc; ++j) ym[j] += xk * wk[j];
      }
    }
  }
}

int linear(const Linear& l, const float* x, float* y, int M, int nthreads) {
  switch (l.kind) {
    case LIN_F32T: linear_f32t(x, static_cast<const float*>(l.w), y, M, l.K, l.N, nthreads); return 0;
    case LIN_INT8:
    case LIN_INT8_PACKED:
      return pagedlm_linear_int8(x, static_cast<const int8_t*>(l.w), static_cast<const float*>(l.scale), y, M,
                                 l.K, l.N, l.kind == LIN_INT8_PACKED, nthreads);
    case LIN_INT8_X16:
      return pagedlm_linear_int8_x16(x, static_cast<const int8_t*>(l.w), static_cast<const float*>(l.scale), y, M,
                                     l.K, l.N, nthreads);
    case LIN_INT4:
    case LIN_INT4_X16:
      return pagedlm_linear_int4(x, static_cast<const uint8_t*>(l.w), static_cast<const uint16_t*>(l.scale),
                                 static_cast<const uint16_t*>(l.mins), y, M, l.K, l.N, l.G, l.kind == LIN_INT4_X16,
                                 nthreads);
    default: return 2;
  }
}

// out = (x / rms(x)) * w, row by row (HF's order of operations).
void rms_norm(const float* x, const float* w, float* out, int M, int n, float eps) {
  for (int m = 0; m < M; ++m) {
    const float* xm = x + int64_t(m) * n;
    float* om = out + int64_t(m) * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; ++i) ss += xm[i] * xm[i];
    const float r = 1.f / std::sqrt(ss / float(n) + eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) om[i] = (xm[i] * r) * w[i];
  }
}

// out = silu(g) * u = g / (1 + exp(-g)) * u, as torch computes it.
void silu_mul(const float* g, const float* u, float* out, int n) {
  int i = 0;
#ifdef PAGEDLM_AVX2
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 den = _mm256_add_ps(one, exp_ps(_mm256_xor_ps(gv, sign)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// One K or V row [KVH, D] into int8 cache entries (D values, then the fp32 scale), as kvcache/quant.py
// quantizes: scale = max(max|x| / 127, 1e-12), q = round-half-even(x / scale) clamped to +-127.
void write_int8_entries(const float* x, int KVH, int D, int8_t* dst) {
  for (int h = 0; h < KVH; ++h) {
    const float* xh = x + h * D;
    int8_t* e = dst + int64_t(h) * (D + KV_SCALE_BYTES);
    float amax = 0.f;
    for (int i = 0; i < D; ++i) amax = std::max(amax, std::fabs(xh[i]));
    const float scale = std::max(amax / 127.f, 1e-12f);
    for (int i = 0; i < D; ++i) e[i] = int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(xh[i] / scale))));
    std::memcpy(e + D, &scale, KV_SCALE_BYTES);
  }
}

}  // namespace

extern "C" {

// x: [M, hidden] fp32, the residual stream, run in place through all layers and the final norm. K/V are written
// to (and attention reads) fp32, bf16 (rounded to nearest even, as torch's .to(bfloat16)) or int8 caches
// (quantized per token and head as kvcache/quant.py does).
// cos, sin: [M, D/2]; slots: [M] int64; block tables etc. as in pagedlm_paged_attention (one KV cache group
// shared by all layers). The batch (check_batch) and the slots are validated before anything is computed or
// written. Returns 0, a PagedlmStatus, or the first failing linear kernel's (positive) code.
int pagedlm_llama_decode(const Model* model, float* x, int M, const float* cos, const float* sin,
                         const int64_t* slots, const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                         const int32_t* query_start_loc, int num_seqs, int nthreads) {
  const Model& md = *model;
  const int hid = md.hidden, D = md.D, qd = md.H * D, kvd = md.KVH * D, qkvd = qd + 2 * kvd;
  if (md.kv_kind != KV_F32 && md.kv_kind != KV_BF16 && md.kv_kind != KV_INT8) return PAGEDLM_UNSUPPORTED;
  Args a{md.H, md.KVH, D, md.BS, max_blocks, 0, 1, md.kv_kind, 1.f / std::sqrt(float(D)), block_tables, seq_lens,
         query_start_loc};
  if (int rc = check_batch(a, num_seqs, M, md.num_blocks)) return rc;
  if (int rc = check_slots(slots, M, int64_t(md.num_blocks) * md.BS)) return rc;
  if (nthreads < 1) nthreads = omp_get_max_threads();
  // Scratch kept between calls (grow-only): fresh multi-megabyte buffers every step cost page faults.
  thread_local std::vector<float> h, t, qkv, q, att, gu, act;
  h.resize(size_t(M) * hid); t.resize(size_t(M) * hid); qkv.resize(size_t(M) * qkvd); q.resize(size_t(M) * qd);
  att.resize(size_t(M) * qd); gu.resize(size_t(M) * 2 * md.inter); act.resize(size_t(M) * md.inter);
  for (int li = 0; li < md.num_layers; ++li) {
    const Layer& L = md.layers[li];
    rms_norm(x, L.input_norm, h.data(), M, hid, md.eps);
    int rc = linear(L.qkv, h.data(), qkv.data(), M, nthreads);
    if (rc) return rc;
    if (md.kv_kind == KV_F32) {
      rope_write_kv(qkv.data(), cos, sin, M, md.H, md.KVH, D, slots, static_cast<float*>(L.k_cache),
                    static_cast<float*>(L.v_cache), 1);
    } else if (md.kv_kind == KV_BF16) {
      rope_write_kv(qkv.data(), cos, sin, M, md.H, md.KVH, D, slots, nullptr, nullptr, 1);
      for (int m = 0; m < M; ++m) {
        const float* row = &qkv[size_t(m) * qkvd];
        uint16_t* kd = static_cast<uint16_t*>(L.k_cache) + slots[m] * kvd;
        uint16_t* vd = static_cast<uint16_t*>(L.v_cache) + slots[m] * kvd;
        for (int i = 0; i < kvd; ++i) { from_f(row[qd + i], kd + i); from_f(row[qd + kvd + i], vd + i); }
      }
    } else {
      rope_write_kv(qkv.data(), cos, sin, M, md.H, md.KVH, D, slots, nullptr, nullptr, 1);
      const int64_t entry_row = int64_t(md.KVH) * (D + KV_SCALE_BYTES);
      for (int m = 0; m < M; ++m) {
        const float* row = &qkv[size_t(m) * qkvd];
        write_int8_entries(row + qd, md.KVH, D, static_cast<int8_t*>(L.k_cache) + slots[m] * entry_row);
        write_int8_entries(row + qd + kvd, md.KVH, D, static_cast<int8_t*>(L.v_cache) + slots[m] * entry_row);
      }
    }
    for (int m = 0; m < M; ++m) std::memcpy(&q[size_t(m) * qd], &qkv[size_t(m) * qkvd], sizeof(float) * qd);
    rc = dispatch<float>(q.data(), L.k_cache, L.v_cache, att.data(), a, num_seqs, nthreads);
    if (rc) return rc;
    if ((rc = linear(L.o, att.data(), t.data(), M, nthreads))) return rc;
    for (size_t i = 0; i < size_t(M) * hid; ++i) x[i] += t[i];
    rms_norm(x, L.post_norm, h.data(), M, hid, md.eps);
    if ((rc = linear(L.gate_up, h.data(), gu.data(), M, nthreads))) return rc;
    for (int m = 0; m < M; ++m) {
      const float* g = &gu[size_t(m) * 2 * md.inter];
      silu_mul(g, g + md.inter, &act[size_t(m) * md.inter], md.inter);
    }
    if ((rc = linear(L.down, act.data(), t.data(), M, nthreads))) return rc;
    for (size_t i = 0; i < size_t(M) * hid; ++i) x[i] += t[i];
  }
  rms_norm(x, md.final_norm, h.data(), M, hid, md.eps);
  std::memcpy(x, h.data(), sizeof(float) * size_t(M) * hid);
  return 0;
}

}  // extern "C"
