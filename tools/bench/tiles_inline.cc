// Standalone A/B (not built by the package, not in CI): the AVX-512 VNNI int4 one-token tile loop with each tile's
// f16 scales in their own array (the engine's layout: two streams) against the scales inline at the start of each
// tile (one stream of [2 KB scales][32 KB units] tiles). GLM-4.5-Air's gate_up shape [2816, 4096], 40 matrices
// (~245 MB, beyond L3), distinct pseudo-random content on 2 MB pages, the 8 KiB prefetch, 14 interleaved rounds.
//
//   g++ -O3 -march=native -std=c++17 -pthread tools/bench/tiles_inline.cc -o /tmp/tinl && /tmp/tinl
//
// 2026-12-05, the AVX-512 EPYC VM, two runs: one thread separate 26.2 / 29.1 GB/s, inline 21.2 / 22.3 (two threads:
// 50.6 / 29.6 against 40.4 / 27.8, the VM's two-thread rate swinging): inline scales are slower, not pursued.
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <sys/mman.h>
constexpr int64_t OUT = 2816, IN = 4096, TILES = OUT / 16, NG = IN / 64, UNITS = IN / 8;
constexpr int64_t QB = UNITS * 64, SB = NG * 16 * 2;   // bytes a tile: 32 KB of units, 2 KB of f16 scales
constexpr int NE = 40;
static uint8_t* alloc(size_t n) {
  void* p = mmap(nullptr, n + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  uint8_t* a = (uint8_t*)(((uintptr_t)p + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
  madvise(a, n, MADV_HUGEPAGE);
  uint64_t x = (uint64_t)a | 1;
  for (size_t i = 0; i < n / 8; ++i) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; ((uint64_t*)a)[i] = x; }
  for (size_t i = 0; i < n; i += 2) a[i + 1] &= 0x3B;    // f16-ish bytes stay finite where read as scales
  return a;
}
alignas(64) static int8_t xq[IN];
alignas(64) static float sx[NG];
alignas(64) static int32_t corr[NG];
template <int PF>
inline __m512 tile(const uint8_t* wt, const uint16_t* st) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 accf = _mm512_setzero_ps();
  for (int64_t b = 0; b < NG; ++b) {
    __m512i lo_acc = _mm512_set1_epi32(corr[b]), hi_acc = _mm512_setzero_si512();
    for (int64_t u = b * 8; u < b * 8 + 8; ++u) {
      _mm_prefetch((const char*)(wt + u * 64 + PF), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512((const void*)(wt + u * 64));
      lo_acc = _mm512_dpbusd_epi32(lo_acc, _mm512_and_si512(v, lo4), _mm512_set1_epi32(*(const int32_t*)(xq + u * 8)));
      hi_acc = _mm512_dpbusd_epi32(hi_acc, _mm512_andnot_si512(lo4, v), _mm512_set1_epi32(*(const int32_t*)(xq + u * 8 + 4)));
    }
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(st + b * 16)));
    const __m512i isum = _mm512_add_epi32(lo_acc, _mm512_srai_epi32(hi_acc, 4));
    accf = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(sx[b])), accf);
  }
  return accf;
}
// mode 0: separate (q slab + s slab per matrix); 1: inline (per tile [scales][units])
float run(int mode, uint8_t** q, uint8_t** s, uint8_t** in, int e0, int e1, int t0, int t1) {
  __m512 acc = _mm512_setzero_ps();
  for (int e = e0; e < e1; ++e)
    for (int64_t t = t0; t < t1; ++t) {
      if (mode == 0) acc = _mm512_add_ps(acc, tile<8192>(q[e] + t * QB, (const uint16_t*)(s[e] + t * SB)));
      else acc = _mm512_add_ps(acc, tile<8192>(in[e] + t * (QB + SB) + SB, (const uint16_t*)(in[e] + t * (QB + SB))));
    }
  return _mm512_reduce_add_ps(acc);
}
int main() {
  std::vector<uint8_t*> q(NE), s(NE), in(NE);
  uint8_t* qa = alloc(NE * TILES * QB); uint8_t* sa = alloc(NE * TILES * SB); uint8_t* ia = alloc(NE * TILES * (QB + SB));
  for (int e = 0; e < NE; ++e) q[e] = qa + e * TILES * QB, s[e] = sa + e * TILES * SB, in[e] = ia + e * TILES * (QB + SB);
  for (int i = 0; i < IN; ++i) xq[i] = (rand() % 255) - 127;
  for (int i = 0; i < NG; ++i) sx[i] = 0.01f, corr[i] = 0;
  const double bytes = (double)NE * TILES * (QB + SB);
  volatile float sink = 0;
  for (int th : {1, 2}) {
    std::vector<double> r[2];
    for (int rep = 0; rep < 15; ++rep)
      for (int m : {rep % 2, 1 - rep % 2}) {
        auto t0 = std::chrono::steady_clock::now();
        if (th == 1) sink += run(m, q.data(), s.data(), in.data(), 0, NE, 0, TILES);
        else {   // each matrix's tiles split between two threads (as the engine's row chunks)
          std::thread h([&] { sink += run(m, q.data(), s.data(), in.data(), 0, NE, TILES / 2, TILES); });
          sink += run(m, q.data(), s.data(), in.data(), 0, NE, 0, TILES / 2);
          h.join();
        }
        if (rep) r[m].push_back(bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
      }
    for (int m : {0, 1}) {
      std::sort(r[m].begin(), r[m].end());
      printf("threads %d, scales %s: median %.1f GB/s (min %.1f, max %.1f)\n", th, m ? "inline  " : "separate",
             r[m][r[m].size() / 2], r[m][0], r[m].back());
    }
  }
}
