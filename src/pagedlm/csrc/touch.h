// touch_lines: loads every 64-byte line of [p, p + bytes) and drops the values, so that the lines are in L1 when
// the next piece of work reads them. Real loads, issued back to back, are kept in flight together; software
// prefetches of the same scattered or cold lines were measured not to keep up (on a 2-core Zen 5 they wait for
// the core's few miss buffers and stall the loop). Shared by the attention and quantized-linear kernels, which
// call it for the next tile of K/V or weights while the current one runs.
#pragma once
#include <cstdint>
#if defined(__AVX2__)
#include "simd.h"
#endif

namespace pagedlm_touch {

// Two spans of the same length, their lines loaded in turn (K and V rows: measured faster than one span after the
// other). Each load is of a whole aligned line that holds a byte of its span, so it never reaches into another page.
inline void touch_lines(const void* p, const void* q, int64_t bytes) {
  if (bytes <= 0) return;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63), a1 = reinterpret_cast<uintptr_t>(p) + bytes;
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(q) & ~uintptr_t(63), b1 = reinterpret_cast<uintptr_t>(q) + bytes;
  auto line = [](uintptr_t a) { return reinterpret_cast<const void*>(a); };
#if defined(__AVX512F__)
  __m512i sink = _mm512_setzero_si512();
  uintptr_t a = a0, b = b0;
  for (; a < a1 && b < b1; a += 64, b += 64)
    sink = _mm512_ternarylogic_epi32(sink, _mm512_load_si512(line(a)), _mm512_load_si512(line(b)), 0xfe);
  for (; a < a1; a += 64) sink = _mm512_or_si512(sink, _mm512_load_si512(line(a)));
  for (; b < b1; b += 64) sink = _mm512_or_si512(sink, _mm512_load_si512(line(b)));
#ifdef PAGEDLM_EMULATED_AVX512
  volatile int sunk = _mm512_reduce_add_epi32(sink);
  (void)sunk;
#else
  asm volatile("" : : "v"(sink));
#endif
#elif defined(__AVX2__)
  __m256i sink = _mm256_setzero_si256();
  uintptr_t a = a0, b = b0;
  for (; a < a1 && b < b1; a += 64, b += 64)
    sink = _mm256_or_si256(sink, _mm256_or_si256(_mm256_load_si256(static_cast<const __m256i*>(line(a))),
                                                 _mm256_load_si256(static_cast<const __m256i*>(line(b)))));
  for (; a < a1; a += 64) sink = _mm256_or_si256(sink, _mm256_load_si256(static_cast<const __m256i*>(line(a))));
  for (; b < b1; b += 64) sink = _mm256_or_si256(sink, _mm256_load_si256(static_cast<const __m256i*>(line(b))));
  asm volatile("" : : "x"(sink));
#else
  unsigned char sink = 0;
  for (uintptr_t a = a0; a < a1; a += 64) sink |= *static_cast<const volatile unsigned char*>(line(a));
  for (uintptr_t b = b0; b < b1; b += 64) sink |= *static_cast<const volatile unsigned char*>(line(b));
  asm volatile("" : : "r"(sink));
#endif
}

// One span: its two halves in turn.
inline void touch_lines(const void* p, int64_t bytes) {
  const int64_t half = bytes / 2;
  touch_lines(p, static_cast<const char*>(p) + half, bytes - half);
}

}  // namespace pagedlm_touch
