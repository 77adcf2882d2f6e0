// Standalone microbenchmark of the AVX2 int4 tile loop (glm_jax/kernels/qkernels.cc's tile_i4 layout: tiles of 16
// rows, one 64-byte vector per unit of 8 inputs) for 1-4 tokens: the variants before and after stop 30's one-pass /
// prefetch change, interleaved, medians of 8 reps.  Not part of the build or of CI.
//
//   g++ -O3 -march=native -std=c++17 tools/bench/tiles_avx2.cc -o /tmp/tiles && taskset -c 1 /tmp/tiles [EXPERTS]
//
// EXPERTS (default 36) matrices of 2048 x 1024 int4 (1.06 MB each with scales) are cycled through, 9 per "call":
// 36 exceed this machine's L3 (the decode regime), 4-9 fit it.
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
#include <algorithm>
constexpr int64_t BLK = 64;
struct W { const uint8_t* q; const float* s; int64_t out, in, units, ng; const int32_t* gt;
  const uint8_t* tile(int64_t t) const { return q + t * units * 64; }
  const float* tscale(int64_t t) const { return s + t * ng * 16; } };
struct P { const int8_t* xq; const float* sx; const int32_t* corr; };

// current AVX2 C==1
void tileA(const W& Wm, int64_t t, const P* p, float* out) {
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
        hi16 = _mm256_add_epi16(hi16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), _mm256_set1_epi32(*(const int32_t*)(xq + 4))));
      }
      const __m256 sc = _mm256_loadu_ps(st + Wm.gt[b] * 16 + 8 * h);
      const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(_mm256_set1_epi32(p->corr[b]), _mm256_madd_epi16(lo16, ones)), _mm256_madd_epi16(hi16, ones));
      accf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(p->sx[b])), accf);
    }
    _mm256_storeu_ps(out + 8 * h, accf);
  }
}
// one pass, both halves
template <int PF>
void tileB(const W& Wm, int64_t t, const P* p, float* out) {
  const uint8_t* wt = Wm.tile(t); const float* st = Wm.tscale(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0;
    const int64_t u0 = b * (BLK / 8), u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 8));
    if (PF) { _mm_prefetch((const char*)(wt + u0 * 64 + PF), _MM_HINT_T0); _mm_prefetch((const char*)(wt + u0 * 64 + PF + 64*4), _MM_HINT_T0);}
    for (int64_t u = u0; u < u1; ++u) {
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wt + u * 64));
      const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32));
      const __m256i xa = _mm256_set1_epi32(*(const int32_t*)(p->xq + u * 8));
      const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(p->xq + u * 8 + 4));
      l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(_mm256_and_si256(v0, lo4), xa));
      h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4), xb));
      l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(_mm256_and_si256(v1, lo4), xa));
      h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4), xb));
    }
    const float* sb = st + Wm.gt[b] * 16;
    const __m256 sx = _mm256_set1_ps(p->sx[b]);
    const __m256i cr = _mm256_set1_epi32(p->corr[b]);
    const __m256i i0 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l0, ones)), _mm256_madd_epi16(h0, ones));
    const __m256i i1 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l1, ones)), _mm256_madd_epi16(h1, ones));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(_mm256_loadu_ps(sb), sx), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(_mm256_loadu_ps(sb + 8), sx), acc1);
  }
  _mm256_storeu_ps(out, acc0); _mm256_storeu_ps(out + 8, acc1);
}

template <int PFN>
void tile2(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  constexpr int C = 2;
  const uint8_t* wt = Wm.tile(t); const float* st = Wm.tscale(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  const uint8_t* nxt = wt + Wm.units * 64;
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
          if (PFN && h == 1) _mm_prefetch((const char*)(nxt + u * 64), _MM_HINT_T0);
          if (PFN >= 2 && h == 0) _mm_prefetch((const char*)(wt + u * 64 + PFN), _MM_HINT_T0);
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
// C=1 one pass with prefetch of the next tile, PF bytes ahead
template <int PF>
void tileBp(const W& Wm, int64_t t, const P* p, float* out) {
  const uint8_t* wt = Wm.tile(t); const float* st = Wm.tscale(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0;
    const int64_t u0 = b * (BLK / 8), u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 8));
    for (int64_t u = u0; u < u1; ++u) {
      _mm_prefetch((const char*)(wt + u * 64 + PF), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wt + u * 64));
      const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32));
      const __m256i xa = _mm256_set1_epi32(*(const int32_t*)(p->xq + u * 8));
      const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(p->xq + u * 8 + 4));
      l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(_mm256_and_si256(v0, lo4), xa));
      h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4), xb));
      l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(_mm256_and_si256(v1, lo4), xa));
      h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4), xb));
    }
    const float* sb = st + Wm.gt[b] * 16;
    const __m256 sx = _mm256_set1_ps(p->sx[b]);
    const __m256i cr = _mm256_set1_epi32(p->corr[b]);
    const __m256i i0 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l0, ones)), _mm256_madd_epi16(h0, ones));
    const __m256i i1 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l1, ones)), _mm256_madd_epi16(h1, ones));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(_mm256_loadu_ps(sb), sx), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(_mm256_loadu_ps(sb + 8), sx), acc1);
  }
  _mm256_storeu_ps(out, acc0); _mm256_storeu_ps(out + 8, acc1);
}
void t2a(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[2] = {p, p}; alignas(64) float o[2][16]; tile2<0>(Wm, t, pp, o); memcpy(out, o[0], 64); }
void t2b(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[2] = {p, p}; alignas(64) float o[2][16]; tile2<1>(Wm, t, pp, o); memcpy(out, o[0], 64); }
void t2c(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[2] = {p, p}; alignas(64) float o[2][16]; tile2<4096>(Wm, t, pp, o); memcpy(out, o[0], 64); }

// one pass over the tile for C tokens: per token four int16 chains (lo/hi x half), float accumulators in L1
template <int C>
void tileN(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
  const uint8_t* wt = Wm.tile(t); const float* st = Wm.tscale(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const int64_t nb = (Wm.in + BLK - 1) / BLK;
  alignas(32) float acc[C][16];
  for (int c = 0; c < C; ++c) for (int l = 0; l < 16; ++l) acc[c][l] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i l0[C], h0[C], l1[C], h1[C];
    for (int c = 0; c < C; ++c) l0[c] = h0[c] = l1[c] = h1[c] = _mm256_setzero_si256();
    const int64_t u0 = b * (BLK / 8), u1 = std::min<int64_t>(Wm.units, (b + 1) * (BLK / 8));
    for (int64_t u = u0; u < u1; ++u) {
      _mm_prefetch((const char*)(wt + u * 64 + 4096), _MM_HINT_T0);
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
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c = 0; c < C; ++c) {
      const __m256 sx = _mm256_set1_ps(Pp[c]->sx[b]);
      const __m256i cr = _mm256_set1_epi32(Pp[c]->corr[b]);
      const __m256i i0 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l0[c], ones)), _mm256_madd_epi16(h0[c], ones));
      const __m256i i1 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l1[c], ones)), _mm256_madd_epi16(h1[c], ones));
      _mm256_store_ps(acc[c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(_mm256_loadu_ps(sb), sx), _mm256_load_ps(acc[c])));
      _mm256_store_ps(acc[c] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(_mm256_loadu_ps(sb + 8), sx), _mm256_load_ps(acc[c] + 8)));
    }
  }
  for (int c = 0; c < C; ++c) memcpy(out[c], acc[c], 64);
}
void n2(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[2] = {p, p}; alignas(64) float o[2][16]; tileN<2>(Wm, t, pp, o); memcpy(out, o[0], 64); }
void n3(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[3] = {p, p, p}; alignas(64) float o[3][16]; tileN<3>(Wm, t, pp, o); memcpy(out, o[0], 64); }
void n1(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[1] = {p}; alignas(64) float o[1][16]; tileN<1>(Wm, t, pp, o); memcpy(out, o[0], 64); }

template <int C>
void tile4cur(const W& Wm, int64_t t, const P* const* Pp, float (*out)[16]) {
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
          if (h == 0) _mm_prefetch((const char*)(wt + u * 64 + 4096), _MM_HINT_T0);
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
void c4(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[4] = {p, p, p, p}; alignas(64) float o[4][16]; tile4cur<4>(Wm, t, pp, o); memcpy(out, o[0], 64); }
void n22(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[4] = {p, p, p, p}; alignas(64) float o[4][16]; tileN<2>(Wm, t, pp, o); tileN<2>(Wm, t, pp + 2, o + 2); memcpy(out, o[0], 64); }
void n4(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[4] = {p, p, p, p}; alignas(64) float o[4][16]; tileN<4>(Wm, t, pp, o); memcpy(out, o[0], 64); }
void n31(const W& Wm, int64_t t, const P* p, float* out) { const P* pp[4] = {p, p, p, p}; alignas(64) float o[4][16]; tileN<3>(Wm, t, pp, o); tileN<1>(Wm, t, pp + 3, o + 3); memcpy(out, o[0], 64); }
typedef void (*TF)(const W&, int64_t, const P*, float*);
int main(int argc, char** argv) {
  int64_t out = 2048, in = 1024; int NE = argc > 1 ? atoi(argv[1]) : 36; int K = 9;
  int64_t units = in / 8, tiles = out / 16, ng = in / 64;
  std::vector<uint8_t*> qs(NE); std::vector<float*> ss(NE);
  for (int e = 0; e < NE; ++e) { qs[e] = (uint8_t*)aligned_alloc(64, tiles * units * 64); for (int64_t i = 0; i < tiles*units*64; ++i) qs[e][i] = rand();
    ss[e] = (float*)aligned_alloc(64, tiles * ng * 16 * 4); for (int64_t i = 0; i < tiles*ng*16; ++i) ss[e][i] = 0.01f; }
  std::vector<int32_t> gt(ng); for (int i = 0; i < ng; ++i) gt[i] = i;
  alignas(64) static int8_t xq[4096]; alignas(64) static float sx[64]; alignas(64) static int32_t corr[64];
  for (int i = 0; i < in; ++i) xq[i] = (rand() % 255) - 127; for (int i = 0; i < 64; ++i) { sx[i] = 0.01f; corr[i] = 0; }
  P p{xq, sx, corr};
  std::vector<float> y(out);
  TF fs[] = {tileA, tileB<0>, tileBp<4096>, t2a, t2c, n2, n3, c4, n22};
  const char* nm[] = {"1 tok: two 32-byte passes (before)", "1 tok: one pass", "1 tok: one pass + prefetch 4K (now)", "2 tok: two passes (before)", "2 tok: two passes + prefetch", "2 tok: one pass (now)", "3 tok: one pass (now)", "4 tok: two passes + prefetch (now)", "4 tok: 2 x one pass"}; const int TOK[] = {1, 1, 1, 2, 2, 2, 3, 4, 4}; const int NF = 9;
  int iter = 0;
  printf("| variant | GB/s of weights, median | min | x tokens |\n|---|---|---|---|\n");
  std::vector<std::vector<double>> res(NF); for (int rep = 0; rep < 9; ++rep) for (int f = 0; f < NF; ++f) {
    auto t0 = std::chrono::steady_clock::now();
    int calls = 100;
    for (int c = 0; c < calls; ++c) { for (int k = 0; k < K; ++k) { int e = (iter++ * 7 + k * 13) % NE;
      W Wm{qs[e], ss[e], out, in, units, ng, gt.data()}; for (int64_t t = 0; t < tiles; ++t) fs[f](Wm, t, &p, y.data() + 16 * t); } }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double bytes = (double)calls * K * (tiles * units * 64 + tiles * ng * 64);
    if (rep >= 1) res[f].push_back(bytes / dt / 1e9);
  }
  for (int f = 0; f < NF; ++f) { auto v = res[f]; std::sort(v.begin(), v.end()); printf("| %s | %.2f | %.2f | %.1f |\n", nm[f], v[v.size()/2], v[0], TOK[f] * v[v.size()/2]); }
  printf("%f\n", y[3]);
}
