// The rows a dense step reads, built in one native call each: the token embeddings, read
// from the 8-row interleaved blocks (flare.models.quant.interleaved), and the cache slots
// of the decode group's positions.
//
//   q8x8_rows(codes int8 [N, K], scales float16 [N, K/32], ids int64 [T])
//       -> float32 [T, K], row t = the dequantized weight row ids[t]:
//       float(code) * float(scale)
//   q4x8_rows(codes uint8 [N, K/2], scales float16 [N, K/32],
//             mins float16 [N, K/32] (Q4_1) or [N, 0] (Q4_0), ids int64 [T])
//       -> float32 [T, K]: float(code) * float(scale) + min, min = float(stored min),
//       or -8 * float(scale) for Q4_0
//   page_gather(pages list[list[int]], lengths list[int], page_size)
//       -> (gather int64 [B, M], lengths int64 [B]), M = max(lengths):
//       gather[b, p] = page * page_size + p % page_size, page = pages[b][p / page_size],
//       or page 0 where sequence b has fewer pages than position p needs (padding that
//       the caller masks); the decode group of flare.runtime.forward.
//
// The lookups round each value exactly as Q8x8Weight.__getitem__ / Q4x8Weight.__getitem__
// round it in torch (a float32 product, then a float32 sum; the build has
// -ffp-contract=off, so no fused multiply-add), so the rows are the same bits. In torch
// either is a dozen tensor operations, and the gather eight: at batch 1 they cost about
// as much as a layer's small ops, every step.
//
// Layout (interleave(t, chunk)): rows 8g..8g+7 form group g; group g holds, chunk by
// chunk, each of its 8 rows' `chunk` bytes in turn. Codes use 4-byte chunks, scales and
// mins one value. A q4 block of 32 values is 16 bytes: value j < 16 is byte j's low
// nibble, value 16 + j its high nibble.
//
// Raises (c10::Error, a RuntimeError in Python): wrong dtypes or shapes, N not a multiple
// of 8, K not a multiple of 32, an id outside [0, N); page_gather: no sequence, a length
// below 1, a page size below 1, or a page table and lengths of different counts.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t QK = 32;     // values per block
constexpr int64_t GROUP = 8;   // rows per interleaved group
constexpr int64_t CHUNK = 4;   // bytes of a row per interleaved code chunk

void check_rows(const torch::Tensor& codes, const torch::Tensor& scales,
                const torch::Tensor& ids, int64_t K, torch::ScalarType code_type) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == code_type && codes.is_contiguous(),
              "codes must be a contiguous ", code_type, " [N, ...] tensor");
  const int64_t N = codes.size(0);
  TORCH_CHECK(N % GROUP == 0, "N must be a multiple of 8, got ", N);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / QK,
              "scales must be a contiguous float16 [N, K/32] tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
              "ids must be a contiguous int64 [T] tensor");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < N, "id ", id[t], " is outside [0, ", N, ")");
}

// the interleaved position of row r's chunk c, a row holding `chunks_per_row` chunks of
// `chunk` elements (codes: CHUNK bytes; scales and mins: c is the block, one value)
inline int64_t at(int64_t r, int64_t c, int64_t chunks_per_row, int64_t chunk) {
  return ((r / GROUP * chunks_per_row + c) * GROUP + r % GROUP) * chunk;
}

// out float32 [T, K] with row t = fill(ids[t], row t's K floats), rows split over torch's
// threads (each row is written by one call, so the split never changes a value)
template <typename Fill>
torch::Tensor gather_rows(const torch::Tensor& ids, int64_t K, Fill fill) {
  const int64_t T = ids.size(0);
  auto out = torch::empty({T, K}, torch::kFloat32);
  const int64_t* id = ids.data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fill(id[t], od + t * K);
  });
  return out;
}

torch::Tensor q8x8_rows(const torch::Tensor& codes, const torch::Tensor& scales,
                        const torch::Tensor& ids) {
  const int64_t K = codes.size(1);
  check_rows(codes, scales, ids, K, torch::kInt8);
  const int64_t nb = K / QK;
  const int8_t* cd = codes.data_ptr<int8_t>();
  const at::Half* sd = scales.data_ptr<at::Half>();
  return gather_rows(ids, K, [&](int64_t r, float* o) {
    for (int64_t b = 0; b < nb; ++b) {
      const float s = static_cast<float>(sd[at(r, b, nb, 1)]);
      for (int64_t c = b * (QK / CHUNK); c < (b + 1) * (QK / CHUNK); ++c) {
        const int8_t* q = cd + at(r, c, K / CHUNK, CHUNK);
        for (int64_t j = 0; j < CHUNK; ++j) o[c * CHUNK + j] = static_cast<float>(q[j]) * s;
      }
    }
  });
}

torch::Tensor q4x8_rows(const torch::Tensor& codes, const torch::Tensor& scales,
                        const torch::Tensor& mins, const torch::Tensor& ids) {
  const int64_t K = codes.size(1) * 2;
  check_rows(codes, scales, ids, K, torch::kUInt8);
  const int64_t nb = K / QK, N = codes.size(0);
  const bool stored = mins.numel() != 0;  // Q4_1 (else Q4_0: min = -8 * scale)
  TORCH_CHECK(mins.scalar_type() == torch::kHalf && mins.is_contiguous() && mins.dim() == 2 &&
                  mins.size(0) == N && (mins.size(1) == nb || mins.size(1) == 0),
              "mins must be a contiguous float16 [N, K/32] or [N, 0] tensor");
  const uint8_t* cd = codes.data_ptr<uint8_t>();
  const at::Half* sd = scales.data_ptr<at::Half>();
  const at::Half* md = stored ? mins.data_ptr<at::Half>() : nullptr;
  constexpr int64_t BLOCK_BYTES = QK / 2;
  return gather_rows(ids, K, [&](int64_t r, float* o) {
    for (int64_t b = 0; b < nb; ++b) {
      const float s = static_cast<float>(sd[at(r, b, nb, 1)]);
      const float m = stored ? static_cast<float>(md[at(r, b, nb, 1)]) : s * -8.0f;
      for (int64_t c = b * (BLOCK_BYTES / CHUNK); c < (b + 1) * (BLOCK_BYTES / CHUNK); ++c) {
        const uint8_t* q = cd + at(r, c, K / 2 / CHUNK, CHUNK);
        const int64_t j0 = c * CHUNK - b * BLOCK_BYTES;  // byte of the block
        for (int64_t j = 0; j < CHUNK; ++j) {
          float* ob = o + b * QK + j0 + j;
          ob[0] = static_cast<float>(q[j] & 0xF) * s + m;
          ob[BLOCK_BYTES] = static_cast<float>(q[j] >> 4) * s + m;
        }
      }
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> page_gather(
    const std::vector<std::vector<int64_t>>& pages, const std::vector<int64_t>& lengths,
    int64_t page_size) {
  const int64_t B = static_cast<int64_t>(lengths.size());
  TORCH_CHECK(B > 0 && pages.size() == lengths.size(),
              "page_gather needs a page table and a length for each of B >= 1 sequences");
  TORCH_CHECK(page_size > 0, "page_size must be at least 1, got ", page_size);
  int64_t M = 0;
  for (const int64_t n : lengths) {
    TORCH_CHECK(n >= 1, "a decode length must be at least 1, got ", n);
    M = std::max(M, n);
  }
  auto gather = torch::empty({B, M}, torch::kInt64);
  auto lens = torch::empty({B}, torch::kInt64);
  int64_t* g = gather.data_ptr<int64_t>();
  int64_t* ld = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    ld[b] = lengths[b];
    const auto& table = pages[b];
    for (int64_t p = 0; p < M; ++p) {
      const int64_t i = p / page_size;
      const int64_t page = i < static_cast<int64_t>(table.size()) ? table[i] : 0;
      g[b * M + p] = page * page_size + p % page_size;
    }
  }
  return {gather, lens};
}

}  // namespace

void flare_register_rows(pybind11::module_& m) {
  m.def("q8x8_rows", &q8x8_rows,
        "float32 [T, K]: rows ids of a Q8x8Weight, dequantized as its __getitem__",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("ids"));
  m.def("q4x8_rows", &q4x8_rows,
        "float32 [T, K]: rows ids of a Q4x8Weight, dequantized as its __getitem__",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("mins"),
        pybind11::arg("ids"));
  m.def("page_gather", &page_gather,
        "(gather int64 [B, M], lengths int64 [B]): the cache slots of each sequence's "
        "positions 0..M-1 from its page table (page 0 past its pages), M = max(lengths)",
        pybind11::arg("pages"), pybind11::arg("lengths"), pybind11::arg("page_size"));
}
