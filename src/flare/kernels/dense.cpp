// Flare's row-invariant dense GEMMs for float16 and float32 weights (AVX2/FMA/F16C).
//
// y [M, N] = x [M, K] W^T (+ bias) with x float32 and W stored in column panels:
//
//   dense_pack(w [N, K] float16 or float32) -> panels [ceil(N/16), K, 16] (same dtype)
//       panels[p, k, j] = w[16 p + j, k]; rows beyond N are zeros. One k step of a panel
//       is 16 consecutive outputs' weights, so one (or two, for float16) loads feed 16
//       accumulators.
//   f16_linear(x [M, K] float32, panels float16 [ceil(N/16), K, 16], N, bias [N] or None)
//       -> y [M, N] float32
//   f32_linear(x, panels float32 [ceil(N/16), K, 16], N, bias or None) -> y [M, N]
//
// THE INVARIANCE RULE. Every output element is one chain
//     acc = 0.0f;  for k = 0 .. K-1 in order: acc = fma(x[i, k], w[n, k], acc);
//     y[i, n] = acc (+ bias[n], one rounded add)
// whatever M, the tile that computes it, the thread that runs it or the thread count:
// row i of a call with M rows is bit for bit the same row computed alone. (fbgemm's fp16
// GEMM and MKL's sgemm pick their blocking, and so their summation order, by M.) The
// float16 weights are widened exactly (vcvtph2ps), so f16_linear is the float32 product
// with the float16-rounded weights, summed in order.
//
// Microkernel: an outer product over k of R rows of x (broadcast) by P panels of W (16
// columns each) into R x 2P registers of 8 floats. Tile shapes are chosen by the rows
// left (6 x 16 for prompts, 1 x 64 for decode: 8 independent chains hide the FMA
// latency; see MAX_PANELS) since the arithmetic per element never depends on the shape.
// K is never split; no lanes are ever reduced into each other. Work units (a chunk of
// rows x a group of 4 panels) are spread over torch's intra-op pool with
// at::parallel_for; a task gets at least MIN_TASK_MACS multiply-adds, so tiny calls stay
// on the calling thread.
//
// Built by flare.kernels.qgemm() with -O3 -mavx2 -mfma -mf16c -ffp-contract=off (the
// bias add must stay a separate rounding; nothing here may be contracted or reordered).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PANEL = 16;             // outputs per panel
constexpr int64_t GROUP = 4;              // panels per work unit
constexpr int64_t MAX_ROWS = 6;           // rows per register tile
constexpr int64_t CHUNK_ROWS = 48;        // rows per work unit when M > SINGLE_CHUNK_ROWS
constexpr int64_t SINGLE_CHUNK_ROWS = 64; // up to this many rows: one chunk (W read once)
constexpr int64_t MIN_TASK_MACS = 1 << 15;
// panels per tile for R rows: R x 2P accumulators stay within 12 of the 16 registers
constexpr int MAX_PANELS[MAX_ROWS + 1] = {0, 4, 3, 2, 1, 1, 1};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// y[0:n] = v[0:n] (+ bias[0:n]), n < 8: the same single rounded add as the full case.
__attribute__((noinline)) void store_partial(__m256 v, const float* bias, int64_t n,
                                             float* y) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  for (int64_t i = 0; i < n; ++i) y[i] = bias != nullptr ? buf[i] + bias[i] : buf[i];
}

// y[r, c] for r < R, c < min(ncols, 16 P): the chains over k of x rows (stride ldx) with
// the P panels at w (stride pstride elements between panels); ldy: y's row stride.
template <typename T, int R, int P>
void tile(const float* x, int64_t ldx, const T* w, int64_t pstride, int64_t K, float* y,
          int64_t ldy, const float* bias, int64_t ncols) {
  __m256 acc[R][2 * P];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm256_setzero_ps();
  const T* wp = w;
  for (int64_t k = 0; k < K; ++k, wp += PANEL) {
    __m256 wv[2 * P];
    #pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      wv[2 * p] = load8(wp + p * pstride);
      wv[2 * p + 1] = load8(wp + p * pstride + 8);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      #pragma GCC unroll 8
      for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm256_fmadd_ps(xb, wv[j], acc[r][j]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    #pragma GCC unroll 8
    for (int j = 0; j < 2 * P; ++j) {
      const int64_t c = 8 * j;
      if (c + 8 <= ncols) {
        __m256 v = acc[r][j];
        if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
        _mm256_storeu_ps(yr + c, v);
      } else if (c < ncols) {  // the last, partial 8 columns
        store_partial(acc[r][j], bias != nullptr ? bias + c : nullptr, ncols - c, yr + c);
      }
    }
  }
}

template <typename T>
using TileFn = void (*)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t,
                        const float*, int64_t);

template <typename T>
TileFn<T> pick(int R, int P) {
  static const TileFn<T> table[MAX_ROWS][4] = {
      {tile<T, 1, 1>, tile<T, 1, 2>, tile<T, 1, 3>, tile<T, 1, 4>},
      {tile<T, 2, 1>, tile<T, 2, 2>, tile<T, 2, 3>, nullptr},
      {tile<T, 3, 1>, tile<T, 3, 2>, nullptr, nullptr},
      {tile<T, 4, 1>, nullptr, nullptr, nullptr},
      {tile<T, 5, 1>, nullptr, nullptr, nullptr},
      {tile<T, 6, 1>, nullptr, nullptr, nullptr}};
  return table[R - 1][P - 1];
}

template <typename T>
void gemm(const float* x, int64_t M, int64_t K, const T* w, int64_t N, const float* bias,
          float* y) {
  const int64_t NP = (N + PANEL - 1) / PANEL;
  const int64_t pstride = K * PANEL;
  const int64_t groups = (NP + GROUP - 1) / GROUP;
  const int64_t chunk = M <= SINGLE_CHUNK_ROWS ? M : CHUNK_ROWS;
  const int64_t chunks = (M + chunk - 1) / chunk;
  const int64_t unit_macs = std::max<int64_t>(1, chunk * GROUP * PANEL * K);
  const int64_t grain = std::max<int64_t>(1, MIN_TASK_MACS / unit_macs);
  at::parallel_for(0, chunks * groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {  // chunk-major: a thread keeps its rows
      const int64_t r0 = (u / groups) * chunk, r1 = std::min(M, r0 + chunk);
      const int64_t p0 = (u % groups) * GROUP, p1 = std::min(NP, p0 + GROUP);
      for (int64_t r = r0; r < r1;) {
        const int R = static_cast<int>(std::min<int64_t>(MAX_ROWS, r1 - r));
        for (int64_t p = p0; p < p1;) {
          const int P = static_cast<int>(std::min<int64_t>(MAX_PANELS[R], p1 - p));
          const int64_t c0 = p * PANEL;
          pick<T>(R, P)(x + r * K, K, w + p * pstride, pstride, K, y + r * N + c0, N,
                        bias != nullptr ? bias + c0 : nullptr,
                        std::min<int64_t>(N - c0, P * PANEL));
          p += P;
        }
        r += R;
      }
    }
  });
}

torch::Tensor dense_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "dense_pack: w must be 2-D [N, K], got ", w.dim(), "-D");
  TORCH_CHECK(w.scalar_type() == at::kHalf || w.scalar_type() == at::kFloat,
              "dense_pack: w must be float16 or float32, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "dense_pack: w must be on CPU, got ", w.device());
  const int64_t N = w.size(0), K = w.size(1), NP = (N + PANEL - 1) / PANEL;
  // pad the output axis with zero rows, then [NP, 16, K] -> [NP, K, 16]
  torch::Tensor padded = at::constant_pad_nd(w.contiguous(), {0, 0, 0, NP * PANEL - N}, 0);
  return padded.view({NP, PANEL, K}).transpose(1, 2).contiguous();
}

torch::Tensor dense_linear(const char* name, const torch::Tensor& x,
                           const torch::Tensor& panels, int64_t N,
                           const c10::optional<torch::Tensor>& bias, at::ScalarType wtype) {
  TORCH_CHECK(x.dim() == 2, name, ": x must be 2-D [M, K], got ", x.dim(), "-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), name,
              ": x and panels must be on CPU");
  TORCH_CHECK(x.is_contiguous(), name, ": x must be contiguous");
  TORCH_CHECK(panels.scalar_type() == wtype, name, ": panels must be ", wtype, ", got ",
              panels.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL, name,
              ": panels must be [ceil(N/16), K, 16] (from dense_pack), got ",
              panels.sizes());
  TORCH_CHECK(panels.is_contiguous(), name, ": panels must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(N >= 0 && panels.size(0) == (N + PANEL - 1) / PANEL, name, ": N = ", N,
              " needs ", (N + PANEL - 1) / PANEL, " panels, got ", panels.size(0));
  TORCH_CHECK(panels.size(1) == K, name, ": x has K = ", K, " columns, panels have ",
              panels.size(1));
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, name, ": bias must be [", N,
                "], got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == at::kFloat, name, ": bias must be float32, got ",
                bias->scalar_type());
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous(), name,
                ": bias must be a contiguous CPU tensor");
    b = bias->data_ptr<float>();
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (wtype == at::kHalf)
    gemm<uint16_t>(x.data_ptr<float>(), M, K,
                   reinterpret_cast<const uint16_t*>(panels.data_ptr<at::Half>()), N, b,
                   y.data_ptr<float>());
  else
    gemm<float>(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), N, b,
                y.data_ptr<float>());
  return y;
}

torch::Tensor f16_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                         const c10::optional<torch::Tensor>& bias) {
  return dense_linear("f16_linear", x, panels, N, bias, at::kHalf);
}

torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                         const c10::optional<torch::Tensor>& bias) {
  return dense_linear("f32_linear", x, panels, N, bias, at::kFloat);
}

}  // namespace

namespace flare_ops {  // ops.h
torch::Tensor f16_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                         const c10::optional<torch::Tensor>& bias) {
  return ::f16_linear(x, panels, N, bias);
}
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                         const c10::optional<torch::Tensor>& bias) {
  return ::f32_linear(x, panels, N, bias);
}
}  // namespace flare_ops

void flare_register_dense(pybind11::module_& m) {
  m.def("dense_pack", &dense_pack,
        "panels [ceil(N/16), K, 16] (zero-padded rows) of w [N, K], float16 or float32",
        pybind11::arg("w"));
  m.def("f16_linear", &f16_linear,
        "y[M, N] = x[M, K] @ W^T (+ bias), float16 panels, float32 math, row-invariant",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("N"),
        pybind11::arg("bias") = pybind11::none());
  m.def("f32_linear", &f32_linear,
        "y[M, N] = x[M, K] @ W^T (+ bias), float32 panels, row-invariant",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("N"),
        pybind11::arg("bias") = pybind11::none());
}
