// bf16 products on AVX512-BF16 dot-product instructions (vdpbf16ps), row-invariant: y[M, N] = x[M, K] · W[N, K]ᵀ
// with x rounded to bf16 (nearest even) and float32 accumulation. For CPUs that multiply bf16 natively but have no
// AMX tiles (AMD Zen 4/5, Intel Cooper Lake): the avx512 path widens each bf16 weight to float32 first, which halves
// the products a cycle.
//
// Weights are stored "blocked" (dmtd.engine.lowbit.pack on this path): blocks of 16 output rows, each block's K/2
// input pairs in order, a pair of inputs for each of its 16 outputs side by side —
// w[b][p][2·l + e] = W[16·b + l][2·p + e], rows past N zero. One vdpbf16ps then adds the products of one input
// pair to 16 outputs of one activation row, and a register tile of MR rows × NB blocks keeps MR·NB accumulators
// busy per weight load (an outer product: no horizontal sums). Each output is one accumulator lane summed over the
// input pairs in ascending order from zero, whatever M is, which rows share the call and where a row sits in its
// tile: a position gets the same bits in a one-row step, a check, a refill chunk or a prefill.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && !defined(DMTD_AMX)
#define DMTD_BF16DOT 1
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "steal.h"

namespace dmtd_bf16dot {

// x [M, K] float32 (K a multiple of 32) → [M, K/2] input pairs of bf16 (nearest even), as 32-bit words
inline void pack_x(const float* x, int64_t M, int64_t K, std::vector<uint32_t>& out) {
  out.resize(static_cast<size_t>(M * K / 2));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * K + k + 16), _mm512_loadu_ps(x + m * K + k));
        _mm512_storeu_si512(out.data() + (m * K + k) / 2, reinterpret_cast<const __m512i&>(v));
      }
  });
}

// Rows m0 .. m0 + MR − 1 times blocks b0 .. b0 + NB − 1 (outputs 16·b0 .. 16·(b0 + NB) − 1, those below N stored).
template <int MR, int NB>
inline void tile(const uint32_t* xp, const uint16_t* w, float* y, int64_t K2, int64_t N, int64_t m0, int64_t b0) {
  __m512 acc[MR][NB];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* wb = w + b0 * K2 * 32;
  const uint32_t* xr = xp + m0 * K2;
  for (int64_t p = 0; p < K2; ++p) {
    __m512i wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wb + (j * K2 + p) * 32);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xr[i * K2 + p]));
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], reinterpret_cast<const __m512bh&>(xv),
                                     reinterpret_cast<const __m512bh&>(wv[j]));
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const int64_t n = (b0 + j) * 16;
      float* out = y + (m0 + i) * N + n;
      if (n + 16 <= N) _mm512_storeu_ps(out, acc[i][j]);
      else if (n < N) _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << (N - n)) - 1), acc[i][j]);
    }
}

// The row tile's height for NB blocks: MR·NB accumulators, NB weights and one broadcast within 32 registers
constexpr int mr_max(int nb) { return nb >= 4 ? 6 : nb == 3 ? 7 : 12; }

template <int NB>
inline void rows_tile(int mr, const uint32_t* xp, const uint16_t* w, float* y, int64_t K2, int64_t N, int64_t m0,
                      int64_t b0) {
  switch (mr) {
#define DMTD_MR(R) \
  case R:          \
    if constexpr (R <= mr_max(NB)) return tile<R, NB>(xp, w, y, K2, N, m0, b0); \
    break;
    DMTD_MR(1) DMTD_MR(2) DMTD_MR(3) DMTD_MR(4) DMTD_MR(5) DMTD_MR(6)
    DMTD_MR(7) DMTD_MR(8) DMTD_MR(9) DMTD_MR(10) DMTD_MR(11) DMTD_MR(12)
#undef DMTD_MR
    default: break;
  }
}

// Blocks b0 .. b1 − 1 for every row: in tiles of 4 blocks (the last 1-3), each over all rows in tiles of mr_max.
inline void panel(const uint32_t* xp, const uint16_t* w, float* y, int64_t M, int64_t K2, int64_t N, int64_t b0,
                  int64_t b1) {
  for (int64_t b = b0; b < b1;) {
    const int nb = static_cast<int>(std::min<int64_t>(4, b1 - b));
    const int mr = nb == 4 ? mr_max(4) : nb == 3 ? mr_max(3) : mr_max(2);
    for (int64_t m = 0; m < M; m += mr) {
      const int r = static_cast<int>(std::min<int64_t>(mr, M - m));
      switch (nb) {
        case 4: rows_tile<4>(r, xp, w, y, K2, N, m, b); break;
        case 3: rows_tile<3>(r, xp, w, y, K2, N, m, b); break;
        case 2: rows_tile<2>(r, xp, w, y, K2, N, m, b); break;
        default: rows_tile<1>(r, xp, w, y, K2, N, m, b); break;
      }
    }
    b += nb;
  }
}

// y [M, N] = x [M, K] · Wᵀ for blocked bf16 weights w [ceil(N/16), K/2, 32], parallel over panels of output blocks
// (steal.h).
inline void linear(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  thread_local std::vector<uint32_t> tl_x;
  std::vector<uint32_t>& xp = tl_x;  // this thread's buffer, read by the workers below
  pack_x(x, M, K, xp);
  const int64_t K2 = K / 2, blocks = (N + 15) / 16;
  const int64_t T0 = at::in_parallel_region() ? 1 : at::get_num_threads();
  // panels of 4 blocks when there are many, of 2 where 4 would leave the threads' shares uneven (N = 576: 36 blocks)
  const int64_t per = blocks >= 16 * T0 ? 4 : 2;
  const int64_t panels = (blocks + per - 1) / per;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(T0, panels));
  auto run = [&](int64_t c) { panel(xp.data(), w, y, M, K2, N, c * per, std::min(blocks, (c + 1) * per)); };
  if (T <= 1) {
    for (int64_t c = 0; c < panels; ++c) run(c);
    return;
  }
  dmtd_steal::run(panels, T, run);
}

}  // namespace dmtd_bf16dot
#endif
