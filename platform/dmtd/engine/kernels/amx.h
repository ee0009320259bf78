// bf16 products on AMX tiles, row-invariant: y[M, N] = x[M, K] · W[N, K]ᵀ with W bf16 row-major (the packed
// "bf16" format as it is) and x rounded to bf16 (nearest even). Every output is summed in one fixed order — one
// TDPBF16PS per 32 inputs, K ascending, from zero — whatever M is, whatever rows share the call and wherever the
// row sits in its tile, so a position gets the same bits in a one-row step, a check, a refill chunk or a prefill.
// Used for every row count on a CPU with AMX-BF16 (one code path; torch's oneDNN matmul picks its blocking by
// shape, which is what made bf16 exactness depend on the row count).
//
// Operands: W is the tile's A side (16 output rows × 32 inputs, read in place with the row stride), x is packed
// once per call into B tiles in the VNNI layout (16 input pairs × 16 rows), so C[n][m] = Σ_k W[n][k]·x[m][k].
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define DMTD_AMX 1
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "steal.h"

namespace dmtd_amx {

// Linux hands out the 8 KiB tile state only on request, once per process.
inline bool ready() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C (n-block 0/1 × m-block 0/1), tmm4-5: A (W, n-block 0/1), tmm6-7: B (x, m-block 0/1); all 16 × 64 B.
// Loaded by every thread that runs tiles, at every call (the configuration is per thread, and another library
// on the same thread may have loaded its own).
inline void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// 16 floats → their bf16 bits (nearest even, as torch's .to(bfloat16); NaN stays a quiet NaN) in the low half of
// each 32-bit lane
inline __m512i round16(const float* p) {
  const __m512 x = _mm512_loadu_ps(p);
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

// x [M, K] float32 → B tiles [ceil(M/16)][K/32][16 pairs][16 rows][2] bf16 (rows past M zero).
inline void pack_x(const float* x, int64_t M, int64_t K, std::vector<uint16_t>& out) {
  const int64_t mblocks = (M + 15) / 16, kb = K / 32;
  out.assign(static_cast<size_t>(mblocks * kb * 512), 0);
  uint32_t* o32 = reinterpret_cast<uint32_t*>(out.data());
  const __m512i rows16 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  at::parallel_for(0, mblocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t m = b * 16; m < std::min(M, b * 16 + 16); ++m) {
        const float* xr = x + m * K;
        for (int64_t c = 0; c < kb; ++c) {
          uint32_t* tile = o32 + (b * kb + c) * 256 + (m - b * 16);  // pair r of this row at [r * 16]
          // 32 inputs rounded, in order: pair r (inputs 2r, 2r + 1) goes to the tile's row r
          const __m512i lo = round16(xr + c * 32), hi = round16(xr + c * 32 + 16);
          const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                                   _mm512_cvtepi32_epi16(hi), 1);
          _mm512_i32scatter_epi32(tile, rows16, pairs, 4);
        }
      }
    }
  });
}

// Output rows n0 .. n0 + 31 (two 16-row blocks; fewer at the end: `w` then points at a zero-padded copy) for the
// x rows of m-blocks mb0 .. mb1 − 1.
inline void pair(const uint16_t* w, int64_t wstride_b, int64_t nvalid, const uint16_t* xp, int64_t K, int64_t M,
                 int64_t mb0, int64_t mb1, float* y, int64_t N, int64_t n0) {
  const int64_t kb = K / 32;
  const bool two_n = nvalid > 16;
  alignas(64) float buf[4][256];
  const __m512i cols16 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int64_t mb = mb0; mb < mb1; mb += 2) {
    const bool two_m = mb + 1 < mb1;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* b0 = xp + mb * kb * 512;
    const uint16_t* b1 = b0 + kb * 512;
    for (int64_t c = 0; c < kb; ++c) {
      _tile_loadd(4, w + c * 32, wstride_b);
      _tile_loadd(6, b0 + c * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two_n) {
        _tile_loadd(5, reinterpret_cast<const char*>(w) + 16 * wstride_b + c * 64, wstride_b);
        _tile_dpbf16ps(1, 5, 6);
      }
      if (two_m) {
        _tile_loadd(7, b1 + c * 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        if (two_n) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, buf[0], 64);
    if (two_n) _tile_stored(1, buf[1], 64);
    if (two_m) _tile_stored(2, buf[2], 64);
    if (two_m && two_n) _tile_stored(3, buf[3], 64);
    for (int t = 0; t < 4; ++t) {
      const int64_t mbase = (mb + (t >> 1)) * 16, nbase = (t & 1) * 16;
      if ((t >> 1) && !two_m) continue;
      if ((t & 1) && !two_n) continue;
      const int64_t mc = std::min<int64_t>(16, M - mbase), nc = std::min<int64_t>(16, nvalid - nbase);
      const __mmask16 keep = static_cast<__mmask16>((1u << nc) - 1);
      for (int64_t m = 0; m < mc; ++m)  // C holds y transposed: column m of the tile is row m of y
        _mm512_mask_storeu_ps(y + (mbase + m) * N + n0 + nbase, keep,
                              _mm512_i32gather_ps(_mm512_add_epi32(cols16, _mm512_set1_epi32(static_cast<int>(m))),
                                                  buf[t], 4));
    }
  }
}

// y [M, N] float32 = x [M, K] float32 · W [N, K] bf16ᵀ; K a multiple of 32.
inline void linear_bf16(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  thread_local std::vector<uint16_t> tl_xp;
  std::vector<uint16_t>& xp = tl_xp;  // this thread's buffer, read by the workers below
  pack_x(x, M, K, xp);
  const int64_t pairs = (N + 31) / 32, mblocks = (M + 15) / 16;
  const int64_t full_pairs = N / 32;  // pairs past this read a zero-padded copy of W's last rows
  std::vector<uint16_t> tail;
  if (full_pairs < pairs) {
    tail.assign(static_cast<size_t>(32 * K), 0);
    std::memcpy(tail.data(), w + full_pairs * 32 * K, static_cast<size_t>((N - full_pairs * 32) * K) * 2);
  }
  // x rows in chunks of 16 blocks (256 rows, ≤ 0.8 MB of tiles for K = 1,536) that stay in cache while every
  // output pair passes over them
  constexpr int64_t MCHUNK = 16;
  for (int64_t c0 = 0; c0 < mblocks; c0 += MCHUNK) {
    const int64_t c1 = std::min(mblocks, c0 + MCHUNK);
    auto run = [&](int64_t p) {
      const int64_t n0 = p * 32;
      if (p < full_pairs) pair(w + n0 * K, K * 2, 32, xp.data(), K, M, c0, c1, y, N, n0);
      else pair(tail.data(), K * 2, N - n0, xp.data(), K, M, c0, c1, y, N, n0);
    };
    const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs / 2));
    if (T <= 1 || at::in_parallel_region()) {
      configure();
      for (int64_t p = 0; p < pairs; ++p) run(p);
      _tile_release();
      continue;
    }
    dmtd_steal::run(pairs, T, run, [] { configure(); }, [] { _tile_release(); });
  }
}

}  // namespace dmtd_amx
#endif
