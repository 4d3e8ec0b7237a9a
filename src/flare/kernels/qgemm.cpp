// Flare's block-quantized weight GEMMs for x86 CPUs with AVX2 and FMA.
//
// Weights W [N, K] (K a multiple of 32) are stored in blocks of 32 along K:
//   q4: codes uint8 [N, K/2] (16 bytes per block: byte j holds element j in its low
//       nibble and element j + 16 in its high nibble), scales float32 [N, K/32],
//       mins float32 [N, K/32]; value = scale * code + min.
//   q8: codes int8 [N, K], scales float32 [N, K/32]; value = scale * code.
// Activations x [B, K] are float32; y [B, N] = x W^T is accumulated in float32 as
//   sum_blocks scale * sum_j(x_j * code_j) + min * sum_j(x_j),
// with the per-block sums of x computed once per call. Rows of x are processed in
// tiles of up to 8, each block dequantized once per tile. Work is split over output
// rows with at::parallel_for (torch's intra-op thread pool).
//
// Built by flare.kernels.qgemm() with -O3 -mavx2 -mfma -ffp-contract=off (the dequantize
// functions compute scale * code + min with two roundings, as the Python reference does;
// changing this file changes the build key, so the next use rebuilds it).
//
// Cost per block of 32 weights: unpacking takes 12 vector ops (shift, mask, convert x 4),
// then 5 FP ops for one row of x, or 4 scale multiplies plus 4 mul/FMA and 1 add per row
// for several rows. fbgemm's fp16 GEMM converts 8 weights in 1 op, so this kernel wins
// where decode is bound by the bytes read (1-2 rows) and loses where it is bound by
// arithmetic (4+ rows); see flare.models.quant for the measured figures.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "qrows.h"
#include "simd.h"

#include <cstdint>
#include <vector>

namespace {

using flare_qrows::QK;
using flare_qrows::TILE;
using flare_qrows::check_common;
using flare_qrows::for_rows;

using flare_simd::dot;
using flare_simd::hsum;

// The q4 unpacking broadcasts a block's 16 code bytes to both 128-bit lanes; dword lane
// L (0..7) then holds bytes 4*(L%4) .. 4*(L%4)+3, and group g (0..3) shifts lane L right
// by 8*g (+4 for L >= 4) and masks 4 bits. Group g, lane L is element
// 4*(L%4) + g + 16*(L/4) of the block. No cross-lane shuffles are needed; x is permuted
// into that order once per call instead.
inline int64_t q4_perm(int64_t g, int64_t lane) {
  return 4 * (lane % 4) + g + 16 * (lane / 4);
}

// xp [B, K]: x permuted per block into the q4 group order; xs [B, K/32]: block sums.
void prep_x(const float* x, int64_t B, int64_t K, bool permute, float* xp, float* xs) {
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t kb = 0; kb < nb; ++kb) {
      const float* s = x + b * K + kb * QK;
      float sum = 0.f;
      for (int64_t j = 0; j < QK; ++j) sum += s[j];
      xs[b * nb + kb] = sum;
      if (permute) {
        float* d = xp + b * K + kb * QK;
        for (int64_t g = 0; g < 4; ++g)
          for (int64_t l = 0; l < 8; ++l) d[g * 8 + l] = s[q4_perm(g, l)];
      }
    }
  }
}

// One block of 32 dequantized weights (w0..w3: 8 values each, in the order the rows of x
// are laid out in) scaled by d and accumulated into R rows of x. One row: scale the
// block's dot product (5 FP ops per block). Several rows: scale the codes once, then 4
// FMAs per row; a block's partial sum starts from zero, so the chain through acc[r] is
// one add per block, not four FMAs (the loop is latency-bound otherwise).
template <int R>
inline void accumulate_block(__m256 w0, __m256 w1, __m256 w2, __m256 w3, __m256 d,
                             const float* x, int64_t K, __m256* acc) {
  if (R == 1) {
    __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
    t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), t);
    t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), t);
    t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), t);
    acc[0] = _mm256_fmadd_ps(d, t, acc[0]);
  } else {
    const __m256 s0 = _mm256_mul_ps(d, w0), s1 = _mm256_mul_ps(d, w1);
    const __m256 s2 = _mm256_mul_ps(d, w2), s3 = _mm256_mul_ps(d, w3);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      __m256 a = _mm256_mul_ps(s0, _mm256_loadu_ps(xr));
      a = _mm256_fmadd_ps(s1, _mm256_loadu_ps(xr + 8), a);
      a = _mm256_fmadd_ps(s2, _mm256_loadu_ps(xr + 16), a);
      a = _mm256_fmadd_ps(s3, _mm256_loadu_ps(xr + 24), a);
      acc[r] = _mm256_add_ps(acc[r], a);
    }
  }
}

template <int R>
inline void q4_row(const uint8_t* c, const float* sc, const float* mn, const float* xp,
                   const float* xs, int64_t K, float* out, int64_t out_stride) {
  const int64_t nb = K / QK;
  const __m256i mask = _mm256_set1_epi32(0xF);
  const __m256i sh0 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i sh1 = _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12);
  const __m256i sh2 = _mm256_setr_epi32(16, 16, 16, 16, 20, 20, 20, 20);
  const __m256i sh3 = _mm256_setr_epi32(24, 24, 24, 24, 28, 28, 28, 28);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < nb; ++kb) {
    const __m256i raw = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kb * 16)));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(raw, sh0), mask));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(raw, sh1), mask));
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(raw, sh2), mask));
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(raw, sh3), mask));
    accumulate_block<R>(w0, w1, w2, w3, _mm256_broadcast_ss(sc + kb), xp + kb * QK, K, acc);
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) + dot(mn, xs + r * nb, nb);
}

template <int R>
inline void q8_row(const int8_t* c, const float* sc, const float* x, int64_t K, float* out,
                   int64_t out_stride) {
  const int64_t nb = K / QK;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < nb; ++kb) {
    const int8_t* cb = c + kb * QK;
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb))));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + 8))));
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + 16))));
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + 24))));
    accumulate_block<R>(w0, w1, w2, w3, _mm256_broadcast_ss(sc + kb), x + kb * QK, K, acc);
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
}

torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& codes,
                        const torch::Tensor& scales, const torch::Tensor& mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8,
              "q4 codes must be uint8 [N, K/2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, B = x.size(0);
  check_common(x, codes, scales, K);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == torch::kFloat32 &&
                  mins.is_contiguous(), "mins must be float32 like scales");
  auto y = torch::empty({B, N}, x.options());
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  std::vector<float> xp(B * K), xs(B * nb);
  prep_x(x.data_ptr<float>(), B, K, true, xp.data(), xs.data());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* mn = mins.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for_rows(B, N, [&](int64_t n, int64_t b0, int64_t rows) {
    FLARE_DISPATCH_R(rows, (q4_row<R>(c + n * (K / 2), sc + n * nb, mn + n * nb,
                                      xp.data() + b0 * K, xs.data() + b0 * nb, K,
                                      out + b0 * N + n, N)));
  });
  return y;
}

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                        const torch::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8,
              "q8 codes must be int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), B = x.size(0);
  check_common(x, codes, scales, K);
  auto y = torch::empty({B, N}, x.options());
  if (B == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* xd = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for_rows(B, N, [&](int64_t n, int64_t b0, int64_t rows) {
    FLARE_DISPATCH_R(rows, (q8_row<R>(c + n * K, sc + n * nb, xd + b0 * K, K,
                                      out + b0 * N + n, N)));
  });
  return y;
}

// out [N, K] float32 = scale * code + min (two roundings, as the Python reference).
void q4_dequantize_into(const torch::Tensor& codes, const torch::Tensor& scales,
                        const torch::Tensor& mins, torch::Tensor& out) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, nb = K / QK;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kFloat32 &&
                  out.size(0) == N && out.size(1) == K, "out must be float32 [N, K]");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* mn = mins.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t kb = 0; kb < nb; ++kb) {
        const uint8_t* cb = c + n * (K / 2) + kb * 16;
        const __m256 d = _mm256_set1_ps(sc[n * nb + kb]);
        const __m256 m = _mm256_set1_ps(mn[n * nb + kb]);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb));
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0xF));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0xF));
        float* ob = o + n * K + kb * QK;
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int p = 0; p < 4; ++p) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
          _mm256_storeu_ps(ob + 8 * p, _mm256_add_ps(_mm256_mul_ps(d, q), m));
        }
      }
  });
}

torch::Tensor q4_dequantize(const torch::Tensor& codes, const torch::Tensor& scales,
                            const torch::Tensor& mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8 &&
                  codes.is_contiguous(), "q4 codes must be contiguous uint8 [N, K/2]");
  auto out = torch::empty({codes.size(0), codes.size(1) * 2},
                          torch::TensorOptions().dtype(torch::kFloat32));
  q4_dequantize_into(codes, scales, mins, out);
  return out;
}

}  // namespace

void flare_register_fused(pybind11::module_& m);  // fused.cpp
void flare_register_qdot8(pybind11::module_& m);  // qdot8.cpp
void flare_register_dense(pybind11::module_& m);  // dense.cpp
void flare_register_attention(pybind11::module_& m);  // attention.cpp
void flare_register_recurrent(pybind11::module_& m);  // recurrent.cpp
void flare_register_layers(pybind11::module_& m);  // layers.cpp
void flare_register_sample(pybind11::module_& m);  // sample.cpp
void flare_register_rows(pybind11::module_& m);  // rows.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Flare block-quantized (q4, q8) and row-invariant dense (f16, f32) weight GEMMs "
            "and fused float32 ops, AVX2/FMA";
  m.def("q4_linear", &q4_linear, "y[B, N] = x[B, K] @ dequant_q4(W)^T, float32");
  m.def("q8_linear", &q8_linear, "y[B, N] = x[B, K] @ dequant_q8(W)^T, float32");
  m.def("q4_dequantize", &q4_dequantize, "float32 [N, K] = scale * code + min");
  m.def("q4_dequantize_into", &q4_dequantize_into, "as q4_dequantize, into out [N, K]");
  flare_register_qdot8(m);  // q4x8_linear, q8x8_linear, quantize_rows_q8
  flare_register_dense(m);  // dense_pack, f16_linear, f32_linear
  flare_register_fused(m);  // rms_norm, add_rms_norm, rope_store, silu_mul
  flare_register_attention(m);  // cached_attention, decode_attention(_gather)
  flare_register_recurrent(m);  // gated_delta_rule
  flare_register_layers(m);  // DenseLayers: every decoder layer of a dense step
  flare_register_sample(m);  // argmax_rows
  flare_register_rows(m);  // q8x8_rows, q4x8_rows: embedding lookups
}
