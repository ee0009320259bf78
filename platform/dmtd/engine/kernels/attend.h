// Attention of decode rows over the paged float32 KV cache, one (row, query head) at a time: each row reads keys
// 0 .. len − 1 of its own sequence, page by page through its page table, with exactly the same arithmetic whatever else shares the call (how many rows,
// which lengths, which thread), so a verified cycle's check over a chunk of positions scores each position as a
// step of that position alone does — bitwise. One call per layer replaces the ~10 tensor ops per row (slices,
// two batched matmuls, a softmax, casts) that dominated a check's cost per extra position on CPU.
//
// Included by lowbit.cpp (built with -march=native): AVX-512 where the CPU has it and hd is a multiple of 16,
// else AVX2 with FMA where hd is a multiple of 8, else plain loops.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define DMTD_AVX2 1
#endif
#if defined(__AVX512F__) || defined(DMTD_AVX2)
#include <immintrin.h>
#endif

namespace dmtd_attend {

#if defined(DMTD_AVX2)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp (Cephes' expf polynomial, ~1 ulp) for x in [−87, 88]; outside it x is clamped (exp(−87) ~1e-38 instead of
// 0, exp(88) ~1.7e38 instead of inf); NaN stays NaN.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));  // NaN passes (2nd operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n built in the exponent field (n in −126 .. 127 after the clamp)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
// exp for x ≤ 0 (Cephes' expf polynomial, ~1 ulp); NaN stays NaN, x < −87 gives ~1e-38 instead of 0.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // NaN in x is returned as is (second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The sum of v's 16 lanes as GCC's _mm512_reduce_add_ps takes it — a tree: lane i + lane i + 8, then + 4, then + 2,
// then + 1 — written out, so that sum16x16 gives the same bits for 16 vectors at once whatever the compiler.
inline float hsum16(__m512 v) {
  const __m256 t3 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                                  _mm512_castps512_ps256(v));
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

// hsum16 of 16 vectors at once, its tree level by level across them (15 adds and 30 shuffles for the 16 sums, where
// one at a time takes 4 adds and 4 shuffles each): lane i of the result is hsum16(v[4 · (i % 4) + i / 4]), bit for
// bit — put vector i at that index (kSlot) and the sums come out in order.
inline __m512 sum16x16(const __m512* v) {
  __m512 s[8], t[4], u[2];
  for (int k = 0; k < 8; ++k)  // lanes i + 8 → i: each half of s[k] one vector's 8 sums
    s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int k = 0; k < 4; ++k)  // + 4: each 128-bit lane one vector's 4 sums
    t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int k = 0; k < 2; ++k)  // + 2
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)),  // + 1
                       _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)));
}
constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};  // key i of a block → its vector

// std::max over x[0 .. n − 1] from −inf, 16 lanes at a time: a maximum does not depend on the order it is taken in,
// and a NaN is skipped as std::max(m, NaN) skips it (the vector max returns its second operand, the running max).
inline float max512(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + t), m);
  float mx = _mm512_reduce_max_ps(m);
  for (; t < n; ++t) mx = std::max(mx, x[t]);
  return mx;
}

// s[0 .. n − 1] ← exp(s − max s), 16 lanes at a time, their sum taken lane-wise in order; returns 1 / the sum.
inline float softmax512(float* s, int64_t n) {
  const __m512 mv = _mm512_set1_ps(max512(s, n));
  __m512 sv = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    sv = _mm512_add_ps(sv, e);
  }
  if (t < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mv));
    _mm512_mask_storeu_ps(s + t, m, e);
    sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(m, e));
  }
  return 1.f / _mm512_reduce_add_ps(sv);
}
#endif

// One KV head's keys and values in pages: key t sits at k + pages[t / P] * ps + (t % P) * hd (v likewise). T: the
// cache's element, float or bf16 (a bf16 cache holds each key and value rounded once, as written; read here it
// widens exactly to float, so every sum below is the float cache's arithmetic on those values).
template <typename T>
struct Paged {
  const T* k;
  const T* v;
  const int64_t* pages;
  int64_t P, ps;
};

inline float val(float x) { return x; }
inline float val(c10::BFloat16 x) { return static_cast<float>(x); }
#if defined(__AVX512F__)
inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld16(const c10::BFloat16* p) {  // 16 bf16 → float: each the high half of its float's bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif
#if defined(DMTD_AVX2)
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

// Query heads hq0 .. hq0 + g − 1 (rows of q, hd floats each, consecutive) over n paged keys/values
// → out (g rows of hd). sc: scratch of n floats. The pages are walked in order: a key's arithmetic and the order of
// every sum are those of one contiguous run of keys.
template <typename T>
inline void heads(const float* q, const Paged<T>& kv, int64_t n, int64_t g, int64_t hd, float scale,
                  float* sc, float* out) {
  const int64_t P = kv.P;
#if defined(__AVX512F__)
  if (hd % 16 == 0 && hd <= 256) {
    const int64_t C = hd / 16;
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * hd;
      __m512 qv[16];
      for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qh + 16 * c);
      for (int64_t t0 = 0, pg = 0; t0 < n; t0 += P, ++pg) {
        const T* kp = kv.k + kv.pages[pg] * kv.ps;
        for (int64_t t = t0, e = std::min(n, t0 + P); t < e; ++t) {
          const T* kt = kp + (t - t0) * hd;
          __m512 a = _mm512_mul_ps(qv[0], ld16(kt));
          for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], ld16(kt + 16 * c), a);
          sc[t] = hsum16(a) * scale;
        }
      }
      const float inv = softmax512(sc, n);
      __m512 acc[16];
      for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
      for (int64_t t0 = 0, pg = 0; t0 < n; t0 += P, ++pg) {
        const T* vp = kv.v + kv.pages[pg] * kv.ps;
        for (int64_t u = t0, e = std::min(n, t0 + P); u < e; ++u) {
          const __m512 w = _mm512_set1_ps(sc[u]);
          const T* vt = vp + (u - t0) * hd;
          for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(w, ld16(vt + 16 * c), acc[c]);
        }
      }
      const __m512 iv = _mm512_set1_ps(inv);
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(out + h * hd + 16 * c, _mm512_mul_ps(acc[c], iv));
    }
    return;
  }
#elif defined(DMTD_AVX2)
  if (hd % 8 == 0 && hd <= 128) {
    const int64_t C = hd / 8;
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * hd;
      __m256 qv[16];
      for (int64_t c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(qh + 8 * c);
      for (int64_t t0 = 0, pg = 0; t0 < n; t0 += P, ++pg) {
        const T* kp = kv.k + kv.pages[pg] * kv.ps;
        for (int64_t t = t0, e = std::min(n, t0 + P); t < e; ++t) {
          const T* kt = kp + (t - t0) * hd;
          __m256 a = _mm256_mul_ps(qv[0], ld8(kt));
          for (int64_t c = 1; c < C; ++c) a = _mm256_fmadd_ps(qv[c], ld8(kt + 8 * c), a);
          sc[t] = hsum256(a) * scale;
        }
      }
      float mx = -INFINITY;
      int64_t t = 0;
      for (t = 0; t < n; ++t) mx = std::max(mx, sc[t]);
      const __m256 mv = _mm256_set1_ps(mx);
      __m256 sv = _mm256_setzero_ps();
      for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mv));
        _mm256_storeu_ps(sc + t, e);
        sv = _mm256_add_ps(sv, e);
      }
      float sum = hsum256(sv);
      for (; t < n; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
      const float inv = 1.f / sum;
      __m256 acc[16];
      for (int64_t c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t t0 = 0, pg = 0; t0 < n; t0 += P, ++pg) {
        const T* vp = kv.v + kv.pages[pg] * kv.ps;
        for (int64_t u = t0, e = std::min(n, t0 + P); u < e; ++u) {
          const __m256 w = _mm256_set1_ps(sc[u]);
          const T* vt = vp + (u - t0) * hd;
          for (int64_t c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(w, ld8(vt + 8 * c), acc[c]);
        }
      }
      const __m256 iv = _mm256_set1_ps(inv);
      for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(out + h * hd + 8 * c, _mm256_mul_ps(acc[c], iv));
    }
    return;
  }
#endif
  for (int64_t h = 0; h < g; ++h) {
    const float* qh = q + h * hd;
    float mx = -INFINITY;
    for (int64_t t0 = 0, pg = 0; t0 < n; t0 += P, ++pg) {
      const T* kp = kv.k + kv.pages[pg] * kv.ps;
      for (int64_t t = t0, e = std::min(n, t0 + P); t < e; ++t) {
        const T* kt = kp + (t - t0) * hd;
        float d = 0.f;
        for (int64_t j = 0; j < hd; ++j) d += qh[j] * val(kt[j]);
        sc[t] = d * scale;
        mx = std::max(mx, sc[t]);
      }
    }
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    float* o = out + h * hd;
    for (int64_t j = 0; j < hd; ++j) o[j] = 0.f;
    for (int64_t t0 = 0, pg = 0; t0 < n; t0 += P, ++pg) {
      const T* vp = kv.v + kv.pages[pg] * kv.ps;
      for (int64_t t = t0, e = std::min(n, t0 + P); t < e; ++t)
        for (int64_t j = 0; j < hd; ++j) o[j] += sc[t] * val(vp[(t - t0) * hd + j]);
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < hd; ++j) o[j] *= inv;
  }
}

#if defined(__AVX512F__)
// How many pages ahead group512 asks for keys (a page of 16 keys is ~50 ns of its work, memory ~100 ns away).
constexpr int64_t kAhead = 4;

// G queries that read one KV head of one sequence (the GQA group's heads of a row, or of consecutive rows of one
// sequence: a check's or a prompt's positions): query j (hd = 16·C floats at q[j]) over keys 0 .. n[j] − 1 → out[j];
// sc: scratch of G·max(n) floats. Each key and each value is loaded once for the G queries (one at a time, a long
// context's keys came from L3 once per query); every query's arithmetic is heads()'s — the same products, the same
// sums in the same order — so its bits are those of heads() alone, whatever shares the group.
template <int C, int G, typename T>
inline void group512(const float* const* q, const int64_t* n, const Paged<T>& kv, int64_t hd, float scale, float* sc,
                     float* const* out) {
  const int64_t P = kv.P;
  int64_t nmax = 0;
  for (int j = 0; j < G; ++j) nmax = std::max(nmax, n[j]);
  __m512 qv[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) qv[j][c] = _mm512_loadu_ps(q[j] + 16 * c);
  // scores 16 keys at a time: each key's 16 lane products per query are kept, then summed for the 16 keys at once
  // (sum16x16: each sum's tree is hsum16's, so a score's bits are heads()'s)
  __m512 part[G][16];
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < nmax; b += 16) {
    const int64_t e = std::min(nmax, b + 16);
    for (int j = 0; j < G; ++j)  // a query's last block: the slots of keys it does not read hold zeros
      for (int64_t t = std::max(b, std::min(n[j], e)); t < b + 16; ++t) part[j][kSlot[t - b]] = _mm512_setzero_ps();
    int64_t pg = b / P, off = b % P;
    const int64_t last = (nmax - 1) / P;
    const T* kp = kv.k + kv.pages[pg] * kv.ps;
    for (int64_t t = b; t < e; ++t, ++off) {
      if (off == P) {
        off = 0;
        kp = kv.k + kv.pages[++pg] * kv.ps;
      }
      const T* kt = kp + off * hd;
      // the pages are scattered, so the hardware's prefetch stops at each page's end: ask for the key at this
      // offset four pages on (over the first page, one to four pages on), and for this key's value (read after
      // the softmax) — no effect on any result
      for (int64_t d = pg == 0 ? 1 : kAhead; d <= kAhead && pg + d <= last; ++d) {
        const T* kn = kv.k + kv.pages[pg + d] * kv.ps + off * hd;
        for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(kn + 16 * c), _MM_HINT_T0);
      }
      {
        const T* vn = kv.v + kv.pages[pg] * kv.ps + off * hd;
        for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(vn + 16 * c), _MM_HINT_T1);
      }
      __m512 kk[C];
      for (int c = 0; c < C; ++c) kk[c] = ld16(kt + 16 * c);
      for (int j = 0; j < G; ++j) {
        if (t >= n[j]) continue;
        __m512 a = _mm512_mul_ps(qv[j][0], kk[0]);
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[j][c], kk[c], a);
        part[j][kSlot[t - b]] = a;
      }
    }
    for (int j = 0; j < G; ++j) {
      if (b >= n[j]) continue;
      const int64_t m = std::min<int64_t>(16, n[j] - b);
      _mm512_mask_storeu_ps(sc + j * nmax + b, static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(sum16x16(part[j]), sv));
    }
  }
  __m512 iv[G];
  for (int j = 0; j < G; ++j) iv[j] = _mm512_set1_ps(softmax512(sc + j * nmax, n[j]));
  __m512 acc[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0, pg = 0; t0 < nmax; t0 += P, ++pg) {
    const T* vp = kv.v + kv.pages[pg] * kv.ps;
    for (int64_t u = t0, e = std::min(nmax, t0 + P); u < e; ++u) {
      const T* vt = vp + (u - t0) * hd;
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = ld16(vt + 16 * c);
      for (int j = 0; j < G; ++j) {
        if (u >= n[j]) continue;
        const __m512 w = _mm512_set1_ps(sc[j * nmax + u]);
        for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(w, vv[c], acc[j][c]);
      }
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[j] + 16 * c, _mm512_mul_ps(acc[j][c], iv[j]));
}

template <int C, int G, typename T>
inline void group512_upto(int m, const float* const* q, const int64_t* n, const Paged<T>& kv, int64_t hd, float scale,
                          float* sc, float* const* out) {
  if constexpr (G > 1) {
    if (m < G) return group512_upto<C, G - 1, T>(m, q, n, kv, hd, scale, sc, out);
  }
  group512<C, G, T>(q, n, kv, hd, scale, sc, out);
}
#endif

// The most queries one group() call takes at once (their queries and accumulators stay in registers).
constexpr int64_t kGroupMax = 6;

// Queries q[j] (hd floats each) over keys 0 .. n[j] − 1 of one KV head of one sequence → out[j], j < m ≤ kGroupMax;
// sc: scratch of m·max(n) floats.
template <typename T>
inline void group(const float* const* q, const int64_t* n, int64_t m, const Paged<T>& kv, int64_t hd, float scale,
                  float* sc, float* const* out) {
#if defined(__AVX512F__)
  const int mm = static_cast<int>(m);
  if (hd == 64) return group512_upto<4, 6, T>(mm, q, n, kv, hd, scale, sc, out);
  if (hd == 32) return group512_upto<2, 6, T>(mm, q, n, kv, hd, scale, sc, out);
  if (hd == 128) {
    for (int j = 0; j < mm; ++j) group512<8, 1, T>(q + j, n + j, kv, hd, scale, sc, out + j);
    return;
  }
#endif
  for (int64_t j = 0; j < m; ++j) heads(q[j], kv, n[j], 1, hd, scale, sc, out[j]);  // each rereads the keys
}

// Rows b = 0 .. B − 1: q [B, nh, hd] → out [B, nh, hd]; row b reads keys 0 .. lens[b] − 1 of sequence slots[b],
// whose pages are table[slots[b] · tw ..] in kc/vc [pages, nkv, P, hd]. The work units are (row, query head),
// ordered KV head by KV head, within one its rows in turn, within a row its query heads: the threads take
// contiguous ranges of them (one row's nine heads split 5:4 over two cores, where a split by KV head went 2:1), and
// each range runs as groups of up to kGroupMax consecutive units whose rows read one sequence (group(): a key loaded
// once for the group — a row's GQA heads, and the next rows' where they are positions of the same sequence, as a
// check's or a prompt's are). A unit's arithmetic is the same whichever thread runs it and whatever shares its
// group; only calls of a few keys stay on the calling thread.
template <typename E>
inline void rows(const float* q, const E* kc, const E* vc, const int64_t* table, int64_t tw,
                 const int64_t* slots, const int64_t* lens, int64_t B, int64_t nh, int64_t nkv, int64_t P, int64_t hd,
                 float scale, float* out) {
  const int64_t g = nh / nkv, units = B * nh;
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += lens[b];
  auto run = [&](int64_t u0, int64_t u1) {
    std::vector<float> sc;
    const float* qs[kGroupMax];
    float* os[kGroupMax];
    int64_t ns[kGroupMax];
    for (int64_t u = u0; u < u1;) {
      // a group: the next units of one KV head whose rows read one sequence, at most kGroupMax
      const int64_t kvh = u / (B * g), slot = slots[(u % (B * g)) / g];
      int64_t m = 0, nmax = 1;
      for (; u < u1 && m < kGroupMax && u / (B * g) == kvh; ++u, ++m) {
        const int64_t b = (u % (B * g)) / g, h = kvh * g + u % g;
        if (slots[b] != slot) break;
        qs[m] = q + (b * nh + h) * hd;
        os[m] = out + (b * nh + h) * hd;
        ns[m] = lens[b];
        nmax = std::max(nmax, lens[b]);
      }
      sc.resize(static_cast<size_t>(m * nmax));
      const Paged<E> kv{kc + kvh * P * hd, vc + kvh * P * hd, table + slot * tw, P, nkv * P * hd};
      group(qs, ns, m, kv, hd, scale, sc.data(), os);
    }
  };
  if (work * nh * hd < (1 << 13) || at::in_parallel_region()) return run(0, units);
  // The threads take ranges of equal work (a unit costs its row's keys), not of equal units: a prompt's rows read
  // 1 .. n keys, and equal unit counts gave the thread with the last rows of a KV head ~40 % more keys than the
  // other (a 1,088-token prefill on two cores). Which thread runs a unit never changes its arithmetic.
  const int64_t T = std::min<int64_t>(at::get_num_threads(), units);
  std::vector<int64_t> cut(static_cast<size_t>(T + 1), units);
  cut[0] = 0;
  const int64_t total = work * nh + 16 * units;  // + a unit's own fixed cost, in keys
  int64_t acc = 0, t = 1;
  for (int64_t u = 0; u < units && t < T; ++u) {
    acc += lens[(u % (B * g)) / g] + 16;
    while (t < T && acc * T >= total * t) cut[static_cast<size_t>(t++)] = u + 1;
  }
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) run(cut[static_cast<size_t>(i)], cut[static_cast<size_t>(i + 1)]);
  });
}

}  // namespace dmtd_attend
