// Attention over a paged KV cache (CPU, AVX2/FMA): ONE routine for every query row, decode
// token or prefill row alike, so a row's output never depends on how its prompt was
// chunked, where a reuse started, or which rows ran beside it.
//
// The cache holds float32 or float16 (the plan's kv_dtype; q and o are float32). A float16
// K or V element is widened to float32 as it is loaded (F16C, exact) and everything after
// runs in float32, so a float16 cache gives bit for bit what the float32 routine gives on
// the same cache widened: half the bytes a decode step streams, the same arithmetic.
//
//   cached_attention(q [T, H, D], k_cache [S, KVH, D], v_cache [S, KVH, D],
//                    gather int64 [B, M], lengths int64 [B], rows_per_seq R, scale)
//       -> o [T, H, D], T = B * R
//     Sequence b owns query rows q[b*R : (b+1)*R]; its keys are the cache rows
//     gather[b, 0 .. lengths[b]) (positions 0..lengths[b]-1). Row r of it is the token at
//     position lengths[b] - R + r and attends to positions 0 .. lengths[b] - R + r
//     (causal). Decode is R = 1 (one token per sequence, B sequences); a prefill chunk
//     is B = 1, R = the chunk's length. Query head h reads KV head h / (H / KVH) (GQA).
//   decode_attention(q [H, D] or [1, H, D], k_cache, v_cache, start, length, scale,
//                    out = None) -> o (q's shape)
//     one decode token over the consecutive slots [start, start + length); `out`, when
//     given, is o written in place (layers.cpp's step reuses its buffers)
//   decode_attention_gather(q [B, H, D], k_cache, v_cache, gather [B, M], lengths [B],
//                           scale, out = None) -> o [B, H, D]
//     cached_attention with R = 1 (which takes an `out` too)
//
// The arithmetic of one row (query q, n keys), the invariant every path keeps:
//   s_j = tree_sum(lanes of the 8-lane FMA chain q[i..i+8) * k_j[i..i+8) over i) * scale
//         (D a multiple of 8; simd.h's hsum8x8 tree, the same whichever (row, key) pairs
//         share its call), else a scalar chain over i;
//   m = max_j s_j;  e_j = exp8(s_j - m);  z = tree_sum(8 lanes, lane l summing e_j for
//   j = l mod 8 in order of j);
//   o[d] = (the FMA chain e_0 v_0[d], e_1 v_1[d], ... in order of j, from 0) * (1 / z).
// Nothing in it depends on which other rows share a tile, how the keys are blocked, or
// how work is split over threads; tiles only share loads: many query rows of one KV head
// (several positions x the heads of a GQA group) read each block of KEY_BLOCK keys once
// while it is in L1. Partial sums are stored to memory between key blocks, which is
// exact. A NaN or infinite score makes the row NaN, as SDPA does.
//
// The AVX-512 build (kernel variant avx512vnni) runs the same arithmetic in zmm registers:
// scores_4x8 holds two query rows' 8-lane chains in one register (scores_3x8 a third row's
// in a ymm beside them, for a GQA group of 3 at one position), and the PV tiles cover 16
// lanes of D a register; the score reduction runs two hsum8x8 trees at once
// (hsum8x8_x2, one per 256-bit half) and the softmax takes its max and exp8 over 16 scores
// a register (exp16, the same instructions per lane), adding both halves into the 8-lane
// sum in order of j. A tile of many rows (a prefill chunk's) puts 16 query rows in the
// lanes of a register instead (attend_tile_lanes), so the hsum8x8 tree becomes vertical
// adds. Every chain and tree is the one above, so its results equal the avx2 build's bit
// for bit (the kernel probe and test_kernel_variants compare them).
//
// Compiled with -ffp-contract=off (kernels/__init__.py), so no compiler-chosen FMA
// changes one path's rounding and not another's.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"
#include "ops.h"
#include "checks.h"
#include "team.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using flare_checks::check_f32;
using flare_checks::check_kv_caches;

using flare_simd::exp8;
using flare_simd::hsum;
using flare_simd::hsum8x8;

constexpr int64_t KEY_BLOCK = 64;  // keys per block: 64 x D=64 floats of K or V = 16 KB
constexpr int MAX_TILE_ROWS = 48;  // query rows sharing each key block
// A float16 tile of at most this many rows (a decode position's query heads, GQA groups
// up to 4) reads K and V as float16 in its passes, widening each vector as it loads it
// (F16C, exact: the same floats as widen_rows gives); more rows share one widened copy
// of each key block. Widening for 3 rows cost a store and a reload a value for 3 uses:
// on a Zen 4 EPYC (2 threads, float16 cache) decode attention over 2,048 keys ran
// 1.3-1.4x faster without it, 8 streams and 1 alike (bench/bench_attention.py).
constexpr int DIRECT_MAX_ROWS = 4;
// Keys ahead whose K (scores) or V (PV) row is prefetched, into L2. The pool hands pages
// out in any order, and the hardware prefetcher stops at each 4 KB page (five key rows of
// one head at KVH = 3, D = 64), so without it a long context streamed K/V at about 8 GB/s.
// Into L1 (_MM_HINT_T0) each prefetch holds one of the core's few L1 miss buffers until
// its line arrives, which capped a decode step's K/V reads at about 13 GB/s on 2 threads
// whatever the distance (16, 48, 64 or 160 keys: the same); into L2 (_MM_HINT_T1), 64
// keys ahead (one key block), a Zen 4 EPYC decoding 8 streams at 2,048 cached tokens read
// twice as fast (widening alone: 0.98 -> 0.50 ms a layer; the whole call 1.3-1.7x, 1
// stream 1.5-1.7x; 128 keys ahead was slower). The loads then hit L2, not memory.
constexpr int64_t PREFETCH_KEYS = 64;
// (query row, key) pairs worth a thread handoff: one sequence's decode (9 query heads)
// goes parallel from 57 keys on. At 4,096 it stayed on one thread up to 455 keys, and a
// Zen 5 EPYC (2 threads) decoded 7% slower at 300 keys (4.26 against 3.95 ms a step);
// at 32 keys the two tied.
constexpr int64_t PARALLEL_MIN_WORK = 512;

// A tile: up to MAX_TILE_ROWS query rows over one KV head's keys, row r attending keys
// [0, n[r]). `p` holds each row's scores, then probabilities (stride `pstride`).
struct Tile {
  int rows = 0;
  const float* q[MAX_TILE_ROWS];
  float* o[MAX_TILE_ROWS];
  int64_t n[MAX_TILE_ROWS];
};

// One key's row of one head (D elements from `row`) on its way into L2 (PREFETCH_KEYS says
// why not L1); no value changes.
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  constexpr int64_t per_line = 64 / sizeof(T);
  for (int64_t i = 0; i < D; i += per_line)
    _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(row + D - 1), _MM_HINT_T1);  // an unaligned tail
}

// a stored K/V element as float32 (float16 widened exactly)
inline float kv_value(float x) { return x; }
inline float kv_value(uint16_t x) { return _cvtsh_ss(x); }

// scores of rows a, b (b may equal a) for the 4 keys at slots ks[0..3] into pa, pb
template <typename T>
inline void scores_2x4(const float* qa, const float* qb, const T* const* ks, int64_t D,
                       __m256 scv, float* pa, float* pb) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 x = _mm256_loadu_ps(qa + i), y = _mm256_loadu_ps(qb + i);
    for (int c = 0; c < 4; ++c) {
      const __m256 kv = flare_simd::F8::load(ks[c] + i);
      acc[c] = _mm256_fmadd_ps(x, kv, acc[c]);
      acc[4 + c] = _mm256_fmadd_ps(y, kv, acc[4 + c]);
    }
  }
  const __m256 s = _mm256_mul_ps(hsum8x8(acc), scv);
  _mm_storeu_ps(pa, _mm256_castps256_ps128(s));  // (b == a: the same four values twice)
  _mm_storeu_ps(pb, _mm256_extractf128_ps(s, 1));
}

// scores of rows a, b, c for the 4 keys at slots ks[0..3] into pa, pb, pc: scores_2x4's
// chains and tree for a third row in the same pass (12 accumulators, 3 q vectors and one
// K vector fill the 16 ymm registers), so a GQA group of 3 heads (SmolLM2's) computes 3
// rows a pass rather than 4 with one repeated
template <typename T>
inline void scores_3x4(const float* qa, const float* qb, const float* qc, const T* const* ks,
                       int64_t D, __m256 scv, float* pa, float* pb, float* pc) {
  __m256 acc[16];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 x = _mm256_loadu_ps(qa + i), y = _mm256_loadu_ps(qb + i),
                 z = _mm256_loadu_ps(qc + i);
    for (int c = 0; c < 4; ++c) {
      const __m256 kv = flare_simd::F8::load(ks[c] + i);
      acc[c] = _mm256_fmadd_ps(x, kv, acc[c]);
      acc[4 + c] = _mm256_fmadd_ps(y, kv, acc[4 + c]);
      acc[8 + c] = _mm256_fmadd_ps(z, kv, acc[8 + c]);
    }
  }
  for (int c = 0; c < 4; ++c) acc[12 + c] = acc[8 + c];  // hsum8x8 reduces 8 at a time
  const __m256 s = _mm256_mul_ps(hsum8x8(acc), scv);
  const __m256 u = _mm256_mul_ps(hsum8x8(acc + 8), scv);
  _mm_storeu_ps(pa, _mm256_castps256_ps128(s));
  _mm_storeu_ps(pb, _mm256_extractf128_ps(s, 1));
  _mm_storeu_ps(pc, _mm256_castps256_ps128(u));
}

#ifdef __AVX512F__
// scores of rows a[0..3] for the 8 keys at slots ks[0..7] into pa[0..3] (rows may repeat:
// the same values are then written twice). The 8-lane chains of scores_2x4, two rows to a
// zmm (lanes 0-7 row a[2m], 8-15 row a[2m + 1]) against each key's 8 floats in both
// halves, and each row's 8 chains reduced by the same hsum8x8 tree: the same scores bit
// for bit, for 4 rows x 8 keys per pass.
template <typename T>
inline void scores_4x8(const float* const* qa, const T* const* ks, int64_t D,
                       __m256 scv, float* const* pa) {
  __m512 acc[2][8];
  for (int m = 0; m < 2; ++m)
    for (int c = 0; c < 8; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    __m512 x[2];
    for (int m = 0; m < 2; ++m)
      x[m] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa[2 * m] + i)),
                                _mm256_loadu_ps(qa[2 * m + 1] + i), 1);
    for (int c = 0; c < 8; ++c) {
      const __m512 kv = _mm512_broadcast_f32x8(flare_simd::F8::load(ks[c] + i));
      acc[0][c] = _mm512_fmadd_ps(x[0], kv, acc[0][c]);
      acc[1][c] = _mm512_fmadd_ps(x[1], kv, acc[1][c]);
    }
  }
  const __m512 scz = _mm512_broadcast_f32x8(scv);
  for (int m = 0; m < 2; ++m) {  // both rows' trees at once (hsum8x8_x2)
    const __m512 s = _mm512_mul_ps(flare_simd::hsum8x8_x2(acc[m]), scz);
    _mm256_storeu_ps(pa[2 * m], _mm512_castps512_ps256(s));
    _mm256_storeu_ps(pa[2 * m + 1], _mm512_extractf32x8_ps(s, 1));
  }
}

// scores_4x8 for 3 rows a[0..2] (a GQA group of 3, SmolLM2's, at one decode position):
// rows 0 and 1 share a zmm as there, row 2 runs its 8-lane chains in a ymm against the
// same key vectors and is reduced by hsum8x8, the tree hsum8x8_x2 runs in each half. The
// same scores bit for bit, without the fourth (repeated) row's FMAs.
template <typename T>
inline void scores_3x8(const float* const* qa, const T* const* ks, int64_t D,
                       __m256 scv, float* const* pa) {
  __m512 acc[8];
  __m256 acc2[8];
  for (int c = 0; c < 8; ++c) {
    acc[c] = _mm512_setzero_ps();
    acc2[c] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < D; i += 8) {
    const __m512 x = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa[0] + i)),
                                        _mm256_loadu_ps(qa[1] + i), 1);
    const __m256 y = _mm256_loadu_ps(qa[2] + i);
    for (int c = 0; c < 8; ++c) {
      const __m256 k8 = flare_simd::F8::load(ks[c] + i);
      acc[c] = _mm512_fmadd_ps(x, _mm512_broadcast_f32x8(k8), acc[c]);
      acc2[c] = _mm256_fmadd_ps(y, k8, acc2[c]);
    }
  }
  const __m512 s = _mm512_mul_ps(flare_simd::hsum8x8_x2(acc), _mm512_broadcast_f32x8(scv));
  _mm256_storeu_ps(pa[0], _mm512_castps512_ps256(s));
  _mm256_storeu_ps(pa[1], _mm512_extractf32x8_ps(s, 1));
  _mm256_storeu_ps(pa[2], _mm256_mul_ps(hsum8x8(acc2), scv));
}
#endif

// the scalar form for D not a multiple of 8 (one order, used by every path alike)
template <typename T>
inline float score_scalar(const float* q, const T* k, int64_t D, float sc) {
  float s = 0.f;
  for (int64_t i = 0; i < D; ++i) s = s + q[i] * kv_value(k[i]);
  return s * sc;
}

// p[0..n) <- exp(p - max p) in place (p has room for n rounded up to 8); returns
// 1 / sum, or NaN when a score is NaN or the max is not finite (the row is then NaN).
// The AVX-512 builds take 16 scores a step (exp16, exp8's bits per lane) and add each
// step's two halves into the 8-lane sum one after the other: the same sums in the same
// order as 8 a step.
inline float softmax_numerators(float* p, int64_t n) {
  const int64_t np = (n + 7) / 8 * 8;
  for (int64_t j = n; j < np; ++j) p[j] = -INFINITY;
  __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 zmax = _mm512_set1_ps(-INFINITY);
  __mmask16 znan = 0;
  for (; j + 16 <= np; j += 16) {  // max is exact in any order
    const __m512 x = _mm512_loadu_ps(p + j);
    zmax = _mm512_max_ps(zmax, x);
    znan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  vmax = _mm256_max_ps(_mm512_castps512_ps256(zmax), _mm512_extractf32x8_ps(zmax, 1));
  if (znan != 0) return NAN;
#endif
  for (; j < np; j += 8) {
    const __m256 x = _mm256_loadu_ps(p + j);
    vmax = _mm256_max_ps(vmax, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  const float mx = flare_simd::hmax8(vmax);
  if (_mm256_movemask_ps(nan) != 0 || !std::isfinite(mx)) return NAN;
  __m256 sum = _mm256_setzero_ps();  // lane l sums j = l mod 8 in order of j
  j = 0;
#ifdef __AVX512F__
  const __m512 mz = _mm512_set1_ps(mx);
  for (; j + 16 <= np; j += 16) {
    __m512 e = flare_simd::exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), mz));
    if (j + 16 > n)  // the padding lanes: exp16 clamps -inf to a tiny number, drop it
      e = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << (n - j)) - 1), e);
    _mm512_storeu_ps(p + j, e);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
    sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(e, 1));
  }
#endif
  const __m256 mv = _mm256_set1_ps(mx);
  for (; j < np; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    if (j + 8 > n)  // the padding lanes: exp8 clamps -inf to a tiny number, drop it
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
          _mm256_set1_epi32(static_cast<int>(n - j)),
          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    _mm256_storeu_ps(p + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / hsum(sum);
}

// o_r[d0 .. d0 + L NV) += sum_{j in [j0, j1)} p_r[j PS] v_j, for NR rows, in order of j,
// in vectors of L = VF::lanes floats (PS: 1 for a row's own scores, LANE_ROWS for a lane
// group's, where key j of row i sits at j * 16 + i); with `prefetch` (the first chunk of D), V's rows
// PREFETCH_KEYS keys ahead (up to key `jlast`) are fetched whole for the chunks after it
template <typename VF, int NR, int NV, int PS, typename T, typename Slot>
inline void pv_tile(const float* const* p, float* const* o, int64_t d0, const T* v,
                    int64_t stride, Slot slot, int64_t j0, int64_t j1, bool prefetch,
                    int64_t D, int64_t jlast) {
  constexpr int L = VF::lanes;
  typename VF::F acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = VF::load(o[r] + d0 + L * c);
  for (int64_t j = j0; j < j1; ++j) {
    if (prefetch) prefetch_row(v + slot(std::min(j + PREFETCH_KEYS, jlast)) * stride, D);
    const T* vr = v + slot(j) * stride + d0;
    typename VF::F vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = VF::load(vr + L * c);
    for (int r = 0; r < NR; ++r) {
      const typename VF::F pv = VF::set1(p[r][j * PS]);
      for (int c = 0; c < NV; ++c) acc[r][c] = VF::fmadd(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) VF::store(o[r] + d0 + L * c, acc[r][c]);
}

// NR rows over D in chunks of NV vectors of the widest float type (zmm in AVX-512 builds,
// ymm else), then 8-lane vectors for the rest; V's rows ahead are prefetched up to key
// `jlast`, none when jlast < 0 (V already in L1: the widened block). A chunk holds NR x
// NV accumulators, NV of V and one broadcast p in the registers (16 ymm, 32 zmm): one more
// and the compiler keeps an accumulator on the stack, which chains every FMA of it
// through a store and a load (3 x 4 ymm did: the whole PV pass ran at half speed). Several
// rows share each V load; each output lane is its own chain over j, so neither the rows
// sharing a load nor the vector width ever changes a result.
template <int NR, int PS, typename T, typename Slot>
inline void pv_rows(const float* const* p, float* const* o, int64_t D, const T* v,
                    int64_t stride, Slot slot, int64_t j0, int64_t j1, int64_t jlast) {
  using VF = flare_simd::FWide;
  constexpr int L = VF::lanes;
  constexpr int NV = NR == 1 || VF::registers == 32 ? 4 : 2;
  static_assert(NR * NV + NV + 1 <= VF::registers, "the PV tile must fit the registers");
  int64_t d0 = 0;
  const bool prefetch = jlast >= 0;
  for (; d0 + L * NV <= D; d0 += L * NV)
    pv_tile<VF, NR, NV, PS>(p, o, d0, v, stride, slot, j0, j1, prefetch && d0 == 0, D, jlast);
  for (; d0 + L <= D; d0 += L)
    pv_tile<VF, NR, 1, PS>(p, o, d0, v, stride, slot, j0, j1, prefetch && d0 == 0, D, jlast);
  for (; d0 + 8 <= D; d0 += 8)
    pv_tile<flare_simd::F8, NR, 1, PS>(p, o, d0, v, stride, slot, j0, j1, prefetch && d0 == 0,
                                   D, jlast);
}

// Rows r .. r + NR of a tile over keys [j0, j1) of their own: together over the keys all
// of them see, then each alone over the rest
template <int NR, int PS, typename T, typename Slot>
inline void pv_group(float* const* pr, const Tile& t, int r, int64_t D, const T* v,
                     int64_t stride, Slot slot, int64_t j0, int64_t j1, int64_t jlast) {
  int64_t common = j1;
  for (int i = r; i < r + NR; ++i) common = std::min(common, t.n[i]);
  if (common > j0) pv_rows<NR, PS>(pr + r, t.o + r, D, v, stride, slot, j0, common, jlast);
  if (NR == 1) return;
  for (int i = r; i < r + NR; ++i) {
    const int64_t a = std::max(j0, common), b = std::min(j1, t.n[i]);
    if (b > a) pv_rows<1, PS>(pr + i, t.o + i, D, v, stride, slot, a, b, jlast);
  }
}

// Rows j0 .. j1 of one head's float16 K or V (key j at slot(j) * stride) widened to
// float32 into w (key j at (j - j0) * D; exact, F16C), the pool's rows PREFETCH_KEYS ahead
// (up to key jlast) fetched on the way. The score and PV passes then read each key block
// as float32 from L1, once converted for every row of the tile: converting in the passes
// (vcvtph2ps and a broadcast beside every two FMAs in scores_4x8) held 2,048-token
// prefill attention to about 40% of the FMA peak. (The AVX-512 lane-group path widens K
// only: its scores broadcast each K element once for 16 rows, and a PV tile converts each
// V vector once for up to 6 rows, which ran 1.04x faster than widening V.)
template <typename Slot>
inline void widen_rows(const uint16_t* src, int64_t stride, Slot slot, int64_t j0,
                       int64_t j1, int64_t jlast, int64_t D, float* w) {
  for (int64_t j = j0; j < j1; ++j) {
    prefetch_row(src + slot(std::min(j + PREFETCH_KEYS, jlast)) * stride, D);
    const uint16_t* row = src + slot(j) * stride;
    float* out = w + (j - j0) * D;
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) _mm256_storeu_ps(out + i, flare_simd::F8::load(row + i));
    for (; i < D; ++i) out[i] = kv_value(row[i]);
  }
}

// The scores of a tile's rows for keys [j0, j1) into pr[r][j0 .. j1): key j is row slot(j)
// of k (row stride `stride`); keys from `last` on read row slot(last) (a valid row, their
// scores unused); with `prefetch`, K's rows PREFETCH_KEYS keys ahead (up to `last`).
template <typename T, typename Slot>
void scores_block(const Tile& t, const T* k, int64_t stride, Slot slot, int64_t j0,
                  int64_t j1, int64_t last, bool prefetch, int64_t D, float sc,
                  float* const* pr) {
  const bool vec = D % 8 == 0;
  const __m256 scv = _mm256_set1_ps(sc);
#ifdef __AVX512F__
  if (vec) {  // zmm: 4 rows x 8 keys a pass (the last rows repeated to fill it), or the
             // last 3 rows in one scores_3x8 pass
    for (int64_t j = j0; j < j1; j += 8) {
      if (prefetch)
        for (int c = 0; c < 8; ++c)
          prefetch_row(k + slot(std::min(j + PREFETCH_KEYS + c, last)) * stride, D);
      const T* ks[8];
      for (int c = 0; c < 8; ++c) ks[c] = k + slot(std::min(j + c, last)) * stride;
      for (int r = 0; r < t.rows; r += 4) {
        const float* qa[4];
        float* pa[4];
        for (int i = 0; i < 4; ++i) {
          const int ri = std::min(r + i, t.rows - 1);
          qa[i] = t.q[ri];
          pa[i] = pr[ri] + j;
        }
        if (t.rows - r == 3) scores_3x8(qa, ks, D, scv, pa);
        else scores_4x8(qa, ks, D, scv, pa);
      }
    }
    return;
  }
#endif
  for (int64_t j = j0; j < j1; j += 4) {
    if (prefetch)
      for (int c = 0; c < 4; ++c)
        prefetch_row(k + slot(std::min(j + PREFETCH_KEYS + c, last)) * stride, D);
    const T* ks[4];
    for (int c = 0; c < 4; ++c) ks[c] = k + slot(std::min(j + c, last)) * stride;
    if (vec) {  // rows in threes, then twos (a last single row repeated in both halves)
      int r = 0;
      for (; r + 3 <= t.rows; r += 3)
        scores_3x4(t.q[r], t.q[r + 1], t.q[r + 2], ks, D, scv, pr[r] + j, pr[r + 1] + j,
                   pr[r + 2] + j);
      for (; r < t.rows; r += 2) {
        const int rb = r + 1 < t.rows ? r + 1 : r;
        scores_2x4(t.q[r], t.q[rb], ks, D, scv, pr[r] + j, pr[rb] + j);
      }
    } else {
      for (int r = 0; r < t.rows; ++r)
        for (int c = 0; c < 4; ++c) pr[r][j + c] = score_scalar(t.q[r], ks[c], D, sc);
    }
  }
}

// o_r += P_r V over keys [j0, j1) for every row of the tile: rows in sixes, then threes,
// over the keys all of them see, then each row alone over the rest of its keys (pv_group)
template <int PS, typename T, typename Slot>
inline void pv_block(float* const* pr, const Tile& t, int64_t D, const T* v, int64_t stride,
                     Slot slot, int64_t j0, int64_t j1, int64_t jlast) {
  int r = 0;
  for (; r + 6 <= t.rows; r += 6) pv_group<6, PS>(pr, t, r, D, v, stride, slot, j0, j1, jlast);
  for (; r + 3 <= t.rows; r += 3) pv_group<3, PS>(pr, t, r, D, v, stride, slot, j0, j1, jlast);
  for (; r < t.rows; ++r) pv_group<1, PS>(pr, t, r, D, v, stride, slot, j0, j1, jlast);
}

// o_r *= inv[r] for every row of a tile (the softmax normalization, applied last), or
// o_r = NaN where inv[r] is NaN (a NaN score or a non-finite max)
inline void normalize_rows(const Tile& t, const float* inv, int64_t D) {
  for (int r = 0; r < t.rows; ++r) {
    if (std::isnan(inv[r])) {
      std::fill(t.o[r], t.o[r] + D, NAN);
      continue;
    }
    for (int64_t d = 0; d < D; ++d) t.o[r][d] = t.o[r][d] * inv[r];
  }
}

#ifdef __AVX512F__
// A tile of many rows (a prefill chunk's) runs its scores and softmax with query rows as
// the 16 lanes of a zmm register (a "lane group"), keys one a register:
//   qt [D, 16]: the group's q transposed (rows past the tile's zero);
//   acc_l (l = 0..7) for key j: lane i is row i's chain q_i[l] k_j[l], q_i[l+8] k_j[l+8],
//   ... (each FMA with k_j's element broadcast), exactly row i's 8-lane chain l of
//   scores_4x8; the hsum8x8 tree, ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), then
//   runs as 7 vertical adds. So the same scores bit for bit, without the horizontal
//   shuffles and q inserts that made the row-major pass ~1.4x slower than the PV pass for
//   the same FLOPs. Scores and numerators are kept as pt [keys, 16] (row i of key j at
//   j * 16 + i), and the PV pass broadcasts them from there.
constexpr int LANE_ROWS = 16;
// Tiles of at least this many rows take the lane-group path. After 2,048 cached keys
// (float16, G = 3, 2 threads, Zen 4 EPYC) a chunk of 2 new tokens (6 query rows a KV head,
// a lane group mostly empty) ran 0.90x the row-major path, 3 tokens 1.10x, 5 1.25x, 19
// 1.12x and 512 1.04-1.13x (17.4 ms a layer: 156 GFLOP/s where bench/peers.py measured an
// fp32 FMA peak of 168).
constexpr int LANES_MIN_ROWS = 8;

// qt[d * 16 + i] = q of the tile's row 16 g + i at d (0 past the tile's rows)
inline void transpose_q(const Tile& t, int g, int64_t D, float* qt) {
  for (int i = 0; i < LANE_ROWS; ++i) {
    const int r = g * LANE_ROWS + i;
    for (int64_t d = 0; d < D; ++d) qt[d * LANE_ROWS + i] = r < t.rows ? t.q[r][d] : 0.f;
  }
}

// Scores of a lane group for keys [j0, j1) into pt[j * 16 ..): key j is row slot(j) of the
// float32 rows k (stride `stride`); 3 keys a pass (24 accumulators); with `prefetch`, K's
// rows PREFETCH_KEYS keys ahead (up to key `last`).
template <typename Slot>
inline void scores_lanes(const float* qt, const float* k, int64_t stride, Slot slot,
                         int64_t j0, int64_t j1, int64_t last, bool prefetch, int64_t D,
                         __m512 scz, float* pt) {
  for (int64_t j = j0; j < j1; j += 3) {
    if (prefetch)
      for (int c = 0; c < 3; ++c)
        prefetch_row(k + slot(std::min(j + PREFETCH_KEYS + c, last)) * stride, D);
    const float* ks[3];
    for (int c = 0; c < 3; ++c) ks[c] = k + slot(std::min(j + c, j1 - 1)) * stride;
    __m512 acc[3][8];
    for (int c = 0; c < 3; ++c)
      for (int l = 0; l < 8; ++l) acc[c][l] = _mm512_setzero_ps();
    for (int64_t m = 0; m < D; m += 8)
      for (int l = 0; l < 8; ++l) {
        __m512 qv = _mm512_loadu_ps(qt + (m + l) * LANE_ROWS);
        asm("" : "+v"(qv));  // one load for 3 FMAs: keep the compiler from reloading it
        for (int c = 0; c < 3; ++c)
          acc[c][l] = _mm512_fmadd_ps(qv, _mm512_set1_ps(ks[c][m + l]), acc[c][l]);
      }
    for (int c = 0; c < 3 && j + c < j1; ++c) {
      const __m512* a = acc[c];
      const __m512 s = _mm512_add_ps(
          _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
          _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
      _mm512_storeu_ps(pt + (j + c) * LANE_ROWS, _mm512_mul_ps(s, scz));
    }
  }
}

// softmax_numerators for a lane group: lane i (row i, n[i] keys; 0 for a lane past the
// tile) gets pt[j * 16 + i] <- exp(s - max) for j < n[i], 0 for n[i] <= j < nmax, and
// inv[i] = 1 / sum, or NaN when a score is NaN or the max is not finite. The same bits as
// the row-major form: the max is exact in any order, exp16 is exp8 lane for lane, and
// z[l] sums e_j for j = l mod 8 in order of j (a row's last keys add nothing, where the
// row-major form adds masked zeros), reduced by hsum's tree
// ((z0 + z4) + (z2 + z6)) + ((z1 + z5) + (z3 + z7)).
inline void softmax_lanes(float* pt, __m512i n, int64_t nmax, float* inv) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  for (int64_t j = 0; j < nmax; ++j) {
    const __mmask16 valid = _mm512_cmpgt_epi32_mask(n, _mm512_set1_epi32(static_cast<int>(j)));
    const __m512 s = _mm512_loadu_ps(pt + j * LANE_ROWS);
    mx = _mm512_mask_max_ps(mx, valid, mx, s);
    bad |= _mm512_mask_cmp_ps_mask(valid, s, s, _CMP_UNORD_Q);
  }
  bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(mx), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
  __m512 z[8];
  for (int l = 0; l < 8; ++l) z[l] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < nmax; j0 += 8)
    for (int l = 0; l < 8 && j0 + l < nmax; ++l) {
      const int64_t j = j0 + l;
      const __mmask16 valid =
          _mm512_cmpgt_epi32_mask(n, _mm512_set1_epi32(static_cast<int>(j)));
      const __m512 e = _mm512_maskz_mov_ps(
          valid, flare_simd::exp16(_mm512_sub_ps(_mm512_loadu_ps(pt + j * LANE_ROWS), mx)));
      _mm512_storeu_ps(pt + j * LANE_ROWS, e);
      z[l] = _mm512_add_ps(z[l], e);
    }
  const __m512 sum = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(z[0], z[4]), _mm512_add_ps(z[2], z[6])),
      _mm512_add_ps(_mm512_add_ps(z[1], z[5]), _mm512_add_ps(z[3], z[7])));
  const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.f), sum);
  _mm512_storeu_ps(inv, _mm512_mask_mov_ps(r, bad, _mm512_set1_ps(NAN)));
}

// attend_tile for a tile of many rows (D a multiple of 8), its rows in lane groups of 16:
// scores and softmax as above, then the PV pass of attend_tile reading each row's
// numerators from its group's pt (a stride of 16 between keys). Scratch `p`: groups x 16
// x pstride floats (pstride >= max n + 16); `wide`: KEY_BLOCK x D floats; `qt`:
// groups x D x 16 floats.
template <typename T, typename Slot>
void attend_tile_lanes(const Tile& t, const T* k, const T* v, int64_t stride, Slot slot,
                       int64_t D, float sc, float* p, int64_t pstride, float* wide,
                       float* qt) {
  const int groups = (t.rows + LANE_ROWS - 1) / LANE_ROWS;
  int64_t nmax = 0, ngroup[MAX_TILE_ROWS / LANE_ROWS] = {};
  for (int r = 0; r < t.rows; ++r) {
    nmax = std::max(nmax, t.n[r]);
    ngroup[r / LANE_ROWS] = std::max(ngroup[r / LANE_ROWS], t.n[r]);
  }
  const auto pt = [&](int g) { return p + g * LANE_ROWS * pstride; };
  for (int g = 0; g < groups; ++g) transpose_q(t, g, D, qt + g * D * LANE_ROWS);
  const __m512 scz = _mm512_set1_ps(sc);
  // 1. scores, a key block at a time (a float16 block widened once for all groups)
  for (int64_t j0 = 0; j0 < nmax; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(j0 + KEY_BLOCK, nmax);
    if constexpr (std::is_same_v<T, uint16_t>)
      widen_rows(k, stride, slot, j0, j1, nmax - 1, D, wide);
    for (int g = 0; g < groups; ++g) {
      const int64_t jg = std::min(j1, ngroup[g]);
      if (jg <= j0) continue;
      if constexpr (std::is_same_v<T, uint16_t>)
        scores_lanes(qt + g * D * LANE_ROWS, wide, D, [j0](int64_t j) { return j - j0; }, j0,
                     jg, 0, false, D, scz, pt(g));
      else
        scores_lanes(qt + g * D * LANE_ROWS, k, stride, slot, j0, jg, nmax - 1, g == 0, D,
                     scz, pt(g));
    }
  }
  // 2. softmax numerators, a lane group at a time
  alignas(64) float inv[MAX_TILE_ROWS];
  alignas(64) int32_t nl[LANE_ROWS];
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < LANE_ROWS; ++i) {
      const int r = g * LANE_ROWS + i;
      nl[i] = r < t.rows ? static_cast<int32_t>(t.n[r]) : 0;
    }
    softmax_lanes(pt(g), _mm512_load_si512(nl), ngroup[g], inv + g * LANE_ROWS);
  }
  // 3. o = (E V) / sum(E) as attend_tile's, V read from the cache (a float16 V widened as
  // it loads: one conversion shared by the rows of a PV tile)
  float* pr[MAX_TILE_ROWS];
  for (int r = 0; r < t.rows; ++r) pr[r] = pt(r / LANE_ROWS) + r % LANE_ROWS;
  for (int r = 0; r < t.rows; ++r) std::fill(t.o[r], t.o[r] + D, 0.f);
  for (int64_t j0 = 0; j0 < nmax; j0 += KEY_BLOCK)
    pv_block<LANE_ROWS>(pr, t, D, v, stride, slot, j0, std::min(j0 + KEY_BLOCK, nmax),
                        nmax - 1);
  normalize_rows(t, inv, D);
}
#endif

// Attention of a tile's rows over one KV head whose key j is row slot(j) of k / v (row
// stride `stride` elements of T, float or float16 bits). Scratch `p`: rows x pstride
// floats, pstride >= max n + 8; `wide` (a float16 cache): KEY_BLOCK x D floats.
template <typename T, typename Slot>
void attend_tile(const Tile& t, const T* k, const T* v, int64_t stride, Slot slot,
                 int64_t D, float sc, float* p, int64_t pstride, float* wide, float* qt) {
  constexpr bool kHalf = std::is_same_v<T, uint16_t>;
#ifdef __AVX512F__
  if (D % 8 == 0 && t.rows >= LANES_MIN_ROWS) {
    attend_tile_lanes(t, k, v, stride, slot, D, sc, p, pstride, wide, qt);
    return;
  }
#endif
  int64_t nmax = 0;
  for (int r = 0; r < t.rows; ++r) nmax = std::max(nmax, t.n[r]);
  const bool vec = D % 8 == 0;
  float* pr[MAX_TILE_ROWS];
  for (int r = 0; r < t.rows; ++r) pr[r] = p + r * pstride;
  // A float16 tile of many rows widens each key block once for all of them (widen_rows);
  // a decode tile (one position's query heads) converts as it loads instead
  const bool widen = kHalf && t.rows > DIRECT_MAX_ROWS;
  // 1. scores, a key block at a time; rows past their own n compute (unused) extra
  // scores up to nmax; keys past nmax read slot(nmax - 1) (a valid row) and are dropped
  for (int64_t j0 = 0; j0 < nmax; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(j0 + KEY_BLOCK, nmax);
    if constexpr (kHalf) {
      if (widen) {
        widen_rows(k, stride, slot, j0, j1, nmax - 1, D, wide);
        scores_block(t, static_cast<const float*>(wide), D,
                     [j0](int64_t j) { return j - j0; }, j0, j1, j1 - 1, false, D, sc, pr);
        continue;
      }
    }
    scores_block(t, k, stride, slot, j0, j1, nmax - 1, true, D, sc, pr);
  }
  // 2. softmax numerators per row over its own n; the normalization is applied last
  float inv[MAX_TILE_ROWS];
  for (int r = 0; r < t.rows; ++r) inv[r] = softmax_numerators(pr[r], t.n[r]);
  // 3. o = (E V) / sum(E), a key block at a time: rows in sixes, then threes, over the
  // keys all of them see, then each row alone over the rest of its keys in the block
  for (int r = 0; r < t.rows; ++r) std::fill(t.o[r], t.o[r] + D, 0.f);
  if (vec) {
    for (int64_t j0 = 0; j0 < nmax; j0 += KEY_BLOCK) {
      const int64_t j1 = std::min(j0 + KEY_BLOCK, nmax);
      if constexpr (kHalf) {
        if (widen) {
          widen_rows(v, stride, slot, j0, j1, nmax - 1, D, wide);
          pv_block<1>(pr, t, D, static_cast<const float*>(wide), D,
                   [j0](int64_t j) { return j - j0; }, j0, j1, -1);
          continue;
        }
      }
      pv_block<1>(pr, t, D, v, stride, slot, j0, j1, nmax - 1);
    }
  } else {
    for (int r = 0; r < t.rows; ++r)
      for (int64_t j = 0; j < t.n[r]; ++j) {
        const T* vr = v + slot(j) * stride;
        for (int64_t d = 0; d < D; ++d) t.o[r][d] = t.o[r][d] + pr[r][j] * kv_value(vr[d]);
      }
  }
  normalize_rows(t, inv, D);
}

void check_caches(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache) {
  check_kv_caches(k_cache, v_cache);
  const int64_t H = q.size(-2), D = q.size(-1), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [S, KVH, D] with q's D");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "H (", H, ") must be a multiple of KVH (", KVH,
              ") > 0");
  // a tile holds one position's G query heads at least (Tile's arrays)
  TORCH_CHECK(H / KVH <= MAX_TILE_ROWS, "at most ", MAX_TILE_ROWS,
              " query heads a KV head, got ", H / KVH);
}

// The work of one call: sequences b in [0, B) with R rows each; a work item is (b, KV
// head, a run of positions whose G query heads fill one tile). T: the cache's element
// (float, or uint16_t for float16 bits).
template <typename T, typename SlotOf>
void run_cache(const torch::Tensor& q, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, int64_t B, int64_t R, const int64_t* lengths,
               SlotOf slot_of, float sc, torch::Tensor& o) {
  const int64_t H = q.size(-2), D = q.size(-1), KVH = k_cache.size(1);
  const int64_t G = H / KVH;
  // as few tiles as MAX_TILE_ROWS allows, their positions shared out evenly: a turn's 50
  // new rows at G = 3 make tiles of 13, 13, 13 and 11 positions rather than 16, 16, 16 and
  // 2, so the 12 items split 6 and 6 over 2 threads with equal work (a tile's rows only
  // share loads: the results do not depend on it)
  const int64_t pos_per_tile = std::max<int64_t>(1, MAX_TILE_ROWS / G);
  const int64_t tiles_per_seq = (R + pos_per_tile - 1) / pos_per_tile;
  const int64_t rows_per_tile = (R + tiles_per_seq - 1) / tiles_per_seq;
  int64_t nmax = 0, nmin = B > 0 ? lengths[0] : 0;
  for (int64_t b = 0; b < B; ++b) {
    nmax = std::max(nmax, lengths[b]);
    nmin = std::min(nmin, lengths[b]);
  }
  // Decode of several sequences of about one length (R = 1, the longest at most twice the
  // shortest), as many a thread: an item is one sequence's KV heads, one after another,
  // so a thread reads each cached token's K and V rows for all heads, KVH * D contiguous
  // values (8 streams of the embedded model: a step 2-3.5% faster, median of 6-10 rounds
  // of bench/ab_builds.py --batch 8 at 32 and 500 cached tokens). Otherwise an item a
  // head: the heads then share out evenly over the threads, and a long sequence beside
  // short ones does not leave one thread with all of its keys.
  const int64_t threads =
      flare_team::active() ? flare_team::self.size : at::get_num_threads();
  const int64_t heads_per_item =
      R == 1 && B > 1 && B % threads == 0 && nmax <= 2 * nmin ? KVH : 1;
  const int64_t W = B * (KVH / heads_per_item) * tiles_per_seq;
  const float* qd = q.data_ptr<float>();
  const T* kd = static_cast<const T*>(k_cache.data_ptr());
  const T* vd = static_cast<const T*>(v_cache.data_ptr());
  float* od = o.data_ptr<float>();
  const int64_t pstride = nmax + 16;
  const int64_t tile_rows = std::min<int64_t>(rows_per_tile * G, MAX_TILE_ROWS);
  const bool many_rows = tile_rows > DIRECT_MAX_ROWS;  // widened or lane-group tiles
  const int64_t padded_rows = (tile_rows + 15) / 16 * 16;  // whole lane groups of 16
#ifdef __AVX512F__
  const bool lanes = many_rows;
#else
  constexpr bool lanes = false;
#endif
  // The i-th work item a thread's range hands out: sequence b, KV head kh (the first of
  // its heads_per_item), tile ti of the sequence's positions. Zig-zag over the items, so
  // the two halves a static split makes each get as many long (late) as short (early)
  // causal rows.
  struct Item {
    int64_t b, kh, ti;
  };
  const auto item = [&](int64_t i) {
    const int64_t w = i % 2 == 0 ? i / 2 : W - 1 - i / 2;
    const int64_t groups = KVH / heads_per_item;
    return Item{w / (groups * tiles_per_seq), (w / tiles_per_seq) % groups * heads_per_item,
                w % tiles_per_seq};
  };
  // An item's first PREFETCH_KEYS K and V rows on their way into L2. A tile's passes
  // prefetch PREFETCH_KEYS keys ahead of where they read, so without this each item's
  // first keys came from memory one miss after another, and short items (8 decode
  // streams at a few hundred cached tokens) are mostly that start. Fetched one item
  // ahead, decode attention alone over 30 layers' float16 KV with L3 evicted between
  // rounds (as a step's weights evict it) ran 1.3-1.6x faster at 128 and 256 cached
  // tokens, 1.06x at 1,024, 1 stream at 1,024 1.09x; prefill chunks the same; a whole
  // 8-stream step 1.00-1.03x (Zen 4 EPYC, 2 threads). No value changes.
  const auto prefetch_start = [&](const Item& it) {
    const auto slot = slot_of(it.b);
    const int64_t n = std::min<int64_t>(lengths[it.b], PREFETCH_KEYS);
    for (int64_t j = 0; j < n; ++j) {
      prefetch_row(kd + it.kh * D + slot(j) * KVH * D, heads_per_item * D);
      prefetch_row(vd + it.kh * D + slot(j) * KVH * D, heads_per_item * D);
    }
  };
  const auto work = [&](int64_t w0, int64_t w1) {
    // scores: a row of pstride floats a tile row, rounded up to whole lane groups
    std::vector<float> p(static_cast<size_t>(padded_rows) * pstride);
    // widened key blocks, for float16 tiles of more than DIRECT_MAX_ROWS rows only (a
    // decode step's tiles read the cache directly and need none), and q transposed for
    // the lane groups of such tiles (AVX-512 builds)
    std::vector<float> wide(std::is_same_v<T, uint16_t> && many_rows ? KEY_BLOCK * D : 0);
    std::vector<float> qt(lanes ? padded_rows * D : 0);
    for (int64_t i = w0; i < w1; ++i) {
      const Item it = item(i);
      if (i == w0) prefetch_start(it);
      if (i + 1 < w1) prefetch_start(item(i + 1));  // while this item runs
      const int64_t b = it.b, r0 = it.ti * rows_per_tile;
      const int64_t r1 = std::min(R, r0 + rows_per_tile);
      for (int64_t kh = it.kh; kh < it.kh + heads_per_item; ++kh) {
        Tile t;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t row = (b * R + r) * H + kh * G + g;
            t.q[t.rows] = qd + row * D;
            t.o[t.rows] = od + row * D;
            t.n[t.rows] = lengths[b] - R + r + 1;
            ++t.rows;
          }
        attend_tile(t, kd + kh * D, vd + kh * D, KVH * D, slot_of(b), D, sc, p.data(),
                    pstride, wide.data(), qt.data());
      }
    }
  };
  // decode over a short context: less work than a thread handoff costs (in a decode team
  // the handoff is a barrier the step needs anyway, so the items always split)
  const bool small = W <= 1 || B * R * H * nmax < PARALLEL_MIN_WORK;
  if (small && !flare_team::active()) work(0, W);
  else flare_team::for_range(0, W, 1, work);
}

// run_cache for the cache's dtype (check_caches has admitted it)
template <typename SlotOf>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         int64_t B, int64_t R, const int64_t* lengths, SlotOf slot_of, float sc,
         torch::Tensor& o) {
  if (k_cache.scalar_type() == torch::kFloat16)
    run_cache<uint16_t>(q, k_cache, v_cache, B, R, lengths, slot_of, sc, o);
  else
    run_cache<float>(q, k_cache, v_cache, B, R, lengths, slot_of, sc, o);
}

torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& gather,
                               const torch::Tensor& lengths, int64_t rows_per_seq,
                               double scale,
                               const c10::optional<torch::Tensor>& out = c10::nullopt) {
  check_f32(q, "q", 3);
  check_caches(q, k_cache, v_cache);
  TORCH_CHECK(gather.dim() == 2 && gather.is_contiguous() &&
                  gather.scalar_type() == torch::kInt64, "gather must be int64 [B, M]");
  const int64_t B = gather.size(0), M = gather.size(1), S = k_cache.size(0);
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.is_contiguous() &&
                  lengths.scalar_type() == torch::kInt64, "lengths must be int64 [B]");
  TORCH_CHECK(rows_per_seq >= 1 && q.size(0) == B * rows_per_seq, "q has ", q.size(0),
              " rows, expected B (", B, ") x rows_per_seq (", rows_per_seq, ")");
  const int64_t* gd = gather.data_ptr<int64_t>();
  const int64_t* ld = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ld[b] >= rows_per_seq && ld[b] <= M, "lengths[", b, "] = ", ld[b],
                " outside [", rows_per_seq, ", ", M, "]");
    for (int64_t j = 0; j < ld[b]; ++j)
      TORCH_CHECK(gd[b * M + j] >= 0 && gd[b * M + j] < S, "gather[", b, ", ", j, "] = ",
                  gd[b * M + j], " outside the cache [0, ", S, ")");
  }
  auto o = flare_checks::output_f32(out, q.sizes(), q);
  const auto slot_of = [gd, M](int64_t b) {
    const int64_t* rows = gd + b * M;
    return [rows](int64_t j) { return rows[j]; };
  };
  run(q, k_cache, v_cache, B, rows_per_seq, ld, slot_of, static_cast<float>(scale), o);
  return o;
}

torch::Tensor decode_attention_gather(const torch::Tensor& q, const torch::Tensor& k_cache,
                                      const torch::Tensor& v_cache,
                                      const torch::Tensor& gather,
                                      const torch::Tensor& lengths, double scale,
                                      const c10::optional<torch::Tensor>& out = c10::nullopt) {
  return cached_attention(q, k_cache, v_cache, gather, lengths, 1, scale, out);
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, int64_t start, int64_t length,
                               double scale,
                               const c10::optional<torch::Tensor>& out = c10::nullopt) {
  const bool rows = q.dim() == 3;  // [1, H, D]: the step's one row, as its rows hold it
  check_f32(q, "q", rows ? 3 : 2);
  TORCH_CHECK(!rows || q.size(0) == 1, "a 3-dim q must be [1, H, D], got ", q.sizes());
  check_caches(q, k_cache, v_cache);
  const int64_t S = k_cache.size(0);
  TORCH_CHECK(length > 0 && start >= 0 && start <= S - length,
              "slots [", start, ", ", start + length, ") outside the cache [0, ", S, ")");
  auto o = flare_checks::output_f32(out, q.sizes(), q);
  const int64_t H = q.size(-2), D = q.size(-1);
  auto q3 = rows ? q : q.view({1, H, D});
  auto o3 = rows ? o : o.view({1, H, D});
  const int64_t len[1] = {length};
  const auto slot_of = [start](int64_t) { return [start](int64_t j) { return start + j; }; };
  run(q3, k_cache, v_cache, 1, 1, len, slot_of, static_cast<float>(scale), o3);
  return o;
}

}  // namespace

namespace flare_ops {  // ops.h
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& gather,
                               const torch::Tensor& lengths, int64_t rows_per_seq,
                               double scale, const c10::optional<torch::Tensor>& out) {
  return ::cached_attention(q, k_cache, v_cache, gather, lengths, rows_per_seq, scale, out);
}
torch::Tensor decode_attention_gather(const torch::Tensor& q, const torch::Tensor& k_cache,
                                      const torch::Tensor& v_cache,
                                      const torch::Tensor& gather,
                                      const torch::Tensor& lengths, double scale,
                                      const c10::optional<torch::Tensor>& out) {
  return ::decode_attention_gather(q, k_cache, v_cache, gather, lengths, scale, out);
}
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, int64_t start, int64_t length,
                               double scale, const c10::optional<torch::Tensor>& out) {
  return ::decode_attention(q, k_cache, v_cache, start, length, scale, out);
}
}  // namespace flare_ops

void flare_register_attention(pybind11::module_& m) {
  m.def("cached_attention", &cached_attention,
        "o[T, H, D]: sequence b's rows q[b*R:(b+1)*R] over cache slots gather[b, :lengths[b]], "
        "row r causal at position lengths[b] - R + r; one fixed-order routine, GQA",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("gather"), pybind11::arg("lengths"), pybind11::arg("rows_per_seq"),
        pybind11::arg("scale"),
        pybind11::arg("out") = pybind11::none());
  m.def("decode_attention_gather", &decode_attention_gather,
        "o[B, H, D]: row b = softmax(q[b] K^T * scale) V over cache slots "
        "gather[b, :lengths[b]], GQA (cached_attention with one row per sequence)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("gather"), pybind11::arg("lengths"), pybind11::arg("scale"),
        pybind11::arg("out") = pybind11::none());
  m.def("decode_attention", &decode_attention,
        "o[H, D] = softmax(q K^T * scale) V over cache slots [start, start + length), GQA",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("start"), pybind11::arg("length"), pybind11::arg("scale"),
        pybind11::arg("out") = pybind11::none());
}
