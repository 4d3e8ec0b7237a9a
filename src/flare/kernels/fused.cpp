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
//       the raw v to v_cache[slots[t]]; q returned
//   silu_mul(gu [T, 2F]) -> y [T, F] = silu(gu[:, :F]) * gu[:, F:]
//   decode_attention(q [H, D], k_cache [S, KVH, D], v_cache [S, KVH, D], start, length,
//                    scale) -> o [H, D]
//       one query token over cache slots [start, start + length): softmax(q K^T * scale) V
//       in fp32, query head h reading KV head h / (H / KVH) (GQA)
//   decode_attention_gather(q [B, H, D], k_cache, v_cache, gather int64 [B, M],
//                           lengths int64 [B], scale) -> o [B, H, D]
//       the same for B sequences, sequence b over slots gather[b, :lengths[b]]
//
// Rows are split over torch's intra-op pool with at::parallel_for only when there are
// many (prefill); the grain keeps a handful of rows, and so decode, on the calling
// thread (a thread handoff costs more than the work). exp is a vectorized polynomial
// (Cephes' expf coefficients, range-reduced by ln 2; ~1 ulp), so silu and softmax differ
// from torch's in the last bits only.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t ROW_GRAIN = 16;  // rows per task: fewer rows run on the calling thread

using flare_simd::dot;
using flare_simd::hsum;

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 floats, x clamped to [-87.3, 88.7]: x = n ln2 + r, |r| <= ln2/2,
// exp(r) by a degree-6 polynomial, times 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n: n in [-126, 128]; split so 2^n never overflows the exponent field
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256 s1 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

inline float exp1(float x) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, exp8(_mm256_set1_ps(x)));
  return buf[0];
}

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

template <typename F>
void for_rows(int64_t T, int64_t grain, F f) {
  if (T <= grain) {  // decode: no thread handoff
    f(0, T);
    return;
  }
  at::parallel_for(0, T, grain, f);
}

void check_f32(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == dim &&
                  t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor with ", dim, " dims");
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
                           double eps) {
  check_f32(x, "x", 2);
  check_f32(r, "r", 2);
  check_f32(w, "w", 1);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(r.size(0) == T && r.size(1) == H, "r must have x's shape [T, H]");
  TORCH_CHECK(w.size(0) == H, "w has ", w.size(0), " elements, x rows ", H);
  auto y = torch::empty_like(x);
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

torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& positions,
                         torch::Tensor& k_cache, torch::Tensor& v_cache,
                         const torch::Tensor& slots, int64_t H, int64_t KVH,
                         const c10::optional<torch::Tensor>& qk_norm, double eps) {
  check_f32(qkv, "qkv", 2);
  check_f32(cos, "cos", 2);
  check_f32(sin, "sin_signed", 2);
  check_f32(k_cache, "k_cache", 3);
  check_f32(v_cache, "v_cache", 3);
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
  auto q = torch::empty({T, H, D}, qkv.options());
  const float* xd = qkv.data_ptr<float>();
  const float* cd = cos.data_ptr<float>();
  const float* snd = sin.data_ptr<float>();
  float* qd = q.data_ptr<float>();
  float* kd = k_cache.data_ptr<float>();
  float* vd = v_cache.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t row = (H + 2 * KVH) * D;
  for_rows(T, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(nw ? D : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = xd + t * row;
      const float* c = cd + pd[t] * D;
      const float* s = snd + pd[t] * D;
      float* kr = kd + sd[t] * KVH * D;
      for (int64_t h = 0; h < H + KVH; ++h) {
        const float* src = x + h * D;
        if (nw) {
          scale_row(src, nw + h * D, inv_rms(src, D, e), D, tmp.data());
          src = tmp.data();
        }
        rope_head(src, c, s, D, h < H ? qd + (t * H + h) * D : kr + (h - H) * D);
      }
      std::memcpy(vd + sd[t] * KVH * D, x + (H + KVH) * D, KVH * D * sizeof(float));
    }
  });
  return q;
}

torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_f32(gu, "gu", 2);
  const int64_t T = gu.size(0), F2 = gu.size(1), F = F2 / 2;
  TORCH_CHECK(F2 % 2 == 0, "gu must have an even number of columns, got ", F2);
  auto y = torch::empty({T, F}, gu.options());
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

// 8 vectors -> one vector of their 8 horizontal sums
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                       _mm256_permute2f128_ps(t0, t1, 0x31));
}

// p[j] = scale * q . k(j) for keys j in [0, M); key j's row at k + slot(j) * stride
template <typename Slot>
void scores(const float* q, const float* k, int64_t stride, Slot slot, int64_t M, int64_t D,
            float sc, float* p) {
  const __m256 scv = _mm256_set1_ps(sc);
  int64_t j = 0;
  if (D % 8 == 0) {
    for (; j + 8 <= M; j += 8) {
      __m256 a[8];
      const float* kr[8];
      for (int r = 0; r < 8; ++r) {
        a[r] = _mm256_setzero_ps();
        kr[r] = k + slot(j + r) * stride;
      }
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 8; ++r)
          a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[r] + i), a[r]);
      }
      _mm256_storeu_ps(p + j, _mm256_mul_ps(hsum8x8(a), scv));
    }
  }
  for (; j < M; ++j) {
    p[j] = dot(q, k + slot(j) * stride, D) * sc;
  }
}

// o[D] = sum_j p[j] v(j), the accumulator in registers (ND = D / 8 vectors)
template <int ND, typename Slot>
void weighted_sum(const float* p, const float* v, int64_t stride, Slot slot, int64_t M,
                  float* o) {
  __m256 acc[ND];
  for (int i = 0; i < ND; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < M; ++j) {
    const __m256 pv = _mm256_set1_ps(p[j]);
    const float* vr = v + slot(j) * stride;
    for (int i = 0; i < ND; ++i)
      acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * i), acc[i]);
  }
  for (int i = 0; i < ND; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

template <typename Slot>
void weighted_sum_any(const float* p, const float* v, int64_t stride, Slot slot, int64_t M,
                      int64_t D, float* o) {
  switch (D) {
    case 64: return weighted_sum<8>(p, v, stride, slot, M, o);
    case 128: return weighted_sum<16>(p, v, stride, slot, M, o);
    case 32: return weighted_sum<4>(p, v, stride, slot, M, o);
    default: break;
  }
  for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
  for (int64_t j = 0; j < M; ++j)
    for (int64_t i = 0; i < D; ++i) o[i] += p[j] * v[slot(j) * stride + i];
}

// One query head q [D] over M keys of one KV head: o [D] = softmax(q K^T * sc) V, where
// key j is row slot(j) of k / v (row stride `stride` floats). pr: scratch of >= M + 7.
template <typename Slot>
void attend_head(const float* q, const float* k, const float* v, int64_t stride, Slot slot,
                 int64_t M, int64_t D, float sc, float* pr, float* o) {
  const int64_t Mp = (M + 7) / 8 * 8;
  scores(q, k, stride, slot, M, D, sc, pr);
  float mx = -INFINITY;  // softmax in place; the padding lanes end as 0
  for (int64_t j = 0; j < M; ++j) mx = std::max(mx, pr[j]);
  bool finite = std::isfinite(mx);  // std::max and exp8's clamps drop NaN: check them here
  for (int64_t j = 0; j < M && finite; ++j) finite = !std::isnan(pr[j]);
  if (!finite) {  // a NaN or infinite score: the output is NaN, as SDPA's
    for (int64_t i = 0; i < D; ++i) o[i] = NAN;
    return;
  }
  for (int64_t j = M; j < Mp; ++j) pr[j] = mx;
  const __m256 mv = _mm256_set1_ps(mx);
  for (int64_t j = 0; j < Mp; j += 8)
    _mm256_storeu_ps(pr + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + j), mv)));
  for (int64_t j = M; j < Mp; ++j) pr[j] = 0.f;
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < Mp; j += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(pr + j));
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
  for (int64_t j = 0; j < Mp; j += 8)
    _mm256_storeu_ps(pr + j, _mm256_mul_ps(_mm256_loadu_ps(pr + j), inv));
  weighted_sum_any(pr, v, stride, slot, M, D, o);
}

void check_caches(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache) {
  check_f32(k_cache, "k_cache", 3);
  check_f32(v_cache, "v_cache", 3);
  const int64_t H = q.size(-2), D = q.size(-1), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [S, KVH, D] with q's D");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "H (", H, ") must be a multiple of KVH (", KVH,
              ") > 0");
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, int64_t start, int64_t length,
                               double scale) {
  check_f32(q, "q", 2);
  check_caches(q, k_cache, v_cache);
  const int64_t H = q.size(0), D = q.size(1), KVH = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(length > 0 && start >= 0 && start <= S - length,
              "slots [", start, ", ", start + length, ") outside the cache [0, ", S, ")");
  const int64_t G = H / KVH;
  auto o = torch::empty({H, D}, q.options());
  const float* qd = q.data_ptr<float>();
  const float* kd = k_cache.data_ptr<float>();
  const float* vd = v_cache.data_ptr<float>();
  float* od = o.data_ptr<float>();
  std::vector<float> pbuf(length + 7);
  const auto slot = [start](int64_t j) { return start + j; };
  for (int64_t hh = 0; hh < H; ++hh) {
    const int64_t kh = hh / G;
    attend_head(qd + hh * D, kd + kh * D, vd + kh * D, KVH * D, slot, length, D,
                static_cast<float>(scale), pbuf.data(), od + hh * D);
  }
  return o;
}

// B sequences' one query token each, over gathered cache slots: sequence b attends to
// slots gather[b, 0 .. lengths[b]). Work is split over (sequence, KV head) pairs.
torch::Tensor decode_attention_gather(const torch::Tensor& q, const torch::Tensor& k_cache,
                                      const torch::Tensor& v_cache,
                                      const torch::Tensor& gather,
                                      const torch::Tensor& lengths, double scale) {
  check_f32(q, "q", 3);
  check_caches(q, k_cache, v_cache);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const int64_t S = k_cache.size(0);
  TORCH_CHECK(gather.dim() == 2 && gather.size(0) == B && gather.is_contiguous() &&
                  gather.scalar_type() == torch::kInt64, "gather must be int64 [B, M]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.is_contiguous() &&
                  lengths.scalar_type() == torch::kInt64, "lengths must be int64 [B]");
  const int64_t M = gather.size(1), G = H / KVH;
  const int64_t* gd = gather.data_ptr<int64_t>();
  const int64_t* ld = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ld[b] >= 1 && ld[b] <= M, "lengths[", b, "] = ", ld[b], " outside [1, ", M,
                "]");
    for (int64_t j = 0; j < ld[b]; ++j)
      TORCH_CHECK(gd[b * M + j] >= 0 && gd[b * M + j] < S, "gather[", b, ", ", j, "] = ",
                  gd[b * M + j], " outside the cache [0, ", S, ")");
  }
  auto o = torch::empty({B, H, D}, q.options());
  const float* qd = q.data_ptr<float>();
  const float* kd = k_cache.data_ptr<float>();
  const float* vd = v_cache.data_ptr<float>();
  float* od = o.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> pbuf(M + 7);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / KVH, kh = w % KVH;
      const int64_t* rows = gd + b * M;
      const auto slot = [rows](int64_t j) { return rows[j]; };
      for (int64_t hh = kh * G; hh < (kh + 1) * G; ++hh)
        attend_head(qd + (b * H + hh) * D, kd + kh * D, vd + kh * D, KVH * D, slot, ld[b], D,
                    sc, pbuf.data(), od + (b * H + hh) * D);
    }
  });
  return o;
}

}  // namespace

void flare_register_fused(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "y[T, H] = w * (x * rsqrt(mean(x^2) + eps)), float32",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "x += r in place; returns rms_norm(x, w, eps)",
        pybind11::arg("x"), pybind11::arg("r"), pybind11::arg("w"), pybind11::arg("eps"));
  m.def("rope_store", &rope_store,
        "optional q/k head norm, RoPE of q and k, k and v written to the cache at slots; "
        "returns q [T, H, D]",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin_signed"),
        pybind11::arg("positions"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slots"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
        pybind11::arg("qk_norm") = pybind11::none(), pybind11::arg("eps") = 1e-6);
  m.def("silu_mul", &silu_mul, "y[T, F] = silu(gu[:, :F]) * gu[:, F:], float32",
        pybind11::arg("gu"));
  m.def("decode_attention_gather", &decode_attention_gather,
        "o[B, H, D]: row b = softmax(q[b] K^T * scale) V over cache slots "
        "gather[b, :lengths[b]], GQA",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("gather"), pybind11::arg("lengths"), pybind11::arg("scale"));
  m.def("decode_attention", &decode_attention,
        "o[H, D] = softmax(q K^T * scale) V over cache slots [start, start + length), GQA",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("start"), pybind11::arg("length"), pybind11::arg("scale"));
}
