// Weight-only linear layers for CPU decoding: y[M, N] = x[M, K] · W[N, K]ᵀ, with W stored row-major
// (one output row's K weights contiguous) as bf16, int8 (per-group scale) or int4 (per-group scale and
// minimum). Each weight group of 32 is dequantised once into registers and multiplied into up to eight
// activation rows, so a decode step reads each weight byte once per eight rows of the batch.
//
// Registered as the CPU kernel of ``dmtd::linear`` (schema defined from Python in dmtd.engine.lowbit).
// Built on the machine that runs it (-march=native): AVX-512 when the CPU has it, else AVX2 with FMA (most
// x86 CPUs of the last decade: AMD Zen, Intel Haswell on), else plain C++ loops that the compiler vectorises
// for whatever it finds.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "bf16dot.h"
#include "attend.h"
#include "attend_amx.h"
#include "steal.h"

namespace {

constexpr int64_t G = 32;   // weights per group
#if !defined(__AVX512F__) && defined(DMTD_AVX2)
constexpr int64_t MB = 4;   // activation rows per weight pass (16 ymm registers: two accumulators a row and a
                            // group's four weight vectors)
#else
constexpr int64_t MB = 8;   // activation rows per weight pass
#endif

// Software prefetch this many bytes ahead of the weight stream (0: none; dmtd::set_prefetch changes it, for
// scripts/bench_prefetch.py): on the AVX2 machine measured (AMD EPYC Milan, 2 cores) a decode step streams its
// weights from memory 3-8 % faster with it (2 KiB) than on the hardware prefetcher alone.
std::atomic<int64_t> g_prefetch{2048};
enum Mode : int64_t { BF16 = 1, INT8 = 2, INT4 = 3, I8DOT = 4, BF16_BLOCKED = 5 };
constexpr int64_t QB = 64;  // I8DOT: activations quantised per block of 64 along K

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Dequantise group g of row n into out[32] (portable path).
inline void dequant_group(int64_t mode, const uint8_t* w, const float* s, int64_t K, int64_t n, int64_t g,
                          float* out) {
  const int64_t ng = K / G;
  if (mode == BF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w) + n * K + g * G;
    for (int64_t j = 0; j < G; ++j) out[j] = bf16_to_float(p[j]);
  } else if (mode == INT8) {
    const int8_t* p = reinterpret_cast<const int8_t*>(w) + n * K + g * G;
    const float d = s[n * ng + g];
    for (int64_t j = 0; j < G; ++j) out[j] = d * static_cast<float>(p[j]);
  } else {
    const uint8_t* p = w + (n * K + g * G) / 2;
    const float d = s[2 * (n * ng + g)], m = s[2 * (n * ng + g) + 1];
    for (int64_t j = 0; j < G / 2; ++j) {
      out[j] = d * static_cast<float>(p[j] & 0xF) + m;
      out[j + G / 2] = d * static_cast<float>(p[j] >> 4) + m;
    }
  }
}

#if defined(__AVX512F__)
// The 32 weights of group g of row n as two 16-lane float vectors.
inline void dequant_group_512(int64_t mode, const uint8_t* w, const float* s, int64_t K, int64_t n, int64_t g,
                              __m512& w0, __m512& w1) {
  const int64_t ng = K / G;
  if (mode == BF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w) + n * K + g * G;
    __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
    w0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    w1 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  } else if (mode == INT8) {
    const int8_t* p = reinterpret_cast<const int8_t*>(w) + n * K + g * G;
    const __m512 d = _mm512_set1_ps(s[n * ng + g]);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))));
  } else {
    const uint8_t* p = w + (n * K + g * G) / 2;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
    const __m512 d = _mm512_set1_ps(s[2 * (n * ng + g)]);
    const __m512 m = _mm512_set1_ps(s[2 * (n * ng + g) + 1]);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
  }
}
#elif defined(DMTD_AVX2)
// The 32 weights of group g of row n as four 8-lane float vectors.
inline void dequant_group_256(int64_t mode, const uint8_t* w, const float* s, int64_t K, int64_t n, int64_t g,
                              __m256* wv) {
  const int64_t ng = K / G;
  if (mode == BF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w) + n * K + g * G;
    for (int c = 0; c < 4; ++c)
      wv[c] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * c))), 16));
  } else if (mode == INT8) {
    const int8_t* p = reinterpret_cast<const int8_t*>(w) + n * K + g * G;
    const __m256 d = _mm256_set1_ps(s[n * ng + g]);
    for (int c = 0; c < 4; ++c)
      wv[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c)))));
  } else {
    const uint8_t* p = w + (n * K + g * G) / 2;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0F));                     // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));  // weights 16..31
    const __m256 d = _mm256_set1_ps(s[2 * (n * ng + g)]);
    const __m256 m = _mm256_set1_ps(s[2 * (n * ng + g) + 1]);
    wv[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    wv[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    wv[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    wv[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
  }
}
#endif

// Rows n0..n1 of y for the MBT activation rows from m0 (a compile-time count, so the accumulators stay in
// registers: two per row, for the two halves of a group, to keep two FMA chains in flight).
template <int MBT>
void rows_kernel(int64_t mode, const uint8_t* w, const float* s, const float* x, float* y, int64_t K, int64_t N,
                 int64_t m0, int64_t n0, int64_t n1) {
  const int64_t ng = K / G;
#if defined(__AVX512F__)
  for (int64_t n = n0; n < n1; ++n) {
    __m512 a0[MBT], a1[MBT];
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m512 w0, w1;
      dequant_group_512(mode, w, s, K, n, g, w0, w1);
      const float* xg = x + m0 * K + g * G;
#pragma GCC unroll 8
      for (int i = 0; i < MBT; ++i) {
        a0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + i * K), a0[i]);
        a1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + i * K + 16), a1[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) y[(m0 + i) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
  }
#elif defined(DMTD_AVX2)
  const int64_t wbits = mode == BF16 ? 16 : mode == INT8 ? 8 : 4;
  const int64_t PF = g_prefetch.load(std::memory_order_relaxed);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 a0[MBT], a1[MBT];
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m256 wv[4];
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(w) + (n * K + g * G) * wbits / 8 + PF, _MM_HINT_T0);
      dequant_group_256(mode, w, s, K, n, g, wv);
      const float* xg = x + m0 * K + g * G;
#pragma GCC unroll 8
      for (int i = 0; i < MBT; ++i) {
        a0[i] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xg + i * K), a0[i]);
        a1[i] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xg + i * K + 8), a1[i]);
        a0[i] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xg + i * K + 16), a0[i]);
        a1[i] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xg + i * K + 24), a1[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) y[(m0 + i) * N + n] = dmtd_attend::hsum256(_mm256_add_ps(a0[i], a1[i]));
  }
#else
  float wg[G];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[MBT][16] = {};
    for (int64_t g = 0; g < ng; ++g) {
      dequant_group(mode, w, s, K, n, g, wg);
      const float* xg = x + m0 * K + g * G;
      for (int i = 0; i < MBT; ++i)
        for (int64_t j = 0; j < 16; ++j) acc[i][j] += wg[j] * xg[i * K + j] + wg[j + 16] * xg[i * K + j + 16];
    }
    for (int i = 0; i < MBT; ++i) {
      float t = 0;
      for (int64_t j = 0; j < 16; ++j) t += acc[i][j];
      y[(m0 + i) * N + n] = t;
    }
  }
#endif
}

void rows(int64_t mb, int64_t mode, const uint8_t* w, const float* s, const float* x, float* y, int64_t K,
          int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  switch (mb) {
    case 1: return rows_kernel<1>(mode, w, s, x, y, K, N, m0, n0, n1);
    case 2: return rows_kernel<2>(mode, w, s, x, y, K, N, m0, n0, n1);
    case 3: return rows_kernel<3>(mode, w, s, x, y, K, N, m0, n0, n1);
    case 4: return rows_kernel<4>(mode, w, s, x, y, K, N, m0, n0, n1);
    case 5: return rows_kernel<5>(mode, w, s, x, y, K, N, m0, n0, n1);
    case 6: return rows_kernel<6>(mode, w, s, x, y, K, N, m0, n0, n1);
    case 7: return rows_kernel<7>(mode, w, s, x, y, K, N, m0, n0, n1);
    default: return rows_kernel<8>(mode, w, s, x, y, K, N, m0, n0, n1);
  }
}

// I8DOT (drafts only): int8 weights with one scale per output row, times activations quantised on the fly to
// int8 per block of 64 (scale max|x|/127). The integer products are summed by AVX512-VNNI (vpdpbusd: unsigned ×
// signed bytes, so the activations' magnitudes are the unsigned side and their signs move onto the weights), a
// block at a time, then scaled and summed in float. No per-weight conversion: the weights stream at memory speed.
struct QuantX {
  std::vector<uint8_t> mag;   // [M, K] |q|
  std::vector<int8_t> sq;     // [M, K] q, filled only where the AVX2 path reads it (its signs come from here)
  std::vector<uint64_t> neg;  // [M, K/64] bit j: q_j < 0
  std::vector<float> d;       // [M, K/64] block scales
};

// Quantise x [M, K] into q, reusing its buffers (a draft pass makes ~40 products of one or two rows; four fresh
// vectors and a scalar loop per product were a measurable share of the small ones). The AVX2 loop computes what
// the scalar one does: the same block maxima, the same products rounded to nearest even.
void quantise_rows(const float* x, int64_t M, int64_t K, QuantX& q) {
  const int64_t nb = K / QB;
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(DMTD_AVX2)
  constexpr bool signed_q = true;
#else
  constexpr bool signed_q = false;
#endif
  q.mag.resize(M * K);
  q.sq.resize(signed_q ? M * K : 0);
  q.neg.resize(M * nb);
  q.d.resize(M * nb);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QB;
      const int64_t o = m * K + b * QB;
#if defined(DMTD_AVX2)
      const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 mv = _mm256_setzero_ps();
      for (int64_t j = 0; j < QB; j += 8)  // max(v, mv): a NaN lane of v leaves mv, as std::max(amax, NaN) does
        mv = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + j), absmask), mv);
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m256 iv = _mm256_set1_ps(inv);
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      uint64_t neg = 0;
      for (int64_t j = 0; j < QB; j += 32) {
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), iv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), iv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 16), iv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 24), iv));
        // packs work within 128-bit lanes: the dword permutation puts the 32 bytes back in order
        const __m256i v = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), order);
        if (signed_q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.sq.data() + o + j), v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.mag.data() + o + j), _mm256_abs_epi8(v));
        neg |= static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(v))) << j;
      }
#else
      float amax = 0.f;
      for (int64_t j = 0; j < QB; ++j) amax = std::max(amax, std::abs(xb[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      uint64_t neg = 0;
      for (int64_t j = 0; j < QB; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
        q.mag[o + j] = static_cast<uint8_t>(v < 0 ? -v : v);
        if (signed_q) q.sq[o + j] = static_cast<int8_t>(v);
        if (v < 0) neg |= uint64_t{1} << j;
      }
#endif
      q.neg[m * nb + b] = neg;
      q.d[m * nb + b] = d;
    }
  }
}

template <int MBT>
void i8dot_kernel(const int8_t* w, const float* s, const QuantX& q, float* y, int64_t K, int64_t N, int64_t m0,
                  int64_t n0, int64_t n1) {
  const int64_t nb = K / QB;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[MBT];
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) acc[i] = _mm512_setzero_ps();
    const int8_t* wr = w + n * K;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512i wv = _mm512_loadu_si512(wr + b * QB);
#pragma GCC unroll 8
      for (int i = 0; i < MBT; ++i) {
        const int64_t m = m0 + i;
        const __m512i ws = _mm512_mask_sub_epi8(wv, static_cast<__mmask64>(q.neg[m * nb + b]), zero, wv);
        const __m512i xv = _mm512_loadu_si512(q.mag.data() + m * K + b * QB);
        const __m512i dot = _mm512_dpbusd_epi32(zero, xv, ws);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(q.d[m * nb + b]), acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) y[(m0 + i) * N + n] = s[n] * _mm512_reduce_add_ps(acc[i]);
  }
#elif defined(DMTD_AVX2)
  // vpmaddubsw (|x| unsigned × signed weights, pairs summed to int16: at most 2·127·127, no saturation) then
  // vpmaddwd by ones to int32; the signs move onto the weights with vpsignb (weights are −127..127)
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t PF = g_prefetch.load(std::memory_order_relaxed);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MBT];
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) acc[i] = _mm256_setzero_ps();
    const int8_t* wr = w + n * K;
    for (int64_t b = 0; b < nb; ++b) {
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(wr + b * QB) + PF, _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * QB));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * QB + 32));
#pragma GCC unroll 8
      for (int i = 0; i < MBT; ++i) {
        const int64_t m = m0 + i, o = m * K + b * QB;
        const __m256i s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.sq.data() + o));
        const __m256i s1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.sq.data() + o + 32));
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.mag.data() + o));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.mag.data() + o + 32));
        const __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(x0, _mm256_sign_epi8(w0, s0)), ones);
        const __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(x1, _mm256_sign_epi8(w1, s1)), ones);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), _mm256_set1_ps(q.d[m * nb + b]),
                                 acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MBT; ++i) y[(m0 + i) * N + n] = s[n] * dmtd_attend::hsum256(acc[i]);
  }
#else
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    for (int i = 0; i < MBT; ++i) {
      const int64_t m = m0 + i;
      float t = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        const uint64_t neg = q.neg[m * nb + b];
        for (int64_t j = 0; j < QB; ++j) {
          const int32_t v = q.mag[m * K + b * QB + j];
          dot += ((neg >> j) & 1 ? -v : v) * static_cast<int32_t>(wr[b * QB + j]);
        }
        t += static_cast<float>(dot) * q.d[m * nb + b];
      }
      y[m * N + n] = s[n] * t;
    }
  }
#endif
}

void i8dot_rows(int64_t mb, const int8_t* w, const float* s, const QuantX& q, float* y, int64_t K, int64_t N,
                int64_t m0, int64_t n0, int64_t n1) {
  switch (mb) {
    case 1: return i8dot_kernel<1>(w, s, q, y, K, N, m0, n0, n1);
    case 2: return i8dot_kernel<2>(w, s, q, y, K, N, m0, n0, n1);
    case 3: return i8dot_kernel<3>(w, s, q, y, K, N, m0, n0, n1);
    case 4: return i8dot_kernel<4>(w, s, q, y, K, N, m0, n0, n1);
    case 5: return i8dot_kernel<5>(w, s, q, y, K, N, m0, n0, n1);
    case 6: return i8dot_kernel<6>(w, s, q, y, K, N, m0, n0, n1);
    case 7: return i8dot_kernel<7>(w, s, q, y, K, N, m0, n0, n1);
    default: return i8dot_kernel<8>(w, s, q, y, K, N, m0, n0, n1);
  }
}

// x [..., K] (float32 or bfloat16) → y [..., N] in x's dtype; w: packed [N, K] (bf16 / int8) or [N, K/2] (int4).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t mode) {
  TORCH_CHECK(mode >= BF16 && mode <= BF16_BLOCKED, "dmtd::linear: unknown mode ", mode);
  TORCH_CHECK(w.is_contiguous() && s.is_contiguous(), "dmtd::linear: packed weights must be contiguous");
  if (mode == BF16_BLOCKED) {  // w [ceil(N/16), K/2, 32] bf16; s an empty [N, 0] carrying N (bf16dot.h)
#if defined(DMTD_BF16DOT)
    TORCH_CHECK(w.dim() == 3 && w.size(2) == 32 && s.dim() == 2 && w.size(0) == (s.size(0) + 15) / 16,
                "dmtd::linear: blocked bf16 weights are [ceil(N/16), K/2, 32] with an empty [N, 0] beside them");
    const int64_t N = s.size(0), K = w.size(1) * 2;
    TORCH_CHECK(x.size(-1) == K, "dmtd::linear: x has ", x.size(-1), " features, the weight ", K);
    TORCH_CHECK(K % G == 0, "dmtd::linear: K must be a multiple of ", G);
    auto out_shape = x.sizes().vec();
    out_shape.back() = N;
    const at::Tensor x32 = x.reshape({-1, K}).to(at::kFloat).contiguous();
    const int64_t M = x32.size(0);
    at::Tensor y = at::empty({M, N}, x32.options());
    if (M > 0)
      dmtd_bf16dot::linear(x32.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                           y.data_ptr<float>(), M, K, N);
    y = y.view(out_shape);
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
#else
    TORCH_CHECK(false, "dmtd::linear: blocked bf16 weights need the avx512bf16 kernel path");
#endif
  }
  const int64_t N = w.size(0);
  const int64_t K = mode == INT4 ? w.size(1) * 2 : w.size(1);
  TORCH_CHECK(x.size(-1) == K, "dmtd::linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(K % (mode == I8DOT ? QB : G) == 0, "dmtd::linear: K must be a multiple of ", mode == I8DOT ? QB : G);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor x32 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x32.size(0);
  at::Tensor y = at::empty({M, N}, x32.options());
#if defined(DMTD_AMX)
  if (mode == BF16) {  // every row count: one summation order per output (amx.h)
    TORCH_CHECK(dmtd_amx::ready(), "dmtd::linear: this process may not use AMX tiles (arch_prctl refused)");
    dmtd_amx::linear_bf16(x32.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                          y.data_ptr<float>(), M, K, N);
    y = y.view(out_shape);
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
#endif
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* sp = mode == BF16 ? nullptr : s.data_ptr<float>();
  const float* xp = x32.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Parallel over output rows, in chunks of 16 rows that stay in cache while every block of MB activation
  // rows passes over them. Each thread owns a contiguous range of chunks and walks it in order; a thread that
  // is done takes the chunks still left in the others' ranges. On a CPU replica the serving path (event loop,
  // Ray, the gateway) shares the cores, and a thread it preempts would otherwise hold the whole product back
  // at the barrier while the other one waits. Which thread computes a row does not change its value.
  const int64_t chunks = (N + 15) / 16;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks / 2));
  thread_local QuantX tl_q;
  QuantX& q = tl_q;  // a local reference: the worker threads below must read this thread's buffers, not their own
  if (mode == I8DOT) quantise_rows(xp, M, K, q);
  const int8_t* w8 = reinterpret_cast<const int8_t*>(wp);
  auto chunk = [&](int64_t c) {
    const int64_t n0 = c * 16, n1 = std::min(n0 + 16, N);
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      if (mode == I8DOT) i8dot_rows(std::min(MB, M - m0), w8, sp, q, yp, K, N, m0, n0, n1);
      else rows(std::min(MB, M - m0), mode, wp, sp, xp, yp, K, N, m0, n0, n1);
    }
  };
  if (T <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
  } else {
    dmtd_steal::run(chunks, T, chunk);
  }
  y = y.view(out_shape);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}


// Layers over rows that each hold one position of one sequence, in one call: row r is position pos[r] of sequence
// slots[r], whose KV pages are table[slots[r]] (rows of one slot hold distinct positions; a row attends to keys 0 .. its own position, those the other
// rows write in this call included). The same computation as dmtd.engine.model.layer_forward (pre-norm attention
// with rope and GQA over the float32 KV cache — a qkv bias and per-head q/k norms where the model has them — then
// a SwiGLU MLP), in float32 throughout — the residual stream
// too — with the packed projections' kernel, where the TorchScript loop spends ~45 tensor ops a layer on it (about
// a third of a bf16 decode step of SmolLM2 on 2 cores). Every row is computed alone: the products, the norms and
// attention give a row the same bits whatever rows share the call, which the exact profile's equality with τ = 1
// rests on.
namespace {

// RMS norm of B consecutive rows. A row's sum of squares runs in order (its bits); the B rows' sums are independent
// chains side by side, where one row's alone waits on each add (~4 cycles an element: a prefill's 1,100 rows spent
// ~2 ms a layer in them on one core while the other waited).
template <int B>
inline void rms_block(const float* x, const float* w, float* y, int64_t H, float eps) {
  float ss[B] = {};
  for (int64_t j = 0; j < H; ++j)
    for (int b = 0; b < B; ++b) ss[b] += x[b * H + j] * x[b * H + j];
  for (int b = 0; b < B; ++b) {
    const float inv = 1.f / std::sqrt(ss[b] / static_cast<float>(H) + eps);
    for (int64_t j = 0; j < H; ++j) y[b * H + j] = x[b * H + j] * inv * w[j];
  }
}

void rms_rows(const float* x, const float* w, float* y, int64_t R, int64_t H, float eps) {
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {  // rows apart (a few rows stay on this thread)
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) rms_block<8>(x + r * H, w, y + r * H, H, eps);
    for (; r < r1; ++r) rms_block<1>(x + r * H, w, y + r * H, H, eps);
  });
}

// rotate_half rope with the signed-sin table: out[j] = x[j]·cos[j] + x[j ± hd/2]·sin[j]
void rope_head(float* x, const float* c, const float* sn, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * c[j] + b * sn[j];
    x[j + half] = b * c[j + half] + a * sn[j + half];
  }
}

// silu(gate) · up of each row of gu [R, 2·inter] into out [R, inter] (rows apart on the threads: elementwise)
void swiglu_rows(const float* gp, float* actp, int64_t R, int64_t inter) {
  at::parallel_for(0, R, 32, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gp + r * 2 * inter;
    float* o = actp + r * inter;
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= inter; j += 16) {  // 16 lanes (the scalar exp was ~5 % of a draft)
      const __m512 a = _mm512_loadu_ps(g + j);
      const __m512 e = dmtd_attend::exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
      _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                            _mm512_loadu_ps(g + inter + j)));
    }
#endif
#if !defined(__AVX512F__) && defined(DMTD_AVX2)
    for (; j + 8 <= inter; j += 8) {
      const __m256 a = _mm256_loadu_ps(g + j);
      const __m256 e = dmtd_attend::exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                            _mm256_loadu_ps(g + inter + j)));
    }
#endif
    for (; j < inter; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * g[inter + j];
  }
  });
}

// x · W for the layer loop
at::Tensor project_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t mode) {
  return linear(x, w, s, mode).contiguous();
}

// Rows' attention, row b over keys 0 .. lens[b] − 1 of sequence slots[b]: a prompt's rows (flagged in `prompt`:
// runs of one sequence's consecutive positions) on AMX tiles where the build has them and heads are of 64
// (attend_amx.h), every other row — decode rows, checks, a resumed sequence's own tokens — as dmtd_attend computes it.
template <typename T>
void attend_rows(const float* q, const T* kc, const T* vc, const int64_t* tp, int64_t tw, const int64_t* slots,
                 const int64_t* lens, int64_t B, int64_t nh, int64_t nkv, int64_t P, int64_t hd, float scale, float* out,
                 const uint8_t* prompt) {
#if defined(DMTD_AMX)
  if constexpr (std::is_same_v<T, float>) if (prompt != nullptr && hd == dmtd_attend_amx::HD) {
    std::vector<dmtd_attend_amx::Run> runs;
    std::vector<int64_t> drows;
    for (int64_t b = 0; b < B; ++b) {
      if (!prompt[b]) {
        drows.push_back(b);
        continue;
      }
      const int64_t pos = lens[b] - 1;
      if (!runs.empty() && runs.back().slot == slots[b] && runs.back().r0 + runs.back().m == b &&
          runs.back().p0 + runs.back().m == pos) {
        ++runs.back().m;
      } else {
        runs.push_back({slots[b], b, 1, pos});
      }
    }
    if (!runs.empty()) {
      dmtd_attend_amx::runs(q, kc, vc, tp, tw, runs, nh, nkv, P, scale, out);
      const int64_t D = static_cast<int64_t>(drows.size()), qd = nh * hd;
      if (D > 0) {  // the other rows gathered, attended, put back
        std::vector<float> dq(static_cast<size_t>(D * qd)), dout(static_cast<size_t>(D * qd));
        std::vector<int64_t> ds(static_cast<size_t>(D)), dl(static_cast<size_t>(D));
        for (int64_t j = 0; j < D; ++j) {
          std::memcpy(dq.data() + j * qd, q + drows[j] * qd, qd * sizeof(float));
          ds[j] = slots[drows[j]];
          dl[j] = lens[drows[j]];
        }
        dmtd_attend::rows(dq.data(), kc, vc, tp, tw, ds.data(), dl.data(), D, nh, nkv, P, hd, scale, dout.data());
        for (int64_t j = 0; j < D; ++j) std::memcpy(out + drows[j] * qd, dout.data() + j * qd, qd * sizeof(float));
      }
      return;
    }
  }
#endif
  (void)prompt;
  dmtd_attend::rows(q, kc, vc, tp, tw, slots, lens, B, nh, nkv, P, hd, scale, out);
}

at::Tensor rows_layers_impl(const at::Tensor& h_in, at::TensorList ln1, at::TensorList qkv_w, at::TensorList qkv_s,
                            at::TensorList o_w, at::TensorList o_s, at::TensorList ln2, at::TensorList gu_w,
                            at::TensorList gu_s, at::TensorList dn_w, at::TensorList dn_s, at::TensorList kc,
                            at::TensorList vc, at::TensorList qkv_b, at::TensorList q_norm, at::TensorList k_norm,
                            const at::Tensor& table_in, const at::Tensor& cos_in,
                            const at::Tensor& sin_in, const std::vector<int64_t>& rslots, const std::vector<int64_t>& rpos, int64_t nh,
                            int64_t nkv, int64_t hd, double eps_d, int64_t mode,
                            const char* op, const std::vector<uint8_t>& prompt = {}) {
  const int64_t R = h_in.size(0), H = h_in.size(1), L = static_cast<int64_t>(ln1.size());
  TORCH_CHECK(R >= 1 && static_cast<int64_t>(rslots.size()) == R && static_cast<int64_t>(rpos.size()) == R, op,
              ": one slot and one position per row");
  TORCH_CHECK(nh % nkv == 0 && hd % 2 == 0, op, ": bad head shape");
  TORCH_CHECK(qkv_w.size() == static_cast<size_t>(L) && o_w.size() == static_cast<size_t>(L) &&
              gu_w.size() == static_cast<size_t>(L) && dn_w.size() == static_cast<size_t>(L) &&
              ln2.size() == static_cast<size_t>(L) && kc.size() == static_cast<size_t>(L) &&
              vc.size() == static_cast<size_t>(L), op, ": one weight of each kind and one KV pair per layer");
  // optional per layer (Qwen2's qkv bias, Qwen3's per-head q and k norms before rope): none or one a layer
  TORCH_CHECK((qkv_b.empty() || qkv_b.size() == static_cast<size_t>(L)) && q_norm.size() == k_norm.size() &&
              (q_norm.empty() || q_norm.size() == static_cast<size_t>(L)), op,
              ": qkv biases and q/k norms: none, or one a layer");
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 2, op, ": the page table is [sequences, pages]");
  const int64_t tw = table.size(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  at::Tensor h = h_in.to(at::kFloat).contiguous().clone();
  const at::Tensor cs = cos_in.to(at::kFloat).contiguous(), sn = sin_in.to(at::kFloat).contiguous();
  TORCH_CHECK(cs.dim() == 2 && cs.size(0) == R && cs.size(1) == hd && sn.sizes() == cs.sizes(), op, ": rope tables");
  const int64_t qd = nh * hd, kvd = nkv * hd;
  const float eps = static_cast<float>(eps_d), scale = 1.f / std::sqrt(static_cast<float>(hd));
  at::Tensor x = at::empty({R, H}, h.options());
  at::Tensor att = at::empty({R, qd}, h.options());
  std::vector<float> qbuf(R * qd);
  std::vector<int64_t> rlens(R);
  for (int64_t r = 0; r < R; ++r) rlens[r] = rpos[r] + 1;
  float* qp = qbuf.data();
  float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < L; ++i) {
    const bool kv16 = kc[i].scalar_type() == at::kBFloat16;
    TORCH_CHECK((kc[i].scalar_type() == at::kFloat || kv16) && vc[i].scalar_type() == kc[i].scalar_type() &&
                kc[i].dim() == 4 && kc[i].is_contiguous() && vc[i].is_contiguous() && vc[i].sizes() == kc[i].sizes() &&
                kc[i].size(1) == nkv && kc[i].size(3) == hd, op, ": the KV cache must be contiguous float32 or "
                "bfloat16 [pages, nkv, page_size, hd]");
#if defined(DMTD_AMX)
    TORCH_CHECK(!kv16, op, ": the amx path keeps its KV cache in float32");
#endif
    const int64_t P = kc[i].size(2), npages = kc[i].size(0);
    if (i == 0)
      for (int64_t r = 0; r < R; ++r) {
        TORCH_CHECK(rslots[r] >= 0 && rslots[r] < table.size(0) && rpos[r] >= 0 && rpos[r] < tw * P, op,
                    ": sequence or position out of range");
        for (int64_t pg = 0; pg <= rpos[r] / P; ++pg)
          TORCH_CHECK(tp[rslots[r] * tw + pg] >= 0 && tp[rslots[r] * tw + pg] < npages, op,
                      ": a page of the row's keys is not in the pool");
      }
    rms_rows(hp, ln1[i].data_ptr<float>(), xp, R, H, eps);
    at::Tensor y = project_rows(x, qkv_w[i], qkv_s[i], mode);  // [R, qd + 2 kvd]
    if (!qkv_b.empty()) {
      TORCH_CHECK(qkv_b[i].scalar_type() == at::kFloat && qkv_b[i].numel() == qd + 2 * kvd, op,
                  ": a qkv bias is float32 [nh·hd + 2·nkv·hd]");
      y.add_(qkv_b[i]);  // elementwise: a row's bits are its own
    }
    const float* qn = q_norm.empty() ? nullptr : q_norm[i].data_ptr<float>();
    const float* kn = k_norm.empty() ? nullptr : k_norm[i].data_ptr<float>();
    if (qn != nullptr)
      TORCH_CHECK(q_norm[i].scalar_type() == at::kFloat && q_norm[i].numel() == hd &&
                  k_norm[i].scalar_type() == at::kFloat && k_norm[i].numel() == hd, op, ": q/k norms are float32 [hd]");
    float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
      float* yr = yp + r * (qd + 2 * kvd);
      if (qn != nullptr)  // each head's RMS norm over its hd values, in place (rms_block reads a row, then writes it)
        for (int64_t hh = 0; hh < nh + nkv; ++hh) rms_block<1>(yr + hh * hd, hh < nh ? qn : kn, yr + hh * hd, hd, eps);
      for (int64_t hh = 0; hh < nh + nkv; ++hh) rope_head(yr + hh * hd, cs.data_ptr<float>() + r * hd,
                                                        sn.data_ptr<float>() + r * hd, hd);
      const int64_t page = tp[rslots[r] * tw + rpos[r] / P], off = rpos[r] % P;
      if (kv16) {  // rounded to nearest even as torch's .to(bfloat16) rounds: every path writes the same bits
        c10::BFloat16* kb = kc[i].data_ptr<c10::BFloat16>() + page * nkv * P * hd;
        c10::BFloat16* vb = vc[i].data_ptr<c10::BFloat16>() + page * nkv * P * hd;
        for (int64_t kv = 0; kv < nkv; ++kv)
          for (int64_t j = 0; j < hd; ++j) {
            kb[(kv * P + off) * hd + j] = c10::BFloat16(yr[qd + kv * hd + j]);
            vb[(kv * P + off) * hd + j] = c10::BFloat16(yr[qd + kvd + kv * hd + j]);
          }
      } else {
        float* kb = kc[i].data_ptr<float>() + page * nkv * P * hd;
        float* vb = vc[i].data_ptr<float>() + page * nkv * P * hd;
        for (int64_t kv = 0; kv < nkv; ++kv) {
          std::memcpy(kb + (kv * P + off) * hd, yr + qd + kv * hd, hd * sizeof(float));
          std::memcpy(vb + (kv * P + off) * hd, yr + qd + kvd + kv * hd, hd * sizeof(float));
        }
      }
      std::memcpy(qp + r * qd, yr, qd * sizeof(float));  // the queries, packed [R, nh, hd] for dmtd_attend::rows
    }
    TORCH_CHECK(prompt.empty() || static_cast<int64_t>(prompt.size()) == R, op, ": one prompt flag per row");
    const uint8_t* pf = prompt.empty() ? nullptr : prompt.data();  // keys 0 .. its own position
    if (kv16)
      attend_rows(qp, kc[i].data_ptr<c10::BFloat16>(), vc[i].data_ptr<c10::BFloat16>(), tp, tw, rslots.data(),
                  rlens.data(), R, nh, nkv, P, hd, scale, att.data_ptr<float>(), pf);
    else
      attend_rows(qp, kc[i].data_ptr<float>(), vc[i].data_ptr<float>(), tp, tw, rslots.data(), rlens.data(), R, nh,
                  nkv, P, hd, scale, att.data_ptr<float>(), pf);
    h.add_(project_rows(att, o_w[i], o_s[i], mode));
    rms_rows(hp, ln2[i].data_ptr<float>(), xp, R, H, eps);
    at::Tensor gu = project_rows(x, gu_w[i], gu_s[i], mode);
    const int64_t inter = gu.size(1) / 2;
    at::Tensor act = at::empty({R, inter}, h.options());
    swiglu_rows(gu.data_ptr<float>(), act.data_ptr<float>(), R, inter);
    h.add_(project_rows(act, dn_w[i], dn_s[i], mode));
  }
  return h.to(h_in.scalar_type());
}

}  // namespace

// A draft's layers (verified cycles' tails) for one sequence: rows are its consecutive positions ending at
// read_len − 1 of sequence `slot` (its pages: table[slot]; one new position, or a catch-up chunk).
at::Tensor draft_layers(const at::Tensor& h_in, at::TensorList ln1, at::TensorList qkv_w, at::TensorList qkv_s,
                        at::TensorList o_w, at::TensorList o_s, at::TensorList ln2, at::TensorList gu_w,
                        at::TensorList gu_s, at::TensorList dn_w, at::TensorList dn_s, at::TensorList kc,
                        at::TensorList vc, at::TensorList qkv_b, at::TensorList q_norm, at::TensorList k_norm,
                        const at::Tensor& table, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t slot,
                        int64_t read_len, int64_t nh, int64_t nkv, int64_t hd, double eps_d, int64_t mode) {
  const int64_t R = h_in.size(0);
  TORCH_CHECK(R >= 1 && R <= read_len, "dmtd::draft_layers: ", R, " rows for ", read_len, " positions");
  std::vector<int64_t> rslots(R, slot), rpos(R);
  for (int64_t r = 0; r < R; ++r) rpos[r] = read_len - R + r;
  return rows_layers_impl(h_in, ln1, qkv_w, qkv_s, o_w, o_s, ln2, gu_w, gu_s, dn_w, dn_s, kc, vc, qkv_b, q_norm,
                          k_norm, table, cos_in, sin_in, rslots, rpos, nh, nkv, hd, eps_d, mode, "dmtd::draft_layers");
}

// Decode rows through a layer group: row r is position positions[r] of sequence slots[r] (a batch's rows, a check's
// or a refill's chunk of one sequence, or both).
// An optional [R] tensor of flags as bytes (empty: none given).
std::vector<uint8_t> prompt_flags(const std::optional<at::Tensor>& flags, int64_t R) {
  if (!flags.has_value() || !flags->defined()) return {};
  const at::Tensor f = flags->to(at::kByte).contiguous();
  TORCH_CHECK(f.numel() == R, "dmtd: one prompt flag per row, got ", f.numel(), " for ", R, " rows");
  return std::vector<uint8_t>(f.data_ptr<uint8_t>(), f.data_ptr<uint8_t>() + R);
}

at::Tensor rows_layers(const at::Tensor& h_in, at::TensorList ln1, at::TensorList qkv_w, at::TensorList qkv_s,
                       at::TensorList o_w, at::TensorList o_s, at::TensorList ln2, at::TensorList gu_w,
                       at::TensorList gu_s, at::TensorList dn_w, at::TensorList dn_s, at::TensorList kc,
                       at::TensorList vc, at::TensorList qkv_b, at::TensorList q_norm, at::TensorList k_norm,
                       const at::Tensor& table, const at::Tensor& cos_in,
                       const at::Tensor& sin_in, const at::Tensor& slots_in, const at::Tensor& pos_in, int64_t nh, int64_t nkv, int64_t hd,
                       double eps_d, int64_t mode, const std::optional<at::Tensor>& prompt_in) {
  TORCH_CHECK(h_in.dim() == 2, "dmtd::rows_layers: h [R, H]");
  const at::Tensor sl = slots_in.to(at::kLong).contiguous(), ps = pos_in.to(at::kLong).contiguous();
  const int64_t R = h_in.size(0);
  TORCH_CHECK(sl.numel() == R && ps.numel() == R, "dmtd::rows_layers: one slot and one position per row");
  std::vector<int64_t> rslots(sl.data_ptr<int64_t>(), sl.data_ptr<int64_t>() + R);
  std::vector<int64_t> rpos(ps.data_ptr<int64_t>(), ps.data_ptr<int64_t>() + R);
  return rows_layers_impl(h_in, ln1, qkv_w, qkv_s, o_w, o_s, ln2, gu_w, gu_s, dn_w, dn_s, kc, vc, qkv_b, q_norm,
                          k_norm, table, cos_in, sin_in, rslots, rpos, nh, nkv, hd, eps_d, mode, "dmtd::rows_layers",
                          prompt_flags(prompt_in, R));
}

}  // namespace

// Each row's first maximum of x [n, N] and its softmax probability 1 / Σ exp(x − max): (idx int64 [n], p float32
// [n]); p is NaN for a row holding a NaN or no finite value, as torch's softmax would make it.
std::tuple<at::Tensor, at::Tensor> top1(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) > 0, "dmtd::top1: logits [n, N]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t n = x.size(0), N = x.size(1);
  at::Tensor idx = at::empty({n}, x.options().dtype(at::kLong));
  at::Tensor prob = at::empty({n}, x.options());
  for (int64_t r = 0; r < n; ++r) {
    const float* v = x.data_ptr<float>() + r * N;
    int64_t best = 0;
    bool nan = false;
    int64_t j0 = 0;
#if defined(__AVX512F__)
    if (N >= 16) {  // per lane its first maximum, then the lowest index among the lanes holding the overall one
      __m512 bv = _mm512_loadu_ps(v);
      __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i cur = bi;
      __mmask16 un = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
      const __m512i step = _mm512_set1_epi32(16);
      for (j0 = 16; j0 + 16 <= N; j0 += 16) {
        cur = _mm512_add_epi32(cur, step);
        const __m512 x = _mm512_loadu_ps(v + j0);
        un |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(x, bv, _CMP_GT_OQ);
        bv = _mm512_mask_mov_ps(bv, gt, x);
        bi = _mm512_mask_mov_epi32(bi, gt, cur);
      }
      nan = un != 0;
      alignas(64) float vals[16];
      alignas(64) int32_t ids[16];
      _mm512_store_ps(vals, bv);
      _mm512_store_si512(ids, bi);
      best = ids[0];
      for (int k = 1; k < 16; ++k)
        if (vals[k] > v[best] || (vals[k] == v[best] && ids[k] < best)) best = ids[k];
    }
#endif
    for (int64_t j = j0; j < N; ++j) {
      nan |= v[j] != v[j];
      if (v[j] > v[best]) best = j;
    }
    const float mx = v[best];
    float sum = 0.f;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mx);
    for (; j + 16 <= N; j += 16) acc = _mm512_add_ps(acc, dmtd_attend::exp512(_mm512_sub_ps(_mm512_loadu_ps(v + j), m)));
    sum = _mm512_reduce_add_ps(acc);
#elif defined(DMTD_AVX2)
    __m256 acc = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(mx);
    for (; j + 8 <= N; j += 8) acc = _mm256_add_ps(acc, dmtd_attend::exp256(_mm256_sub_ps(_mm256_loadu_ps(v + j), m)));
    sum = dmtd_attend::hsum256(acc);
#endif
    for (; j < N; ++j) sum += std::exp(v[j] - mx);
    idx.data_ptr<int64_t>()[r] = best;
    prob.data_ptr<float>()[r] = nan || !std::isfinite(mx) ? NAN : 1.f / sum;
  }
  return {idx, prob};
}

// Decode rows' attention over the paged float32 or bfloat16 KV cache (attend.h): q [B, nh, hd] → [B, nh·hd] float32; row b reads
// keys 0 .. lens[b] − 1 of sequence slots[b], whose pages are table[slots[b]] in kc/vc [pages, nkv, P, hd].
at::Tensor attend(const at::Tensor& q_in, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table_in,
                  const at::Tensor& slots_in, const at::Tensor& lens_in, double scale,
                  const std::optional<at::Tensor>& prompt_in) {
  TORCH_CHECK(q_in.dim() == 3 && kc.dim() == 4 && vc.sizes() == kc.sizes(), "dmtd::attend: q [B, nh, hd], kc/vc "
              "[pages, nkv, page_size, hd]");
  const bool kv16 = kc.scalar_type() == at::kBFloat16;
  TORCH_CHECK((kc.scalar_type() == at::kFloat || kv16) && vc.scalar_type() == kc.scalar_type() && kc.is_contiguous() &&
              vc.is_contiguous(), "dmtd::attend: the KV cache must be contiguous float32 or bfloat16");
#if defined(DMTD_AMX)
  TORCH_CHECK(!kv16, "dmtd::attend: the amx path keeps its KV cache in float32");
#endif
  const int64_t B = q_in.size(0), nh = q_in.size(1), hd = q_in.size(2), nkv = kc.size(1), P = kc.size(2);
  TORCH_CHECK(kc.size(3) == hd && nh % nkv == 0, "dmtd::attend: head shapes do not match the cache");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 2, "dmtd::attend: the page table is [sequences, pages]");
  const int64_t tw = table.size(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous(), lens = lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == B && lens.numel() == B, "dmtd::attend: one sequence and one length per row");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < table.size(0) && lp[b] >= 1 && lp[b] <= tw * P,
                "dmtd::attend: sequence or length out of range");
    for (int64_t pg = 0; pg < (lp[b] + P - 1) / P; ++pg)
      TORCH_CHECK(tp[sp[b] * tw + pg] >= 0 && tp[sp[b] * tw + pg] < kc.size(0),
                  "dmtd::attend: a page of the row's keys is not in the pool");
  }
  at::Tensor out = at::empty({B, nh * hd}, q.options());
  const std::vector<uint8_t> prompt = prompt_flags(prompt_in, B);
  const uint8_t* pf = prompt.empty() ? nullptr : prompt.data();
  if (kv16)
    attend_rows(q.data_ptr<float>(), kc.data_ptr<c10::BFloat16>(), vc.data_ptr<c10::BFloat16>(), tp, tw, sp, lp, B,
                nh, nkv, P, hd, static_cast<float>(scale), out.data_ptr<float>(), pf);
  else
    attend_rows(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), tp, tw, sp, lp, B, nh, nkv, P, hd,
                static_cast<float>(scale), out.data_ptr<float>(), pf);
  return out;
}

// The prefetch distance of the AVX2 products in bytes (0: none); returns the one before. ``x`` only routes the call.
int64_t set_prefetch(const at::Tensor& x, int64_t bytes) {
  (void)x;
  TORCH_CHECK(bytes >= 0 && bytes <= 65536, "dmtd::set_prefetch: bytes must be in 0..65536, got ", bytes);
  return g_prefetch.exchange(bytes);
}

// The instruction path this build was compiled for (dmtd.engine.lowbit.KERNEL_PATHS): 3 AMX (bf16 products on
// tiles), 4 AVX512-BF16 (bf16 dot products, blocked weights), 2 AVX-512, 1 AVX2 with FMA, 0 plain loops; −1 for an AMX build in a process the OS refuses tiles.
int64_t kernel_path(const at::Tensor& x) {
  (void)x;
#if defined(DMTD_AMX)
  return dmtd_amx::ready() ? 3 : -1;
#elif defined(DMTD_BF16DOT)
  return 4;
#elif defined(__AVX512F__)
  return 2;
#elif defined(DMTD_AVX2)
  return 1;
#else
  return 0;
#endif
}

TORCH_LIBRARY_IMPL(dmtd, CPU, m) {
  m.impl("kernel_path", &kernel_path);
  m.impl("set_prefetch", &set_prefetch);
  m.impl("attend", &attend);
  m.impl("top1", &top1);
  m.impl("linear", &linear);
  m.impl("draft_layers", &draft_layers);
  m.impl("rows_layers", &rows_layers);
}
