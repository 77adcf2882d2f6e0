// Standalone microbenchmark of the AVX-512 VNNI int4 / int8 tile loops (glm_jax/kernels/qkernels.cc's tile_i4 /
// tile_i8, same layout: tiles of 16 rows, one 64-byte vector per unit) for 1-4 tokens, with and without a software
// prefetch PF bytes ahead in the weight stream (the AVX2 build's kPrefetchAhead), interleaved, medians of 8 reps.
// Not part of the build or of CI.
//
//   g++ -O3 -march=native -std=c++17 tools/bench/tiles_vnni.cc -o /tmp/tvnni && taskset -c 1 /tmp/tvnni [EXPERTS [X_OFFSET [HUGE]]]
//
// EXPERTS (default 36) matrices of 2048 x 1024 (int4: 1.06 MB, int8: 2.1 MB each with scales) are cycled through, 9
// per "call".  36 int4 matrices (38 MB) are only just beyond a 32 MB L3, so part of the stream still hits it: 192
// (204 MB) is the decode regime of a real model.  2026-12-04, a core of the AVX-512 EPYC VM, 2 MB pages, medians: int4
// one token with 8K prefetch 30.7 GB/s at 36, 27.8 / 28.5 at 192, where the loads alone (the stream-only row) ran
// 24.3 / 24.8: the tile loop runs at the rate the memory system streams to one core.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <sys/mman.h>

#include "tiles_bench.h"

constexpr int64_t BLK = 64;
struct W {
  const uint8_t* q; const float* s; int64_t out, in, units, ng; const int32_t* gt;
  const uint8_t* tile(int64_t t) const { return q + t * units * 64; }
  const float* tscale(int64_t t) const { return s + t * ng * 16; }
};
struct P { const int8_t* xq; const float* sx; const int32_t* corr; const uint8_t* xa; const uint64_t* neg; };

// S accumulator pairs per token (S = 2: even / odd units, summed at the block's end: the same exact int32 sums, so
// bitwise the same output, with four dependency chains of vpdpbusd instead of two; it gained nothing)
template <int C, int PF, int S = 1>
void tile_i4(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  const uint8_t* wt = Wm.tile(t);
  const float* st = Wm.tscale(t);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 accf[C];
  for (int c = 0; c < C; ++c) accf[c] = _mm512_setzero_ps();
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo_acc[S][C], hi_acc[S][C];
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < S; ++j) {
        lo_acc[j][c] = j == 0 ? _mm512_set1_epi32(Pp[c]->corr[b]) : _mm512_setzero_si512();
        hi_acc[j][c] = _mm512_setzero_si512();
      }
    const int64_t u0 = b * (BLK / 8), u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 8));
    for (int64_t u = u0; u < u1; ++u) {
      const int j = (int)((u - u0) % S);
      if (PF) _mm_prefetch((const char*)(wt + u * 64 + PF), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512((const void*)(wt + u * 64));
      const __m512i lo = _mm512_and_si512(v, lo4);
      const __m512i hi = _mm512_andnot_si512(lo4, v);
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = Pp[c]->xq + u * 8;
        lo_acc[j][c] = _mm512_dpbusd_epi32(lo_acc[j][c], lo, _mm512_set1_epi32(*(const int32_t*)xq));
        hi_acc[j][c] = _mm512_dpbusd_epi32(hi_acc[j][c], hi, _mm512_set1_epi32(*(const int32_t*)(xq + 4)));
      }
    }
    const __m512 sc = _mm512_loadu_ps(st + Wm.gt[b] * 16);
    for (int c = 0; c < C; ++c) {
      for (int j = 1; j < S; ++j) {
        lo_acc[0][c] = _mm512_add_epi32(lo_acc[0][c], lo_acc[j][c]);
        hi_acc[0][c] = _mm512_add_epi32(hi_acc[0][c], hi_acc[j][c]);
      }
      const __m512i isum = _mm512_add_epi32(lo_acc[0][c], _mm512_srai_epi32(hi_acc[0][c], 4));
      accf[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(Pp[c]->sx[b])), accf[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[c], accf[c]);
}

// the floor: the same weight stream (tile by tile, 8 KiB prefetch) only loaded and XORed, no arithmetic -- what the
// memory system gives one core for this access pattern
template <int PF>
void read_i4(const W& Wm, int64_t t, const P* const*, float (*out)[16]) {
  const uint8_t* wt = Wm.tile(t);
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  for (int64_t u = 0; u + 1 < Wm.units; u += 2) {
    if (PF) {
      _mm_prefetch((const char*)(wt + u * 64 + PF), _MM_HINT_T0);
      _mm_prefetch((const char*)(wt + u * 64 + 64 + PF), _MM_HINT_T0);
    }
    a = _mm512_xor_si512(a, _mm512_loadu_si512((const void*)(wt + u * 64)));
    b = _mm512_xor_si512(b, _mm512_loadu_si512((const void*)(wt + u * 64 + 64)));
  }
  a = _mm512_xor_si512(a, _mm512_loadu_si512((const void*)(Wm.tscale(t))));
  _mm512_storeu_si512((void*)out[0], _mm512_xor_si512(a, b));
}

template <int C, int PF>
void tile_i8(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  const uint8_t* wt = Wm.tile(t);
  const __m512i zero = _mm512_setzero_si512();
  __m512 accf[C];
  for (int c = 0; c < C; ++c) accf[c] = _mm512_setzero_ps();
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[C];
    for (int c = 0; c < C; ++c) acc[c] = zero;
    const int64_t u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 4));
    for (int64_t u = b * (BLK / 4); u < u1; ++u) {
      if (PF) _mm_prefetch((const char*)(wt + u * 64 + PF), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512((const void*)(wt + u * 64));
      for (int c = 0; c < C; ++c) {
        const __m512i ws = _mm512_mask_sub_epi8(w, (__mmask64)Pp[c]->neg[u], zero, w);
        acc[c] = _mm512_dpbusd_epi32(acc[c], _mm512_set1_epi32(*(const int32_t*)(Pp[c]->xa + u * 4)), ws);
      }
    }
    for (int c = 0; c < C; ++c)
      accf[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]), _mm512_set1_ps(Pp[c]->sx[b]), accf[c]);
  }
  const __m512 sc = _mm512_loadu_ps(Wm.tscale(t));
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[c], _mm512_mul_ps(accf[c], sc));
}


// f32 rows (a former dot_float<4, 1>): 4 rows x 1 token, one 16-lane accumulator per row; prefetch PF rows
// ahead (PF * row bytes) at the same offset
template <int PFR>
void rows_f32(const float* w, int64_t in, int64_t r0, const float* x, float* out) {
  __m512 acc[4];
  for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < 4; ++r) {
      if (PFR) _mm_prefetch((const char*)(w + (r0 + r + PFR) * in + i), _MM_HINT_T0);
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + (r0 + r) * in + i), xv, acc[r]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// f32, a row at a time (the AVX-512 build's decode): one sequential stream, prefetch PFB bytes ahead
template <int PFB>
void rows_f32_seq(const float* w, int64_t in, int64_t r0, const float* x, float* out) {
  for (int r = 0; r < 4; ++r) {
    __m512 acc = _mm512_setzero_ps();
    const float* wr = w + (r0 + r) * in;
    for (int64_t i = 0; i < in; i += 16) {
      if (PFB) _mm_prefetch((const char*)(wr + i) + PFB, _MM_HINT_T0);
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(wr + i), _mm512_loadu_ps(x + i), acc);
    }
    out[r] = _mm512_reduce_add_ps(acc);
  }
}

// f32, C tokens (prefill, an expert's share of a batch): R rows x C tokens per pass as dot_float<4, 4> (R = 4: four
// streams 4 KB apart, PFR rows ahead prefetched) or a row at a time (R = 1, one stream, PFB bytes ahead)
template <int R, int C, int PFR, int PFB>
void rows_f32_tok(const float* w, int64_t in, int64_t r0, const float* const* x, float* out) {
  for (int rr = 0; rr < 4; rr += R) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
      __m512 xv[C];
      for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(x[c] + i);
      for (int r = 0; r < R; ++r) {
        const float* wr = w + (r0 + rr + r) * in + i;
        if (PFR) _mm_prefetch((const char*)(wr + PFR * in), _MM_HINT_T0);
        if (PFB) _mm_prefetch((const char*)wr + PFB, _MM_HINT_T0);
        const __m512 wv = _mm512_loadu_ps(wr);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[c * 4 + rr + r] = _mm512_reduce_add_ps(acc[r][c]);
  }
}

struct Variant { const char* name; int tokens; bool i8; void (*f)(const W&, int64_t, const P* const*, float (*)[16]); };

int main(int argc, char** argv) {
  const int64_t out = 2048, in = 1024;
  const int NE = argc > 1 ? atoi(argv[1]) : 36, K = 9;
  const int64_t tiles = out / 16, ng = in / 64;
  std::vector<uint8_t*> q4(NE), q8(NE);
  std::vector<float*> ss(NE);
  // HUGE (argv[3] = 1): the int4 matrices in one mapping advised MADV_HUGEPAGE (2 MB pages where THP is "madvise")
  const bool huge = argc > 3 && atoi(argv[3]) == 1;
  const size_t q4b = tiles * (in / 8) * 64;
  uint8_t* slab = (uint8_t*)mmap(nullptr, q4b * NE + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  slab = (uint8_t*)(((uintptr_t)slab + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
  if (huge) madvise(slab, q4b * NE, MADV_HUGEPAGE);
  for (int e = 0; e < NE; ++e) {
    q4[e] = slab + e * q4b;
    for (int64_t i = 0; i < tiles * (in / 8) * 64; ++i) q4[e][i] = rand();
    q8[e] = (uint8_t*)aligned_alloc(64, tiles * (in / 4) * 64);
    for (int64_t i = 0; i < tiles * (in / 4) * 64; ++i) q8[e][i] = rand();
    ss[e] = (float*)aligned_alloc(64, tiles * ng * 16 * 4);
    for (int64_t i = 0; i < tiles * ng * 16; ++i) ss[e][i] = 0.01f;
  }
  std::vector<int32_t> gt(ng), gt1(ng, 0);
  for (int i = 0; i < ng; ++i) gt[i] = i;
  alignas(64) static int8_t xq[4096];
  alignas(64) static uint8_t xa[4096];
  alignas(64) static uint64_t neg[1024];
  alignas(64) static float sx[64];
  alignas(64) static int32_t corr[64];
  for (int i = 0; i < in; ++i) xq[i] = (rand() % 255) - 127, xa[i] = rand() % 128;
  for (int i = 0; i < in / 4; ++i) neg[i] = (uint64_t)(rand() & 15) * 0x1111111111111111ull;
  for (int i = 0; i < 64; ++i) sx[i] = 0.01f, corr[i] = 0;
  const P p{xq, sx, corr, xa, neg};
  const P* pp[4] = {&p, &p, &p, &p};
  std::vector<float> y(out);
  alignas(64) float o[4][16];
  const Variant vs[] = {
      {"int4 stream only (loads, no arithmetic) + prefetch 8K", 1, false, read_i4<8192>},
      {"int4 1 tok", 1, false, tile_i4<1, 0>},
      {"int4 1 tok + prefetch 4K", 1, false, tile_i4<1, 4096>},
      {"int4 1 tok + prefetch 8K", 1, false, tile_i4<1, 8192>},
      {"int4 1 tok + prefetch 16K", 1, false, tile_i4<1, 16384>},
      {"int4 1 tok, split acc + prefetch 8K", 1, false, tile_i4<1, 8192, 2>},
      {"int4 1 tok, split acc + prefetch 4K", 1, false, tile_i4<1, 4096, 2>},
      {"int4 2 tok", 2, false, tile_i4<2, 0>},
      {"int4 2 tok + prefetch 4K", 2, false, tile_i4<2, 4096>},
      {"int4 2 tok + prefetch 8K", 2, false, tile_i4<2, 8192>},
      {"int4 2 tok + prefetch 16K", 2, false, tile_i4<2, 16384>},
      {"int4 4 tok", 4, false, tile_i4<4, 0>},
      {"int4 4 tok + prefetch 4K", 4, false, tile_i4<4, 4096>},
      {"int4 4 tok + prefetch 8K", 4, false, tile_i4<4, 8192>},
      {"int4 4 tok + prefetch 16K", 4, false, tile_i4<4, 16384>},
      {"int8 1 tok", 1, true, tile_i8<1, 0>},
      {"int8 1 tok + prefetch 4K", 1, true, tile_i8<1, 4096>},
      {"int8 1 tok + prefetch 8K", 1, true, tile_i8<1, 8192>},
      {"int8 1 tok + prefetch 16K", 1, true, tile_i8<1, 16384>},
      {"int8 2 tok", 2, true, tile_i8<2, 0>},
      {"int8 2 tok + prefetch 4K", 2, true, tile_i8<2, 4096>},
      {"int8 2 tok + prefetch 8K", 2, true, tile_i8<2, 8192>},
      {"int8 2 tok + prefetch 16K", 2, true, tile_i8<2, 16384>},
      {"int8 4 tok", 4, true, tile_i8<4, 0>},
      {"int8 4 tok + prefetch 4K", 4, true, tile_i8<4, 4096>},
      {"int8 4 tok + prefetch 8K", 4, true, tile_i8<4, 8192>},
      {"int8 4 tok + prefetch 16K", 4, true, tile_i8<4, 16384>},
  };
  const int NF = sizeof(vs) / sizeof(vs[0]);
  int iter = 0;
  printf("| variant | GB/s of weights, median | min | x tokens |\n|---|---|---|---|\n");
  const auto res = interleaved_rates(NF, 9, [&](int f) {
    const int calls = 60;
    const int64_t units = vs[f].i8 ? in / 4 : in / 8, ngf = vs[f].i8 ? 1 : ng;
    for (int c = 0; c < calls; ++c)
      for (int k = 0; k < K; ++k) {
        const int e = (iter++ * 7 + k * 13) % NE;
        const W Wm{vs[f].i8 ? q8[e] : q4[e], ss[e], out, in, units, ngf, vs[f].i8 ? gt1.data() : gt.data()};
        for (int64_t t = 0; t < tiles; ++t) {
          vs[f].f(Wm, t, pp, o);
          std::memcpy(y.data() + 16 * t, o[0], sizeof(o[0]));
        }
      }
    return (double)calls * K * (tiles * units * 64 + tiles * ngf * 64);
  });
  // f32: 12 matrices of 2048 x 1024 f32 (8 MB each) rotating
  const int NEF = 24;
  std::vector<float*> wf(NEF);
  for (int e = 0; e < NEF; ++e) {
    wf[e] = (float*)aligned_alloc(64, out * in * 4);
    for (int64_t i = 0; i < out * in; ++i) wf[e][i] = (rand() % 100) * 0.01f;
  }
  alignas(64) static float xf[4096];
  for (int i = 0; i < in; ++i) xf[i] = 0.5f;
  void (*ff[])(const float*, int64_t, int64_t, const float*, float*) = {rows_f32<0>, rows_f32<4>, rows_f32_seq<0>, rows_f32_seq<4096>, rows_f32_seq<8192>};
  const char* fn[] = {"f32 4 rows x 1 tok", "f32 + prefetch 4 rows ahead", "f32 1 row at a time", "f32 1 row, prefetch 4K", "f32 1 row, prefetch 8K"};
  const auto rf = interleaved_rates(5, 9, [&](int f) {
    for (int c = 0; c < 24; ++c) {
      const float* w = wf[(iter++ * 7) % NEF];
      for (int64_t r = 0; r < out; r += 4) ff[f](w, in, r, xf, y.data() + r);
    }
    return 24.0 * out * in * 4;
  });
  for (int f = 0; f < 5; ++f) print_rate_row(fn[f], rf[f], 1);
  static float xs[8][4096];
  const float* xp[8];
  for (int c = 0; c < 8; ++c) {
    for (int i = 0; i < in; ++i) xs[c][i] = 0.5f + c;
    xp[c] = xs[c] + (argc > 2 ? atoi(argv[2]) * c : 0);
  }
  alignas(64) static float o4[64];
  void (*gtf[])(const float*, int64_t, int64_t, const float* const*, float*) = {
      rows_f32_tok<4, 4, 0, 0>, rows_f32_tok<4, 4, 4, 0>, rows_f32_tok<1, 4, 0, 0>, rows_f32_tok<1, 4, 0, 8192>,
      rows_f32_tok<1, 8, 0, 8192>, rows_f32_tok<2, 4, 0, 8192>};
  const char* gn[] = {"f32 4 rows x 4 tok (dot_float<4,4>)", "f32 4x4 + prefetch 4 rows ahead", "f32 1 row x 4 tok",
                      "f32 1 row x 4 tok, prefetch 8K", "f32 1 row x 8 tok, prefetch 8K", "f32 2 rows x 4 tok, prefetch 8K"};
  const int gtok[] = {4, 4, 4, 4, 8, 4};
  const auto rg = interleaved_rates(6, 9, [&](int f) {
    for (int c = 0; c < 24; ++c) {
      const float* w = wf[(iter++ * 7) % NEF];
      for (int64_t r = 0; r < out; r += 4) gtf[f](w, in, r, xp, o4);
    }
    return 24.0 * out * in * 4;
  });
  for (int f = 0; f < 6; ++f) print_rate_row(gn[f], rg[f], gtok[f]);
  for (int f = 0; f < NF; ++f) print_rate_row(vs[f].name, res[f], vs[f].tokens);
  printf("(checksum %f)\n", y[3]);
  return 0;
}
