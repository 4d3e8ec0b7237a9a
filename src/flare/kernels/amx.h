// AMX tiles for prompt-sized int8 products (the `avx512amx` kernel variant, built with
// -mamx-tile -mamx-int8 on top of the AVX-512 VNNI flags; see qdot8.cpp).
//
// One `tdp*` instruction multiplies a tile of 16 rows of x's int8 codes by a tile of 16
// weight rows' codes and adds the products into 16 x 16 int32 sums, exactly (no
// saturation; the sums here stay far below 2^31). Per block of 32 along K that is the
// same integer sum the vpdpbusd kernels compute lane by lane, so a kernel that stores
// the block's sums and then runs its usual float32 scale math per block, in the same
// order, gives their results bit for bit (qdot8.cpp's `amx_pair_rows`).
//
// Tiles (Intel SDM vol. 1, ch. 18, palette 1), two slots of (C, A, B), so that two
// products are in flight at once:
//   0, 1  C: 16 rows x 16 int32 sums (64 bytes a row)
//   2, 4  A: 16 rows of x, one block of 32 codes each
//   3, 5  B: 8 rows of 64 bytes: row s holds, for each of 16 weight rows, its codes
//         4s..4s+3 (the "VNNI" layout, which the interleaved groups already use)
#pragma once

#ifdef FLARE_AMX

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace flare_amx {

// Linux asks a process to request the AMX tile data state before its first tile
// instruction (arch/x86/include/uapi/asm/prctl.h); without it the first one raises SIGILL.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Whether this process may run tile instructions: the permission is requested once (it
// holds for every thread). False where the kernel refuses it; the callers then take
// their AVX-512 path, which gives the same bits.
inline bool available() {
  static const bool ok =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm statements that declare no memory access, and its
// ldtilecfg builtin does not count as reading the whole configuration (the stores of its
// rows and columns were dropped as dead). So the compiler must be told where memory is
// shared with the tiles: before a tile load of bytes just stored, after a tile store of
// bytes about to be read, and before ldtilecfg.
inline void tile_memory_barrier() { asm volatile("" ::: "memory"); }

// Loads the configuration above into this thread's tile registers (a thread's tile state
// is its own: each worker loads it before its first tile instruction).
inline void configure() {
  TileConfig c;
  const int rows[6] = {16, 16, 16, 8, 16, 8};
  const int colsb[6] = {64, 64, 32, 64, 32, 64};
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t]);
    c.colsb[t] = static_cast<uint16_t>(colsb[t]);
  }
  tile_memory_barrier();
  _tile_loadconfig(&c);
}

// Frees this thread's tile state (so a context switch need not save 8 KiB of it).
inline void release() {
  tile_memory_barrier();
  _tile_release();
}

}  // namespace flare_amx

#endif  // FLARE_AMX
