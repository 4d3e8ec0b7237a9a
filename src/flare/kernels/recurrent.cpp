// Flare's gated delta rule (Qwen3.5 / Qwen3-Next Gated DeltaNet) for x86 CPUs with AVX2/FMA:
// one sequential recurrence for decode and prefill alike.
//
//   gated_delta_rule(q [T, Hq, Dk], k [T, Hq, Dk], v [T, H, Dv], g [T, H], beta [T, H],
//                    state [S, H, Dk, Dv], starts int64 [N + 1], slots int64 [N])
//       -> o [T, H, Dv]
//
// All float32, CPU, contiguous. The T tokens are N sequences' runs: sequence n owns tokens
// [starts[n], starts[n+1]) and the recurrent state state[slots[n]] (read at its first
// token, left after its last, in place). Value head h reads query/key head h / (H / Hq)
// (Hq divides H). Per token, per head, with S = state [Dk, Dv]:
//
//   S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
//
// computed as two passes over S's rows i = 0 .. Dk-1 in ascending order (decay and the
// prediction S^T k in the first, the update and S^T q in the second), each element by a
// fused multiply-add (8 lanes of Dv at a time; the last Dv % 8 columns by the same fma in
// scalar code), exp by std::exp. So every output and state element is a fixed sequence of
// roundings that depends only on its sequence's own inputs and state: a token's result is
// the same whether it runs alone (decode, T = 1), inside a prefill chunk of any length,
// or beside other sequences in the same call. Work is split with at::parallel_for over
// (sequence, head) pairs only; a reduction is never split.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "checks.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using flare_checks::check_f32;

// One (sequence, head) pair: tokens [t0, t1) of head h, state s [Dk, Dv] updated in place.
void run_head(const float* q, const float* k, const float* v, const float* g,
              const float* beta, float* s, float* o, int64_t t0, int64_t t1, int64_t h,
              int64_t H, int64_t Hq, int64_t Dk, int64_t Dv) {
  const int64_t hq = h / (H / Hq);
  const int64_t vec_end = Dv - Dv % 8;
  std::vector<float> u(Dv);
  for (int64_t t = t0; t < t1; ++t) {
    const float* qt = q + (t * Hq + hq) * Dk;
    const float* kt = k + (t * Hq + hq) * Dk;
    const float* vt = v + (t * H + h) * Dv;
    float* ot = o + (t * H + h) * Dv;
    const float decay = std::exp(g[t * H + h]);
    const float b = beta[t * H + h];
    // pass 1: S <- decay * S, pred = S^T k (rows in order); u = b * (v - pred)
    for (int64_t j = 0; j < vec_end; j += 8) {
      const __m256 dv = _mm256_set1_ps(decay);
      __m256 pred = _mm256_setzero_ps();
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = s + i * Dv + j;
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row), dv);
        _mm256_storeu_ps(row, x);
        pred = _mm256_fmadd_ps(x, _mm256_set1_ps(kt[i]), pred);
      }
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(vt + j), pred);
      _mm256_storeu_ps(u.data() + j, _mm256_mul_ps(d, _mm256_set1_ps(b)));
    }
    for (int64_t j = vec_end; j < Dv; ++j) {
      float pred = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        float& x = s[i * Dv + j];
        x = x * decay;
        pred = std::fma(x, kt[i], pred);
      }
      u[j] = (vt[j] - pred) * b;
    }
    // pass 2: S <- S + k u^T, o = S^T q (rows in order)
    for (int64_t j = 0; j < vec_end; j += 8) {
      const __m256 uj = _mm256_loadu_ps(u.data() + j);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = s + i * Dv + j;
        const __m256 x = _mm256_fmadd_ps(_mm256_set1_ps(kt[i]), uj, _mm256_loadu_ps(row));
        _mm256_storeu_ps(row, x);
        acc = _mm256_fmadd_ps(x, _mm256_set1_ps(qt[i]), acc);
      }
      _mm256_storeu_ps(ot + j, acc);
    }
    for (int64_t j = vec_end; j < Dv; ++j) {
      float acc = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        float& x = s[i * Dv + j];
        x = std::fma(kt[i], u[j], x);
        acc = std::fma(x, qt[i], acc);
      }
      ot[j] = acc;
    }
  }
}

torch::Tensor gated_delta_rule(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& g,
                               const torch::Tensor& beta, torch::Tensor state,
                               const torch::Tensor& starts, const torch::Tensor& slots) {
  check_f32(q, "q", 3);
  check_f32(k, "k", 3);
  check_f32(v, "v", 3);
  check_f32(g, "g", 2);
  check_f32(beta, "beta", 2);
  check_f32(state, "state", 4);
  const int64_t T = q.size(0), Hq = q.size(1), Dk = q.size(2);
  const int64_t H = v.size(1), Dv = v.size(2), S = state.size(0);
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape [T, Hq, Dk]");
  TORCH_CHECK(v.size(0) == T, "v must have T = ", T, " rows");
  TORCH_CHECK(g.size(0) == T && g.size(1) == H && beta.sizes() == g.sizes(),
              "g and beta must be [T, H] = [", T, ", ", H, "]");
  TORCH_CHECK(Hq > 0 && H % Hq == 0, "value heads (", H, ") must be a multiple of key heads (",
              Hq, ")");
  TORCH_CHECK(state.size(1) == H && state.size(2) == Dk && state.size(3) == Dv,
              "state must be [S, H, Dk, Dv] = [S, ", H, ", ", Dk, ", ", Dv, "]");
  TORCH_CHECK(starts.device().is_cpu() && starts.scalar_type() == torch::kInt64 &&
                  starts.dim() == 1 && slots.device().is_cpu() &&
                  slots.scalar_type() == torch::kInt64 && slots.dim() == 1,
              "starts and slots must be int64 CPU vectors");
  const int64_t N = slots.size(0);
  TORCH_CHECK(starts.size(0) == N + 1, "starts must have N + 1 = ", N + 1, " entries");
  auto st = starts.contiguous();
  auto sl = slots.contiguous();
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* lp = sl.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[N] == T, "starts must run from 0 to T = ", T);
  std::vector<char> seen(S, 0);
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(sp[n] <= sp[n + 1], "starts must not decrease");
    TORCH_CHECK(lp[n] >= 0 && lp[n] < S, "slot ", lp[n], " out of range [0, ", S, ")");
    TORCH_CHECK(!seen[lp[n]], "slot ", lp[n], " is named twice");
    seen[lp[n]] = 1;
  }
  auto o = torch::empty({T, H, Dv}, v.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* spool = state.data_ptr<float>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t n = w / H, h = w % H;
      float* s = spool + (lp[n] * H + h) * Dk * Dv;
      run_head(qp, kp, vp, gp, bp, s, op, sp[n], sp[n + 1], h, H, Hq, Dk, Dv);
    }
  });
  return o;
}

}  // namespace

void flare_register_recurrent(pybind11::module_& m) {
  m.def("gated_delta_rule", &gated_delta_rule,
        "gated delta rule, token by token, of N sequences' runs of T tokens from their state "
        "slots (updated in place): o [T, H, Dv], float32");
}
