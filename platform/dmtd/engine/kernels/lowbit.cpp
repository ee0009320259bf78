// Weight-only linear layers for CPU decoding: y[M, N] = x[M, K] · W[N, K]ᵀ, with W stored row-major
// (one output row's K weights contiguous) as bf16, int8 (per-group scale) or int4 (per-group scale and
// minimum). Each weight group of 32 is dequantised once into registers and multiplied into up to eight
// activation rows, so a decode step reads each weight byte once per eight rows of the batch.
//
// Registered as the CPU kernel of ``dmtd::linear`` (schema defined from Python in dmtd.engine.lowbit).
// Built on the machine that runs it (-march=native): AVX-512 when the CPU has it, else plain C++ loops
// that the compiler vectorises for whatever it finds.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t G = 32;   // weights per group
constexpr int64_t MB = 8;   // activation rows per weight pass

enum Mode : int64_t { BF16 = 1, INT8 = 2, INT4 = 3 };

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

// x [..., K] (float32 or bfloat16) → y [..., N] in x's dtype; w: packed [N, K] (bf16 / int8) or [N, K/2] (int4).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t mode) {
  TORCH_CHECK(mode == BF16 || mode == INT8 || mode == INT4, "dmtd::linear: unknown mode ", mode);
  TORCH_CHECK(w.is_contiguous() && s.is_contiguous(), "dmtd::linear: packed weights must be contiguous");
  const int64_t N = w.size(0);
  const int64_t K = mode == INT4 ? w.size(1) * 2 : w.size(1);
  TORCH_CHECK(x.size(-1) == K, "dmtd::linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(K % G == 0, "dmtd::linear: K must be a multiple of ", G);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor x32 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x32.size(0);
  at::Tensor y = at::empty({M, N}, x32.options());
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
  auto chunk = [&](int64_t c) {
    const int64_t n0 = c * 16, n1 = std::min(n0 + 16, N);
    for (int64_t m0 = 0; m0 < M; m0 += MB) rows(std::min(MB, M - m0), mode, wp, sp, xp, yp, K, N, m0, n0, n1);
  };
  if (T <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
  } else {
    struct alignas(64) Range { std::atomic<int64_t> next; int64_t end; };
    std::vector<Range> ranges(T);
    for (int64_t t = 0; t < T; ++t) {
      ranges[t].next.store(chunks * t / T, std::memory_order_relaxed);
      ranges[t].end = chunks * (t + 1) / T;
    }
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t v = 0; v < T; ++v) {  // own range first, then the others'
          Range& r = ranges[(t + v) % T];
          for (int64_t c; (c = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) chunk(c);
        }
      }
    });
  }
  y = y.view(out_shape);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(dmtd, CPU, m) { m.impl("linear", &linear); }
