// Row plumbing shared by Flare's block-quantized GEMMs (qgemm.cpp, qdot8.cpp): argument
// checks, the split of output rows over torch's thread pool, and the dispatch of a tile of
// x rows to a kernel templated on its row count.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace flare_qrows {

constexpr int64_t QK = 32;   // values per block
constexpr int64_t TILE = 8;  // rows of x per pass over a weight row (registers: 8 + 5)

// x float32 [B, K], contiguous codes [N, ...] and scales `scale_type` [N, K/32].
inline void check_common(const torch::Tensor& x, const torch::Tensor& codes,
                         const torch::Tensor& scales, int64_t K,
                         torch::ScalarType scale_type = torch::kFloat32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [B, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(),
              "codes and scales must be contiguous");
  TORCH_CHECK(scales.scalar_type() == scale_type && scales.dim() == 2 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == K / QK,
              "scales must be ", scale_type, " [N, K/32]");
}

// Output rows are split over torch's intra-op threads; rows of x go in tiles of TILE, so
// within an output row every tile reuses the weight row while it is in L1.
template <typename RowFn>
void for_rows(int64_t B, int64_t N, RowFn row) {
  const int64_t grain = std::max<int64_t>(8, N / (4 * at::get_num_threads()) + 1);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b0 = 0; b0 < B; b0 += TILE) row(n, b0, std::min(TILE, B - b0));
  });
}

}  // namespace flare_qrows

// CALL with `constexpr int R` bound to the tile's row count R_ (1..TILE).
#define FLARE_DISPATCH_R(R_, CALL)                                 \
  switch (R_) {                                                    \
    case 1: { constexpr int R = 1; CALL; } break;                  \
    case 2: { constexpr int R = 2; CALL; } break;                  \
    case 3: { constexpr int R = 3; CALL; } break;                  \
    case 4: { constexpr int R = 4; CALL; } break;                  \
    case 5: { constexpr int R = 5; CALL; } break;                  \
    case 6: { constexpr int R = 6; CALL; } break;                  \
    case 7: { constexpr int R = 7; CALL; } break;                  \
    default: { constexpr int R = 8; CALL; } break;                 \
  }
