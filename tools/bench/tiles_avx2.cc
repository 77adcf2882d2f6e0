// Standalone microbenchmark of the AVX2 int4 tile loop (glm_jax/kernels/qkernels.cc's tile_i4 layout: tiles of 16
// rows, one 64-byte vector per unit of 8 inputs) for 1-4 tokens: the variants before and after the one-pass /
// prefetch change, interleaved, medians of 8 reps.  Not part of the build or of CI.
//
//   g++ -O3 -march=native -std=c++17 tools/bench/tiles_avx2.cc -o /tmp/tiles && taskset -c 1 /tmp/tiles [EXPERTS]
//
// EXPERTS (default 36) matrices of 2048 x 1024 int4 (1.06 MB each with scales) are cycled through, 9 per "call":
// 36 exceed this machine's L3 (the decode regime), 4-9 fit it.  Three loop shapes, each with or without the
// prefetch: one_token_two_passes (the one-token kernel before), two_passes<C> (the 2-4 token kernel before; now the
// 4-token one), one_pass<C> (now: 1-3 tokens).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tiles_bench.h"

constexpr int64_t BLK = 64;
struct W {
  const uint8_t* q; const float* s; int64_t out, in, units, ng; const int32_t* gt;
  const uint8_t* tile(int64_t t) const { return q + t * units * 64; }
  const float* tscale(int64_t t) const { return s + t * ng * 16; }
};
struct P { const int8_t* xq; const float* sx; const int32_t* corr; };

inline void prefetch(const uint8_t* p, int PF) {
  if (PF) _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
}

// one token, rows 0-7 then rows 8-15: each 64-byte unit read as two 32-byte halves in two passes
void one_token_two_passes(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  const P* p = Pp[0];
  const uint8_t* wt = Wm.tile(t); const float* st = Wm.tscale(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  for (int h = 0; h < 2; ++h) {
    __m256 accf = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lo16 = _mm256_setzero_si256(), hi16 = _mm256_setzero_si256();
      const int64_t u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 8));
      for (int64_t u = b * (BLK / 8); u < u1; ++u) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32 * h));
        const int8_t* xq = p->xq + u * 8;
        lo16 = _mm256_add_epi16(lo16, _mm256_maddubs_epi16(_mm256_and_si256(v, lo4), _mm256_set1_epi32(*(const int32_t*)xq)));
        hi16 = _mm256_add_epi16(hi16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4),
                                                            _mm256_set1_epi32(*(const int32_t*)(xq + 4))));
      }
      const __m256 sc = _mm256_loadu_ps(st + Wm.gt[b] * 16 + 8 * h);
      const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(_mm256_set1_epi32(p->corr[b]), _mm256_madd_epi16(lo16, ones)),
                                            _mm256_madd_epi16(hi16, ones));
      accf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(p->sx[b])), accf);
    }
    _mm256_storeu_ps(out[0] + 8 * h, accf);
  }
}

// C tokens, one half (8 rows) at a time, one int16 accumulator per token over 4 units; prefetch in the first pass
template <int C, int PF>
void two_passes(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  const uint8_t* wt = Wm.tile(t); const float* st = Wm.tscale(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  for (int h = 0; h < 2; ++h) {
    __m256 accf[C];
    for (int c = 0; c < C; ++c) accf[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i i32[C];
      for (int c = 0; c < C; ++c) i32[c] = _mm256_set1_epi32(Pp[c]->corr[b]);
      const int64_t u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 8));
      for (int64_t g = b * (BLK / 8); g < u1; g += 4) {
        __m256i a16[C];
        for (int c = 0; c < C; ++c) a16[c] = _mm256_setzero_si256();
        const int64_t ge = std::min<int64_t>(u1, g + 4);
        for (int64_t u = g; u < ge; ++u) {
          if (h == 0) prefetch(wt + u * 64, PF);
          const __m256i v = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32 * h));
          const __m256i lo = _mm256_and_si256(v, lo4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
          for (int c = 0; c < C; ++c) {
            const int8_t* xq = Pp[c]->xq + u * 8;
            a16[c] = _mm256_add_epi16(a16[c], _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_set1_epi32(*(const int32_t*)xq)),
                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(*(const int32_t*)(xq + 4)))));
          }
        }
        for (int c = 0; c < C; ++c) i32[c] = _mm256_add_epi32(i32[c], _mm256_madd_epi16(a16[c], ones));
      }
      const __m256 sc = _mm256_loadu_ps(st + Wm.gt[b] * 16 + 8 * h);
      for (int c = 0; c < C; ++c)
        accf[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[c]), _mm256_mul_ps(sc, _mm256_set1_ps(Pp[c]->sx[b])), accf[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[c] + 8 * h, accf[c]);
  }
}

// C tokens in one pass over the tile: per token four int16 chains (lo/hi nibble x half), float accumulators in L1
// (qkernels.cc's AVX2 tile_i4 for C <= 3, PF = its kPrefetchAhead)
template <int C, int PF>
void one_pass(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  const uint8_t* wt = Wm.tile(t); const float* st = Wm.tscale(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  alignas(32) float acc[C][16];
  for (int c = 0; c < C; ++c) std::memset(acc[c], 0, sizeof(acc[c]));
  for (int64_t b = 0; b < nb; ++b) {
    __m256i l0[C], h0[C], l1[C], h1[C];
    for (int c = 0; c < C; ++c) l0[c] = h0[c] = l1[c] = h1[c] = _mm256_setzero_si256();
    const int64_t u0 = b * (BLK / 8), u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 8));
    for (int64_t u = u0; u < u1; ++u) {
      prefetch(wt + u * 64, PF);
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wt + u * 64));
      const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32));
      const __m256i a0 = _mm256_and_si256(v0, lo4), b0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4);
      const __m256i a1 = _mm256_and_si256(v1, lo4), b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4);
      for (int c = 0; c < C; ++c) {
        const __m256i xa = _mm256_set1_epi32(*(const int32_t*)(Pp[c]->xq + u * 8));
        l0[c] = _mm256_add_epi16(l0[c], _mm256_maddubs_epi16(a0, xa));
        l1[c] = _mm256_add_epi16(l1[c], _mm256_maddubs_epi16(a1, xa));
        const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(Pp[c]->xq + u * 8 + 4));
        h0[c] = _mm256_add_epi16(h0[c], _mm256_maddubs_epi16(b0, xb));
        h1[c] = _mm256_add_epi16(h1[c], _mm256_maddubs_epi16(b1, xb));
      }
    }
    const float* sb = st + Wm.gt[b] * 16;
    for (int c = 0; c < C; ++c) {
      const __m256 sx = _mm256_set1_ps(Pp[c]->sx[b]);
      const __m256i cr = _mm256_set1_epi32(Pp[c]->corr[b]);
      const __m256i i0 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l0[c], ones)), _mm256_madd_epi16(h0[c], ones));
      const __m256i i1 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l1[c], ones)), _mm256_madd_epi16(h1[c], ones));
      _mm256_store_ps(acc[c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(_mm256_loadu_ps(sb), sx), _mm256_load_ps(acc[c])));
      _mm256_store_ps(acc[c] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(_mm256_loadu_ps(sb + 8), sx),
                                                  _mm256_load_ps(acc[c] + 8)));
    }
  }
  for (int c = 0; c < C; ++c) std::memcpy(out[c], acc[c], sizeof(acc[c]));
}

void three_as_two_and_one(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  two_passes<2, 0>(Wm, t, Pp, out);
  one_token_two_passes(Wm, t, Pp + 2, out + 2);
}

void four_as_two_one_passes(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  one_pass<2, 4096>(Wm, t, Pp, out);
  one_pass<2, 4096>(Wm, t, Pp + 2, out + 2);
}

typedef void (*TF)(const W&, int64_t, const P* const*, float (*)[16]);
struct Variant { const char* name; int tokens; TF f; };

int main(int argc, char** argv) {
  const int64_t out = 2048, in = 1024;
  const int NE = argc > 1 ? atoi(argv[1]) : 36, K = 9;
  const int64_t units = in / 8, tiles = out / 16, ng = in / 64;
  std::vector<uint8_t*> qs(NE);
  std::vector<float*> ss(NE);
  for (int e = 0; e < NE; ++e) {
    qs[e] = (uint8_t*)aligned_alloc(64, tiles * units * 64);
    for (int64_t i = 0; i < tiles * units * 64; ++i) qs[e][i] = rand();
    ss[e] = (float*)aligned_alloc(64, tiles * ng * 16 * 4);
    for (int64_t i = 0; i < tiles * ng * 16; ++i) ss[e][i] = 0.01f;
  }
  std::vector<int32_t> gt(ng);
  for (int i = 0; i < ng; ++i) gt[i] = i;
  alignas(64) static int8_t xq[4096];
  alignas(64) static float sx[64];
  alignas(64) static int32_t corr[64];
  for (int i = 0; i < in; ++i) xq[i] = (rand() % 255) - 127;
  for (int i = 0; i < 64; ++i) sx[i] = 0.01f, corr[i] = 0;
  const P p{xq, sx, corr};
  const P* pp[4] = {&p, &p, &p, &p};
  std::vector<float> y(out);
  alignas(64) float o[4][16];
  const Variant vs[] = {
      {"1 tok: two 32-byte passes (before)", 1, one_token_two_passes},
      {"1 tok: one pass", 1, one_pass<1, 0>},
      {"1 tok: one pass + prefetch 4K (now)", 1, one_pass<1, 4096>},
      {"2 tok: two passes (before)", 2, two_passes<2, 0>},
      {"2 tok: two passes + prefetch", 2, two_passes<2, 4096>},
      {"2 tok: one pass + prefetch (now)", 2, one_pass<2, 4096>},
      {"3 tok: a 2- and a 1-token pass (before)", 3, three_as_two_and_one},
      {"3 tok: one pass + prefetch (now)", 3, one_pass<3, 4096>},
      {"4 tok: two passes + prefetch (now)", 4, two_passes<4, 4096>},
      {"4 tok: 2 x one pass", 4, four_as_two_one_passes},
  };
  const int NF = sizeof(vs) / sizeof(vs[0]);
  int iter = 0;
  printf("| variant | GB/s of weights, median | min | x tokens |\n|---|---|---|---|\n");
  const auto res = interleaved_rates(NF, 9, [&](int f) {
    const int calls = 100;
    for (int c = 0; c < calls; ++c)
      for (int k = 0; k < K; ++k) {
        const int e = (iter++ * 7 + k * 13) % NE;
        const W Wm{qs[e], ss[e], out, in, units, ng, gt.data()};
        for (int64_t t = 0; t < tiles; ++t) {
          vs[f].f(Wm, t, pp, o);
          std::memcpy(y.data() + 16 * t, o[0], sizeof(o[0]));
        }
      }
    return (double)calls * K * (tiles * units * 64 + tiles * ng * 64);
  });
  for (int f = 0; f < NF; ++f) print_rate_row(vs[f].name, res[f], vs[f].tokens);
  printf("(checksum %f)\n", y[3]);
}
