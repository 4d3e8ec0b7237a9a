// A decode step's threads as one team: the kernels' work splits over it without a fork
// and join per kernel.
//
// Every kernel splits its own work with at::parallel_for, one OpenMP parallel region a
// call. A region's fork and join cost 1.6-1.9 us through ATen (2-core Xeon, 2 threads: a
// q4x8_linear of 32 x 64 took 0.7 us on one thread, 2.6 on two), while a barrier inside a
// running region costs 0.3 us; and the small row ops (x's quantization, the norms, SiLU),
// not worth a fork, ran on the calling thread while the other waited. So layers.cpp runs
// a decode step's layers inside one region, each of its threads a member (`Join`), and
// the kernels call `for_range`, which gives each member its share of the range and ends
// in a barrier, so each op's results are complete before the next reads them. The
// barrier is the team's own (`Barrier`, a counter and a generation), not `omp barrier`:
// a step meets about 13 a layer, and 8 streams of the embedded model stepped 3-5%
// faster with it (bench/ab_builds.py --batch 8, 12 rounds: median 6.02 against 6.32 ms,
// 6.34 against 6.54, and 11.75 against 12.31 at 500 cached tokens). Outside a
// team, `for_range` is at::parallel_for. A split never changes a value: each index's
// result is computed by one thread in the same way (test_native_layers compares the
// team's steps with the Python path's, bit for bit).
//
// Rules inside a team: every member calls the same kernels with the same arguments, so
// each meets the same barriers; each kernel writes its caller's `out` tensors (shared),
// never new ones; and a check outside for_range's work fails for every member (they are
// all checks of shared inputs), which catch it and leave the region together. What a
// member's own share of the work throws (an allocation, a check of its rows) reaches the
// others through the team's `failed` flag at for_range's barrier: they throw `Abandoned`
// there, and the failing member its own error, so no member waits at a barrier another
// will never reach. x's quantized rows never grow inside a team: a member's own copy of
// a step's few rows lies in the team's RowBuffers too; and layers.cpp makes every view a
// member uses (each layer's K and V, a stacked linear's part outputs) before the team
// starts, so outside for_range a member allocates nothing.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <thread>
#include <vector>

#include "qrows.h"

namespace flare_team {

// Quantized rows of x (qdot8.cpp's QuantizedRows): q int8 [B, K], d and s float32
// [B, K/QK]. A thread's own, or a team's, which its members share.
struct RowBuffers {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  // room for B rows of K values
  void reserve(int64_t B, int64_t K) {
    const auto values = static_cast<size_t>(B * K);
    const auto blocks = static_cast<size_t>(B * (K / flare_qrows::QK));
    if (q.size() < values) q.resize(values);
    if (d.size() < blocks) d.resize(blocks), s.resize(blocks);
  }
  bool holds(int64_t B, int64_t K) const {
    return q.size() >= static_cast<size_t>(B * K) &&
           d.size() >= static_cast<size_t>(B * (K / flare_qrows::QK));
  }
};

// The team's barrier: a counter and a generation on their own cache lines. A member
// arrives by counting itself in; the last one resets the count and starts the next
// generation, which the others spin on (with a pause, then yielding the core after many
// turns, so a member that lost its core to another process gets it back). Release and
// acquire order every member's writes before the barrier ahead of every read after it.
struct Barrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> generation{0};

  void wait(int size) {
    const int gen = generation.load(std::memory_order_relaxed);
    if (count.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      count.store(0, std::memory_order_relaxed);
      generation.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int turn = 0; generation.load(std::memory_order_acquire) == gen; ++turn) {
      if (turn < 4096) _mm_pause();
      else std::this_thread::yield();
    }
  }
};

// This thread's place in the running team (id -1: not in one), the team's buffers,
// barrier, and flag that a member's share of some work failed.
struct Member {
  int id = -1;
  int size = 1;
  RowBuffers* rows = nullptr;
  std::atomic<bool>* failed = nullptr;
  Barrier* barrier = nullptr;
};
inline thread_local Member self;

inline bool active() { return self.id >= 0; }

// What a member throws at for_range's barrier when another member's share failed: the
// failing member throws its own error, which is the one to report.
struct Abandoned : std::runtime_error {
  Abandoned() : std::runtime_error("another member of the decode team failed") {}
};

// Joins the calling thread to the team for its lifetime (inside the region); `rows` and
// `failed` are the team's, made by the thread that starts it.
struct Join {
  Join(int id, int size, RowBuffers* rows, std::atomic<bool>* failed, Barrier* barrier) {
    self = Member{id, size, rows, failed, barrier};
  }
  ~Join() { self = Member{}; }
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;
};

// f(b, e) over [begin, end) in at most one chunk a member, at least `grain` indices a
// chunk (a shorter range runs on member 0 alone), as at::parallel_for splits it; then
// every member waits for the others. If any member's f threw, every member throws after
// the barrier: the failing one its error, the others Abandoned. Outside a team:
// at::parallel_for.
template <typename F>
void for_range(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!active()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  std::exception_ptr mine;
  if (end > begin) {
    const int64_t n = end - begin;
    const int64_t g = std::max<int64_t>(grain, 1);
    const int64_t parts = n < g ? 1 : std::min<int64_t>(self.size, (n + g - 1) / g);
    const int64_t chunk = (n + parts - 1) / parts;
    const int64_t b = begin + self.id * chunk;
    if (self.id < parts && b < end) {
      try {
        f(b, std::min(end, b + chunk));
      } catch (...) {
        mine = std::current_exception();
        self.failed->store(true, std::memory_order_relaxed);
      }
    }
  }
  self.barrier->wait(self.size);
  // (the barrier orders the flag's store before these loads)
  if (self.failed->load(std::memory_order_relaxed)) {
    if (mine) std::rethrow_exception(mine);
    throw Abandoned();
  }
}

}  // namespace flare_team
