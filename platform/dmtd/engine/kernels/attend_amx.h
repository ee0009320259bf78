// Attention of a prompt's rows on AMX tiles (bf16 products, float32 sums), for heads of 64.
//
// Decode rows, checks and drafts keep dmtd_attend (attend.h: float32, one row at a time); a prompt's positions —
// many rows of one sequence at consecutive positions — take this kernel, where the float32 one spends ~12 vector ops
// a query and key (a quarter of a 1,100-token prefill on two cores). A prompt position's bits therefore differ from
// what a decode step would give it, and hold the same wherever its prompt is split: each row is computed alone in
// a fixed order whatever rows share its block, call or thread —
//   scores: one TDPBF16PS per 32 of the head's dimensions (q and k rounded to bf16), times the scale in float32;
//   softmax: the maximum over the row's keys 0 .. its position; exp as dmtd_attend's; the sum lane-wise over
//            blocks of 16 keys from key 0, keys past the row's position adding exact zeros, then one fixed tree;
//   values: the probabilities rounded to bf16, one TDPBF16PS per 32 keys from key 0 (past the row's position
//           exact zeros), times 1 / the sum.
// The prefix cache shares only prompt chunks (their KV computed this way by whichever prompt ran them first), and a
// preempted sequence's own tokens are recomputed as decode rows (the caller flags only prompt positions).
#pragma once

#if defined(DMTD_AMX)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dmtd_attend_amx {

constexpr int64_t HD = 64;  // the head size this kernel takes (SmolLM2's; others keep dmtd_attend)

// A 16 × 16 matrix of 32-bit lanes transposed in registers: r[i] lane j ↔ r[j] lane i.
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
}

// 32 floats → 32 bf16 in order, as 16 lanes of two (lane j: values 2j, 2j + 1)
inline __m512 pairs32(const float* p) {
  const __m512i lo = dmtd_amx::round16(p), hi = dmtd_amx::round16(p + 16);
  return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                                _mm512_cvtepi32_epi16(hi), 1));
}

// One prompt run's keys and values for one KV head, as tiles: kt [n16][2 halves][16 dim pairs][16 keys] (the B side
// of the scores), vv [n32][4 dim blocks][16 key pairs][16 dims] (the B side of the values); keys past n zero.
struct Tiles {
  std::vector<uint32_t> kt, vv;
  int64_t n = 0;
};

// Group g (keys 32g .. 32g + 31) of keys 0 .. n − 1 of one KV head (key t at base + pages[t / P] · ps + (t % P) · HD).
inline void convert_group(const float* kbase, const float* vbase, const int64_t* pages, int64_t P, int64_t ps,
                          int64_t n, int64_t g, Tiles& tl) {
  auto at = [&](const float* base, int64_t t) { return base + pages[t / P] * ps + (t % P) * HD; };
  const int64_t n16 = (n + 15) / 16;
  for (int64_t b = 2 * g; b < std::min(2 * g + 2, n16); ++b)
    for (int half = 0; half < 2; ++half) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t t = b * 16 + i;
        r[i] = t < n ? pairs32(at(kbase, t) + half * 32) : _mm512_setzero_ps();
      }
      transpose16(r);  // r[dp] lane i: key i's dimensions 2dp, 2dp + 1
      float* dst = reinterpret_cast<float*>(tl.kt.data()) + (b * 2 + half) * 256;
      for (int dp = 0; dp < 16; ++dp) _mm512_storeu_ps(dst + dp * 16, r[dp]);
    }
  for (int kp = 0; kp < 16; ++kp) {
    const int64_t t0 = g * 32 + 2 * kp, t1 = t0 + 1;
    for (int db = 0; db < 4; ++db) {
      const __m512i lo = t0 < n ? dmtd_amx::round16(at(vbase, t0) + db * 16) : _mm512_setzero_si512();
      const __m512i hi = t1 < n ? dmtd_amx::round16(at(vbase, t1) + db * 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(tl.vv.data() + ((g * 4 + db) * 16 + kp) * 16,
                          _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// C += A (tmm4, tmm5: the queries' two halves) · a key block's two tiles (the tile intrinsics take a literal number)
#define DMTD_SCORE_BLOCK(C, k)          \
  do {                                  \
    _tile_loadd(6, (k), 64);            \
    _tile_dpbf16ps(C, 4, 6);            \
    _tile_loadd(7, (k) + 256, 64);      \
    _tile_dpbf16ps(C, 5, 7);            \
  } while (0)

struct Scratch {
  std::vector<float> s;  // scores [16][n16 · 16]
  std::vector<uint16_t> p;  // probabilities [16][n32 · 32], bf16
  alignas(64) uint16_t qa[16 * HD];
  alignas(64) float o[16 * HD];
  float inv[16];
};

// Rows r0 .. r0 + m − 1 (m ≤ 16) of one run, at positions p0 .. p0 + m − 1, query heads h0 .. h0 + g − 1 (one KV
// head's): q/out [R, nh, HD] float32.
inline void block(const float* q, float* out, int64_t nh, int64_t r0, int64_t m, int64_t p0, int64_t h0, int64_t g,
                  float scale, const Tiles& tl, Scratch& sc) {
  const int64_t n = p0 + m, n16 = (n + 15) / 16, n32 = (n + 31) / 32, ss = n16 * 16, ps = n32 * 32;
  sc.s.resize(static_cast<size_t>(16 * ss));
  sc.p.resize(static_cast<size_t>(16 * ps));
  float* S = sc.s.data();
  uint16_t* Pm = sc.p.data();
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t h = h0; h < h0 + g; ++h) {
    for (int64_t i = 0; i < 16; ++i) {  // the queries in bf16, rows past m zero
      uint16_t* d = sc.qa + i * HD;
      if (i < m) {
        const float* qr = q + ((r0 + i) * nh + h) * HD;
        _mm512_storeu_ps(reinterpret_cast<float*>(d), pairs32(qr));
        _mm512_storeu_ps(reinterpret_cast<float*>(d + 32), pairs32(qr + 32));
      } else {
        std::memset(d, 0, HD * 2);
      }
    }
    _tile_loadd(4, sc.qa, HD * 2);
    _tile_loadd(5, sc.qa + 32, HD * 2);
    const uint32_t* kt = tl.kt.data();
    for (int64_t b = 0; b < n16; b += 4) {  // scores, 64 keys a pass (tiles 0-3)
      const int64_t nb = std::min<int64_t>(4, n16 - b);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      DMTD_SCORE_BLOCK(0, kt + (b + 0) * 512);
      if (nb > 1) DMTD_SCORE_BLOCK(1, kt + (b + 1) * 512);
      if (nb > 2) DMTD_SCORE_BLOCK(2, kt + (b + 2) * 512);
      if (nb > 3) DMTD_SCORE_BLOCK(3, kt + (b + 3) * 512);
      _tile_stored(0, S + (b + 0) * 16, ss * 4);
      if (nb > 1) _tile_stored(1, S + (b + 1) * 16, ss * 4);
      if (nb > 2) _tile_stored(2, S + (b + 2) * 16, ss * 4);
      if (nb > 3) _tile_stored(3, S + (b + 3) * 16, ss * 4);
    }
    for (int64_t i = 0; i < 16; ++i) {  // softmax of each row over its keys 0 .. p0 + i
      uint16_t* pr = Pm + i * ps;
      if (i >= m) {
        std::memset(pr, 0, static_cast<size_t>(ps) * 2);
        continue;
      }
      float* sr = S + i * ss;
      const int64_t nk = p0 + i + 1;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < nk; t += 16) {
        const __mmask16 k = t + 16 <= nk ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (nk - t)) - 1);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + t), sv);
        _mm512_mask_storeu_ps(sr + t, k, v);
        mx = _mm512_mask_max_ps(mx, k, v, mx);
      }
      const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      alignas(64) float e16[16];
      for (int64_t t = 0; t < ps; t += 16) {
        __m512 e = _mm512_setzero_ps();
        if (t < nk) {
          const __mmask16 k = t + 16 <= nk ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (nk - t)) - 1);
          e = _mm512_maskz_mov_ps(k, dmtd_attend::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + t), mv)));
        }
        sum = _mm512_add_ps(sum, e);
        _mm512_store_ps(e16, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t), _mm512_cvtepi32_epi16(dmtd_amx::round16(e16)));
      }
      sc.inv[i] = 1.f / _mm512_reduce_add_ps(sum);
    }
    _tile_zero(0);  // values: tiles 0-3 the output's four blocks of 16 dimensions
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* vv = tl.vv.data();
    for (int64_t kg = 0; kg < n32; ++kg) {
      _tile_loadd(4, Pm + kg * 32, ps * 2);
      const uint32_t* v = vv + kg * 4 * 256;
      _tile_loadd(6, v, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, v + 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, v + 512, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, v + 768, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, sc.o, HD * 4);
    _tile_stored(1, sc.o + 16, HD * 4);
    _tile_stored(2, sc.o + 32, HD * 4);
    _tile_stored(3, sc.o + 48, HD * 4);
    for (int64_t i = 0; i < m; ++i) {
      const __m512 iv = _mm512_set1_ps(sc.inv[i]);
      float* o = out + ((r0 + i) * nh + h) * HD;
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(sc.o + i * HD + 16 * c), iv));
    }
  }
}

// A run: rows r0 .. r0 + m − 1 of sequence `slot` at positions p0 .. p0 + m − 1.
struct Run {
  int64_t slot, r0, m, p0;
};

// Every run's rows over their keys (q, out [R, nh, HD]; kc/vc [pages, nkv, P, HD] float32; the page table [*, tw]).
inline void runs(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t tw,
                 const std::vector<Run>& rs, int64_t nh, int64_t nkv, int64_t P, float scale, float* out) {
  const int64_t g = nh / nkv, ps = nkv * P * HD;
  std::vector<Tiles> tiles(rs.size() * static_cast<size_t>(nkv));
  // the keys and values as tiles, once a run and KV head: work items (run, KV head, group of 32 keys)
  std::vector<int64_t> conv_start(rs.size() + 1, 0);
  for (size_t i = 0; i < rs.size(); ++i) {
    const int64_t n = rs[i].p0 + rs[i].m, n16 = (n + 15) / 16, n32 = (n + 31) / 32;
    for (int64_t kvh = 0; kvh < nkv; ++kvh) {
      Tiles& tl = tiles[i * nkv + kvh];
      tl.n = n;
      tl.kt.assign(static_cast<size_t>(n16 * 512), 0);
      tl.vv.assign(static_cast<size_t>(n32 * 1024), 0);
    }
    conv_start[i + 1] = conv_start[i] + nkv * n32;
  }
  at::parallel_for(0, conv_start.back(), 4, [&](int64_t a, int64_t b) {
    for (int64_t u = a; u < b; ++u) {
      const size_t i = static_cast<size_t>(std::upper_bound(conv_start.begin(), conv_start.end(), u) - conv_start.begin() - 1);
      const int64_t n32 = (rs[i].p0 + rs[i].m + 31) / 32, kvh = (u - conv_start[i]) / n32, grp = (u - conv_start[i]) % n32;
      convert_group(kc + kvh * P * HD, vc + kvh * P * HD, table + rs[i].slot * tw, P, ps, tiles[i * nkv + kvh].n, grp,
                    tiles[i * nkv + kvh]);
    }
  });
  // blocks of 16 rows × KV heads, the threads taking ranges of equal keys
  struct Item {
    size_t run;
    int64_t r0, m, p0, kvh;
  };
  std::vector<Item> items;
  int64_t total = 0;
  for (size_t i = 0; i < rs.size(); ++i)
    for (int64_t b = 0; b < rs[i].m; b += 16)
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        items.push_back({i, rs[i].r0 + b, std::min<int64_t>(16, rs[i].m - b), rs[i].p0 + b, kvh});
        total += rs[i].p0 + b + 16 + 64;
      }
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size())));
  std::vector<size_t> cut(static_cast<size_t>(T + 1), items.size());
  cut[0] = 0;
  int64_t acc = 0, t = 1;
  for (size_t u = 0; u < items.size() && t < T; ++u) {
    acc += items[u].p0 + 16 + 64;
    while (t < T && acc * T >= total * t) cut[static_cast<size_t>(t++)] = u + 1;
  }
  auto work = [&](size_t u0, size_t u1) {
    Scratch sc;
    dmtd_amx::configure();
    for (size_t u = u0; u < u1; ++u) {
      const Item& it = items[u];
      block(q, out, nh, it.r0, it.m, it.p0, it.kvh * g, g, scale, tiles[it.run * nkv + it.kvh], sc);
    }
    _tile_release();
  };
  if (T <= 1 || at::in_parallel_region()) return work(0, items.size());
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) work(cut[static_cast<size_t>(i)], cut[static_cast<size_t>(i + 1)]);
  });
}

}  // namespace dmtd_attend_amx
#undef DMTD_SCORE_BLOCK
#endif
