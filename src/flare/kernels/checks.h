// Argument checks the kernel files share: each raises a c10::Error (Python's RuntimeError)
// naming the argument, so every kernel reports a bad tensor in the same words.
#pragma once

#include <torch/extension.h>

namespace flare_checks {

// t is a contiguous float32 CPU tensor with `dim` dims
inline void check_f32(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == dim &&
                  t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor with ", dim, " dims");
}

// The KV pool's two caches: contiguous CPU tensors [S, KVH, D] of one element type, float32
// or float16 (the plan's kv_dtype). Shapes against q or qkv are the caller's to check.
inline void check_kv_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  for (const auto* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->device().is_cpu() && c->dim() == 3 && c->is_contiguous() &&
                    (c->scalar_type() == torch::kFloat32 ||
                     c->scalar_type() == torch::kFloat16),
                c == &k_cache ? "k_cache" : "v_cache",
                " must be a contiguous float32 or float16 CPU tensor with 3 dims");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must have one dtype");
}

// A kernel's float32 output of shape `sizes`: `out` when the caller gives one (checked, then
// written in place, so a native caller reuses its buffers step after step), else a new
// tensor with `like`'s options.
inline torch::Tensor output_f32(const c10::optional<torch::Tensor>& out,
                                c10::IntArrayRef sizes, const torch::Tensor& like) {
  if (!out.has_value()) return torch::empty(sizes, like.options());
  TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == torch::kFloat32 &&
                  out->is_contiguous() && out->sizes() == sizes,
              "out must be a contiguous float32 CPU tensor of shape ", sizes, ", got ",
              out->sizes());
  return *out;
}

}  // namespace flare_checks
