// AVX2/FMA helpers shared by Flare's kernel sources (qgemm.cpp, fused.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace flare_simd {

// Sum of the 8 float lanes of v.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i a[i] * b[i] over n floats: 8 lanes with FMA, then a scalar tail.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace flare_simd
