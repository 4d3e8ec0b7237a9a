// Flare's fused float32 CPU ops for the dense decoder's small per-layer steps (AVX2/FMA).
//
// Batch-1 decode of a small model spends as long in the small ops between the matmuls
// (RMSNorm, RoPE, K/V store, SiLU*up, attention over ~100 keys) as in the matmuls; each
// op here replaces several torch calls by one pass over the activations. All tensors are
// float32 on CPU (positions and slots int64); see flare.models.llama for the torch
// reference each op follows:
//
//   rms_norm(x [T, H], w [H], eps) -> y [T, H]
//       y = w * (x * rsqrt(mean(x^2) + eps))   (transformers' LlamaRMSNorm, fp32)
//   add_rms_norm(x [T, H], r [T, H], w [H], eps) -> y [T, H]
//       x += r in place (the residual), then y = rms_norm(x, w, eps); one pass per row
//   rope_store(qkv [T, (H + 2 KVH) * D], cos [P, D], sin_signed [P, D], positions [T],
//              k_cache [S, KVH, D], v_cache [S, KVH, D], slots [T], H, KVH,
//              qk_norm [H + KVH, D] or None, eps) -> q [T, H, D]
//       optional per-head RMSNorm of q and k heads (Qwen3), then RoPE of q and k as
//       x * cos + swap_halves(x) * sin_signed (each product rounded, then the sum, as the
//       torch path does: bit for bit without qk_norm), k written to k_cache[slots[t]],
//       the raw v to v_cache[slots[t]]; q returned. The caches are float32 or float16
//       (both one dtype): a float16 cache stores each value rounded to nearest even,
//       as torch's .to(torch.float16) does
//   silu_mul(gu [T, 2F]) -> y [T, F] = silu(gu[:, :F]) * gu[:, F:]
//
// add_rms_norm, rope_store and silu_mul take an optional `out` (their result's shape,
// float32, contiguous), written in place of a new tensor: layers.cpp's step reuses its
// buffers that way.
//
// Attention over the KV cache lives in attention.cpp (one routine for decode and prefill).
//
// Rows are split over torch's intra-op pool with at::parallel_for only when there are
// many (prefill); the grain keeps a handful of rows, and so decode, on the calling
// thread (a thread handoff costs more than the work). exp is a vectorized polynomial
// (simd.h: Cephes' expf coefficients, range-reduced by ln 2; ~1 ulp), so silu differs from
// torch's in the last bits only.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"
#include "ops.h"
#include "checks.h"
#include "team.h"

#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

using flare_checks::check_f32;
using flare_checks::check_kv_caches;

constexpr int64_t ROW_GRAIN = 16;  // rows per task: fewer rows run on the calling thread

using flare_simd::exp1;
using flare_simd::exp8;
using flare_simd::hsum;

inline float sum_squares(const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(u, u, a0);
    a1 = _mm256_fmadd_ps(v, v, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 u = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(u, u, a0);
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// y = w * (x * r), two roundings as transformers' formula
inline void scale_row(const float* x, const float* w, float r, int64_t n, float* y) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                          _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
  for (; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
}

// Rows [0, T) in tasks of `grain` rows; in a decode team (team.h), a row a task, as the
// team's barrier is the only handoff.
template <typename F>
void for_rows(int64_t T, int64_t grain, F f) {
  if (flare_team::active()) {
    flare_team::for_range(0, T, 1, f);
    return;
  }
  if (T <= grain) {  // decode: no thread handoff
    f(0, T);
    return;
  }
  at::parallel_for(0, T, grain, f);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "x", 2);
  check_f32(w, "w", 1);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w.size(0) == H, "w has ", w.size(0), " elements, x rows ", H);
  auto y = torch::empty_like(x);
  const float* xd = x.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(T, ROW_GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      scale_row(xd + t * H, wd, inv_rms(xd + t * H, H, e), H, yd + t * H);
  });
  return y;
}

torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w,
                           double eps, const c10::optional<torch::Tensor>& out = c10::nullopt) {
  check_f32(x, "x", 2);
  check_f32(r, "r", 2);
  check_f32(w, "w", 1);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(r.size(0) == T && r.size(1) == H, "r must have x's shape [T, H]");
  TORCH_CHECK(w.size(0) == H, "w has ", w.size(0), " elements, x rows ", H);
  auto y = flare_checks::output_f32(out, {T, H}, x);
  float* xd = x.data_ptr<float>();
  const float* rd = r.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(T, ROW_GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = xd + t * H;
      const float* rr = rd + t * H;
      __m256 a0 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) {
        const __m256 s = _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i));
        _mm256_storeu_ps(xr + i, s);
        a0 = _mm256_fmadd_ps(s, s, a0);
      }
      float ss = hsum(a0);
      for (; i < H; ++i) {
        xr[i] += rr[i];
        ss += xr[i] * xr[i];
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + e);
      scale_row(xr, wd, inv, H, yd + t * H);
    }
  });
  return y;
}

// out[j] = x[j] * c[j] + x[j ^ half] * s[j], products rounded before the sum
inline void rope_head(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  if (half % 8 == 0) {
    for (int64_t j = 0; j < half; j += 8) {
      const __m256 lo = _mm256_loadu_ps(x + j), hi = _mm256_loadu_ps(x + half + j);
      _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + j)),
                                              _mm256_mul_ps(hi, _mm256_loadu_ps(s + j))));
      _mm256_storeu_ps(out + half + j,
                       _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + j)),
                                     _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + j))));
    }
    return;
  }
  for (int64_t j = 0; j < half; ++j) {
    const float lo = x[j], hi = x[half + j];
    out[j] = lo * c[j] + hi * s[j];
    out[half + j] = hi * c[half + j] + lo * s[half + j];
  }
}

// y[0..n) = x rounded to float16 bits, to nearest even (F16C; torch's .to(float16))
inline void store_half(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& positions,
                         torch::Tensor& k_cache, torch::Tensor& v_cache,
                         const torch::Tensor& slots, int64_t H, int64_t KVH,
                         const c10::optional<torch::Tensor>& qk_norm, double eps,
                         const c10::optional<torch::Tensor>& out = c10::nullopt) {
  check_f32(qkv, "qkv", 2);
  check_f32(cos, "cos", 2);
  check_f32(sin, "sin_signed", 2);
  check_kv_caches(k_cache, v_cache);
  const bool half_cache = k_cache.scalar_type() == torch::kFloat16;
  TORCH_CHECK(H > 0 && KVH > 0, "H and KVH must be positive");
  const int64_t T = qkv.size(0), D = cos.size(1), P = cos.size(0), S = k_cache.size(0);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * KVH) * D,
              "qkv has ", qkv.size(1), " columns, expected (H + 2 KVH) * D = ",
              (H + 2 * KVH) * D);
  TORCH_CHECK(sin.sizes() == cos.sizes(), "sin_signed must have cos's shape [P, D]");
  TORCH_CHECK(k_cache.size(1) == KVH && k_cache.size(2) == D &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [S, KVH, D]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1 &&
                  positions.size(0) == T && slots.scalar_type() == torch::kInt64 &&
                  slots.dim() == 1 && slots.size(0) == T,
              "positions and slots must be int64 [T]");
  const float* nw = nullptr;
  if (qk_norm.has_value()) {
    check_f32(*qk_norm, "qk_norm", 2);
    TORCH_CHECK(qk_norm->size(0) == H + KVH && qk_norm->size(1) == D,
                "qk_norm must be [H + KVH, D]");
    nw = qk_norm->data_ptr<float>();
  }
  const auto pos = positions.contiguous(), sl = slots.contiguous();
  const int64_t* pd = pos.data_ptr<int64_t>();
  const int64_t* sd = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pd[t] >= 0 && pd[t] < P, "position ", pd[t], " outside the table [0, ", P, ")");
    TORCH_CHECK(sd[t] >= 0 && sd[t] < S, "slot ", sd[t], " outside the cache [0, ", S, ")");
  }
  auto q = flare_checks::output_f32(out, {T, H, D}, qkv);
  const float* xd = qkv.data_ptr<float>();
  const float* cd = cos.data_ptr<float>();
  const float* snd = sin.data_ptr<float>();
  float* qd = q.data_ptr<float>();
  char* kd = static_cast<char*>(k_cache.data_ptr());  // float or float16 elements
  char* vd = static_cast<char*>(v_cache.data_ptr());
  const int64_t esize = half_cache ? 2 : 4;
  const float e = static_cast<float>(eps);
  const int64_t row = (H + 2 * KVH) * D;
  for_rows(T, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(nw ? D : 0), krow(half_cache ? KVH * D : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = xd + t * row;
      const float* c = cd + pd[t] * D;
      const float* s = snd + pd[t] * D;
      char* kslot = kd + sd[t] * KVH * D * esize;
      // k heads go straight into a float32 cache, through krow into a float16 one
      float* kr = half_cache ? krow.data() : reinterpret_cast<float*>(kslot);
      for (int64_t h = 0; h < H + KVH; ++h) {
        const float* src = x + h * D;
        if (nw) {
          scale_row(src, nw + h * D, inv_rms(src, D, e), D, tmp.data());
          src = tmp.data();
        }
        rope_head(src, c, s, D, h < H ? qd + (t * H + h) * D : kr + (h - H) * D);
      }
      const float* v = x + (H + KVH) * D;
      char* vslot = vd + sd[t] * KVH * D * esize;
      if (half_cache) {
        store_half(kr, reinterpret_cast<uint16_t*>(kslot), KVH * D);
        store_half(v, reinterpret_cast<uint16_t*>(vslot), KVH * D);
      } else {
        std::memcpy(vslot, v, KVH * D * sizeof(float));
      }
    }
  });
  return q;
}

torch::Tensor silu_mul(const torch::Tensor& gu,
                       const c10::optional<torch::Tensor>& out = c10::nullopt) {
  check_f32(gu, "gu", 2);
  const int64_t T = gu.size(0), F2 = gu.size(1), F = F2 / 2;
  TORCH_CHECK(F2 % 2 == 0, "gu must have an even number of columns, got ", F2);
  auto y = flare_checks::output_f32(out, {T, F}, gu);
  const float* g = gu.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  for_rows(T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* a = g + t * F2;
      const float* b = a + F;
      float* o = yd + t * F;
      const __m256 one = _mm256_set1_ps(1.0f);
      const __m256 neg = _mm256_set1_ps(-0.0f);
      int64_t i = 0;
#ifdef __AVX512F__
      // 16 lanes a pass: exp16's lanes are exp8's bit for bit, and the sign flip, add,
      // divide and multiply are exact IEEE operations either width, so the same values.
      // A decode step at 8 sequences runs this on the calling thread over 8 x 1,536
      // elements a layer: 6.9 us a call with 8 lanes, 5.0 with 16 (Zen 4 EPYC)
      const __m512 one16 = _mm512_set1_ps(1.0f);
      const __m512i sign16 = _mm512_set1_epi32(static_cast<int>(0x80000000u));
      for (; i + 16 <= F; i += 16) {
        const __m512 x = _mm512_loadu_ps(a + i);
        const __m512 e = flare_simd::exp16(
            _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign16)));
        const __m512 sx = _mm512_div_ps(x, _mm512_add_ps(one16, e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(sx, _mm512_loadu_ps(b + i)));
      }
#endif
      for (; i + 8 <= F; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        const __m256 sx = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(sx, _mm256_loadu_ps(b + i)));
      }
      for (; i < F; ++i) o[i] = (a[i] / (1.0f + exp1(-a[i]))) * b[i];
    }
  });
  return y;
}

}  // namespace

namespace flare_ops {  // ops.h
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return ::rms_norm(x, w, eps);
}
torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w,
                           double eps, const c10::optional<torch::Tensor>& out) {
  return ::add_rms_norm(x, r, w, eps, out);
}
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& positions,
                         torch::Tensor& k_cache, torch::Tensor& v_cache,
                         const torch::Tensor& slots, int64_t H, int64_t KVH,
                         const c10::optional<torch::Tensor>& qk_norm, double eps,
                         const c10::optional<torch::Tensor>& out) {
  return ::rope_store(qkv, cos, sin, positions, k_cache, v_cache, slots, H, KVH, qk_norm,
                      eps, out);
}
torch::Tensor silu_mul(const torch::Tensor& gu, const c10::optional<torch::Tensor>& out) {
  return ::silu_mul(gu, out);
}
}  // namespace flare_ops

void flare_register_fused(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "y[T, H] = w * (x * rsqrt(mean(x^2) + eps)), float32",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "x += r in place; returns rms_norm(x, w, eps)",
        pybind11::arg("x"), pybind11::arg("r"), pybind11::arg("w"), pybind11::arg("eps"),
        pybind11::arg("out") = pybind11::none());
  m.def("rope_store", &rope_store,
        "optional q/k head norm, RoPE of q and k, k and v written to the cache at slots; "
        "returns q [T, H, D]",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin_signed"),
        pybind11::arg("positions"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slots"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
        pybind11::arg("qk_norm") = pybind11::none(), pybind11::arg("eps") = 1e-6,
        pybind11::arg("out") = pybind11::none());
  m.def("silu_mul", &silu_mul, "y[T, F] = silu(gu[:, :F]) * gu[:, F:], float32",
        pybind11::arg("gu"), pybind11::arg("out") = pybind11::none());
}
