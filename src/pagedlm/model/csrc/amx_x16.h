// AMX (TMUL) forms of the x16 kernels for products of several rows: int4 x16 (F16Scales: int4 and GGUF Q4_0 / Q4_1;
// KScales: Q4_K), int8 x16 and GGUF Q8_0. Compiled where the compiler targets AMX-INT8 (-march=native on a Sapphire
// Rapids or later), used where the kernel grants this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once)
// and pagedlm_amx_enable has not turned it off; everything else runs the AVX-512 VNNI code.
//
// The x16 layouts are already AMX B tiles: a tile's 32-value block holds, per 64-byte row r, inputs 4r .. 4r + 3 of
// its 16 outputs (int8 x16 and Q8_0 as stored; int4 once its nibbles are unpacked: low nibbles of chunk c are row c,
// high ones row 4 + c). The activations, quantized per 32-value block as for the VNNI kernels but packed per group
// of 16 rows (ActLayout kPack16), are A tiles of 16 rows x 32 bytes. Per block and group one TDPBSSD gives the block's
// exact integer dot products (codes as signed bytes: 0..15, or -128..127), stored to L1, and then the VNNI kernels'
// own fp32 operations run on them in their order (int4x16_rows, int8x16_rows, the AVX2 Q8_0 rows, lane for lane): so
// every row's result is bit-identical to the VNNI kernels', whatever the rows batched with it.
#pragma once

#if defined(PAGEDLM_AVX512_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    !defined(PAGEDLM_EMULATED_AVX512)
#define PAGEDLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>

namespace {

std::atomic<int> amx_enabled{1};
std::atomic<int64_t> amx_products{0};  // products that ran on AMX tiles (tests see the path taken)
// Fewer rows run the VNNI code (the same results). Measured on a Sapphire Rapids core (2048 x 5632, one thread): int4
// even with VNNI at 16-32 rows, 1.25x at 64, 1.3x at 128 (its scaling costs twice int8's, and the tile work and the
// scaling did not overlap); int8 1.05x at 8 rows, 2x at 16, 1.4x at 64.
constexpr int AMX_MIN_ROWS_INT4 = 48, AMX_MIN_ROWS_INT8 = 8;

#ifdef PAGEDLM_AMX
// Whether this process may use the tile registers: asked of the kernel once (Linux 5.16+), false if it refuses.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Whether a product of `rows` rows over `bits`-bit codes (4: int4 x16, 8: int8 x16 and Q8_0) runs on AMX tiles.
inline bool amx_use(int rows, int bits) {
  const int mode = amx_enabled.load(std::memory_order_relaxed);  // 2: every row count (tests)
  return mode && (mode == 2 || rows >= (bits == 4 ? AMX_MIN_ROWS_INT4 : AMX_MIN_ROWS_INT8)) && amx_permitted();
}

// Tiles 0, 1: A (16 rows of 32 activation bytes: a block of a group of 16 rows, ActLayout kPack16); 2, 3: B (8 rows
// of 64 weight bytes); 4, 5: C (16 rows of 16 int32). Two sets (0, 2, 4 and 1, 3, 5), so that one block's product
// runs while the previous block's results are scaled.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {32, 32, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 8, 8, 16, 16};
};

// Loads the tile configuration on this thread for the scope's products and releases the tiles after them (so a
// context switch saves no tile data and other code on the thread sees none in use).
struct AmxScope {
  AmxScope() {
    static const AmxConfig cfg;
    _tile_loadconfig(&cfg);
  }
  ~AmxScope() { _tile_release(); }
};

// Starts the product of A tile xa with B tile wb in set SET (tile numbers are literals: gcc's tile intrinsics paste
// them into the instruction).
template <int SET>
inline void amx_issue(const int8_t* xa, const void* wb) {
  if constexpr (SET == 0) {
    _tile_loadd(2, wb, 64);
    _tile_loadd(0, xa, 32);
    _tile_zero(4);
    _tile_dpbssd(4, 0, 2);
  } else {
    _tile_loadd(3, wb, 64);
    _tile_loadd(1, xa, 32);
    _tile_zero(5);
    _tile_dpbssd(5, 1, 3);
  }
}

template <int SET>
inline void amx_store(int32_t* c) {
  if constexpr (SET == 0) _tile_stored(4, c, 64);
  else _tile_stored(5, c, 64);
}

// The tile side of a row group's pass over its blocks (kPack16 activations xg: block b's A tile at xg + 512 b; B
// tiles wb(b)). A tile store reaches L1 only once it retires, so scaling what was just stored would wait for it at
// every block: block b's products are stored a block before they are scaled (in c[b % 3]), and block b + 2's are
// issued meanwhile. The caller's loop, for b = 0 .. nblk: next(b), then scales block b - 1 (b > 0).
template <class W>
struct AmxPass {
  const int8_t* xg;
  int nblk;
  W wb;
  alignas(64) int32_t c[3][16 * 16];

  AmxPass(const int8_t* x, int n, W w) : xg(x), nblk(n), wb(w) {
    amx_issue<0>(xg, wb(0));
    if (nblk > 1) amx_issue<1>(xg + 512, wb(1));
  }
  void next(int b) {
    if (b >= nblk) return;
    if (b & 1) {
      amx_store<1>(c[b % 3]);
      if (b + 2 < nblk) amx_issue<1>(xg + int64_t(b + 2) * 512, wb(b + 2));
    } else {
      amx_store<0>(c[b % 3]);
      if (b + 2 < nblk) amx_issue<0>(xg + int64_t(b + 2) * 512, wb(b + 2));
    }
  }
  const int32_t* dots(int b) const { return c[b % 3]; }
};

// Tile t's int4 codes unpacked to the B tiles of its blocks, out [nblk, 8, 64].
inline void amx_unpack_int4(const uint8_t* qt, int nblk, int8_t* out) {
  const __m512i lo = _mm512_set1_epi8(0x0f);
  for (int b = 0; b < nblk; ++b) {
    const uint8_t* wb = qt + int64_t(b) * X16_BLOCK;
    prefetch_lines(wb + PF_BYTES, X16_BLOCK);
    int8_t* o = out + int64_t(b) * 512;
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wb + 64 * c);
      _mm512_storeu_si512(o + 64 * c, _mm512_and_si512(v, lo));
      _mm512_storeu_si512(o + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), lo));
    }
  }
}

// Rows m0 .. m0 + R (m0 a multiple of 16, activations kPack16) of x against int4 tile n0 / 16 (B tiles wt, see
// amx_unpack_int4): int4x16_rows' fp32 operations on the same integer dot products.
template <int R, class S, class W>
void int4x16_amx_rows(const int8_t* xq, const float* d, const float* gsum, const int32_t* bsum, W wb, const S& sc,
                      float* y, int K, int N, int n0, int m0) {
  const int nblk = K / 32, bpg = sc.bpg, ngroups = nblk / bpg;
  const float *dg = d + int64_t(m0) * nblk, *gg = gsum + int64_t(m0) * ngroups;
  const int32_t* bg = S::offset8 ? bsum + int64_t(m0) * nblk : nullptr;
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  __m512 s = _mm512_setzero_ps(), mn = s;
  AmxPass<W> pass(xq + int64_t(m0) * K, nblk, wb);
  for (int b = 0, g = 0, in_group = 0; b <= nblk; ++b) {
    pass.next(b);
    if (b == 0) continue;
    const int bb = b - 1;  // the block scaled now
    if (in_group == 0) sc.load16(g, s, mn);
    const bool group_end = ++in_group == bpg;
    const int32_t* c = pass.dots(bb);
    const float *db = dg + int64_t(bb) * 16, *gb = gg + int64_t(g) * 16;
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 cs = _mm512_mul_ps(s, _mm512_set1_ps(db[i]));
      __m512i dot = _mm512_load_si512(c + 16 * i);
      if constexpr (S::offset8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * bg[int64_t(bb) * 16 + i]));
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), cs, f[i]);
      if (!S::offset8 && group_end) f[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(gb[i]), f[i]);
    }
    if (group_end) in_group = 0, ++g;
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + int64_t(m0 + i) * N + n0, f[i]);
}

// Calls rows(integral_constant<int, R>, m0) for rows m0 .. m0 + R of M in groups of 16.
template <class F>
inline void for_amx_groups(int M, F rows) {
  for (int m0 = 0; m0 < M; m0 += 16) {
    auto run = [&](auto r) { rows(r, m0); };
    switch (std::min(16, M - m0)) {
#define PAGEDLM_AMX_ROWS(r) case r: run(std::integral_constant<int, r>{}); break;
      PAGEDLM_AMX_ROWS(16) PAGEDLM_AMX_ROWS(15) PAGEDLM_AMX_ROWS(14) PAGEDLM_AMX_ROWS(13) PAGEDLM_AMX_ROWS(12)
      PAGEDLM_AMX_ROWS(11) PAGEDLM_AMX_ROWS(10) PAGEDLM_AMX_ROWS(9) PAGEDLM_AMX_ROWS(8) PAGEDLM_AMX_ROWS(7)
      PAGEDLM_AMX_ROWS(6) PAGEDLM_AMX_ROWS(5) PAGEDLM_AMX_ROWS(4) PAGEDLM_AMX_ROWS(3) PAGEDLM_AMX_ROWS(2)
#undef PAGEDLM_AMX_ROWS
      default: run(std::integral_constant<int, 1>{}); break;
    }
  }
}

// The int4 x16 product for tiles t0 .. t1, every row of x (M rows, activations kPack16): each tile unpacked once
// into a buffer of this thread (K * 16 bytes, in L1 / L2) that every group of rows then reads.
template <class S>
void int4x16_amx_tiles(const int8_t* xq, const float* d, const float* gsum, const int32_t* bsum, const uint8_t* q,
                       const S& scales, float* y, int M, int K, int N, int t0, int t1) {
  const int nblk = K / 32;
  thread_local std::vector<int8_t> buf;
  buf.resize(size_t(nblk) * 512);
  int8_t* const wt = buf.data();
  auto wb = [wt](int b) { return wt + int64_t(b) * 512; };
  AmxScope tiles;
  for (int t = t0; t < t1; ++t) {
    amx_unpack_int4(q + int64_t(t) * nblk * X16_BLOCK, nblk, wt);
    const S sc = scales.tile(t);
    for_amx_groups(M, [&](auto r, int m0) {
      int4x16_amx_rows<decltype(r)::value>(xq, d, gsum, bsum, wb, sc, y, K, N, t * X16, m0);
    });
  }
}

// Rows m0 .. m0 + R of x against an int8 x16 tile (B tiles as stored, wt): int8x16_rows' fp32 operations
// (f = fma(dot, d_x, f), y = f * s) or, for GGUF Q8_0 (q8_0_scales: the tile's fp16 scales [nblk, 16]), the Q8_0
// rows' (f = fma(dot, d_b * d_x, f)).
template <int R>
void int8x16_amx_rows(const int8_t* xq, const float* d, const int8_t* wt, const float* s, const uint16_t* q8_0_scales,
                      float* y, int K, int N, int n0, int m0) {
  const int nblk = K / 32;
  const float* dg = d + int64_t(m0) * nblk;
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  auto wb = [&](int b) {
    const int8_t* p = wt + int64_t(b) * X16_BLOCK8;
    if (m0 == 0) prefetch_lines(p + PF_BYTES, X16_BLOCK8);
    return p;
  };
  AmxPass<decltype(wb)> pass(xq + int64_t(m0) * K, nblk, wb);
  for (int b = 0; b <= nblk; ++b) {
    pass.next(b);
    if (b == 0) continue;
    const int32_t* c = pass.dots(b - 1);
    const float* db = dg + int64_t(b - 1) * 16;
    if (q8_0_scales) {
      const __m512 sb =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8_0_scales + (b - 1) * 16)));
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i)),
                               _mm512_mul_ps(sb, _mm512_set1_ps(db[i])), f[i]);
    } else {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i)), _mm512_set1_ps(db[i]), f[i]);
    }
  }
  const __m512 sv = q8_0_scales ? _mm512_setzero_ps() : _mm512_loadu_ps(s + n0);
  for (int i = 0; i < R; ++i)
    _mm512_storeu_ps(y + int64_t(m0 + i) * N + n0, q8_0_scales ? f[i] : _mm512_mul_ps(f[i], sv));
}

// The int8 x16 (s: per-row scales) or GGUF Q8_0 (q8_0_scales: fp16 scales [N/16, nblk, 16]) product for tiles
// t0 .. t1, every row of x (activations kPack16).
void int8x16_amx_tiles(const int8_t* xq, const float* d, const int8_t* q, const float* s, const uint16_t* q8_0_scales,
                       float* y, int M, int K, int N, int t0, int t1) {
  const int nblk = K / 32;
  AmxScope tiles;
  for (int t = t0; t < t1; ++t) {
    const int8_t* wt = q + int64_t(t) * nblk * X16_BLOCK8;
    const uint16_t* st = q8_0_scales ? q8_0_scales + int64_t(t) * nblk * 16 : nullptr;
    for_amx_groups(M, [&](auto r, int m0) {
      int8x16_amx_rows<decltype(r)::value>(xq, d, wt, s, st, y, K, N, t * X16, m0);
    });
  }
}
#else
inline bool amx_use(int, int) { return false; }
#endif

}  // namespace
