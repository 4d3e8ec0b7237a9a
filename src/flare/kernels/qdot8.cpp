// Block-quantized weight GEMMs with int8 activations (weight formats `q4x8`, `q8x8`,
// `kx8`), AVX2.
//
// The arithmetic of llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products: each row of x
// [B, K] is quantized per block of 32 along K exactly as `flare.models.quant.quantize_q8`
// quantizes a weight (d = amax / 127, q = round-half-even(x / d), an all-zero block has
// d = 0 and q = 0), then every block's dot product is an integer sum:
//
//   q4 weights (value = dw * c + mw, c in 0..15):
//     y = sum_blocks dw * dx * sum_j(c_j * q_j) + mw * (dx * sum_j(q_j))
//   q8 weights (value = dw * c, c in -127..127):
//     y = sum_blocks dw * dx * sum_j(c_j * q_j)
//
// (dx * sum(q) is Q8_1's s). So y is the float32 product of the dequantized weights and
// the dequantized activations, up to summation order: the integer sums are exact, and
// only the activation rounding (at most amax/254 per value) departs from `qgemm.cpp`'s
// float32 product. Every row of x is computed by the same instructions whatever the
// batch, so a row's result does not depend on the rows computed beside it.
//
// Weights are in the 8-row interleaved layout `flare.models.quant` stores for `q4x8`:
// rows 8g..8g+7 form group g (N is a multiple of 8), and a group's block kb is
//   q4: 128 bytes in 4 chunks of 32; chunk c holds, for each row i of the group, the
//       row's block bytes 4c..4c+3 (elements 4c..4c+3 in the low nibbles, 16+4c..19+4c
//       in the high ones) at bytes 4i..4i+3;
//   q8: 256 bytes in 8 chunks of 32; chunk c holds row i's codes 4c..4c+3 at 4i..4i+3;
// and the group's scales (and mins) are float16 [nb, 8] (block, row), as a GGUF stores
// them (F16C widens 8 in one instruction). So one 32-byte load feeds
// 8 output rows, a lane each, and x's 4 codes for that chunk are one broadcast dword:
// per row of x and group block, 8 multiply-adds (u8 x s8 to int16 pairs), their sum, one
// pair-add to int32, a convert and two FMAs give 8 outputs' block terms at once.
//
// GGUF K-quants (super-blocks of 256 along K, format `kx8`) use the same x blocks of 32:
//   Q4_K (q4kx8_linear): q4's codes and kernel, the block scale d * sc and min
//       -(dmin * m) computed from the 6-bit sub-block sc, m (uint8 [nb, 8] per group) and
//       the super-block's float16 d, dmin ([nb / 8, 8]); the products are exact in
//       float32, so the arithmetic is q4's with float32 scales and mins;
//   Q5_0, Q5_1, Q5_K (q5x8_linear, q5kx8_linear): q4's low nibbles plus a 32-byte plane
//       of fifth bits per group block, Q4_1's float16 scale and min (Q5_0's min is -16d)
//       or Q4_K's scales;
//   Q6_K (q6kx8_linear): codes q - 32 in q8's layout, int8 scales per 16 values, one
//       float16 d per super-block; the two half-block sums are scaled by their integer
//       scales in int32 (exact), then by d * dx.
// Every row of x is still computed by the same instructions whatever the batch.
//
// Instruction-set variants (`flare.kernels.variants`): the same source is built with
// -mavxvnni (AVX-VNNI) and with -mavx512vnni -mavx512vl (AVX-512 VNNI), where one
// `vpdpbusd` (u8 x s8, four products and the accumulator added in int32) replaces each
// `vpmaddubsw` + `vpmaddwd` pair (`FLARE_DPBUSD` below). The AVX-512 build also runs two
// adjacent groups per zmm register (`Z16`, `FLARE_ZMM`): the same instructions lane for
// lane, 16 output rows at once. The results are identical bit for bit, because every
// path computes each block's exact integer sum:
//   - AVX2: the unsigned operand is a q4 code (0..15), a q5 code (0..31) or, with the
//     sign moved onto the activation, |c| of a q8 (<= 128) or q6k (<= 32) code; every
//     activation is within -127..127, so no vpmaddubsw pair sum saturates and no int16
//     partial sum wraps (the bounds are at each sum below);
//   - vpdpbusd builds: the q4 and q5 codes are the unsigned operand as on AVX2; for the
//     signed q8 and q6k codes x is quantized biased (q + 128, 0..255, unsigned) and the
//     codes are the signed operand, so sum (q + 128) c - 128 * sum c (`code_sum`, once a
//     weight block for all rows of x) is the sum, all in int32 without saturation.
// The float32 scale math after the integer sum is the same instructions in the same
// order on every path.
//
// The AMX build (-mamx-tile -mamx-int8 on top of AVX-512 VNNI, `FLARE_AMX`) computes
// calls of 32 rows of x and more on tiles (amx.h, `amx_pair_rows`; not Q6_K): a tile
// product gives each block's 16 x 16 exact integer sums at once (signed x by unsigned
// q4/q5 codes; for q8 the biased x by signed codes, the bias subtracted as above), and
// the Z16 float32 math then runs on them per block, in the same order: the same bits.

#include <torch/extension.h>
#include <immintrin.h>

#include "checks.h"
#include "ops.h"
#include "qrows.h"
#include "team.h"

// the avx512amx variant: prompt-sized products on AMX tiles (amx.h, `amx_pair_rows`)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define FLARE_AMX 1
#endif
#include "amx.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using flare_qrows::QK;

// For the helpers that hand a block's codes or sums on in registers (I w[8] and the
// like): GCC's inliner left q4_codes<Z16> out of line once it had three callers, so eight
// zmm registers went through memory and back each block (q4 at 8 rows of x ran 0.90x as
// fast).
#define FLARE_INLINE inline __attribute__((always_inline))

#ifdef __AVX512F__
// x's quantization 16 blocks at a time (AVX-512 builds; quantize_rows below). One block
// alone is a serial chain (a max reduction, the scale's division, then the codes) of about
// 12 ns on this Xeon; 16 at once reduce their maxima and sums in one transposing tree and
// take their scales and reciprocals in one division each: 6.3 ns a block (a standalone
// loop over 8 x 576 and 8 x 1,536, -O3), the same values bit for bit:
//   - d = amax / 127, the same IEEE division in a vector as in a scalar;
//   - a code is round-half-even(x / d) of the correctly rounded quotient, as torch's x /
//     d then round gives it, but taken from t = x * (1 / d) where that cannot change it:
//     t is within 2.3e-5 of the quotient's float32 (|x / d| <= 127 plus a rounding; 1 / d
//     and the product each add at most 2^-24 relative, the quotient's own rounding 2^-24
//     more), so the two round apart only when a half-integer lies between them. A block
//     whose every t lies further than NEAR_HALF = 2^-14 from a half-integer takes t's
//     codes; any other block (about 0.4% of random blocks) divides, as the scalar path;
//   - s = d * sum(codes), the sum exact in int32.
constexpr float NEAR_HALF = 1.0f / 16384.0f;

// Lane j of the result: Op over the 16 lanes of v[j] (v: 16 vectors), by a transposing
// tree (30 shuffles and 15 Ops for 16 vectors, against ~8 shuffles and 4 Ops for each
// vector reduced alone).
template <typename Op>
FLARE_INLINE __m512 reduce_each(const __m512* v, Op op) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // vector i: v[2i] folded to lanes 0-7, v[2i+1] to 8-15
    a[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane l of vector i: v[4i + l] folded to 4 lanes
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // 128-bit lane l: v[8i + l] in 2 lanes, then v[8i + 4 + l]
    c[i] = op(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
              _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // element p of 128-bit lane l: v[4p + l] folded to one value
  const __m512 d =
      op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

constexpr int64_t GROUP_BLOCKS = 16;

// Blocks [0, 16) of x (512 values): their scales d[0..16), codes q[0..512) (XOR flip) and,
// with s, sums s[0..16); every value as quantize_rows' one block at a time gives it.
FLARE_INLINE void quantize_16_blocks(const float* x, int8_t* q, float* d, float* s,
                                     char flip) {
  __m512 m[GROUP_BLOCKS];
  uint32_t nan = 0;  // bit j: block j holds a NaN
  for (int j = 0; j < GROUP_BLOCKS; ++j) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * j), v1 = _mm512_loadu_ps(x + 32 * j + 16);
    m[j] = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    nan |= static_cast<uint32_t>(_mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) != 0) << j;
  }
  const __m512 amax =
      reduce_each(m, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
  // a block holding NaN or inf gets scale NaN (and codes 0)
  const __mmask16 bad = static_cast<__mmask16>(nan) |
                        _mm512_cmp_ps_mask(amax, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
  const __m512 dv = _mm512_mask_mov_ps(_mm512_div_ps(amax, _mm512_set1_ps(127.0f)), bad,
                                       _mm512_set1_ps(NAN));
  alignas(64) float dd[GROUP_BLOCKS], rr[GROUP_BLOCKS];
  _mm512_store_ps(dd, dv);
  _mm512_store_ps(rr, _mm512_div_ps(_mm512_set1_ps(1.0f), dv));
  _mm512_storeu_ps(d, dv);
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 limit = _mm512_set1_ps(0.5f - NEAR_HALF);
  __m512 sums[GROUP_BLOCKS];
  for (int j = 0; j < GROUP_BLOCKS; ++j) {
    int8_t* qb = q + 32 * j;
    if (!(dd[j] > 0.0f)) {  // all zeros (codes 0, scale 0), or not finite (scale NaN)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_set1_epi8(flip));
      sums[j] = _mm512_setzero_ps();
      continue;
    }
    const __m512 v0 = _mm512_loadu_ps(x + 32 * j), v1 = _mm512_loadu_ps(x + 32 * j + 16);
    const __m512 r = _mm512_set1_ps(rr[j]);
    __m512 t0 = _mm512_mul_ps(v0, r), t1 = _mm512_mul_ps(v1, r);
    const __m512 f0 = _mm512_abs_ps(_mm512_sub_ps(t0, _mm512_roundscale_ps(t0, nearest)));
    const __m512 f1 = _mm512_abs_ps(_mm512_sub_ps(t1, _mm512_roundscale_ps(t1, nearest)));
    if ((_mm512_cmp_ps_mask(f0, limit, _CMP_NLT_UQ) |
         _mm512_cmp_ps_mask(f1, limit, _CMP_NLT_UQ)) != 0) {  // next to a half: divide
      const __m512 dj = _mm512_set1_ps(dd[j]);
      t0 = _mm512_div_ps(v0, dj), t1 = _mm512_div_ps(v1, dj);
    }
    const __m512i i0 = _mm512_cvt_roundps_epi32(t0, nearest);
    const __m512i i1 = _mm512_cvt_roundps_epi32(t1, nearest);
    sums[j] = _mm512_castsi512_ps(_mm512_add_epi32(i0, i1));
    // |code| <= 127: the saturating narrowing is exact
    const __m256i codes =
        _mm256_set_m128i(_mm512_cvtsepi32_epi8(i1), _mm512_cvtsepi32_epi8(i0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_xor_si256(codes, _mm256_set1_epi8(flip)));
  }
  if (s == nullptr) return;
  const __m512 total = reduce_each(sums, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  });
  // an all-zero block sums to 0, a non-finite one to NaN (its codes sum to 0)
  _mm512_storeu_ps(s, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_castps_si512(total))));
}
#endif  // __AVX512F__

// q [B, K] int8, d [B, K/32], s [B, K/32] (when not null: d * sum(q) of each block, the
// block sum of the dequantized x, which q4's min term multiplies). With `biased`, each
// code is stored as the byte q + 128 (q XOR 0x80, read as uint8 0..255), the unsigned
// operand of vpdpbusd against signed weight codes. AVX-512 builds take the blocks 16 at a
// time (quantize_16_blocks, the same values), the rest one at a time here.
void quantize_rows(const float* x, int64_t B, int64_t K, int8_t* q, float* d, float* s,
                   bool biased = false) {
  const int64_t nb = K / QK;
  int64_t b = 0;  // blocks are consecutive across rows: B * nb of them from x, q, d and s
#ifdef __AVX512F__
  for (; b + GROUP_BLOCKS <= B * nb; b += GROUP_BLOCKS)
    quantize_16_blocks(x + b * QK, q + b * QK, d + b, s != nullptr ? s + b : nullptr,
                       biased ? static_cast<char>(0x80) : 0);
#endif
  const __m256i flip = _mm256_set1_epi8(biased ? static_cast<char>(0x80) : 0);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; b < B * nb; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                           _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                           _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float amax = _mm_cvtss_f32(h);
    // max_ps drops NaN lanes: a block holding NaN or inf gets scale NaN (and codes 0), so
    // every output it feeds is NaN, as the float product's would be non-finite
    __m256 any = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) any = _mm256_or_ps(any, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    if (!std::isfinite(amax) || _mm256_movemask_ps(any) != 0) amax = NAN;
    const float db = amax / 127.0f;
    d[b] = db;
    int8_t* qb = q + b * QK;
    if (!(db > 0.0f)) {  // all zeros (codes 0, scale 0), or not finite (scale NaN)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), flip);
      if (s != nullptr) s[b] = db == 0.0f ? 0.0f : NAN;
      continue;
    }
    // x / d, not x * (1 / d): the division rounds as torch's does, so the codes equal
    // quantize_q8's bit for bit
    const __m256 dv = _mm256_set1_ps(db);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
      i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(
          _mm256_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // |code| <= 127, so the saturating packs are exact; they interleave 128-bit lanes,
    // which the permute puts back in element order
    if (s != nullptr) {
      const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                         _mm256_add_epi32(i32[2], i32[3]));
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
      int32_t sum = 0;
      for (int32_t v : lanes) sum += v;
      s[b] = db * static_cast<float>(sum);
    }
    const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
    const __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_xor_si256(p8, flip));
  }
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define FLARE_DPBUSD 1
#endif

// Whether the signed-code kernels (q8, Q6_K) take x biased (`quantize_rows`): with
// vpdpbusd, (q + 128) x c needs no per-row sign moved onto x, and the bias 128 * sum(c)
// is one subtraction a block, computed once per weight block for every row of x.
#ifdef FLARE_DPBUSD
constexpr bool kBiasedSignedX = true;
#else
constexpr bool kBiasedSignedX = false;
#endif

// Rows of x a decode team quantizes on each member, into the member's own buffers, with
// no barrier: fewer rows than members each take than the barrier costs
constexpr int64_t TEAM_OWN_ROWS = 2;

// Activations quantized once per call, shared by every output row (`biased`: codes stored
// as q + 128, see quantize_rows): q int8 [B, K], d (and with `sums`, s) float32 [B, K/32].
// The arrays are the calling thread's, kept from call to call and grown as needed (a
// decode step quantizes x ~120 times, and three fresh zeroed vectors each time were part
// of a batch-1 step's serial work), or in a decode team the team's, reserved before it
// starts (so x's rows never grow inside a team: team.h): more than TEAM_OWN_ROWS rows are
// shared, each member quantizing its share, and fewer are each member's own copy, member
// m's at rows [m B, (m + 1) B). So at most one QuantizedRows a thread (a team) is alive
// at a time: each linear below makes one and calls no other linear.
struct QuantizedRows {
  int8_t* q;
  float* d;
  float* s;
  QuantizedRows(const torch::Tensor& x, bool sums, bool biased = false) {
    const int64_t B = x.size(0), K = x.size(1), nb = K / QK;
    thread_local flare_team::RowBuffers own;
    const bool team = flare_team::active(), shared = team && B > TEAM_OWN_ROWS;
    const int64_t first = team && !shared ? flare_team::self.id * B : 0;
    flare_team::RowBuffers& buf = team ? *flare_team::self.rows : own;
    if (team) {  // every member sees the same sizes, so all pass or all fail
      TORCH_CHECK(buf.holds(B * flare_team::self.size, K),
                  "the team's buffers were not reserved for ", B, " x ", K, " a member");
    } else {
      buf.reserve(B, K);
    }
    q = buf.q.data() + first * K;
    d = buf.d.data() + first * nb;
    s = sums ? buf.s.data() + first * nb : nullptr;
    const float* xd = x.data_ptr<float>();
    const auto quantize = [&](int64_t b0, int64_t b1) {
      quantize_rows(xd + b0 * K, b1 - b0, K, q + b0 * K, d + b0 * nb,
                    s ? s + b0 * nb : nullptr, biased);
    };
    if (shared) flare_team::for_range(0, B, 1, quantize);
    else if (flare_team::active()) quantize(0, B);
    else at::parallel_for(0, B, 8, quantize);  // prompts: many rows
  }
};

// Whether the int8 kernels prefetch their weights non-temporally (_MM_HINT_NTA) rather
// than into every cache level (_MM_HINT_T0): set by set_weight_prefetch_nta, which
// flare.kernels.weight_prefetch drives from the CPU's vendor, the model's weight bytes and
// the last-level cache. A decode step reads each weight once. On a Zen 4 EPYC (32 MiB L3),
// NTA kept a ~100 MB model's weights from displacing the KV cache and activations: a step
// at batch 1 1.10-1.12x faster. On a Xeon, NTA was slower at every size (a step of the same
// models at batch 1 2.5-2.7x slower: an Intel core fetches NTA lines into L1 alone).
// Figures in weight_prefetch.py. A hint only: the same bits either way. Set before the
// kernels run, read by each prefetch.
bool weight_prefetch_nta = false;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define FLARE_ZMM 1  // the AVX-512 variant: two groups per zmm register (Z16 below)
#endif

// The lanes one pass of a group kernel fills. Y8: one group of 8 weight rows in a ymm
// register. Z16 (the AVX-512 variant only): two adjacent groups g, g + 1 in a zmm, group
// g in lanes 0-7 and g + 1 in lanes 8-15, each half loaded from its own group's bytes
// (`next` = the distance from group g's data to group g + 1's). Every output lane runs
// the same integer sums and the same float32 instructions in the same order either way,
// so Z16 gives Y8's results bit for bit, for twice the rows per instruction.
struct Y8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t groups = 1;
  static I load(const void* p, int64_t) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  }
  // 8 float16 values at p, widened to float32
  static F half8(const at::Half* p, int64_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // 8 unsigned bytes at p, as float32 lanes
  static F u8_ps(const uint8_t* p, int64_t) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // 8 int8 values at p as int32 lanes
  static I i8_epi32(const int8_t* p, int64_t) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // x's 4 codes at p in every dword lane (one vpbroadcastd from memory)
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I bytes(char c) { return _mm256_set1_epi8(c); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  template <int n> static I srl16(I a) { return _mm256_srli_epi16(a, n); }
  template <int n> static I sll16(I a) { return _mm256_slli_epi16(a, n); }
  static I abs8(I a) { return _mm256_sign_epi8(a, a); }
  // x with the sign of w moved onto it (zero where w is; |w| is zero there anyway)
  static I sign8(I x, I w) { return _mm256_sign_epi8(x, w); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  template <int n> static I sll32(I a) { return _mm256_slli_epi32(a, n); }
  static I mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I zero() { return _mm256_setzero_si256(); }
  // asks for the `bytes` at p (a multiple of 64) in L1, non-temporal or not as
  // weight_prefetch_nta says (a hint, it never faults). Prefill is the same either way
  // (a group's weights stay in L1 over its tiles of x rows).
  static void prefetch(const void* p, int64_t, int bytes) {
    const char* c = static_cast<const char*>(p);
    if (weight_prefetch_nta) {
      for (int o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_NTA);
    } else {
      for (int o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
    }
  }
#ifdef FLARE_DPBUSD
  // acc + (per dword lane) the sum of the 4 products u8 u[j] x s8 s[j], in int32 (wraps,
  // never saturates; the sums here stay far below 2^31)
  static I dpbusd(I acc, I u, I s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
  }
  // dpbusd(acc, u, bcast(p)): with AVX-512 one instruction whose signed operand is the
  // dword at p broadcast from memory (EVEX {1to8}), which GCC does not fold by itself
  static I dpbusd_bcast(I acc, I u, const int8_t* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    asm("vpdpbusd %2%{1to8%}, %1, %0"
        : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
#else
    return dpbusd(acc, u, bcast(p));
#endif
  }
#endif
  static F to_ps(I a) { return _mm256_cvtepi32_ps(a); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F neg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
};

#ifdef FLARE_ZMM
struct Z16 {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t groups = 2;
  static I load(const void* p, int64_t next) {
    const auto* b = static_cast<const uint8_t*>(p);
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + next)), 1);
  }
  static F half8(const at::Half* p, int64_t next) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + next)), 1));
  }
  static __m128i two8(const void* p, int64_t next) {  // 8 bytes at p, 8 at p + next
    const auto* b = static_cast<const uint8_t*>(p);
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + next)));
  }
  static F u8_ps(const uint8_t* p, int64_t next) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(two8(p, next)));
  }
  static I i8_epi32(const int8_t* p, int64_t next) {
    return _mm512_cvtepi8_epi32(two8(p, next));
  }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I bytes(char c) { return _mm512_set1_epi8(c); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  template <int n> static I srl16(I a) { return _mm512_srli_epi16(a, n); }
  template <int n> static I sll16(I a) { return _mm512_slli_epi16(a, n); }
  static I abs8(I a) { return _mm512_abs_epi8(a); }
  // no vpsignb in AVX-512: negate x where w < 0 and keep it where w == 0 (|w| = 0 there,
  // so the product, and the integer sum, are Y8's)
  static I sign8(I x, I w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  template <int n> static I sll32(I a) { return _mm512_slli_epi32(a, n); }
  static I mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I zero() { return _mm512_setzero_si512(); }
  static void prefetch(const void* p, int64_t next, int bytes) {  // both groups' bytes
    Y8::prefetch(p, 0, bytes);
    Y8::prefetch(static_cast<const char*>(p) + next, 0, bytes);
  }
  static I dpbusd(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I dpbusd_bcast(I acc, I u, const int8_t* p) {  // as Y8's, {1to16}
    asm("vpdpbusd %2%{1to16%}, %1, %0"
        : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
  static F to_ps(I a) { return _mm512_cvtepi32_ps(a); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F neg(F a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
#endif

// A Q4_1-style group's block scales and mins: float16 [nb, 8] each, as stored; `next`
// elements on to the next group's.
struct HalfScales {
  const at::Half* d;
  const at::Half* m;
  int64_t next;
  template <typename V>
  inline void load(V, int64_t kb, typename V::F& d8, typename V::F& m8) const {
    d8 = V::half8(d + kb * 8, next);
    m8 = V::half8(m + kb * 8, next);
  }
};

// The block scales of a Q4_0 or Q5_0 group (float16 [nb, 8], `next` elements on to the
// next group's) and mins derived from them: min `factor` x d (-8 for Q4_0, -16 for Q5_0),
// exact in float32 (a power-of-two multiple), so the very value a stored float16 min
// would widen to. Saves the 0.5 bits a weight a stored min takes.
struct DerivedMinScales {
  const at::Half* d;
  int64_t next;
  float factor;
  template <typename V>
  inline void load(V, int64_t kb, typename V::F& d8, typename V::F& m8) const {
    d8 = V::half8(d + kb * 8, next);
    m8 = V::mul(d8, V::set1(factor));
  }
};

// A Q4_K group's block scales and mins, computed from the 6-bit sub-block scale sc and
// min m (uint8 [nb, 8] each, `next_b` bytes on to the next group's) and the super-block's
// d and dmin (float16 [nb / 8, 8], `next_h` elements on): scale d * sc and min
// -(dmin * m). Both products are exact in float32 (11 + 6 bits), so they are the very
// values gguf's dequantization multiplies and subtracts.
struct Q4KScales {
  const uint8_t* sc;
  const uint8_t* m;
  const at::Half* d;
  const at::Half* dmin;
  int64_t next_b, next_h;
  template <typename V>
  inline void load(V, int64_t kb, typename V::F& d8, typename V::F& m8) const {
    d8 = V::mul(V::half8(d + (kb / 8) * 8, next_h), V::u8_ps(sc + kb * 8, next_b));
    m8 = V::neg(V::mul(V::half8(dmin + (kb / 8) * 8, next_h), V::u8_ps(m + kb * 8, next_b)));
  }
};

#ifdef FLARE_DPBUSD
// sum_s dpbusd(w[s], x's dword s): a block's 32 products per lane, in two chains (each
// vpdpbusd waits for its accumulator, and one chain of 8 would leave the units idle);
// the integer sum is exact in any order
template <typename V>
FLARE_INLINE typename V::I dot8(const typename V::I* w, const int8_t* xb) {
  typename V::I a = V::zero(), b = V::zero();
  for (int s = 0; s < 8; s += 2) {
    a = V::dpbusd_bcast(a, w[s], xb + 4 * s);
    b = V::dpbusd_bcast(b, w[s + 1], xb + 4 * s + 4);
  }
  return V::add32(a, b);
}
#endif

// Per dword lane, the sum of `chunks` x 4 signed codes w[0..chunks) (int32, exact): with
// x biased by 128, sum (q + 128) c = sum q c + 128 * code_sum, so the kernels subtract
// code_sum << 7. Two chains, as in dot8.
template <typename V, int chunks>
FLARE_INLINE typename V::I code_sum(const typename V::I* w) {
  const typename V::I ones = V::bytes(1);
  typename V::I a = V::zero(), b = V::zero();
  for (int s = 0; s < chunks; s += 2) {
    a = V::dpbusd(a, ones, w[s]);
    b = V::dpbusd(b, ones, w[s + 1]);
  }
  return V::add32(a, b);
}

// How far ahead of the block being computed the group kernels ask for weight bytes
// (V::prefetch). Decode streams every weight from memory once a call, and the hardware
// prefetcher, following 8 (16 with Z16) interleaved streams a group, falls behind: on a
// Zen 5 EPYC (2 threads, 48 weight copies, so not in cache) q8 at 8 rows ran 1.14-1.23x
// faster with it and Q6_K 1.53x, q4 1.04x, 1 row 1.00-1.07x; 512 bytes ahead was slower
// than 1,024, and 2,048 gave q8 1.15x more at 8 rows and tied elsewhere.
constexpr int64_t PREFETCH_AHEAD = 2048;

// Asks for the weight bytes a pass will read `ahead` bytes after the block at cb, which
// lies `at` bytes into its group (groups are stored one after another, `next` bytes
// each). Y8 reads one group, then the next: the bytes ahead are simply further on. Z16
// reads groups g and g + 1 side by side, then g + 2 and g + 3, so past group g's end the
// bytes ahead are the next pair's, one group further on (group g + 1's are being read
// already). Without that wrap the start of each pair's second group was never asked for,
// and 8-row passes waited on memory: the embedded model's decode step at 8 sequences
// went from 12.2 to 9.2-9.6 ms with it (bench/ab_builds.py --batch 8, Xeon with AMX, 2
// threads). Plain `inline`: with FLARE_INLINE, GCC 12 dropped every prefetch instruction
// of its callers.
template <typename V>
inline void prefetch_ahead(const void* cb, int64_t at, int64_t next, int bytes,
                           int64_t ahead = PREFETCH_AHEAD) {
  const char* p = static_cast<const char*>(cb) + ahead;
  if constexpr (V::groups > 1) {
    if (at + ahead >= next) p += next;
  }
  V::prefetch(p, next, bytes);
}

// A q4 group block's codes (128 bytes at cb; with Z16 the next group's `next` bytes on)
// as 8 registers: w[s] holds elements 4s..4s+3 of the block for each row, a dword lane a
// row (the layout vpdpbusd and AMX's B tile take).
template <typename V>
FLARE_INLINE void q4_codes(const uint8_t* cb, int64_t next, typename V::I* w) {
  const typename V::I low = V::bytes(0x0F);
  for (int ch = 0; ch < 4; ++ch) {
    const typename V::I raw = V::load(cb + 32 * ch, next);
    w[ch] = V::and_(raw, low);
    w[ch + 4] = V::and_(V::template srl16<4>(raw), low);
  }
}

// A 5-bit group block's codes: q4's low nibbles plus the block's 32-byte plane of high
// bits at hp (`next_h` bytes on to the next group's), byte 4i + b of which holds in bit s
// the high bit of row i's element 4s + b; codes 0..31, laid out as q4_codes'.
template <typename V>
FLARE_INLINE void q5_codes(const uint8_t* cb, int64_t next, const uint8_t* hp, int64_t next_h,
                     typename V::I* w) {
  using I = typename V::I;
  const I bit4 = V::bytes(0x10);
  const I hb = V::load(hp, next_h);
  q4_codes<V>(cb, next, w);
  // bit s of each plane byte to bit 4 (16-bit shifts: the mask drops what crosses bytes)
  w[0] = V::or_(w[0], V::and_(V::template sll16<4>(hb), bit4));
  w[1] = V::or_(w[1], V::and_(V::template sll16<3>(hb), bit4));
  w[2] = V::or_(w[2], V::and_(V::template sll16<2>(hb), bit4));
  w[3] = V::or_(w[3], V::and_(V::template sll16<1>(hb), bit4));
  w[4] = V::or_(w[4], V::and_(hb, bit4));
  w[5] = V::or_(w[5], V::and_(V::template srl16<1>(hb), bit4));
  w[6] = V::or_(w[6], V::and_(V::template srl16<2>(hb), bit4));
  w[7] = V::or_(w[7], V::and_(V::template srl16<3>(hb), bit4));
}

// A q8 group block's signed codes (256 bytes at cb; with Z16 the next group's `next`
// bytes on) as 8 registers, laid out as q4_codes'.
template <typename V>
FLARE_INLINE void q8_codes(const int8_t* cb, int64_t next, typename V::I* w) {
  for (int ch = 0; ch < 8; ++ch) w[ch] = V::load(cb + 32 * ch, next);
}

// One block's float32 math for one row of x, given its exact integer sums p (as float32,
// a lane per weight row): every kernel and variant runs these, in this order, which is
// why their bits agree. q4 and q5 codes: acc + (d * dx) * p, then + m * sx (x's block
// scale dx and block sum sx; the weights' scales d and mins m).
template <typename V>
FLARE_INLINE typename V::F q4_term(typename V::F acc, typename V::F d8, typename V::F m8,
                             typename V::F p, float dx, float sx) {
  acc = V::fmadd(V::mul(d8, V::set1(dx)), p, acc);
  return V::fmadd(m8, V::set1(sx), acc);
}

// The signed-code formats (q8, Q6_K): acc + (d * dx) * p.
template <typename V>
FLARE_INLINE typename V::F q8_term(typename V::F acc, typename V::F d8, typename V::F p, float dx) {
  return V::fmadd(V::mul(d8, V::set1(dx)), p, acc);
}

// R rows of quantized x against one q4 group (two with Z16, `next` bytes apart): acc[r]
// (a lane per weight row). `scales.load(V{}, kb, d8, m8)` gives block kb's scales and
// mins as float32.
template <typename V, int R, typename Scales>
inline void q4_group(const uint8_t* pc, int64_t next, const Scales& scales, const int8_t* xq,
                     const float* xd, const float* xs, int64_t K, typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  const int64_t nb = K / QK;
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  for (int64_t kb = 0; kb < nb; ++kb) {
    const uint8_t* cb = pc + kb * 128;
    prefetch_ahead<V>(cb, kb * 128, next, 128);
    I w[8];
    q4_codes<V>(cb, next, w);
    F d8, m8;
    scales.load(V{}, kb, d8, m8);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + kb * QK;
#ifdef FLARE_DPBUSD
      const F p = V::to_ps(dot8<V>(w, xb));
#else
      // each int16 pair sum is at most 2 * 15 * 127 = 3810 in magnitude: 8 of them add
      // up without overflow
      const __m256i ones = _mm256_set1_epi16(1);
      __m256i s16 = _mm256_maddubs_epi16(w[0], V::bcast(xb));
      for (int s = 1; s < 8; ++s)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[s], V::bcast(xb + 4 * s)));
      const F p = V::to_ps(_mm256_madd_epi16(s16, ones));
#endif
      acc[r] = q4_term<V>(acc[r], d8, m8, p, xd[r * nb + kb], xs[r * nb + kb]);
    }
  }
}

// R rows of quantized x against one 5-bit group (Q5_0, Q5_1, Q5_K): q4's low nibbles
// (128 bytes a block) plus a 32-byte plane of high bits (`ph`, `next_h` bytes on to the
// next group's), byte 4i + b of which holds in bit s the high bit of row i's element
// 4s + b, so w[s] takes its fifth bits from one shift and mask of the plane.
// `scales` as for q4_group; codes 0..31.
template <typename V, int R, typename Scales>
inline void q5_group(const uint8_t* pc, int64_t next, const uint8_t* ph, int64_t next_h,
                     const Scales& scales, const int8_t* xq, const float* xd,
                     const float* xs, int64_t K, typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  const int64_t nb = K / QK;
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  for (int64_t kb = 0; kb < nb; ++kb) {
    const uint8_t* cb = pc + kb * 128;
    prefetch_ahead<V>(cb, kb * 128, next, 128);
    // the plane has a quarter of the codes' bytes: as many blocks ahead is a quarter as far
    prefetch_ahead<V>(ph + kb * 32, kb * 32, next_h, 64, PREFETCH_AHEAD / 4);
    I w[8];
    q5_codes<V>(cb, next, ph + kb * 32, next_h, w);
    F d8, m8;
    scales.load(V{}, kb, d8, m8);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + kb * QK;
#ifdef FLARE_DPBUSD
      const F p = V::to_ps(dot8<V>(w, xb));
#else
      // a pair sum is at most 2 * 31 * 127 = 7874: four add up in int16 (31496), so the
      // block's two halves go to int32 apart
      const __m256i ones = _mm256_set1_epi16(1);
      __m256i a16 = _mm256_maddubs_epi16(w[0], V::bcast(xb));
      __m256i b16 = _mm256_maddubs_epi16(w[4], V::bcast(xb + 16));
      for (int s = 1; s < 4; ++s) {
        a16 = _mm256_add_epi16(a16, _mm256_maddubs_epi16(w[s], V::bcast(xb + 4 * s)));
        b16 = _mm256_add_epi16(b16, _mm256_maddubs_epi16(w[s + 4], V::bcast(xb + 16 + 4 * s)));
      }
      const F p = V::to_ps(
          _mm256_add_epi32(_mm256_madd_epi16(a16, ones), _mm256_madd_epi16(b16, ones)));
#endif
      acc[r] = q4_term<V>(acc[r], d8, m8, p, xd[r * nb + kb], xs[r * nb + kb]);
    }
  }
}

// 8 int8 scales at p (one per row) as int16 pairs: dword lane i holds scale i in both
// halves, so vpmaddwd against two int16 partial sums gives scale * (their sum).
[[maybe_unused]] inline __m256i scale_pairs(const int8_t* p) {
  const __m256i v = Y8::i8_epi32(p, 0);
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
                         _mm256_slli_epi32(v, 16));
}

// R rows of quantized x against one Q6_K group: codes c = q - 32 (int8, -32..31) in the
// q8 layout, int8 scales per 16 values ([nb * 2, 8]: block kb's halves at 16 kb and
// 16 kb + 8), float16 d per super-block of 256 ([nb / 8, 8]); the next group's codes,
// scales and d are `next`, `next_s` and `next_d` elements on. Per block of 32 and row:
//   p = sc_lo * sum_{j<16}(c_j q_j) + sc_hi * sum_{j>=16}(c_j q_j)      (int32, exact)
//   y += (d * dx) * p
// |p| <= 2 * 128 * 16 * 32 * 127 < 2^24, so its float32 conversion is exact too.
// x is biased (q + 128) in the vpdpbusd builds (kBiasedSignedX), signed otherwise.
template <typename V, int R>
inline void q6k_group(const int8_t* pc, int64_t next, const int8_t* psc, int64_t next_s,
                      const at::Half* pd, int64_t next_d, const int8_t* xq, const float* xd,
                      int64_t K, typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  const int64_t nb = K / QK;
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  for (int64_t kb = 0; kb < nb; ++kb) {
    const int8_t* cb = pc + kb * 256;
    prefetch_ahead<V>(cb, kb * 256, next, 256);
    I raw[8];
    q8_codes<V>(cb, next, raw);
    const F d8 = V::half8(pd + (kb / 8) * 8, next_d);
#ifdef FLARE_DPBUSD
    const I lo = V::i8_epi32(psc + kb * 16, next_s), hi = V::i8_epi32(psc + kb * 16 + 8, next_s);
    // 128 * (sc_lo * sum_{j<16} c_j + sc_hi * sum_{j>=16} c_j): what x's bias adds to p
    const I bias = V::template sll32<7>(V::add32(V::mul32(code_sum<V, 4>(raw), lo),
                                                 V::mul32(code_sum<V, 4>(raw + 4), hi)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + kb * QK;
      // each half's biased sum is at most 16 * 255 * 32 = 130560: times a scale (<= 128),
      // far below 2^31
      I a32 = V::zero(), b32 = V::zero();
      for (int ch = 0; ch < 4; ++ch) {
        a32 = V::dpbusd(a32, V::bcast(xb + 4 * ch), raw[ch]);
        b32 = V::dpbusd(b32, V::bcast(xb + 16 + 4 * ch), raw[ch + 4]);
      }
      const I p = V::sub32(V::add32(V::mul32(a32, lo), V::mul32(b32, hi)), bias);
      acc[r] = q8_term<V>(acc[r], d8, V::to_ps(p), xd[r * nb + kb]);
    }
#else
    I mag[8];
    for (int ch = 0; ch < 8; ++ch) mag[ch] = V::abs8(raw[ch]);  // |c| <= 32
    const I lo = scale_pairs(psc + kb * 16), hi = scale_pairs(psc + kb * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + kb * QK;
      // c * q = |c| * (q * sign(c)); a pair sum is at most 2 * 32 * 127 = 8128: four add
      // up in int16 (32512)
      __m256i a16 = _mm256_maddubs_epi16(mag[0], V::sign8(V::bcast(xb), raw[0]));
      __m256i b16 = _mm256_maddubs_epi16(mag[4], V::sign8(V::bcast(xb + 16), raw[4]));
      for (int ch = 1; ch < 4; ++ch) {
        a16 = _mm256_add_epi16(a16, _mm256_maddubs_epi16(
            mag[ch], V::sign8(V::bcast(xb + 4 * ch), raw[ch])));
        b16 = _mm256_add_epi16(b16, _mm256_maddubs_epi16(
            mag[ch + 4], V::sign8(V::bcast(xb + 16 + 4 * ch), raw[ch + 4])));
      }
      const I p = _mm256_add_epi32(_mm256_madd_epi16(a16, lo), _mm256_madd_epi16(b16, hi));
      acc[r] = q8_term<V>(acc[r], d8, V::to_ps(p), xd[r * nb + kb]);
    }
#endif
  }
}

// R rows of quantized x against one q8 group (signed codes; the next group's codes and
// scales `next` and `next_s` elements on). x is biased (q + 128) in the vpdpbusd builds
// (kBiasedSignedX), signed otherwise.
template <typename V, int R>
inline void q8_group(const int8_t* pc, int64_t next, const at::Half* ps, int64_t next_s,
                     const int8_t* xq, const float* xd, int64_t K, typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  const int64_t nb = K / QK;
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  for (int64_t kb = 0; kb < nb; ++kb) {
    const int8_t* cb = pc + kb * 256;
    prefetch_ahead<V>(cb, kb * 256, next, 256);
    I raw[8];
    q8_codes<V>(cb, next, raw);
    const F d8 = V::half8(ps + kb * 8, next_s);
#ifdef FLARE_DPBUSD
    const I bias = V::template sll32<7>(code_sum<V, 8>(raw));  // 128 * sum(c)
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + kb * QK;
      // |sum (q + 128) c| <= 32 * 255 * 128 < 2^20: exact in int32
      I s0 = V::zero(), s1 = V::zero();  // two chains, as in dot8
      for (int ch = 0; ch < 8; ch += 2) {
        s0 = V::dpbusd(s0, V::bcast(xb + 4 * ch), raw[ch]);
        s1 = V::dpbusd(s1, V::bcast(xb + 4 * ch + 4), raw[ch + 1]);
      }
      const I s32 = V::sub32(V::add32(s0, s1), bias);
      acc[r] = q8_term<V>(acc[r], d8, V::to_ps(s32), xd[r * nb + kb]);
    }
#else
    I mag[8];
    for (int ch = 0; ch < 8; ++ch) mag[ch] = V::abs8(raw[ch]);  // |c| (-128: byte 0x80, 128 unsigned)
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + kb * QK;
      // c * q = |c| * (q * sign(c)); a pair sum reaches 2 * 128 * 127 = 32512 (no
      // saturation), so each goes to int32 before the next is added
      I s32 = V::zero();
      for (int ch = 0; ch < 8; ++ch) {
        const I xs = V::sign8(V::bcast(xb + 4 * ch), raw[ch]);
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(mag[ch], xs),
                                                      _mm256_set1_epi16(1)));
      }
      acc[r] = q8_term<V>(acc[r], d8, V::to_ps(s32), xd[r * nb + kb]);
    }
#endif
  }
}

// Rows of x a pass over a group: 4 with Y8 (registers: 8 codes, 4 sums, 4 more); with
// Z16, 8 (8 codes, 8 sums and the rest fit the 32 zmm registers). The byte formats fit 8
// since x is biased for them (no |c| registers beside the codes): q8 at 128-512 rows of
// 1536 x 768 went 1.40x faster (Zen 5, 2 threads, in cache), Q6_K 1.29x, from the bias
// and the 8 rows together.
constexpr int64_t TILE = 4;
constexpr int64_t ZTILE = 8;
// Calls of 16 rows of x or more (prompts) take the zmm kernels 16 rows at a time, the
// rest 8 at most: a block's codes, unpacked once into 8 registers, then serve 16 rows
// rather than 8 (16 accumulators, 8 code registers and the block's scales still fit the
// 32 zmm registers). bench/kernel_ab.py --hot, 512 rows, Zen 4 EPYC, 2 threads: Q6_K
// 1.06-1.19x, q5 1.07x, q4 and q8 1.02-1.04x (16 rows: the same or better; 8: unchanged).
constexpr int64_t ZTILE_WIDE = 16;
// Which is faster at few rows of x (decode of 1-4 sequences) depends on the CPU, so the
// AVX-512 variant takes Z16 from `zmm_min_rows` rows of x on (`set_zmm_min_rows`), a lone
// last group Y8. flare.kernels.register_width measures both on this machine once and sets
// it: on a Xeon with AMX Z16 won from one row (bench/ab_builds.py, 2 threads: a step of
// the embedded model's q4x8 at batch 1 1.04-1.17x faster, at 2 and 4 1.09-1.21x), on a
// Zen 4 EPYC Y8 won at 1-4 rows (a step at batch 1 1.28x, 2 1.18x, 4 1.10x). Both give
// the same bits, so this chooses speed only. Set before the kernels run, read by each call.
int64_t zmm_min_rows = 1;
template <typename V>
constexpr int64_t tile_rows = std::is_same_v<V, Y8> ? TILE : ZTILE_WIDE;

// Group g's outputs (and g + 1's with Z16) for rows first.. of x, in tiles of T rows while
// T are left, then of at most T_REST (the group's weights stay in L1 between tiles). Each
// row's sums and float math are its own, so the tiling never changes a result.
template <typename V, int64_t T, int64_t T_REST, typename GroupFn>
inline void group_rows(int64_t B, int64_t N, float* out, int64_t g, GroupFn& group,
                       int64_t first = 0) {
  for (int64_t b0 = first; b0 < B;) {
    const int64_t rows = B - b0 >= T ? T : std::min(T_REST, B - b0);
    typename V::F acc[T];
    group(V{}, g, b0, rows, acc);
    for (int64_t r = 0; r < rows; ++r) V::store(out + (b0 + r) * N + 8 * g, acc[r]);
    b0 += rows;
  }
}

// Splits groups g0 .. N / 8 over torch's threads, in pairs, for rows first .. B of x: with
// Z16 in the AVX-512 variant from zmm_min_rows rows on (a lone last group takes Y8),
// ZTILE rows of x a Z16 pass and TILE a Y8 one. `group(V{}, g, b0, rows, acc)` computes
// rows b0 .. b0 + rows of x against group g (and g + 1 with Z16) into acc. The group
// kernels' only call site: with a second one (the AMX build's), GCC left them out of
// line, and their registers went through memory (q8 at 8-16 rows of x ran 0.95x as fast).
template <typename GroupFn>
void for_groups(int64_t B, int64_t N, float* out, GroupFn group, int64_t first = 0,
                int64_t g0 = 0) {
  const int64_t G = N / 8;
#ifdef FLARE_ZMM
  constexpr int64_t W = Z16::groups;
#else
  constexpr int64_t W = Y8::groups;
#endif
  const int64_t U = (G - g0 + W - 1) / W;
  const int64_t grain = std::max<int64_t>(1, U / (4 * at::get_num_threads()) + 1);
  flare_team::for_range(0, U, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = g0 + W * u;
#ifdef FLARE_ZMM
      if (g + 1 < G && B - first >= zmm_min_rows) {
        group_rows<Z16, ZTILE_WIDE, ZTILE>(B, N, out, g, group, first);
        continue;
      }
#endif
      for (int64_t h = g; h < std::min(G, g + W); ++h)
        group_rows<Y8, TILE, TILE>(B, N, out, h, group, first);
    }
  });
}

// The block formats on AMX tiles (`amx_pair_rows`), one struct a format: `codes` gives a
// pair of groups' block kb in Z16 registers (tile B's rows), `bias` (the signed-code
// formats only) what x's bias of 128 adds to each lane's sum, and `block` the float32
// math of one block for 16 rows of x from its integer sums: q4_term / q8_term, as the
// group kernels run them, so the bits are the same. Member templates, so only the AMX
// build instantiates them.
// xd, xs: x's block scales and sums, [B, nb].
template <typename Scales>
struct Q4Tiles {  // q4 codes with float scales and mins: Q4_0, Q4_1, Q4_K
  static constexpr bool kSigned = false;
  const uint8_t* pc;
  int64_t next;
  Scales scales;
  const float *xd, *xs;
  int64_t nb;
  template <typename V> void codes(int64_t kb, typename V::I* w) const {
    q4_codes<V>(pc + kb * 128, next, w);
  }
  template <typename V>
  void block(int64_t kb, int64_t b0, const int32_t* p, const int32_t*,
             typename V::F* acc) const {
    typename V::F d8, m8;
    scales.load(V{}, kb, d8, m8);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const typename V::F ps = V::to_ps(_mm512_loadu_si512(p + 16 * r));
      acc[r] = q4_term<V>(acc[r], d8, m8, ps, xd[(b0 + r) * nb + kb], xs[(b0 + r) * nb + kb]);
    }
  }
};

template <typename Scales>
struct Q5Tiles : Q4Tiles<Scales> {  // 5-bit codes: Q5_0, Q5_1, Q5_K
  const uint8_t* ph;
  int64_t next_h;
  template <typename V> void codes(int64_t kb, typename V::I* w) const {
    q5_codes<V>(this->pc + kb * 128, this->next, ph + kb * 32, next_h, w);
  }
};

struct Q8Tiles {  // signed codes, x biased: Q8_0
  static constexpr bool kSigned = true;
  const int8_t* pc;
  int64_t next;
  const at::Half* ps;
  int64_t next_s;
  const float* xd;
  int64_t nb;
  template <typename V> void codes(int64_t kb, typename V::I* w) const {
    q8_codes<V>(pc + kb * 256, next, w);
  }
  template <typename V> typename V::I bias(const typename V::I* w) const {
    return V::template sll32<7>(code_sum<V, 8>(w));  // 128 * sum(c)
  }
  template <typename V>
  void block(int64_t kb, int64_t b0, const int32_t* p, const int32_t* bias,
             typename V::F* acc) const {
    const typename V::F d8 = V::half8(ps + kb * 8, next_s);
    const typename V::I b = _mm512_loadu_si512(bias);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const typename V::I s32 = V::sub32(_mm512_loadu_si512(p + 16 * r), b);
      acc[r] = q8_term<V>(acc[r], d8, V::to_ps(s32), xd[(b0 + r) * nb + kb]);
    }
  }
};

#ifdef FLARE_AMX
// Rows of x a tile holds. Calls with AMX_MIN_ROWS rows or more take the tiles for every
// whole tile of rows, and the Z16 kernels for the rest: at 16 rows the tiles ran 0.75-1.19x
// the Z16 kernels, from 64 rows 1.13-1.43x (bench/kernel_ab.py --hot, q4, q8, Q5_0 at
// 1536 x 576 and 576 x 1536, Xeon with AMX, 2 threads). Q6_K stays on Z16: its sub-block
// scales take two half-block products (k = 16), which ran 0.5-0.6x.
constexpr int64_t AMX_ROWS = 16;
constexpr int64_t AMX_MIN_ROWS = 32;

// Groups g and g + 1 (one 16-lane Z16 pass) for rows 0 .. B16 of x (a multiple of 16),
// on tiles: the pair's codes are laid out once; then for each 16 rows of x, the tiles
// compute each block's exact integer sums (two products in flight, amx.h's slots), and
// `fmt.block` scales them into acc block by block, in order.
// xq: x's codes [B, K] (biased where Fmt::kSigned). Scratch, the thread's own: panel, the
// pair's codes in tile B's layout (512 bytes a block); bias, their biases (16 int32 a
// block); sums, a ring of two blocks' sums (256 int32 each).
template <typename Fmt>
void amx_pair_rows(const Fmt& fmt, int64_t B16, int64_t K, int64_t N, int64_t g,
                   const int8_t* xq, float* out, std::vector<uint8_t>& panel,
                   std::vector<int32_t>& bias, std::vector<int32_t>& sums) {
  using V = Z16;
  const int64_t nb = K / QK;
  panel.resize(nb * 512);
  bias.resize(nb * 16);
  sums.resize(512);
  for (int64_t kb = 0; kb < nb; ++kb) {
    V::I w[8];
    fmt.template codes<V>(kb, w);
    for (int s = 0; s < 8; ++s) _mm512_storeu_si512(panel.data() + kb * 512 + 64 * s, w[s]);
    if constexpr (Fmt::kSigned)
      _mm512_storeu_si512(bias.data() + kb * 16, fmt.template bias<V>(w));
  }
  flare_amx::tile_memory_barrier();  // the panel is stored before any tile loads it
  const uint8_t* wp = panel.data();
  int32_t* sp = sums.data();
  for (int64_t b0 = 0; b0 < B16; b0 += AMX_ROWS) {
    flare_amx::tile_memory_barrier();  // the last rows' reads of the sums come first
    const int8_t* xt = xq + b0 * K;
    V::F acc[16];
    for (auto& a : acc) a = V::fzero();
    // slot 0 the even blocks, slot 1 the odd ones, each two blocks ahead of the scaling: a
    // block's sums are stored (into the ring, in L1) while the next block's product runs,
    // and scaled while the tiles compute the block after (a tile store right after its
    // own product stalled on it; GCC's tile intrinsics paste their tile numbers into
    // assembly, so the slots are literals in a macro)
#define FLARE_TILE_ISSUE(C, A, B, KB)                                      \
  do {                                                                     \
    _tile_zero(C);                                                         \
    _tile_loadd(A, xt + (KB) * QK, K);                                     \
    _tile_loadd(B, wp + (KB) * 512, 64);                                   \
    if constexpr (Fmt::kSigned)                                            \
    _tile_dpbusd(C, A, B); /* x biased (unsigned) by signed codes */     \
    else                                                                   \
    _tile_dpbsud(C, A, B); /* signed x by unsigned codes */              \
  } while (0)
    int32_t* ring0 = sp;
    int32_t* ring1 = sp + 256;
    FLARE_TILE_ISSUE(0, 2, 3, 0);
    if (nb > 1) FLARE_TILE_ISSUE(1, 4, 5, 1);
    for (int64_t kb = 0; kb < nb; kb += 2) {
      _tile_stored(0, ring0, 64);
      flare_amx::tile_memory_barrier();
      if (kb + 2 < nb) FLARE_TILE_ISSUE(0, 2, 3, kb + 2);
      fmt.template block<V>(kb, b0, ring0, bias.data() + kb * 16, acc);
      if (kb + 1 == nb) break;
      _tile_stored(1, ring1, 64);
      flare_amx::tile_memory_barrier();
      if (kb + 3 < nb) FLARE_TILE_ISSUE(1, 4, 5, kb + 3);
      fmt.template block<V>(kb + 1, b0, ring1, bias.data() + (kb + 1) * 16, acc);
    }
#undef FLARE_TILE_ISSUE
    for (int r = 0; r < 16; ++r) V::store(out + (b0 + r) * N + 8 * g, acc[r]);
  }
}
#endif

// for_groups, and where this build has AMX tiles and the call has AMX_MIN_ROWS rows of x,
// each pair of groups on tiles: `tiles(g)` gives the format's struct above for groups g
// and g + 1. A lone last group, and the rows past the last whole tile, then take `group`
// through for_groups. The same bits either way.
// xq: x's codes [B, K] as the group kernels take them.
template <typename GroupFn, typename TilesOf>
void for_groups(int64_t B, int64_t N, float* out, GroupFn group,
                [[maybe_unused]] const int8_t* xq, [[maybe_unused]] int64_t K,
                [[maybe_unused]] TilesOf tiles) {
#ifdef FLARE_AMX
  if (B >= AMX_MIN_ROWS && flare_amx::available()) {
    const int64_t G = N / 8, B16 = B / AMX_ROWS * AMX_ROWS;
    at::parallel_for(0, G / 2, 1, [&](int64_t u0, int64_t u1) {
      flare_amx::configure();
      std::vector<uint8_t> panel;
      std::vector<int32_t> bias, sums;
      for (int64_t u = u0; u < u1; ++u)
        amx_pair_rows(tiles(2 * u), B16, K, N, 2 * u, xq, out, panel, bias, sums);
      flare_amx::release();
    });
    if (G % 2 == 1) for_groups(B16, N, out, group, 0, G - 1);
    if (B16 < B) for_groups(B, N, out, group, B16);
    return;
  }
#endif
  for_groups(B, N, out, group);
}

// CALL with the compile-time R = R_ (1 .. 4, or with MAXR 16 also 5 .. 8 and 16)
#define FLARE_DISPATCH_GTILE(R_, MAXR, CALL)                       \
  if constexpr (MAXR == 16) {                                      \
    switch (R_) {                                                  \
      case 16: { constexpr int R = 16; CALL; } return;             \
      case 5: { constexpr int R = 5; CALL; } return;               \
      case 6: { constexpr int R = 6; CALL; } return;               \
      case 7: { constexpr int R = 7; CALL; } return;               \
      case 8: { constexpr int R = 8; CALL; } return;               \
      default: break;                                              \
    }                                                              \
  }                                                                \
  switch (R_) {                                                    \
    case 1: { constexpr int R = 1; CALL; } break;                  \
    case 2: { constexpr int R = 2; CALL; } break;                  \
    case 3: { constexpr int R = 3; CALL; } break;                  \
    default: { constexpr int R = 4; CALL; } break;                 \
  }

void check_part(const torch::Tensor& t, const char* what, torch::ScalarType type, int64_t N,
                int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == type && t.is_contiguous() &&
                  t.size(0) == N && t.size(1) == cols,
              what, " must be contiguous ", type, " [", N, ", ", cols, "]");
}

// Calls run(scales_of), scales_of(g) giving group g's block scales and mins (nb blocks a
// group): the stored float16 mins `mn`, or, for a weight that holds none (mn null: Q4_0,
// Q5_0), `factor` x each scale (DerivedMinScales).
template <typename Run>
void with_block_scales(const at::Half* sc, const at::Half* mn, int64_t nb, float factor,
                       Run run) {
  if (mn == nullptr)
    run([=](int64_t g) { return DerivedMinScales{sc + g * nb * 8, nb * 8, factor}; });
  else
    run([=](int64_t g) { return HalfScales{sc + g * nb * 8, mn + g * nb * 8, nb * 8}; });
}

void check_packed(const torch::Tensor& x, const torch::Tensor& codes,
                  const torch::Tensor& scales, int64_t K) {
  flare_qrows::check_common(x, codes, scales, K, torch::kHalf);
  TORCH_CHECK(codes.size(0) % 8 == 0, "packed weights have a multiple of 8 rows, got ",
              codes.size(0));
}

torch::Tensor q4x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& out = c10::nullopt) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8,
              "q4 codes must be uint8 [N, K/2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, B = x.size(0);
  check_packed(x, codes, scales, K);
  // Q4_0 holds no mins ([N, 0]): each is -8 times its scale
  const bool derived = mins.dim() == 2 && mins.size(1) == 0;
  check_part(mins, "q4 mins", torch::kHalf, N, derived ? 0 : K / QK);
  auto y = flare_checks::output_f32(out, {B, N}, x);
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  const QuantizedRows xr(x, true);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const at::Half* mn = derived ? nullptr : mins.data_ptr<at::Half>();
  with_block_scales(scales.data_ptr<at::Half>(), mn, nb, -8.0f, [&](auto scales_of) {
    for_groups(B, N, y.data_ptr<float>(),
               [&](auto lanes, int64_t g, int64_t b0, int64_t rows, auto* acc) {
      using V = decltype(lanes);
      FLARE_DISPATCH_GTILE(rows, tile_rows<V>,
                           (q4_group<V, R>(c + g * nb * 128, nb * 128, scales_of(g),
                                           xr.q + b0 * K, xr.d + b0 * nb,
                                           xr.s + b0 * nb, K, acc)));
    }, xr.q, K, [&](int64_t g) {
      return Q4Tiles<decltype(scales_of(g))>{c + g * nb * 128, nb * 128, scales_of(g),
                                             xr.d, xr.s, nb};
    });
  });
  return y;
}

torch::Tensor q8x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& out = c10::nullopt) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8,
              "q8 codes must be int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), B = x.size(0);
  check_packed(x, codes, scales, K);
  auto y = flare_checks::output_f32(out, {B, N}, x);
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  const QuantizedRows xr(x, false, kBiasedSignedX);
  const int8_t* c = codes.data_ptr<int8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  for_groups(B, N, y.data_ptr<float>(),
             [&](auto lanes, int64_t g, int64_t b0, int64_t rows, auto* acc) {
    using V = decltype(lanes);
    FLARE_DISPATCH_GTILE(rows, tile_rows<V>,
                         (q8_group<V, R>(c + g * nb * 256, nb * 256, sc + g * nb * 8,
                                         nb * 8, xr.q + b0 * K, xr.d + b0 * nb,
                                         K, acc)));
  }, xr.q, K, [&](int64_t g) {
    return Q8Tiles{c + g * nb * 256, nb * 256, sc + g * nb * 8, nb * 8, xr.d, nb};
  });
  return y;
}

void check_k(const torch::Tensor& x, const torch::Tensor& codes, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [B, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % 256 == 0, "K-quant weights need K a multiple of 256, got ", K);
  TORCH_CHECK(codes.is_contiguous() && codes.size(0) % 8 == 0,
              "packed weights have contiguous codes and a multiple of 8 rows, got ",
              codes.size(0));
}

// the scale parts Q4_K and Q5_K share: a scale and a min byte per 32-block, and each
// 256-block's float16 d and dmin
void check_kscales(const torch::Tensor& scales, const torch::Tensor& mins,
                   const torch::Tensor& d, const torch::Tensor& dmin, int64_t N, int64_t K,
                   const std::string& kind) {
  check_part(scales, (kind + " scales").c_str(), torch::kUInt8, N, K / QK);
  check_part(mins, (kind + " mins").c_str(), torch::kUInt8, N, K / QK);
  check_part(d, (kind + " d").c_str(), torch::kHalf, N, K / 256);
  check_part(dmin, (kind + " dmin").c_str(), torch::kHalf, N, K / 256);
}

torch::Tensor q4kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& mins,
                           const torch::Tensor& d, const torch::Tensor& dmin,
                           const c10::optional<torch::Tensor>& out = c10::nullopt) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8,
              "q4k codes must be uint8 [N, K/2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, B = x.size(0);
  check_k(x, codes, K);
  check_kscales(scales, mins, d, dmin, N, K, "q4k");
  auto y = flare_checks::output_f32(out, {B, N}, x);
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  const QuantizedRows xr(x, true);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* sc = scales.data_ptr<uint8_t>();
  const uint8_t* mn = mins.data_ptr<uint8_t>();
  const at::Half* pd = d.data_ptr<at::Half>();
  const at::Half* pm = dmin.data_ptr<at::Half>();
  // group g's scales, for the group kernel and the tiles alike
  const auto kscales = [&](int64_t g) {
    return Q4KScales{sc + g * nb * 8, mn + g * nb * 8, pd + g * nb, pm + g * nb, nb * 8, nb};
  };
  for_groups(B, N, y.data_ptr<float>(),
             [&](auto lanes, int64_t g, int64_t b0, int64_t rows, auto* acc) {
    using V = decltype(lanes);
    const Q4KScales gs = kscales(g);
    FLARE_DISPATCH_GTILE(rows, tile_rows<V>, (q4_group<V, R>(c + g * nb * 128, nb * 128, gs,
                                            xr.q + b0 * K,
                                            xr.d + b0 * nb, xr.s + b0 * nb, K,
                                            acc)));
  }, xr.q, K, [&](int64_t g) {
    return Q4Tiles<Q4KScales>{c + g * nb * 128, nb * 128, kscales(g), xr.d,
                              xr.s, nb};
  });
  return y;
}

torch::Tensor q6kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& d,
                           const c10::optional<torch::Tensor>& out = c10::nullopt) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8,
              "q6k codes must be int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), B = x.size(0);
  check_k(x, codes, K);
  check_part(scales, "q6k scales", torch::kInt8, N, K / 16);
  check_part(d, "q6k d", torch::kHalf, N, K / 256);
  auto y = flare_checks::output_f32(out, {B, N}, x);
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  const QuantizedRows xr(x, false, kBiasedSignedX);
  const int8_t* c = codes.data_ptr<int8_t>();
  const int8_t* sc = scales.data_ptr<int8_t>();
  const at::Half* pd = d.data_ptr<at::Half>();
  for_groups(B, N, y.data_ptr<float>(),
             [&](auto lanes, int64_t g, int64_t b0, int64_t rows, auto* acc) {
    using V = decltype(lanes);
    FLARE_DISPATCH_GTILE(rows, tile_rows<V>,
                         (q6k_group<V, R>(c + g * nb * 256, nb * 256, sc + g * nb * 16,
                                                nb * 16, pd + g * nb, nb,
                                             xr.q + b0 * K, xr.d + b0 * nb, K,
                                             acc)));
  });
  return y;
}

torch::Tensor q5x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& high, const torch::Tensor& scales,
                          const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& out = c10::nullopt) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8,
              "q5 codes must be uint8 [N, K/2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, B = x.size(0);
  check_packed(x, codes, scales, K);
  check_part(high, "q5 high bits", torch::kUInt8, N, K / 8);
  // Q5_0 holds no mins ([N, 0]): each is -16 times its scale
  const bool derived = mins.dim() == 2 && mins.size(1) == 0;
  check_part(mins, "q5 mins", torch::kHalf, N, derived ? 0 : K / QK);
  auto y = flare_checks::output_f32(out, {B, N}, x);
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  const QuantizedRows xr(x, true);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* h = high.data_ptr<uint8_t>();
  const at::Half* mn = derived ? nullptr : mins.data_ptr<at::Half>();
  with_block_scales(scales.data_ptr<at::Half>(), mn, nb, -16.0f, [&](auto scales_of) {
    for_groups(B, N, y.data_ptr<float>(),
               [&](auto lanes, int64_t g, int64_t b0, int64_t rows, auto* acc) {
      using V = decltype(lanes);
      FLARE_DISPATCH_GTILE(rows, tile_rows<V>,
                           (q5_group<V, R>(c + g * nb * 128, nb * 128, h + g * nb * 32,
                                           nb * 32, scales_of(g), xr.q + b0 * K,
                                           xr.d + b0 * nb, xr.s + b0 * nb,
                                           K, acc)));
    }, xr.q, K, [&](int64_t g) {
      using S = decltype(scales_of(g));
      return Q5Tiles<S>{{c + g * nb * 128, nb * 128, scales_of(g), xr.d, xr.s,
                         nb}, h + g * nb * 32, nb * 32};
    });
  });
  return y;
}

torch::Tensor q5kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& high, const torch::Tensor& scales,
                           const torch::Tensor& mins, const torch::Tensor& d,
                           const torch::Tensor& dmin,
                           const c10::optional<torch::Tensor>& out = c10::nullopt) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8,
              "q5k codes must be uint8 [N, K/2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, B = x.size(0);
  check_k(x, codes, K);
  check_part(high, "q5k high bits", torch::kUInt8, N, K / 8);
  check_kscales(scales, mins, d, dmin, N, K, "q5k");
  auto y = flare_checks::output_f32(out, {B, N}, x);
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  const QuantizedRows xr(x, true);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* h = high.data_ptr<uint8_t>();
  const uint8_t* sc = scales.data_ptr<uint8_t>();
  const uint8_t* mn = mins.data_ptr<uint8_t>();
  const at::Half* pd = d.data_ptr<at::Half>();
  const at::Half* pm = dmin.data_ptr<at::Half>();
  // group g's scales, for the group kernel and the tiles alike
  const auto kscales = [&](int64_t g) {
    return Q4KScales{sc + g * nb * 8, mn + g * nb * 8, pd + g * nb, pm + g * nb, nb * 8, nb};
  };
  for_groups(B, N, y.data_ptr<float>(),
             [&](auto lanes, int64_t g, int64_t b0, int64_t rows, auto* acc) {
    using V = decltype(lanes);
    const Q4KScales gs = kscales(g);
    FLARE_DISPATCH_GTILE(rows, tile_rows<V>,
                         (q5_group<V, R>(c + g * nb * 128, nb * 128, h + g * nb * 32,
                                               nb * 32, gs,
                                            xr.q + b0 * K, xr.d + b0 * nb,
                                            xr.s + b0 * nb, K, acc)));
  }, xr.q, K, [&](int64_t g) {
    return Q5Tiles<Q4KScales>{{c + g * nb * 128, nb * 128, kscales(g), xr.d,
                               xr.s, nb},
                              h + g * nb * 32, nb * 32};
  });
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> quantize_rows_q8(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [B, K] tensor");
  const int64_t B = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  auto q = torch::empty({B, K}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({B, K / QK}, x.options());
  quantize_rows(x.data_ptr<float>(), B, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                nullptr);
  return {q, d};
}

}  // namespace

namespace flare_ops {  // ops.h
torch::Tensor q4x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& out) {
  return ::q4x8_linear(x, codes, scales, mins, out);
}
torch::Tensor q8x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& out) {
  return ::q8x8_linear(x, codes, scales, out);
}
torch::Tensor q4kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& mins,
                           const torch::Tensor& d, const torch::Tensor& dmin,
                           const c10::optional<torch::Tensor>& out) {
  return ::q4kx8_linear(x, codes, scales, mins, d, dmin, out);
}
torch::Tensor q6kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& d,
                           const c10::optional<torch::Tensor>& out) {
  return ::q6kx8_linear(x, codes, scales, d, out);
}
torch::Tensor q5x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& high, const torch::Tensor& scales,
                          const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& out) {
  return ::q5x8_linear(x, codes, high, scales, mins, out);
}
torch::Tensor q5kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& high, const torch::Tensor& scales,
                           const torch::Tensor& mins, const torch::Tensor& d,
                           const torch::Tensor& dmin,
                           const c10::optional<torch::Tensor>& out) {
  return ::q5kx8_linear(x, codes, high, scales, mins, d, dmin, out);
}
}  // namespace flare_ops

void flare_register_qdot8(pybind11::module_& m) {
  m.def("q4x8_linear", &q4x8_linear,
        "y[B, N] = x[B, K] @ dequant_q4(W)^T with x quantized to int8 blocks, float32; "
        "mins [N, 0] (Q4_0): each block's min is -8 x its scale",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("mins"),
        pybind11::arg("out") = pybind11::none());
  m.def("q8x8_linear", &q8x8_linear,
        "y[B, N] = x[B, K] @ dequant_q8(W)^T with x quantized to int8 blocks, float32",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("out") = pybind11::none());
  m.def("q4kx8_linear", &q4kx8_linear,
        "y[B, N] = x[B, K] @ dequant_q4_k(W)^T with x quantized to int8 blocks, float32",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("mins"), pybind11::arg("d"), pybind11::arg("dmin"),
        pybind11::arg("out") = pybind11::none());
  m.def("q6kx8_linear", &q6kx8_linear,
        "y[B, N] = x[B, K] @ dequant_q6_k(W)^T with x quantized to int8 blocks, float32",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("d"),
        pybind11::arg("out") = pybind11::none());
  m.def("q5x8_linear", &q5x8_linear,
        "y[B, N] = x[B, K] @ dequant_q5(W)^T (Q5_0, Q5_1) with x quantized to int8 blocks; "
        "mins [N, 0] (Q5_0): each block's min is -16 x its scale",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("high"),
        pybind11::arg("scales"), pybind11::arg("mins"),
        pybind11::arg("out") = pybind11::none());
  m.def("q5kx8_linear", &q5kx8_linear,
        "y[B, N] = x[B, K] @ dequant_q5_k(W)^T with x quantized to int8 blocks, float32",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("high"),
        pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("d"),
        pybind11::arg("dmin"),
        pybind11::arg("out") = pybind11::none());
  m.def("quantize_rows_q8", &quantize_rows_q8,
        "(codes int8 [B, K], scales float32 [B, K/32]): x's rows in Q8_0 blocks",
        pybind11::arg("x"));
  m.def("set_zmm_min_rows", [](int64_t rows) {
          TORCH_CHECK(rows >= 1, "zmm_min_rows must be >= 1, got ", rows);
          zmm_min_rows = rows;
        },
        "the AVX-512 variant's int8 kernels take two 8-row groups a zmm register from "
        "this many rows of x on (one group a ymm register below it; the same bits either "
        "way); other variants ignore it",
        pybind11::arg("rows"));
  m.def("zmm_min_rows", [] { return zmm_min_rows; },
        "the rows of x from which the AVX-512 variant's int8 kernels take zmm registers");
  m.def("set_weight_prefetch_nta", [](bool nta) { weight_prefetch_nta = nta; },
        "whether the int8 kernels prefetch their weights non-temporally (_MM_HINT_NTA) "
        "or into every cache level (_MM_HINT_T0); a hint only, the same bits either way",
        pybind11::arg("nta"));
  m.def("weight_prefetch_nta", [] { return weight_prefetch_nta; },
        "whether the int8 kernels prefetch their weights non-temporally");
}
