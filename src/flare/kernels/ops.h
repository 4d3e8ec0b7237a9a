// The kernels other translation units call directly (layers.cpp): each is the function
// the module registers under the same name, so a native caller runs exactly what the
// Python path runs, bit for bit. Definitions forward to each file's own function.
#pragma once

#include <torch/extension.h>

namespace flare_ops {

// qdot8.cpp
torch::Tensor q4x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor q8x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor q4kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& mins,
                           const torch::Tensor& d, const torch::Tensor& dmin,
                           const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor q6kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& d,
                           const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor q5x8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& high, const torch::Tensor& scales,
                          const torch::Tensor& mins,
                          const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor q5kx8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& high, const torch::Tensor& scales,
                           const torch::Tensor& mins, const torch::Tensor& d,
                           const torch::Tensor& dmin,
                           const c10::optional<torch::Tensor>& out = c10::nullopt);
// dense.cpp
torch::Tensor f16_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                         const c10::optional<torch::Tensor>& bias);
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                         const c10::optional<torch::Tensor>& bias);
// fused.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w,
                           double eps,
                           const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& positions,
                         torch::Tensor& k_cache, torch::Tensor& v_cache,
                         const torch::Tensor& slots, int64_t H, int64_t KVH,
                         const c10::optional<torch::Tensor>& qk_norm, double eps,
                         const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor silu_mul(const torch::Tensor& gu,
                       const c10::optional<torch::Tensor>& out = c10::nullopt);
// attention.cpp
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& gather,
                               const torch::Tensor& lengths, int64_t rows_per_seq,
                               double scale,
                               const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor decode_attention_gather(const torch::Tensor& q, const torch::Tensor& k_cache,
                                      const torch::Tensor& v_cache,
                                      const torch::Tensor& gather,
                                      const torch::Tensor& lengths, double scale,
                                      const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, int64_t start, int64_t length,
                               double scale,
                               const c10::optional<torch::Tensor>& out = c10::nullopt);

}  // namespace flare_ops
