// Every decoder layer of a dense (recipe `llama`) step in one native call, and the
// output layer on the rows that sample.
//
// `DenseLayers` keeps the model's per-layer weights, described once at load
// (flare.models.native_layers builds the description), and `forward` runs all layers of
// a step: the same kernel functions as LlamaModel._forward_fused, in the same order, on
// the same inputs (ops.h), so the hidden states are bit-identical to that path; only
// the Python between the kernels is gone (wrappers, views, per-layer argument packing).
//
//   DenseLayers(layers, final_norm, cos, sin_signed, num_heads, num_kv_heads, eps, scale,
//               lm_head)
//     layers: per layer (input_norm [hidden], qkv, qk_norm [H + KVH, D] | None, o_proj,
//             post_norm [hidden], gate_up, down); each linear a tuple
//             (kind, tensors, out_features, bias | None, parts) with kind
//               "q4x8" (codes, scales, mins), "q8x8" (codes, scales),
//               "q4kx8" (codes, scales, mins, d, dmin), "q6kx8" (codes, scales, d),
//               "q5x8" (codes, high, scales, mins), "q5kx8" (codes, high, scales, mins,
//               d, dmin), "f16" / "f32" (panels), or "stacked" (parts: linears, outputs
//               concatenated, then the bias added), as flare.models.quant.linear.Linear
//               runs them.
//     lm_head: the output layer, a linear tuple, or None (then forward_logits raises).
//   forward(x [T, hidden], positions int64 [T], slots int64 [T], k [L, S, KVH, D],
//           v [L, S, KVH, D], decode_kind, decode_rows, decode_span, decode_len,
//           decode_gather | None, decode_lengths | None, chunk_starts, chunk_lens,
//           chunk_gathers) -> y [T, hidden]
//     x: the embedded tokens, a fresh contiguous tensor (the residual, updated in
//     place); y: the final norm's output. decode_kind 0: no decode group; 1: one
//     sequence over consecutive slots [decode_span, decode_span + decode_len)
//     (decode_attention); 2: decode_rows sequences over decode_gather [B, M] with
//     decode_lengths [B] (decode_attention_gather). Chunk c: rows
//     [chunk_starts[c], + chunk_lens[c]) over cache slots chunk_gathers[c] [1, ctx].
//   forward_logits(<forward's arguments>, logit_rows) -> logits [N, vocab]
//     forward, then the lm_head on rows logit_rows (N indices into T, in that order), as
//     LlamaModel.logits(hidden[rows]) computes them: the same kernel on the same rows.
//
// Buffers: forward allocates the step's activations once (one tensor each: norm output,
// qkv, q, attention output, o_proj, gate_up, SiLU product, down) and every layer's
// kernels write them in place (their `out` arguments, ops.h); a layer whose widths differ
// from layer 0's gets new tensors instead.
//
// Threads: a decode step of several sequences (no prompt chunk, 2 to 16 rows) of a model
// whose layers all fit the step's buffers runs every layer inside one OpenMP region, its
// threads a team (team.h): each kernel takes its share and ends in a barrier, so there is
// one fork and join a step rather than one a kernel, and the small row ops (norms, SiLU,
// x's quantization at 8 rows) split too (8 sequences: a step 1.02-1.08x faster).
// Otherwise each kernel splits its own work with at::parallel_for (one region per kernel
// that asks for one, as on the Python path; decode's small ops stay on the calling
// thread). Either way the same values: a split never changes one. The GIL is released
// for the whole step.

#include <torch/extension.h>
#include <ATen/ThreadLocalState.h>
#include <omp.h>

#include "ops.h"
#include "team.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;

enum class Kind { Q4X8, Q8X8, Q4KX8, Q6KX8, Q5X8, Q5KX8, F16, F32, STACKED };

struct LinearSpec {
  Kind kind;
  std::vector<torch::Tensor> t;
  int64_t n = 0;
  c10::optional<torch::Tensor> bias;
  std::vector<LinearSpec> parts;
};

LinearSpec parse_linear(const py::handle& obj) {
  const auto tup = obj.cast<py::tuple>();
  TORCH_CHECK(tup.size() == 5, "a linear is (kind, tensors, out_features, bias, parts)");
  LinearSpec s;
  const auto kind = tup[0].cast<std::string>();
  s.t = tup[1].cast<std::vector<torch::Tensor>>();
  s.n = tup[2].cast<int64_t>();
  if (!tup[3].is_none()) s.bias = tup[3].cast<torch::Tensor>();
  size_t want = 0;
  if (kind == "q4x8") s.kind = Kind::Q4X8, want = 3;
  else if (kind == "q8x8") s.kind = Kind::Q8X8, want = 2;
  else if (kind == "q4kx8") s.kind = Kind::Q4KX8, want = 5;
  else if (kind == "q6kx8") s.kind = Kind::Q6KX8, want = 3;
  else if (kind == "q5x8") s.kind = Kind::Q5X8, want = 4;
  else if (kind == "q5kx8") s.kind = Kind::Q5KX8, want = 6;
  else if (kind == "f16") s.kind = Kind::F16, want = 1;
  else if (kind == "f32") s.kind = Kind::F32, want = 1;
  else if (kind == "stacked") s.kind = Kind::STACKED, want = 0;
  else TORCH_CHECK(false, "unknown linear kind '", kind, "'");
  TORCH_CHECK(s.t.size() == want, "linear '", kind, "' takes ", want, " tensors, got ",
              s.t.size());
  for (const auto& p : tup[4].cast<py::list>()) s.parts.push_back(parse_linear(p));
  TORCH_CHECK((s.kind == Kind::STACKED) == !s.parts.empty(),
              "only a 'stacked' linear has parts, and it needs some");
  return s;
}

// A decode team's outputs of stacked linears' parts (stacked_in_team): for part index i,
// views [T, n] of one flat buffer, one view for each width n a part i has in some layer.
// Made before the team starts, as a member must not allocate outside for_range (a
// TensorImpl a view takes could fail on one member only, and the other would wait at a
// barrier), and shared by the members, which only write their rows through them.
using PartViews = std::vector<std::vector<torch::Tensor>>;

torch::Tensor linear(const LinearSpec& s, const torch::Tensor& x,
                     const c10::optional<torch::Tensor>& out = c10::nullopt,
                     const PartViews* part_views = nullptr);

// part_views[i]'s view of width n
const torch::Tensor& part_view(const PartViews& part_views, size_t i, int64_t n) {
  for (const auto& view : part_views[i])
    if (view.size(1) == n) return view;
  TORCH_CHECK(false, "no team buffer for stacked part ", i, " of width ", n);
}

// A stacked linear in a decode team (team.h): part i into its view of part_views, then
// the parts' columns side by side into out [T, N], rows split over the team. Allocates
// nothing.
torch::Tensor stacked_in_team(const LinearSpec& s, const torch::Tensor& x,
                              const torch::Tensor& out, const PartViews& part_views) {
  const int64_t T = x.size(0), N = out.size(1);
  for (size_t i = 0; i < s.parts.size(); ++i)
    linear(s.parts[i], x, part_view(part_views, i, s.parts[i].n));
  float* o = out.data_ptr<float>();
  flare_team::for_range(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t col = 0;
      for (size_t i = 0; i < s.parts.size(); ++i) {
        const int64_t n = s.parts[i].n;
        const float* y = part_view(part_views, i, n).data_ptr<float>();
        std::memcpy(o + t * N + col, y + t * n, n * sizeof(float));
        col += n;
      }
    }
  });
  return out;
}

// y = x W^T (+ b), as Linear.__call__ runs this weight (x contiguous). The int8 kinds
// write y into `out` [B, N] when given, and so does a stacked linear in a decode team
// (its parts through part_views); the others (float panels, stacked parts) return a new
// tensor, so the caller uses what this returns.
torch::Tensor linear(const LinearSpec& s, const torch::Tensor& x,
                     const c10::optional<torch::Tensor>& out,
                     const PartViews* part_views) {
  const auto& t = s.t;
  torch::Tensor y;
  switch (s.kind) {
    case Kind::F16: return flare_ops::f16_linear(x, t[0], s.n, s.bias);
    case Kind::F32: return flare_ops::f32_linear(x, t[0], s.n, s.bias);
    case Kind::Q4X8: y = flare_ops::q4x8_linear(x, t[0], t[1], t[2], out); break;
    case Kind::Q8X8: y = flare_ops::q8x8_linear(x, t[0], t[1], out); break;
    case Kind::Q4KX8: y = flare_ops::q4kx8_linear(x, t[0], t[1], t[2], t[3], t[4], out); break;
    case Kind::Q6KX8: y = flare_ops::q6kx8_linear(x, t[0], t[1], t[2], out); break;
    case Kind::Q5X8: y = flare_ops::q5x8_linear(x, t[0], t[1], t[2], t[3], out); break;
    case Kind::Q5KX8:
      y = flare_ops::q5kx8_linear(x, t[0], t[1], t[2], t[3], t[4], t[5], out);
      break;
    case Kind::STACKED: {
      if (flare_team::active()) {
        y = stacked_in_team(s, x, *out, *part_views);
        break;
      }
      std::vector<torch::Tensor> ys;
      ys.reserve(s.parts.size());
      for (const auto& p : s.parts) ys.push_back(linear(p, x));
      y = torch::cat(ys, 1);
      break;
    }
  }
  if (!s.bias.has_value()) return y;
  if (!flare_team::active()) return y.add_(*s.bias);
  const int64_t N = y.size(1);  // a team adds the bias a row a member, in place
  float* yd = y.data_ptr<float>();
  const float* bd = s.bias->data_ptr<float>();
  flare_team::for_range(0, y.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t r = t0; r < t1; ++r)
      for (int64_t j = 0; j < N; ++j) yd[r * N + j] += bd[j];
  });
  return y;
}

struct Layer {
  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> qk_norm;
  LinearSpec qkv, o_proj, gate_up, down;
};

// Rows a step may have to run as a team: decode of 2 to 16 sequences. At one row the
// team measured no faster (bench/ab_builds.py, Xeon, 2 threads: the embedded model's
// step 3.18 against 3.20 ms, Q4_K_M's 3.33 against 3.51, whose stacked q/k/v adds a
// copy), as most of a batch-1 step's ops are one row on one thread either way; the int8
// kernels' AMX tiles, from 32 rows on, split with at::parallel_for outside teams.
constexpr int64_t TEAM_MIN_ROWS = 2, TEAM_MAX_ROWS = 16;

// Whether a team can run a linear (a team's members must not allocate): an int8 kind,
// which writes the caller's buffer, or a stacked linear of them (stacked_in_team).
bool runs_in_team(const LinearSpec& s) {
  if (s.kind == Kind::F16 || s.kind == Kind::F32) return false;
  return std::all_of(s.parts.begin(), s.parts.end(), [](const LinearSpec& p) {
    return p.kind != Kind::STACKED && runs_in_team(p);
  });
}

// body() on each of `threads` members of one team (team.h) inside one OpenMP region,
// with the caller's thread-local state (inference mode and the like); `rows`, the
// team's quantized rows of x. Rethrows what a member threw: the failing member's own
// error, not the Abandoned the others throw when its for_range share failed.
template <typename Body>
void run_as_team(int threads, flare_team::RowBuffers* rows, const Body& body) {
  const at::ThreadLocalState state;
  std::atomic<bool> failed{false};
  flare_team::Barrier barrier;
  std::exception_ptr failure;
#pragma omp parallel num_threads(threads)
  {
    const at::ThreadLocalStateGuard guard(state);
    const flare_team::Join join(omp_get_thread_num(), omp_get_num_threads(), rows, &failed,
                                &barrier);
    try {
      body();
    } catch (const flare_team::Abandoned&) {  // the failing member reports its own
    } catch (...) {
#pragma omp critical(flare_team_failure)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

// A team of `threads` running two for_range calls over 64 indices, in which member
// `failing` throws from its share of the first (none when it is not a member): the
// errors path of run_as_team, for tests. Returns how many indices the team ran.
int64_t team_failure_check(int64_t threads, int64_t failing) {
  TORCH_CHECK(threads >= 1, "threads must be >= 1, got ", threads);
  flare_team::RowBuffers rows;
  std::atomic<int64_t> ran{0};
  run_as_team(static_cast<int>(threads), &rows, [&] {
    for (int call = 0; call < 2; ++call)
      flare_team::for_range(0, 64, 1, [&](int64_t b, int64_t e) {
        TORCH_CHECK(!(call == 0 && flare_team::self.id == failing), "member ", failing,
                    " failed on its share [", b, ", ", e, ")");
        ran += e - b;
      });
  });
  return ran.load();
}

// A team step's views (layers.cpp makes them before the team starts): each layer's K and
// V caches, k.select(0, i) and v.select(0, i), and the stacked linears' part outputs for
// T rows. A decode step of the same caches and row count uses the same views, so
// DenseLayers keeps the last step's rather than making 2 L views and a buffer each step.
// The views hold the caches' storage, so a cache freed and another allocated at its
// address cannot match (and the last caches a team step ran on stay allocated until a
// step on other caches, or the model's end, lets them go: one pool per model in an
// engine).
struct TeamViews {
  const void* k = nullptr;
  const void* v = nullptr;
  std::vector<int64_t> k_sizes, k_strides;
  int64_t rows = 0;
  std::vector<torch::Tensor> k_layers, v_layers;
  PartViews part_views;

  bool fit(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t T) const {
    return k == k_cache.data_ptr() && v == v_cache.data_ptr() && rows == T &&
           k_sizes == k_cache.sizes().vec() && k_strides == k_cache.strides().vec() &&
           v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides();
  }
};

class DenseLayers {
 public:
  DenseLayers(const py::list& layers, torch::Tensor final_norm, torch::Tensor cos,
              torch::Tensor sin_signed, int64_t num_heads, int64_t num_kv_heads, double eps,
              double scale, const py::object& lm_head)
      : final_norm_(std::move(final_norm)), cos_(std::move(cos)),
        sin_(std::move(sin_signed)), H_(num_heads), KVH_(num_kv_heads), eps_(eps),
        scale_(scale) {
    TORCH_CHECK(py::len(layers) > 0, "DenseLayers needs at least one layer");
    if (!lm_head.is_none()) lm_head_ = parse_linear(lm_head);
    for (const auto& obj : layers) {
      const auto tup = obj.cast<py::tuple>();
      TORCH_CHECK(tup.size() == 7, "a layer is (input_norm, qkv, qk_norm, o_proj, "
                                   "post_norm, gate_up, down)");
      Layer l;
      l.input_norm = tup[0].cast<torch::Tensor>();
      l.qkv = parse_linear(tup[1]);
      if (!tup[2].is_none()) l.qk_norm = tup[2].cast<torch::Tensor>();
      l.o_proj = parse_linear(tup[3]);
      l.post_norm = tup[4].cast<torch::Tensor>();
      l.gate_up = parse_linear(tup[5]);
      l.down = parse_linear(tup[6]);
      layers_.push_back(std::move(l));
    }
    const Layer& l0 = layers_[0];
    team_ok_ = std::all_of(layers_.begin(), layers_.end(), [&](const Layer& l) {
      return runs_in_team(l.qkv) && runs_in_team(l.o_proj) && runs_in_team(l.gate_up) &&
             runs_in_team(l.down) && l.qkv.n == l0.qkv.n && l.o_proj.n == l0.o_proj.n &&
             l.gate_up.n == l0.gate_up.n && l.down.n == l0.down.n;
    });
    // each width part i of any stacked linear has: the team's part views
    for (const Layer& l : layers_)
      for (const LinearSpec* s : {&l.qkv, &l.o_proj, &l.gate_up, &l.down})
        for (size_t i = 0; i < s->parts.size(); ++i) {
          if (part_widths_.size() <= i) part_widths_.emplace_back();
          auto& widths = part_widths_[i];
          if (std::find(widths.begin(), widths.end(), s->parts[i].n) == widths.end())
            widths.push_back(s->parts[i].n);
        }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool has_lm_head() const { return lm_head_.has_value(); }
  // whether decode steps of TEAM_MIN_ROWS to TEAM_MAX_ROWS rows run as one team (with 2+
  // threads)
  bool decodes_as_team() const { return team_ok_; }

  torch::Tensor forward(torch::Tensor x, const torch::Tensor& positions,
                        const torch::Tensor& slots, const torch::Tensor& k,
                        const torch::Tensor& v, int64_t decode_kind, int64_t decode_rows,
                        int64_t decode_span, int64_t decode_len,
                        const c10::optional<torch::Tensor>& decode_gather,
                        const c10::optional<torch::Tensor>& decode_lengths,
                        const std::vector<int64_t>& chunk_starts,
                        const std::vector<int64_t>& chunk_lens,
                        const std::vector<torch::Tensor>& chunk_gathers) const {
    const int64_t L = num_layers();
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) >= L && v.size(0) >= L,
                "k and v must be [L, S, KVH, D] with at least ", L, " layers");
    TORCH_CHECK(decode_kind >= 0 && decode_kind <= 2, "decode_kind must be 0, 1 or 2");
    TORCH_CHECK(decode_kind != 2 || (decode_gather.has_value() && decode_lengths.has_value()),
                "decode_kind 2 needs decode_gather and decode_lengths");
    TORCH_CHECK(chunk_starts.size() == chunk_lens.size() &&
                    chunk_lens.size() == chunk_gathers.size(),
                "chunk_starts, chunk_lens and chunk_gathers must have one entry a chunk");
    const int64_t T = x.size(0), D = cos_.size(1);
    std::vector<torch::Tensor> chunk_ctx;  // lengths [1] of each chunk's context
    for (const auto& g : chunk_gathers)
      chunk_ctx.push_back(torch::full({1}, g.size(1), torch::kInt64));
    const size_t groups = (decode_kind != 0 ? 1 : 0) + chunk_starts.size();
    TORCH_CHECK(groups > 0, "a step needs a decode group or a prefill chunk");

    // The step's activations: one buffer each, allocated here and reused by every layer
    // (the kernels write them in place), not a fresh tensor per kernel call per layer,
    // whose allocation and dispatch were a visible share of a batch-1 step's serial work.
    // y: the norm outputs; o2: attention's output as o_proj reads it, o its [T, H, D] view.
    torch::Tensor y = flare_ops::rms_norm(x, layers_[0].input_norm, eps_);
    const int64_t hidden = x.size(1);
    const Layer& l0 = layers_[0];
    const auto buffer = [&](int64_t cols) { return torch::empty({T, cols}, x.options()); };
    const torch::Tensor qkv_buf = buffer(l0.qkv.n), q_buf = buffer(H_ * D).view({T, H_, D});
    const torch::Tensor o2 = buffer(H_ * D), o_buf = o2.view({T, H_, D});
    const torch::Tensor proj_buf = buffer(hidden), gu_buf = buffer(l0.gate_up.n);
    const torch::Tensor act_buf = buffer(l0.gate_up.n / 2), m_buf = buffer(hidden);
    // a layer whose linear has other widths than layer 0's gets new tensors instead
    const auto fits = [](const torch::Tensor& buf, int64_t cols) {
      return buf.size(1) == cols ? c10::optional<torch::Tensor>(buf) : c10::nullopt;
    };
    // rows [s, s + n) of a step buffer, in place (the whole buffer, with no view op, when
    // they are all of its rows: the usual step of one group)
    const auto rows = [T](const torch::Tensor& t, int64_t s, int64_t n) {
      return s == 0 && n == T ? t : t.slice(0, s, s + n);
    };
    // a team's views, made before it starts (a member allocates nothing outside
    // for_range): each layer's K and V caches, its stacked linears' part outputs
    TeamViews views;
    const std::vector<torch::Tensor>& k_layers = views.k_layers;
    const std::vector<torch::Tensor>& v_layers = views.v_layers;
    const PartViews& part_views = views.part_views;
    // every layer from y (the first layer's input norm); returns the final norm's output
    // (y's buffer, written in place)
    const auto run_layers = [&](torch::Tensor y) {
      for (int64_t i = 0; i < L; ++i) {
        const Layer& l = layers_[i];
        torch::Tensor kc = k_layers.empty() ? k.select(0, i) : k_layers[i];
        torch::Tensor vc = v_layers.empty() ? v.select(0, i) : v_layers[i];
        // [T, (H + 2 KVH) * D]
        const auto qkv = linear(l.qkv, y, fits(qkv_buf, l.qkv.n), &part_views).contiguous();
        const auto q = flare_ops::rope_store(qkv, cos_, sin_, positions, kc, vc, slots, H_,
                                             KVH_, l.qk_norm, eps_, q_buf);  // [T, H, D]
        // paged_attention with the fused ops: one kernel call per group, each writing its
        // rows of o_buf in place
        if (decode_kind == 1)
          flare_ops::decode_attention(rows(q, 0, 1), kc, vc, decode_span, decode_len, scale_,
                                      rows(o_buf, 0, 1));
        else if (decode_kind == 2)
          flare_ops::decode_attention_gather(rows(q, 0, decode_rows), kc, vc, *decode_gather,
                                             *decode_lengths, scale_, rows(o_buf, 0, decode_rows));
        for (size_t c = 0; c < chunk_starts.size(); ++c) {
          const int64_t s = chunk_starts[c], t = chunk_lens[c];
          flare_ops::cached_attention(rows(q, s, t), kc, vc, chunk_gathers[c], chunk_ctx[c], t,
                                      scale_, rows(o_buf, s, t));
        }
        const auto proj = linear(l.o_proj, o2, fits(proj_buf, l.o_proj.n), &part_views).contiguous();
        y = flare_ops::add_rms_norm(x, proj, l.post_norm, eps_, y);
        const auto gu = linear(l.gate_up, y, fits(gu_buf, l.gate_up.n), &part_views).contiguous();
        const auto act = flare_ops::silu_mul(gu, fits(act_buf, gu.size(1) / 2));
        const auto m = linear(l.down, act, fits(m_buf, l.down.n), &part_views).contiguous();
        const auto& nxt = i + 1 < L ? layers_[i + 1].input_norm : final_norm_;
        y = flare_ops::add_rms_norm(x, m, nxt, eps_, y);  // x += m; the next norm's output
      }
      return y;
    };
    const int threads = at::get_num_threads();
    if (!team_ok_ || !chunk_starts.empty() || T < TEAM_MIN_ROWS || T > TEAM_MAX_ROWS ||
        threads < 2 || at::in_parallel_region())
      return run_layers(y);
    // x's quantized rows, shared by the team's members, with room for each member's own
    // copy of a step's few rows (qdot8.cpp's QuantizedRows), of the widest x a linear
    // takes (a pointer: inside the region the thread_local's name is each member's own)
    thread_local flare_team::RowBuffers team_rows;
    flare_team::RowBuffers* const rows_of_x = &team_rows;
    const int64_t widest = std::max({hidden, H_ * D, l0.gate_up.n / 2});
    rows_of_x->reserve(T * threads, widest);
    views = take_team_views();
    if (!views.fit(k, v, T)) views = make_team_views(k, v, T, x.options());
    run_as_team(threads, rows_of_x, [&] { run_layers(y); });
    keep_team_views(std::move(views));
    return y;
  }

  torch::Tensor forward_logits(torch::Tensor x, const torch::Tensor& positions,
                               const torch::Tensor& slots, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t decode_kind,
                               int64_t decode_rows, int64_t decode_span, int64_t decode_len,
                               const c10::optional<torch::Tensor>& decode_gather,
                               const c10::optional<torch::Tensor>& decode_lengths,
                               const std::vector<int64_t>& chunk_starts,
                               const std::vector<int64_t>& chunk_lens,
                               const std::vector<torch::Tensor>& chunk_gathers,
                               const std::vector<int64_t>& logit_rows) const {
    TORCH_CHECK(lm_head_.has_value(), "this DenseLayers was built without an lm_head");
    TORCH_CHECK(!logit_rows.empty(), "logit_rows must name at least one row");
    const auto y = forward(std::move(x), positions, slots, k, v, decode_kind, decode_rows,
                           decode_span, decode_len, decode_gather, decode_lengths,
                           chunk_starts, chunk_lens, chunk_gathers);
    // a view of the caller's indices: index_select reads them (and checks their range)
    const auto rows = torch::from_blob(const_cast<int64_t*>(logit_rows.data()),
                                       {static_cast<int64_t>(logit_rows.size())},
                                       torch::kInt64);
    return linear(*lm_head_, y.index_select(0, rows));  // [N, vocab]
  }

 private:
  TeamViews make_team_views(const torch::Tensor& k, const torch::Tensor& v, int64_t T,
                            const torch::TensorOptions& options) const {
    TeamViews views;
    views.k = k.data_ptr(), views.v = v.data_ptr(), views.rows = T;
    views.k_sizes = k.sizes().vec(), views.k_strides = k.strides().vec();
    for (int64_t i = 0; i < num_layers(); ++i) {
      views.k_layers.push_back(k.select(0, i));
      views.v_layers.push_back(v.select(0, i));
    }
    for (const auto& widths : part_widths_) {
      const int64_t widest_part = *std::max_element(widths.begin(), widths.end());
      const torch::Tensor flat = torch::empty({T * widest_part}, options);
      auto& part = views.part_views.emplace_back();
      for (const int64_t n : widths) part.push_back(flat.narrow(0, 0, T * n).view({T, n}));
    }
    return views;
  }
  // The kept views, moved out (a call running beside another, which holds them, makes
  // its own: two steps never share part buffers), and put back after the step.
  TeamViews take_team_views() const {
    const std::lock_guard<std::mutex> lock(team_views_mutex_);
    return std::exchange(team_views_, TeamViews{});
  }
  void keep_team_views(TeamViews views) const {
    const std::lock_guard<std::mutex> lock(team_views_mutex_);
    team_views_ = std::move(views);
  }

  mutable std::mutex team_views_mutex_;
  mutable TeamViews team_views_;
  std::vector<Layer> layers_;
  c10::optional<LinearSpec> lm_head_;
  torch::Tensor final_norm_, cos_, sin_;
  int64_t H_, KVH_;
  double eps_, scale_;
  bool team_ok_ = false;  // every layer's linears write the step's buffers in place
  std::vector<std::vector<int64_t>> part_widths_;  // per part index, each width it has
};

}  // namespace

void flare_register_layers(pybind11::module_& m) {
  m.def("team_failure_check", &team_failure_check,
        "a team of `threads` whose member `failing` throws from its share of a for_range: "
        "raises that member's error (returns the indices run when no member fails)",
        py::arg("threads"), py::arg("failing"), py::call_guard<py::gil_scoped_release>());
  py::class_<DenseLayers>(m, "DenseLayers",
                          "every decoder layer of a dense step in one call (layers.cpp)")
      .def(py::init<const py::list&, torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                    int64_t, double, double, const py::object&>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("cos"), py::arg("sin_signed"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"), py::arg("scale"),
           py::arg("lm_head"))
      .def_property_readonly("num_layers", &DenseLayers::num_layers)
      .def_property_readonly("has_lm_head", &DenseLayers::has_lm_head)
      .def_property_readonly("decodes_as_team", &DenseLayers::decodes_as_team,
                             "decode steps of 2 to 16 rows run their layers as one team "
                             "of threads (team.h)")
      .def("forward", &DenseLayers::forward,
           "all layers of a step; returns the final norm's output [T, hidden]",
           py::arg("x"), py::arg("positions"), py::arg("slots"), py::arg("k"), py::arg("v"),
           py::arg("decode_kind"), py::arg("decode_rows"), py::arg("decode_span"),
           py::arg("decode_len"), py::arg("decode_gather"), py::arg("decode_lengths"),
           py::arg("chunk_starts"), py::arg("chunk_lens"), py::arg("chunk_gathers"),
           py::call_guard<py::gil_scoped_release>())
      .def("forward_logits", &DenseLayers::forward_logits,
           "forward, then the lm_head on rows logit_rows; returns logits [N, vocab]",
           py::arg("x"), py::arg("positions"), py::arg("slots"), py::arg("k"), py::arg("v"),
           py::arg("decode_kind"), py::arg("decode_rows"), py::arg("decode_span"),
           py::arg("decode_len"), py::arg("decode_gather"), py::arg("decode_lengths"),
           py::arg("chunk_starts"), py::arg("chunk_lens"), py::arg("chunk_gathers"),
           py::arg("logit_rows"), py::call_guard<py::gil_scoped_release>());
}
