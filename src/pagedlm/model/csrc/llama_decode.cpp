// The whole decoder stack for a few new tokens (decode steps) in one call: per layer RMSNorm, fused QKV
// projection, RoPE + paged K/V write, paged attention, output projection + residual, RMSNorm, fused gate/up
// projection, SiLU (or GELU) * up, down projection + residual. It removes the ~40 torch ops (and their dispatch,
// dtype checks and temporaries) per layer that dominate a single-stream decode step on a CPU once the weights are
// quantized. LLaMA layers, and Gemma 3's: per-head RMSNorm of q and k before RoPE, RMSNorms of the attention and
// MLP outputs before their residual adds, GELU (tanh), two RoPE tables and sliding-window layers with their own
// KV cache group. Same arithmetic as the torch path except the order of sums inside RMSNorm and the exp in SiLU
// and GELU.
//
// One translation unit with the kernels it chains (their helpers live in anonymous namespaces).
#include <numeric>
#include "quant_linear.cpp"
#include "../../attention/csrc/paged_attention.cpp"

namespace {

enum LinearKind {
  LIN_F32T = 0, LIN_INT8 = 1, LIN_INT4 = 2, LIN_INT8_PACKED = 3, LIN_INT4_X16 = 4, LIN_INT8_X16 = 5, LIN_BF16_X16 = 6,
  LIN_INT4_X16_K = 7, LIN_GGUF_X16 = 8, LIN_CONCAT = 9
};

// A linear layer y = x @ W^T: fp32 stored transposed ([K, N], as layers.Linear keeps it on CPUs), or the
// int8 / int4 / bf16 layouts of quant_linear.cpp, or a GGUF x16 layout (gguf_x16.h: G is its GgufKind, w its codes,
// scale its scales, mins its aux bytes, planes its high bits), or parts side by side (LIN_CONCAT: w points at G
// Linears, whose outputs fill y's columns in turn).
struct Linear {
  int kind, K, N, G;
  const void *w, *scale, *mins, *planes;
};

struct Layer {
  const float *input_norm, *post_norm;  // [hidden]: before attention, before the MLP
  Linear qkv, o, gate_up, down;
  void *k_cache, *v_cache;  // [blocks, BS, KVH, D] fp32, bf16 or fp16, or [blocks, BS, KVH, D + 4] int8 entries (kv_kind)
  const float *q_norm, *k_norm;  // [D]: RMSNorm of each q / k head before RoPE ([H * D], [KVH * D]: of the
                                 // whole projection, qk_norm_whole), or null
  const float *attn_out_norm, *mlp_out_norm;  // [hidden]: RMSNorm of the attention / MLP output, or null
  int window;  // sliding window (<= 0: none)
  int rope;    // the rotary table it uses (index into cos / sin)
  int group;   // the batch layout of its KV cache group (index into groups)
  const float* qkv_bias;  // [H * D + 2 * KVH * D]: added to the q/k/v projection's output (Qwen2), or null
  int qk_norm_whole;  // q_norm / k_norm normalize the whole q / k projection (OLMoE), not each head
  float clip_qkv;     // q, k and v clamped to [-clip_qkv, clip_qkv] after the norms (OLMoE), or 0: not clamped
  // A mixture-of-experts MLP in place of gate_up / down (router null: a dense MLP): router [num_experts, hidden]
  // fp32 logits, softmax, the top_k experts (their weights renormalized to sum to 1 if norm_topk), each expert's
  // products exp_gate_up[e] / exp_down[e]; expert_counts[e] counts the tokens routed to expert e.
  const float* router;
  int num_experts, top_k, norm_topk;
  const Linear *exp_gate_up, *exp_down;
  int64_t* expert_counts;
  // A shared expert beside them (Qwen2-MoE), or null: every token's shared_gate_up / shared_down MLP, times
  // sigmoid(shared_gate . h), added after the routed experts.
  const Linear *shared_gate_up, *shared_down;
  const float* shared_gate;  // [hidden]
};

enum Activation { ACT_SILU = 0, ACT_GELU_TANH = 1 };

struct Model {
  int num_layers, hidden, H, KVH, D, inter, BS, num_blocks, kv_kind;  // every layer's cache: num_blocks x BS tokens
  float eps;
  const Layer* layers;
  const float* final_norm;  // [hidden]
  int act;      // Activation of the gate
  float scale;  // attention's softmax scale
};

// One KV cache group's view of the batch (see pagedlm_paged_attention): its slots, block tables, lengths.
struct Group {
  const int64_t* slots;
  const int32_t *block_tables, *seq_lens, *query_start_loc;
  int max_blocks;
};


int linear(const Linear& l, const float* x, float* y, int M, int nthreads);
void silu_mul(const float* g, const float* u, float* out, int n);
void gelu_tanh_mul(const float* g, const float* u, float* out, int n);

// sum of a[i] * b[i]: 16 independent partial sums, so the loop vectorizes without reordering any one of them
float dot16(const float* a, const float* b, int n) {
  float lane[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] += a[i + l] * b[i + l];
  float acc = 0.f;
  for (int l = 0; l < 16; ++l) acc += lane[l];
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// o[n, down.N] = down(act(gate) * up) of x[n, gate_up.K], (gate, up) = gate_up(x): one expert's gated MLP.
int expert_rows(const Linear& gate_up, const Linear& down, int act, const float* x, float* o, int n, int nthreads) {
  const int inter = down.K;
  thread_local std::vector<float> gu, a;
  gu.resize(size_t(n) * 2 * inter); a.resize(size_t(n) * inter);
  if (int rc = linear(gate_up, x, gu.data(), n, nthreads)) return rc;
  for (int r = 0; r < n; ++r) {
    const float* g = gu.data() + size_t(r) * 2 * inter;
    if (act == ACT_GELU_TANH) gelu_tanh_mul(g, g + inter, a.data() + size_t(r) * inter, inter);
    else silu_mul(g, g + inter, a.data() + size_t(r) * inter, inter);
  }
  return linear(down, a.data(), o, n, nthreads);
}

std::atomic<int64_t> split_tokens{0};  // tokens whose experts ran split between threads (tests see the path)

// o[j, N] = the gated MLP of expert ids[j] over the one token x, j < k: the experts split between the threads, each
// expert's products on one thread, so one team pass covers them all (each product a few MB read as a stream; split
// by rows, k products of both threads would each end at a barrier). For k a multiple of nthreads.
int experts_one_token(const Linear* gate_up, const Linear* down, const int* ids, int k, int act, const float* x,
                      float* o, int N, int nthreads) {
  split_tokens.fetch_add(1, std::memory_order_relaxed);
  std::atomic<int> rc{0};
  parallel_for(k, nthreads, k / nthreads, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      if (int r = expert_rows(gate_up[ids[j]], down[ids[j]], act, x, o + j * N, 1, 1)) rc = r;
  });
  return rc;
}

// dst[i] += w * src[i], each product rounded before the sum (as torch's weighting, then its add)
void add_weighted(float* dst, const float* src, float w, int n) {
  for (int i = 0; i < n; ++i) {
    const volatile float scaled = src[i] * w;
    dst[i] += scaled;
  }
}

// out[M, hidden] += the shared expert of layer L over h[M, hidden], each row times sigmoid(shared_gate . h[m]).
int shared_expert(const Layer& L, int hid, int act, const float* h, float* out, int M, int nthreads) {
  thread_local std::vector<float> o;
  o.resize(size_t(M) * hid);
  if (int rc = expert_rows(*L.shared_gate_up, *L.shared_down, act, h, o.data(), M, nthreads)) return rc;
  for (int m = 0; m < M; ++m) {
    const float s = 1.f / (1.f + std::exp(-dot16(h + int64_t(m) * hid, L.shared_gate, hid)));
    add_weighted(out + int64_t(m) * hid, o.data() + size_t(m) * hid, s, hid);
  }
  return 0;
}

// out[M, hidden] = the mixture-of-experts MLP of layer L over h[M, hidden], as model/moe.py computes it: router
// logits, softmax in fp32, the top k by probability (renormalized where the family says so); the tokens grouped by
// expert, each chosen expert's products run once over its tokens, its rows weighted and added into their tokens in
// expert order; then the shared expert, if any.
int moe_mlp(const Layer& L, int hid, int act, const float* h, float* out, int M, int nthreads) {
  const int E = L.num_experts, k = L.top_k;
  thread_local std::vector<float> logits, w, xs, o;
  thread_local std::vector<int> ids, rows, slot;
  logits.resize(size_t(M) * E); w.resize(size_t(M) * k); ids.resize(size_t(M) * k);
  float* const lp = logits.data();  // the team's threads see their own thread_locals: pass the caller's buffer
  parallel_for(E, nthreads, 8, [&, lp](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const float* r = L.router + e * hid;
      for (int m = 0; m < M; ++m) {
        lp[size_t(m) * E + e] = dot16(h + int64_t(m) * hid, r, hid);
      }
    }
  });
  for (int m = 0; m < M; ++m) {
    float* lg = logits.data() + size_t(m) * E;
    const float mx = *std::max_element(lg, lg + E);
    float sum = 0.f;
    for (int e = 0; e < E; ++e) sum += (lg[e] = std::exp(lg[e] - mx));
    for (int e = 0; e < E; ++e) lg[e] /= sum;
    int* id = ids.data() + size_t(m) * k;
    float* wm = w.data() + size_t(m) * k;
    float chosen = 0.f;
    for (int j = 0; j < k; ++j) {  // the j-th largest probability (the lowest id among equals)
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken |= id[i] == e;
        if (!taken && (best < 0 || lg[e] > lg[best])) best = e;
      }
      id[j] = best;
      wm[j] = lg[best];
      chosen += lg[best];
    }
    if (L.norm_topk)
      for (int j = 0; j < k; ++j) wm[j] /= chosen;
  }
  std::fill(out, out + int64_t(M) * hid, 0.f);
  if (M == 1 && nthreads > 1 && k % nthreads == 0) {  // decode: the experts in ascending order, as below
    rows.assign(ids.begin(), ids.begin() + k);
    std::sort(rows.begin(), rows.end());
    o.resize(size_t(k) * hid);
    if (int rc = experts_one_token(L.exp_gate_up, L.exp_down, rows.data(), k, act, h, o.data(), hid, nthreads))
      return rc;
    for (int j = 0; j < k; ++j) {
      const int e = rows[j];
      ++L.expert_counts[e];
      add_weighted(out, o.data() + size_t(j) * hid, w[std::find(ids.begin(), ids.begin() + k, e) - ids.begin()], hid);
    }
    return L.shared_down ? shared_expert(L, hid, act, h, out, M, nthreads) : 0;
  }
  o.resize(size_t(M) * hid); xs.resize(size_t(M) * hid); rows.resize(M); slot.resize(M);
  for (int e = 0; e < E; ++e) {
    int n = 0;
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < k; ++j)
        if (ids[size_t(m) * k + j] == e) { rows[n] = m; slot[n] = j; ++n; }
    if (n == 0) continue;
    L.expert_counts[e] += n;
    for (int r = 0; r < n; ++r) std::memcpy(xs.data() + size_t(r) * hid, h + int64_t(rows[r]) * hid, sizeof(float) * hid);
    if (int rc = expert_rows(L.exp_gate_up[e], L.exp_down[e], act, xs.data(), o.data(), n, nthreads)) return rc;
    for (int r = 0; r < n; ++r)  // as torch's mul_ by the weights, then index_add_ into the tokens
      add_weighted(out + int64_t(rows[r]) * hid, o.data() + size_t(r) * hid, w[size_t(rows[r]) * k + slot[r]], hid);
  }
  return L.shared_down ? shared_expert(L, hid, act, h, out, M, nthreads) : 0;
}

constexpr int CB = 64;  // output columns per work item of the transposed fp32 product (8 accumulators)

// y[M, N] = x[M, K] @ w[K, N] for w stored [K, N] (row k holds input k's weights for every output).
void linear_f32t(const float* x, const float* w, float* y, int M, int K, int N, int nthreads) {
  const int blocks = (N + CB - 1) / CB;
  parallel_for(blocks, nthreads, 1, [&](int64_t b0, int64_t b1) {
  for (int b = int(b0); b < b1; ++b) {
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
  });
}

int linear(const Linear& l, const float* x, float* y, int M, int nthreads);

// A LIN_CONCAT layer: each part into a scratch buffer, then into its columns of y.
int linear_concat(const Linear& l, const float* x, float* y, int M, int nthreads) {
  thread_local std::vector<float> part_out;
  const Linear* parts = static_cast<const Linear*>(l.w);
  for (int p = 0, col = 0; p < l.G; col += parts[p].N, ++p) {
    const Linear& q = parts[p];
    if (q.K != l.K || col + q.N > l.N || q.kind == LIN_CONCAT) return 2;
    part_out.resize(size_t(M) * q.N);
    float* out = part_out.data();
    if (const int rc = linear(q, x, out, M, nthreads)) return rc;
    for (int m = 0; m < M; ++m) std::memcpy(y + int64_t(m) * l.N + col, out + int64_t(m) * q.N, sizeof(float) * q.N);
  }
  return 0;
}

int linear(const Linear& l, const float* x, float* y, int M, int nthreads) {
  switch (l.kind) {
    case LIN_CONCAT: return linear_concat(l, x, y, M, nthreads);
    case LIN_F32T: linear_f32t(x, static_cast<const float*>(l.w), y, M, l.K, l.N, nthreads); return 0;
    case LIN_INT8:
    case LIN_INT8_PACKED:
      return pagedlm_linear_int8(x, static_cast<const int8_t*>(l.w), static_cast<const float*>(l.scale), y, M,
                                 l.K, l.N, l.kind == LIN_INT8_PACKED, nthreads);
    case LIN_INT8_X16:
      return pagedlm_linear_int8_x16(x, static_cast<const int8_t*>(l.w), static_cast<const float*>(l.scale), y, M,
                                     l.K, l.N, nthreads);
    case LIN_BF16_X16:
      return pagedlm_linear_bf16_x16(x, static_cast<const uint32_t*>(l.w), y, M, l.K, l.N, nthreads);
    case LIN_INT4:
    case LIN_INT4_X16:
    case LIN_INT4_X16_K:
      return pagedlm_linear_int4(x, static_cast<const uint8_t*>(l.w), l.scale, l.mins, y, M, l.K, l.N, l.G,
                                 l.kind == LIN_INT4 ? INT4_ROW_LAYOUT : l.kind == LIN_INT4_X16 ? INT4_X16 : INT4_X16_K,
                                 nthreads);
    case LIN_GGUF_X16:
      return pagedlm_linear_gguf(x, l.G, static_cast<const uint8_t*>(l.w), static_cast<const uint8_t*>(l.planes),
                                 static_cast<const uint16_t*>(l.scale), static_cast<const uint8_t*>(l.mins), y, M, l.K,
                                 l.N, nthreads);
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
// The AVX-512 loop runs exp_ps's 16-lane form: the AVX2 loop's operations lane for lane, so the same results.
void silu_mul(const float* g, const float* u, float* out, int n) {
  int i = 0;
#if defined(PAGEDLM_AVX2) && defined(__AVX512F__)
  {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));
      const __m512 den = _mm512_add_ps(one, exp_ps(neg));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, den), _mm512_loadu_ps(u + i)));
    }
  }
#endif
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

// out = gelu_tanh(g) * u, gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with
// tanh(y) = 1 - 2 / (1 + exp(2 y)).
void gelu_tanh_mul(const float* g, const float* u, float* out, int n) {
  constexpr float kC = 0.7978845608028654f, kA = 0.044715f;
  int i = 0;
#ifdef PAGEDLM_AVX2
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
  const __m256 c2 = _mm256_set1_ps(2.f * kC), a = _mm256_set1_ps(kA);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 y2 = _mm256_mul_ps(c2, _mm256_fmadd_ps(_mm256_mul_ps(a, x), _mm256_mul_ps(x, x), x));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, exp_ps(y2))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t)),
                                            _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float x = g[i];
    out[i] = 0.5f * x * (1.f + std::tanh(kC * (x + kA * x * x * x))) * u[i];
  }
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

// The rows of sequence i that go on past the last layer's K/V write when out_qsl is given: its last
// out_qsl[i + 1] - out_qsl[i] query tokens, moved (their residual rows in x, their q heads in q) to rows
// out_qsl[i] .. in order. Returns their number.
int keep_out_rows(float* x, float* q, int hid, int qd, const int32_t* qsl, const int32_t* out_qsl, int num_seqs) {
  for (int i = 0; i < num_seqs; ++i) {
    const int n = out_qsl[i + 1] - out_qsl[i], src = qsl[i + 1] - n, dst = out_qsl[i];
    if (src == dst) continue;
    for (int j = 0; j < n; ++j) {  // dst <= src: moving forward in order never overwrites a row still to move
      std::memmove(x + int64_t(dst + j) * hid, x + int64_t(src + j) * hid, sizeof(float) * hid);
      std::memmove(q + int64_t(dst + j) * qd, q + int64_t(src + j) * qd, sizeof(float) * qd);
    }
  }
  return out_qsl[num_seqs];
}

// The layers and the final norm of pagedlm_llama_decode (batch checked; args[g]: group g's attention batch).
// Between the products, the row-wise work (norms, RoPE and K/V writes, the activation, residual adds) runs
// rows in parallel too: serial, it took a third of a 2,048-token prefill chunk.
int decode_layers(const Model& md, float* x, int M, const float* const* cos, const float* const* sin,
                  const Group* groups, const Args* args, int num_seqs, const int32_t* out_qsl, int nthreads) {
  const int hid = md.hidden, D = md.D, qd = md.H * D, kvd = md.KVH * D, qkvd = qd + 2 * kvd;
  // Scratch kept between calls (grow-only): fresh multi-megabyte buffers every step cost page faults.
  thread_local std::vector<float> h, t, qkv, q, att, gu, act;
  h.resize(size_t(M) * hid); t.resize(size_t(M) * hid); qkv.resize(size_t(M) * qkvd); q.resize(size_t(M) * qd);
  att.resize(size_t(M) * qd); gu.resize(size_t(M) * 2 * md.inter); act.resize(size_t(M) * md.inter);
  float *const hp = h.data(), *const tp = t.data(), *const qkvp = qkv.data(), *const qp = q.data();
  float *const gup = gu.data(), *const actp = act.data();
  // f(m) for every row m, rows in parallel (chunks of ~16K values of `width`-wide rows)
  auto each_row = [&](int width, auto&& f) {
    parallel_for(M, nthreads, std::max(1, (1 << 14) / width), [&](int64_t m0, int64_t m1) {
      for (int m = int(m0); m < m1; ++m) f(m);
    });
  };
  // x += (norm ? rms_norm(t) : t), the residual add of a block's output t; then h = rms_norm(x) * next_norm
  auto residual_norm = [&](const float* norm, const float* next_norm) {
    each_row(hid, [&](int m) {
      float *xm = x + int64_t(m) * hid, *tm = tp + int64_t(m) * hid;
      if (norm) rms_norm(tm, norm, tm, 1, hid, md.eps);
      for (int i = 0; i < hid; ++i) xm[i] += tm[i];
      rms_norm(xm, next_norm, hp + int64_t(m) * hid, 1, hid, md.eps);
    });
  };
  each_row(hid, [&](int m) { rms_norm(x + int64_t(m) * hid, md.layers[0].input_norm, hp + int64_t(m) * hid, 1, hid,
                                      md.eps); });
  for (int li = 0; li < md.num_layers; ++li) {
    const Layer& L = md.layers[li];
    const Group& gr = groups[L.group];
    const int64_t* slots = gr.slots;
    const float *cs = cos[L.rope], *sn = sin[L.rope];
    int rc = linear(L.qkv, hp, qkvp, M, nthreads);
    if (rc) return rc;
    // Per token: the q/k/v bias, QK-norm, RoPE, its K/V into the cache, its q heads into q.
    each_row(qkvd, [&](int m) {
      float* row = qkvp + int64_t(m) * qkvd;
      if (L.qkv_bias)
        for (int i = 0; i < qkvd; ++i) row[i] += L.qkv_bias[i];
      if (L.q_norm && L.qk_norm_whole) {
        rms_norm(row, L.q_norm, row, 1, qd, md.eps);
        rms_norm(row + qd, L.k_norm, row + qd, 1, md.KVH * D, md.eps);
      } else if (L.q_norm) {
        rms_norm(row, L.q_norm, row, md.H, D, md.eps);
        rms_norm(row + qd, L.k_norm, row + qd, md.KVH, D, md.eps);
      }
      if (L.clip_qkv > 0.f)
        for (int i = 0; i < qkvd; ++i) row[i] = std::min(std::max(row[i], -L.clip_qkv), L.clip_qkv);
      // An fp32 cache takes the rotated K/V as they are; bf16, fp16 and int8 ones are written here.
      const bool f32 = md.kv_kind == KV_F32;
      rope_write_kv(row, cs + int64_t(m) * (D / 2), sn + int64_t(m) * (D / 2), 1, md.H, md.KVH, D, slots + m,
                    f32 ? static_cast<float*>(L.k_cache) : nullptr, f32 ? static_cast<float*>(L.v_cache) : nullptr,
                    1);
      if (md.kv_kind == KV_BF16) {
        uint16_t* kd = static_cast<uint16_t*>(L.k_cache) + slots[m] * kvd;
        uint16_t* vd = static_cast<uint16_t*>(L.v_cache) + slots[m] * kvd;
        for (int i = 0; i < kvd; ++i) { from_f(row[qd + i], kd + i); from_f(row[qd + kvd + i], vd + i); }
      } else if (md.kv_kind == KV_F16) {
        store_half(row + qd, static_cast<uint16_t*>(L.k_cache) + slots[m] * kvd, kvd);
        store_half(row + qd + kvd, static_cast<uint16_t*>(L.v_cache) + slots[m] * kvd, kvd);
      } else if (md.kv_kind == KV_INT8) {
        const int64_t entry_row = int64_t(md.KVH) * (D + KV_SCALE_BYTES);
        write_int8_entries(row + qd, md.KVH, D, static_cast<int8_t*>(L.k_cache) + slots[m] * entry_row);
        write_int8_entries(row + qd + kvd, md.KVH, D, static_cast<int8_t*>(L.v_cache) + slots[m] * entry_row);
      }
      std::memcpy(qp + int64_t(m) * qd, row, sizeof(float) * qd);
    });
    Args a = args[L.group];
    a.window = L.window > 0 ? L.window : 0;
    if (out_qsl != nullptr && li + 1 == md.num_layers) {
      // Only the rows the caller reads (a prefill's last token per sequence) need the rest of the last layer.
      M = keep_out_rows(x, qp, hid, qd, a.qsl, out_qsl, num_seqs);
      a.qsl = out_qsl;
      if (M == 0) return 0;
    }
    rc = dispatch<float>(qp, L.k_cache, L.v_cache, att.data(), a, num_seqs, nthreads);
    if (rc) return rc;
    if ((rc = linear(L.o, att.data(), tp, M, nthreads))) return rc;
    residual_norm(L.attn_out_norm, L.post_norm);
    if (L.router) {
      if ((rc = moe_mlp(L, hid, md.act, hp, tp, M, nthreads))) return rc;
    } else {
      if ((rc = linear(L.gate_up, hp, gup, M, nthreads))) return rc;
      each_row(md.inter, [&](int m) {
        const float* g = gup + int64_t(m) * 2 * md.inter;
        float* out = actp + int64_t(m) * md.inter;
        if (md.act == ACT_GELU_TANH) gelu_tanh_mul(g, g + md.inter, out, md.inter);
        else silu_mul(g, g + md.inter, out, md.inter);
      });
      if ((rc = linear(L.down, actp, tp, M, nthreads))) return rc;
    }
    const bool last = li + 1 == md.num_layers;
    residual_norm(L.mlp_out_norm, last ? md.final_norm : md.layers[li + 1].input_norm);
  }
  std::memcpy(x, hp, sizeof(float) * size_t(M) * hid);
  return 0;
}

}  // namespace

extern "C" {

// x: [M, hidden] fp32, the residual stream, run in place through all layers and the final norm. K/V are written
// to (and attention reads) fp32, bf16 or fp16 (rounded to nearest even, as torch's .to(); fp16 saturating at
// +-65504, as kvcache/quant.py clamps) or int8 caches
// (quantized per token and head as kvcache/quant.py does).
// cos[r], sin[r]: rotary table r, [M, D/2]; groups[g]: KV cache group g's batch layout (slots [M] int64, block
// tables etc. as in pagedlm_paged_attention). out_qsl (null: every row): [num_seqs + 1] offsets of the rows wanted
// out, each sequence's last out_qsl[i + 1] - out_qsl[i] query tokens: every row's K/V is written, but the last
// layer's attention, MLP and the final norm run over those rows only, left in x[0, out_qsl[num_seqs]) (the rest
// of x is scratch). Every group's batch and slots are validated before anything is computed or written. Returns 0,
// a PagedlmStatus, or the first failing linear kernel's (positive) code.
int pagedlm_llama_decode(const Model* model, float* x, int M, const float* const* cos, const float* const* sin,
                         const Group* groups, int num_groups, int num_seqs, const int32_t* out_qsl, int nthreads) {
  const Model& md = *model;
  const int D = md.D;
  if (md.kv_kind != KV_F32 && md.kv_kind != KV_BF16 && md.kv_kind != KV_F16 && md.kv_kind != KV_INT8)
    return PAGEDLM_UNSUPPORTED;
  for (int li = 0; li < md.num_layers; ++li)
    if (md.layers[li].group < 0 || md.layers[li].group >= num_groups) return PAGEDLM_UNSUPPORTED;
  thread_local std::vector<Args> args;  // kept between calls, as the scratch below
  args.clear();
  for (int g = 0; g < num_groups; ++g) {
    const Group& gr = groups[g];
    Args a{md.H, md.KVH, D, md.BS, gr.max_blocks, 0, 1, md.kv_kind, md.scale, gr.block_tables, gr.seq_lens,
           gr.query_start_loc};
    if (int rc = check_batch(a, num_seqs, M, md.num_blocks)) return rc;
    if (int rc = check_slots(gr.slots, M, int64_t(md.num_blocks) * md.BS)) return rc;
    args.push_back(a);
  }
  if (out_qsl != nullptr) {  // each sequence keeps a suffix of its query tokens, the same in every group
    if (out_qsl[0] != 0) return PAGEDLM_BAD_BATCH;
    for (int i = 0; i < num_seqs; ++i) {
      const int n = out_qsl[i + 1] - out_qsl[i];
      if (n < 0 || n > args[0].qsl[i + 1] - args[0].qsl[i]) return PAGEDLM_BAD_BATCH;
    }
    for (int g = 1; g < num_groups; ++g)
      if (!std::equal(args[0].qsl, args[0].qsl + num_seqs + 1, args[g].qsl)) return PAGEDLM_BAD_BATCH;
  }
  if (nthreads < 1) nthreads = default_threads();
  int rc = 0;
  with_team(nthreads, [&] {
    rc = decode_layers(md, x, M, cos, sin, groups, args.data(), num_seqs, out_qsl, nthreads);
  });
  return rc;
}

// One token through k experts of a mixture-of-experts MLP: out[N] = sum over j of weights[j] *
// down[j](act(gate) * up), (gate, up) = gate_up[j](x) (each [2 * inter] outputs: the gate's, then the up's), added
// in the order given, each expert's output multiplied by its weight first (as model/moe.py sums them). The layers
// are any the stack reads (`Linear`), with K and N as their shapes say. Returns 0 or the first failing kernel's code.
int pagedlm_moe_experts(const Linear* gate_up, const Linear* down, const float* weights, int k, const float* x,
                        float* out, int act, int nthreads) {
  if (k < 1) return PAGEDLM_BAD_BATCH;
  const int inter = down[0].K, N = down[0].N;
  for (int j = 0; j < k; ++j)
    if (gate_up[j].N != 2 * inter || down[j].K != inter || down[j].N != N || gate_up[j].K != gate_up[0].K)
      return PAGEDLM_BAD_BATCH;
  thread_local std::vector<float> o;
  thread_local std::vector<int> in_order;
  std::fill(out, out + N, 0.f);
  if (nthreads < 1) nthreads = default_threads();
  const bool split = nthreads > 1 && k % nthreads == 0;  // each expert on one thread (experts_one_token)
  o.resize(size_t(split ? k : 1) * N);
  int rc = 0;
  with_team(nthreads, [&] {
    if (split) {
      in_order.resize(k);
      std::iota(in_order.begin(), in_order.end(), 0);
      if ((rc = experts_one_token(gate_up, down, in_order.data(), k, act, x, o.data(), N, nthreads)) == 0)
        for (int j = 0; j < k; ++j) add_weighted(out, o.data() + size_t(j) * N, weights[j], N);
      return;
    }
    for (int j = 0; j < k && rc == 0; ++j)
      if ((rc = expert_rows(gate_up[j], down[j], act, x, o.data(), 1, nthreads)) == 0)
        add_weighted(out, o.data(), weights[j], N);  // as torch's mul_ then +=
  });
  return rc;
}

int64_t pagedlm_moe_split_tokens() { return split_tokens.load(); }

}  // extern "C"
