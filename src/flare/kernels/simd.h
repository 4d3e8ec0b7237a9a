// AVX2/FMA helpers shared by Flare's kernel sources (qgemm.cpp, fused.cpp, attention.cpp),
// and the float vector types of the AVX-512 builds.
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

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 vectors -> one vector of their 8 horizontal sums. Lane i is
// ((a[i]_0 + a[i]_1) + (a[i]_2 + a[i]_3)) + ((a[i]_4 + a[i]_5) + (a[i]_6 + a[i]_7)) for
// every i: the same tree whichever vectors sit beside a[i] (attention.cpp relies on it).
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                       _mm256_permute2f128_ps(t0, t1, 0x31));
}

#ifdef __AVX512F__
// Two hsum8x8 at once: the 256-bit halves of a[0..8) are two sets of 8 vectors, and each
// half of the result is hsum8x8 of its set, by the same tree (each hadd_ps as the two
// shuffles and the add it is made of, the last step's 128-bit lane moves as shuffle_f32x4),
// so the same bits, in half the instructions of two ymm calls and their extracts.
inline __m512 hadd_x2(__m512 a, __m512 b) {  // _mm256_hadd_ps in each 256-bit half
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 hsum8x8_x2(const __m512* a) {
  const __m512 t0 = hadd_x2(hadd_x2(a[0], a[1]), hadd_x2(a[2], a[3]));
  const __m512 t1 = hadd_x2(hadd_x2(a[4], a[5]), hadd_x2(a[6], a[7]));
  // 128-bit lanes t0 = [A0 A1 A2 A3], t1 = [B0 B1 B2 B3] (A0 A1 the first half's): the
  // sums [A0+A1, A2+A3, B0+B1, B2+B3], then put in order [A0+A1, B0+B1, A2+A3, B2+B3]
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0));
}
#endif

// Float vectors for kernels whose lanes are independent chains (each output element its
// own FMA chain), so the vector width changes how many run at once, never a result:
// F8 (ymm, every variant) and F16 (zmm, AVX-512 builds only).
struct F8 {
  using F = __m256;
  static constexpr int lanes = 8;
  static constexpr int registers = 16;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  // 8 float16 values (IEEE binary16 bits) widened to float32: exact (F16C)
  static F load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F round_nearest(F a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // a * 2^h * 2^(n - h), h = n >> 1, for integral n in [-126, 128] (two factors, so
  // neither overflows the exponent field)
  static F scale_pow2(F a, F n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i h = _mm256_srai_epi32(ni, 1);
    const __m256 s1 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(a, s1), s2);
  }
};

#ifdef __AVX512F__
struct F16 {
  using F = __m512;
  static constexpr int lanes = 16;
  static constexpr int registers = 32;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) {  // 16 float16 values widened to float32: exact
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F round_nearest(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F scale_pow2(F a, F n) {  // as F8's, lane for lane
    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i h = _mm512_srai_epi32(ni, 1);
    const __m512 s1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(h, _mm512_set1_epi32(127)), 23));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_sub_epi32(ni, h), _mm512_set1_epi32(127)), 23));
    return _mm512_mul_ps(_mm512_mul_ps(a, s1), s2);
  }
};
using FWide = F16;  // the widest float vector this build has
#else
using FWide = F8;
#endif

// exp(x) a lane, x clamped to [-87.3, 88.7]: x = n ln2 + r, |r| <= ln2/2, exp(r) by a
// degree-6 polynomial (Cephes' expf coefficients), times 2^n built in the exponent bits.
// Every width runs the same instructions lane for lane, so exp16's lanes equal exp8's bit
// for bit.
template <typename V>
inline typename V::F exp_lanes(typename V::F x) {
  x = V::min(V::max(x, V::set1(-87.3f)), V::set1(88.7f));
  const typename V::F n = V::round_nearest(V::mul(x, V::set1(1.44269504088896341f)));
  typename V::F r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  typename V::F p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
  return V::scale_pow2(p, n);
}

inline __m256 exp8(__m256 x) { return exp_lanes<F8>(x); }
#ifdef __AVX512F__
inline __m512 exp16(__m512 x) { return exp_lanes<F16>(x); }
#endif

// exp of one float, by exp8's arithmetic
inline float exp1(float x) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, exp8(_mm256_set1_ps(x)));
  return buf[0];
}

}  // namespace flare_simd
