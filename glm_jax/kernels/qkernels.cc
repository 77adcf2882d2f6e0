// glm-jax native CPU kernels, registered with XLA through jax.ffi (they run inside the jitted step).
//
//   glmjax_qlinear : y[T, out] = x[T, in] @ W[out, in]^T          (W in one storage format, see below)
//   glmjax_moe     : the MoE seam: for every valid (t, k), e = slots[t, k]:
//                      y_tk = down_e( silu(gate_e x_t) * up_e x_t ),  out[t] = sum_k weights[t, k] * y_tk
//                    (mode 0: out [T, H]; mode 1: the per-(t, k) terms y [T, K, H], invalid entries 0)
//   glmjax_moe_clamped : the same with the SwiGLU clamp: silu(min(gate, limit)) * clamp(up, -limit, limit)
//   glmjax_attn    : GQA attention of a few query rows over the [B, S, nkv, hd] f32 / f16 K/V cache (see "attention")
//   glmjax_sink    : a running decode loop hands its tokens to the host without calling Python (see "Stream sink")
//
// Weight formats and layouts (glm_jax/kernels/formats.py is the reference: quantize / to_tiles):
//   0 f32, 1 bf16 : row-major [out, in]; activations stay f32 (exact f32 FMA dot products)
//   2 int8_row, 3 int4_g<G>/int4_row : the "tiles" layout: rows in tiles of 16; for tile t the input is cut into
//     units of 4 (int8) or 8 (int4) elements, one 64-byte vector per unit holding its 16 rows: byte 4i+j =
//     row 16t+i, element u*4+j (int8) or, for int4, low nibble element 8u+j and high nibble element 8u+4+j
//     (offset-binary q+8).  Rows padded to a multiple of 16, the input to a multiple of 4 / 8 (zero weights).
//     Scales [tiles, groups, 16] (int8: one group).  Activations are quantized to int8 per 64-block (amax/127).
//     One AVX-512 VNNI vpdpbusd then multiplies 16 rows by 4 broadcast activations, accumulating straight into
//     the 16 rows' lanes: no unpacking of activations, no horizontal sums (llama.cpp's repacked Q4_0/Q8_0 idea).
//
// Determinism: every (row, token) result is computed by the same instruction sequence whatever the tile of tokens
// it sits in, the number of tokens, rows or experts in the call, or the thread that runs it, and the MoE output sums
// a token's experts in routing order k.  So a row's result is bitwise independent of the batch around it (the
// engine's batch-invariance tests).  The AVX2 build (a CPU without AVX-512 VNNI: vpmaddubsw / vpmaddwd in 256-bit
// halves) and the portable one (-DGLMJAX_PORTABLE, no SIMD) do the same integer sums and the same per-lane float
// operations, so every build computes the quantized formats bitwise alike (tests/test_kernels.py).
//
// Threads: work is split into tasks shared with XLA's intra-op thread pool (ffi::ThreadPool); the calling thread runs
// tasks too and never waits for a helper that has not started, so a busy pool costs nothing but parallelism.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <map>
#include <thread>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Fmt : int32_t { kF32 = 0, kBF16 = 1, kI8 = 2, kI4 = 3 };
constexpr int64_t BLK = 64;   // activation quantization block (elements)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    !defined(GLMJAX_PORTABLE)
#define GLMJAX_VNNI 1
#else
#define GLMJAX_VNNI 0
#endif
// AVX2 (+FMA) without AVX-512 VNNI (most AMD Zen 2/3 and Intel client CPUs): the tile kernels in 256-bit halves
// (rows 0-7, 8-15 of a tile), the same exact integer sums and per-lane float operations as the other two builds;
// the float kernels as the portable build's 16 lanes in two halves (bitwise its results)
#if !GLMJAX_VNNI && defined(__AVX2__) && defined(__FMA__) && !defined(GLMJAX_PORTABLE)
#define GLMJAX_AVX2 1
#else
#define GLMJAX_AVX2 0
#endif

inline int64_t ceil_to(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ------------------------------------------------------------------------------------------------ weights
struct WMat {
  const uint8_t* q = nullptr;
  const void* s = nullptr;      // scales [tiles, ng, 16]: f32, or f16 where `half` (the int4_g formats)
  bool half = false;
  int64_t out = 0, in = 0, ng = 1, G = 0;
  int fmt = kF32;
  // float formats: row-major, row_bytes per row.  int formats: tiles (K = padded input, unit bytes 64)
  int64_t row_bytes = 0, K = 0, units = 0;
  std::vector<int32_t> gt;      // int formats: group of each 64-block
  const uint8_t* row(int64_t r) const { return q + r * row_bytes; }
  const uint8_t* tile(int64_t t) const { return q + t * units * 64; }
  int64_t sidx(int64_t t, int64_t g = 0) const { return (t * ng + g) * 16; }   // tile t, group g: its 16 scales
};

// Scale element i of a buffer of f16 (half) or f32 scales (one matrix's scales inside a bank / a group of matrices)
inline const void* scale_ptr(const void* s, bool half, int64_t i) {
  return (const uint8_t*)s + i * (half ? 2 : 4);
}

// One scale as f32 (f16 -> f32 is exact, so every build reads the same value)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13);                   // inf / nan
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);             // normal: rebias 15 -> 127
  } else if (m == 0) {
    bits = sign;                                             // zero
  } else {                                                   // subnormal: m x 2^-24, normalised
    int sh = 0;
    uint32_t mm = m;
    while (!(mm & 0x400)) mm <<= 1, ++sh;
    bits = sign | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <bool HS>
inline float scale_at(const WMat& W, int64_t i) {
  return HS ? half_to_float(((const uint16_t*)W.s)[i]) : ((const float*)W.s)[i];
}
#if GLMJAX_VNNI
template <bool HS>
inline __m512 scale16(const WMat& W, int64_t i) {          // scales i .. i+16
  return HS ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)W.s + i)))
                : _mm512_loadu_ps((const float*)W.s + i);
}
#elif GLMJAX_AVX2
template <bool HS>
inline __m256 scale8(const WMat& W, int64_t i) {           // scales i .. i+8
  if (!HS) return _mm256_loadu_ps((const float*)W.s + i);
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)W.s + i)));
#else
  alignas(32) float f[8];
  for (int l = 0; l < 8; ++l) f[l] = half_to_float(((const uint16_t*)W.s)[i + l]);
  return _mm256_load_ps(f);
#endif
}
#endif

inline bool is_float(int fmt) { return fmt == kF32 || fmt == kBF16; }
inline int64_t unit_elems(int fmt) { return fmt == kI4 ? 8 : 4; }

// bytes of one [out, in] matrix in its layout
int64_t matrix_bytes(int fmt, int64_t out, int64_t in) {
  switch (fmt) {
    case kF32: return out * in * 4;
    case kBF16: return out * in * 2;
    case kI8: return ceil_to(out, 16) * ceil_to(in, 4);
    default: return ceil_to(out, 16) * ceil_to(in, 8) / 2;
  }
}

WMat make_wmat(const void* q, const void* s, bool half, int fmt, int64_t out, int64_t in, int64_t ng, int64_t G) {
  WMat W;
  W.q = (const uint8_t*)q;
  W.s = s;
  W.half = half;
  W.out = out;
  W.in = in;
  W.ng = std::max<int64_t>(1, ng);
  W.G = G > 0 ? G : in;
  W.fmt = fmt;
  if (is_float(fmt)) {
    W.row_bytes = in * (fmt == kF32 ? 4 : 2);
  } else {
    W.K = ceil_to(in, unit_elems(fmt));
    W.units = W.K / unit_elems(fmt);
    const int64_t nb = (in + BLK - 1) / BLK;
    W.gt.resize(nb);
    for (int64_t b = 0; b < nb; ++b) W.gt[b] = (int32_t)std::min<int64_t>((b * BLK) / W.G, W.ng - 1);
  }
  return W;
}

// ------------------------------------------------------------------------------------------------ activations
// One token row prepared for a weight format.  Float formats use x itself.  Quantized: int8 per 64-block.
struct Prep {
  const float* xf = nullptr;
  const int8_t* xq = nullptr;     // int4: int8 values, natural order, zero-padded to the 64-blocks
  const uint8_t* xa = nullptr;    // int8: |values|
  const uint64_t* neg = nullptr;  // int8: per 4-element unit, its sign bits repeated over the 16 lanes
  const float* sx = nullptr;      // per 64-block scale
  const int32_t* corr = nullptr;  // int4: per 64-block, -8 * sum of the block's int8 values (offset-binary nibbles)
};

struct PrepLayout {
  int64_t nb = 0, bytes = 0, off_a = 0, off_b = 0, off_sx = 0;
};

PrepLayout prep_layout(int fmt, int64_t in) {
  PrepLayout L;
  L.nb = (in + BLK - 1) / BLK;
  auto al = [](int64_t n) { return (n + 63) / 64 * 64; };
  if (fmt == kI4) {
    L.off_a = 0;                                   // xq
    L.off_b = al(L.nb * BLK);                      // corr
    L.off_sx = L.off_b + al(L.nb * 4);
    L.bytes = L.off_sx + al(L.nb * 4);
  } else if (fmt == kI8) {
    L.off_a = 0;                                   // |x|
    L.off_b = al(L.nb * BLK);                      // sign masks per unit of 4
    L.off_sx = L.off_b + al(L.nb * 16 * 8);
    L.bytes = L.off_sx + al(L.nb * 4);
  }
  return L;
}

#if defined(__AVX2__) && !defined(GLMJAX_PORTABLE)
// a full 64-block in 8-lane vectors: the same amax, the same products x * inv rounded to nearest even (vcvtps2dq
// under the default MXCSR rounding is lrintf's), the same clamp: bitwise the scalar code below (test_kernels' portable
// build comparison).  Returns the scale
inline float block_quant64(const float* x, int8_t* q) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 64; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
  alignas(32) float mv[8];
  _mm256_store_ps(mv, m);
  float amax = 0.f;
  for (int l = 0; l < 8; ++l) amax = std::max(amax, mv[l]);
  const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < 64; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j)
      v[j] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), vinv))));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)(q + i), _mm256_permutevar8x32_epi32(p, perm));
  }
  return s;
}
#endif

inline float block_quant(const float* x, int64_t n, int8_t* q /* 64 */) {
#if defined(__AVX2__) && !defined(GLMJAX_PORTABLE)
  if (n == BLK) return block_quant64(x, q);
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  float s = amax / 127.f;
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < BLK; ++i) {
    float v = i < n ? x[i] * inv : 0.f;
    long r = std::lrintf(v);
    q[i] = (int8_t)std::max(-127L, std::min(127L, r));
  }
  return s;
}

void prep_row(int fmt, const float* x, int64_t in, const PrepLayout& L, uint8_t* buf, Prep* p) {
  p->xf = x;
  if (is_float(fmt)) return;
  float* sx = (float*)(buf + L.off_sx);
  p->sx = sx;
  if (fmt == kI4) {
    int8_t* xq = (int8_t*)(buf + L.off_a);
    int32_t* corr = (int32_t*)(buf + L.off_b);
    for (int64_t b = 0; b < L.nb; ++b) {
      sx[b] = block_quant(x + b * BLK, std::min(BLK, in - b * BLK), xq + b * BLK);
      int32_t sum = 0;
      for (int i = 0; i < BLK; ++i) sum += xq[b * BLK + i];
      corr[b] = -8 * sum;
    }
    p->xq = xq;
    p->corr = corr;
    return;
  }
  uint8_t* xa = buf + L.off_a;
  uint64_t* neg = (uint64_t*)(buf + L.off_b);
  alignas(64) int8_t q[BLK];
  for (int64_t b = 0; b < L.nb; ++b) {
    sx[b] = block_quant(x + b * BLK, std::min(BLK, in - b * BLK), q);
    for (int u = 0; u < 16; ++u) {
      uint64_t bits = 0;
      for (int j = 0; j < 4; ++j) {
        int8_t v = q[4 * u + j];
        xa[b * BLK + 4 * u + j] = (uint8_t)(v < 0 ? -v : v);
        if (v < 0) bits |= (uint64_t)1 << j;
      }
      neg[b * 16 + u] = bits * 0x1111111111111111ull;     // the unit's 4 sign bits in every 32-bit lane
    }
  }
  p->xa = xa;
  p->neg = neg;
}

// ------------------------------------------------------------------------------------------------ float kernels
// R rows x C tokens, row-major weights.  out[c * R + r].  One 16-lane accumulator per (row, token), elements in
// order, one horizontal sum: the same instruction sequence for every (row, token) whatever R and C.
#if GLMJAX_VNNI
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

inline __m512 bf16x16(const void* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, int C, bool BF>
inline void dot_float(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t n = W.in;
  auto wload = [&](int r, int64_t i, __mmask16 m) {
    return BF ? bf16x16((const uint16_t*)W.row(r0 + r) + i, m)
              : _mm512_maskz_loadu_ps(m, (const float*)W.row(r0 + r) + i);
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(P[c]->xf + i);
    for (int r = 0; r < R; ++r) {
      __m512 w = wload(r, i, 0xFFFF);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
    }
  }
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_maskz_loadu_ps(m, P[c]->xf + i);
    for (int r = 0; r < R; ++r) {
      __m512 w = wload(r, i, m);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * R + r] = hsum(acc[r][c]);
}
#else
inline float bf16f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// element i of row r of a float W (bf16 widened)
template <bool BF>
inline float wf(const WMat& W, int64_t r, int64_t i) {
  return BF ? bf16f(((const uint16_t*)W.row(r))[i]) : ((const float*)W.row(r))[i];
}

#if GLMJAX_AVX2
// The portable build's 16 lanes (lane l sums elements i = l mod 16, in order) as two 8-lane halves, the lanes then
// summed in order: bitwise the portable result.  One token at a time (8 accumulators for 4 rows; the rows' weights
// stay in L1/L2 from one token to the next).
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

template <int R, int C, bool BF>
inline void dot_float(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  const int64_t n = W.in, n16 = n / 16 * 16;
  for (int c = 0; c < C; ++c) {
    const float* x = P[c]->xf;
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n16; i += 16) {
      __m256 xl = _mm256_loadu_ps(x + i), xh = _mm256_loadu_ps(x + i + 8);
      for (int r = 0; r < R; ++r) {
        __m256 wl, wh;
        if (BF) {
          const uint16_t* w = (const uint16_t*)W.row(r0 + r) + i;
          wl = bf16x8(w);
          wh = bf16x8(w + 8);
        } else {
          const float* w = (const float*)W.row(r0 + r) + i;
          wl = _mm256_loadu_ps(w);
          wh = _mm256_loadu_ps(w + 8);
        }
        lo[r] = _mm256_fmadd_ps(wl, xl, lo[r]);
        hi[r] = _mm256_fmadd_ps(wh, xh, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float acc[16];
      _mm256_store_ps(acc, lo[r]);
      _mm256_store_ps(acc + 8, hi[r]);
      for (int64_t i = n16; i < n; ++i) {           // the tail as the portable build does it
        float w = wf<BF>(W, r0 + r, i);
        acc[i % 16] = std::fma(w, x[i], acc[i % 16]);
      }
      float sum = 0.f;
      for (int l = 0; l < 16; ++l) sum += acc[l];
      out[c * R + r] = sum;
    }
  }
}
#else
template <int R, int C, bool BF>
inline void dot_float(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float acc[16] = {0};
      for (int64_t i = 0; i < W.in; ++i) {
        float w = wf<BF>(W, r0 + r, i);
        acc[i % 16] = std::fma(w, P[c]->xf[i], acc[i % 16]);
      }
      float s = 0.f;
      for (int l = 0; l < 16; ++l) s += acc[l];
      out[c * R + r] = s;
    }
}
#endif  // GLMJAX_AVX2
#endif

// rows [r0, r1) of a float W against tokens preps[0..n) -> ys[i][row], tiles of 4 rows x 4 tokens
template <bool BF>
void gemm_float(const WMat& W, int64_t r0, int64_t r1, const Prep* const* preps, int64_t n, float* const* ys) {
  float tmp[16];
  int64_t r = r0;
#if GLMJAX_VNNI
  // 1-3 tokens (decode): a row at a time, one sequential stream of weights.  Four rows at once are four streams 4 KB
  // apart; from DRAM a row at a time read 19-24 GB/s a core against 15-18 (tools/bench/tiles_vnni.cc).  The
  // same accumulator per (row, token) either way, so the same results.
  if (n < 4) {
    if (n <= 0) return;             // every row padding
    for (; r < r1; ++r) {
      if (n == 1) {
        dot_float<1, 1, BF>(W, r, preps, ys[0] + r);
        continue;
      }
      n == 2 ? dot_float<1, 2, BF>(W, r, preps, tmp) : dot_float<1, 3, BF>(W, r, preps, tmp);
      for (int64_t c = 0; c < n; ++c) ys[c][r] = tmp[c];
    }
    return;
  }
#endif
  for (; r + 4 <= r1; r += 4) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      dot_float<4, 4, BF>(W, r, preps + i, tmp);
      for (int c = 0; c < 4; ++c) std::memcpy(ys[i + c] + r, tmp + 4 * c, 4 * sizeof(float));
    }
    for (; i < n; ++i) {
      dot_float<4, 1, BF>(W, r, preps + i, tmp);
      std::memcpy(ys[i] + r, tmp, 4 * sizeof(float));
    }
  }
  for (; r < r1; ++r)
    for (int64_t i = 0; i < n; ++i) dot_float<1, 1, BF>(W, r, preps + i, ys[i] + r);
}

// ------------------------------------------------------------------------------------------------ tile kernels
// tile t (16 rows) x C tokens -> out[c][0..16).  Per 64-block: exact int32 sums, then
// acc = fma(float(isum), scale[row] * sx[block], acc) per row lane, blocks in order.
#if GLMJAX_VNNI
// Software prefetch 8 KiB ahead in the weight stream (one 64-byte line per unit), as the AVX2 build does at 4 KiB:
// tools/bench/tiles_vnni.cc on one core of an AVX-512 EPYC, 36 experts of 2048 x 1024 rotating (38 MB, only just
// beyond its 32 MB L3): int4 one token 31.5 -> 47.7 GB/s, two tokens 31.4 -> 46.7, four 27.0 -> 35.8; int8 one token
// 32.6 -> 42.2 (4 KiB: 38.8 / 38.6 / 31.3 / 36.1).  With 192 (204 MB) int4 one token ran 25.3-25.9 -> 27.8-28.5
// GB/s, the weight stream's loads alone 24.3-24.8: there the loop runs at what memory streams to one core.  A prefetch
// past the end of a buffer is harmless (it never faults)
constexpr int64_t kPrefetchAhead = 8192;
template <int C, bool HS>
inline void tile_i4(const WMat& W, int64_t t, const Prep* const* P, float (*out)[16]) {
  const uint8_t* wt = W.tile(t);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 accf[C];
  for (int c = 0; c < C; ++c) accf[c] = _mm512_setzero_ps();
  const int64_t nb = (W.in + BLK - 1) / BLK;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo_acc[C], hi_acc[C];
    for (int c = 0; c < C; ++c) {
      lo_acc[c] = _mm512_set1_epi32(P[c]->corr[b]);
      hi_acc[c] = _mm512_setzero_si512();
    }
    const int64_t u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 8));
    for (int64_t u = b * (BLK / 8); u < u1; ++u) {
      _mm_prefetch((const char*)(wt + u * 64 + kPrefetchAhead), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512((const void*)(wt + u * 64));
      const __m512i lo = _mm512_and_si512(v, lo4);
      const __m512i hi = _mm512_andnot_si512(lo4, v);          // 16 x the high nibble: no shift per vector
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = P[c]->xq + u * 8;
        lo_acc[c] = _mm512_dpbusd_epi32(lo_acc[c], lo, _mm512_set1_epi32(*(const int32_t*)xq));
        hi_acc[c] = _mm512_dpbusd_epi32(hi_acc[c], hi, _mm512_set1_epi32(*(const int32_t*)(xq + 4)));
      }
    }
    const __m512 sc = scale16<HS>(W, W.sidx(t, W.gt[b]));
    for (int c = 0; c < C; ++c) {
      const __m512i isum = _mm512_add_epi32(lo_acc[c], _mm512_srai_epi32(hi_acc[c], 4));
      accf[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(P[c]->sx[b])), accf[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[c], accf[c]);
}

template <int C, bool HS>
inline void tile_i8(const WMat& W, int64_t t, const Prep* const* P, float (*out)[16]) {
  const uint8_t* wt = W.tile(t);
  const __m512i zero = _mm512_setzero_si512();
  __m512 accf[C];
  for (int c = 0; c < C; ++c) accf[c] = _mm512_setzero_ps();
  const int64_t nb = (W.in + BLK - 1) / BLK;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[C];
    for (int c = 0; c < C; ++c) acc[c] = zero;
    const int64_t u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 4));
    for (int64_t u = b * (BLK / 4); u < u1; ++u) {
      _mm_prefetch((const char*)(wt + u * 64 + kPrefetchAhead), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512((const void*)(wt + u * 64));
      for (int c = 0; c < C; ++c) {
        const __m512i ws = _mm512_mask_sub_epi8(w, (__mmask64)P[c]->neg[u], zero, w);     // w * sign(x)
        acc[c] = _mm512_dpbusd_epi32(acc[c], _mm512_set1_epi32(*(const int32_t*)(P[c]->xa + u * 4)), ws);
      }
    }
    for (int c = 0; c < C; ++c)
      accf[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]), _mm512_set1_ps(P[c]->sx[b]), accf[c]);
  }
  const __m512 sc = scale16<HS>(W, W.sidx(t));
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[c], _mm512_mul_ps(accf[c], sc));
}
#elif GLMJAX_AVX2
// Software prefetch 4 KiB ahead in the weight stream (one 64-byte line per unit): the hardware prefetchers stop at
// 4 KiB page boundaries, and a decode step's weights come from DRAM.  Standalone bench, one core, 36 experts of
// 2048 x 1024 int4 rotating (beyond L3): one token 14 -> 19 GB/s, two tokens 8 -> 12.5 GB/s.  A prefetch past the end of
// a buffer is harmless (it never faults)
constexpr int64_t kPrefetchAhead = 4096;
// int4: per 64-block and half, u8 nibbles x s8 activations by vpmaddubsw (pairs <= 2*15*128 = 3840, no saturation);
// a unit's low- and high-nibble products summed (<= 7680) into one int16 accumulator per token over 4 units (<= 30720,
// exact), widened by vpmaddwd into int32: the exact int32 sums of the VNNI build.  One accumulator per token (not
// one per nibble) keeps C = 4 tokens in the 16 ymm registers without spills: 70 -> 80 GMAC/s a core
template <int C, bool HS>
inline void tile_i4(const WMat& W, int64_t t, const Prep* const* P, float (*out)[16]) {
  const uint8_t* wt = W.tile(t);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = (W.in + BLK - 1) / BLK;
  if constexpr (C <= 3) {
    // up to 3 tokens, one pass over the tile: per token both halves' low- and high-nibble int16 chains (<= 30720 each
    // over the block's 8 units), the float accumulators in L1, so each 64-byte unit is loaded once while the loads
    // keep the core busy.  Standalone bench, one core, 36 experts of 2048 x 1024 rotating (beyond L3), GB/s of
    // weights x tokens: 1 token (two 32-byte passes before) 10 -> 17, 2 tokens 19 -> 24, 3 tokens (a 2- and a
    // 1-token pass before) 18 -> 25.  The same integer sums and per-lane float operations as the other builds
    alignas(32) float acc[C][16];
    for (int c = 0; c < C; ++c) std::memset(acc[c], 0, sizeof(acc[c]));
    for (int64_t b = 0; b < nb; ++b) {
      __m256i l0[C], h0[C], l1[C], h1[C];
      for (int c = 0; c < C; ++c) l0[c] = h0[c] = l1[c] = h1[c] = _mm256_setzero_si256();
      const int64_t u0 = b * (BLK / 8), u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 8));
      for (int64_t u = u0; u < u1; ++u) {
        _mm_prefetch((const char*)(wt + u * 64 + kPrefetchAhead), _MM_HINT_T0);
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wt + u * 64));
        const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32));
        const __m256i a0 = _mm256_and_si256(v0, lo4), b0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4);
        const __m256i a1 = _mm256_and_si256(v1, lo4), b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4);
        for (int c = 0; c < C; ++c) {
          const __m256i xa = _mm256_set1_epi32(*(const int32_t*)(P[c]->xq + u * 8));
          l0[c] = _mm256_add_epi16(l0[c], _mm256_maddubs_epi16(a0, xa));
          l1[c] = _mm256_add_epi16(l1[c], _mm256_maddubs_epi16(a1, xa));
          const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(P[c]->xq + u * 8 + 4));
          h0[c] = _mm256_add_epi16(h0[c], _mm256_maddubs_epi16(b0, xb));
          h1[c] = _mm256_add_epi16(h1[c], _mm256_maddubs_epi16(b1, xb));
        }
      }
      const int64_t sb = W.sidx(t, W.gt[b]);
      const __m256 sb0 = scale8<HS>(W, sb), sb1 = scale8<HS>(W, sb + 8);
      for (int c = 0; c < C; ++c) {
        const __m256 sx = _mm256_set1_ps(P[c]->sx[b]);
        const __m256i cr = _mm256_set1_epi32(P[c]->corr[b]);
        const __m256i i0 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l0[c], ones)),
                                            _mm256_madd_epi16(h0[c], ones));
        const __m256i i1 = _mm256_add_epi32(_mm256_add_epi32(cr, _mm256_madd_epi16(l1[c], ones)),
                                            _mm256_madd_epi16(h1[c], ones));
        _mm256_store_ps(acc[c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(sb0, sx),
                                                _mm256_load_ps(acc[c])));
        _mm256_store_ps(acc[c] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1),
                                                    _mm256_mul_ps(sb1, sx),
                                                    _mm256_load_ps(acc[c] + 8)));
      }
    }
    for (int c = 0; c < C; ++c) std::memcpy(out[c], acc[c], sizeof(acc[c]));
    return;
  }
  // one half (8 rows) at a time, the tile's other half read again from L1
  for (int h = 0; h < 2; ++h) {
    __m256 accf[C];
    for (int c = 0; c < C; ++c) accf[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i i32[C];
      for (int c = 0; c < C; ++c) i32[c] = _mm256_set1_epi32(P[c]->corr[b]);
      const int64_t u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 8));
      for (int64_t g = b * (BLK / 8); g < u1; g += 4) {
        __m256i a16[C];
        for (int c = 0; c < C; ++c) a16[c] = _mm256_setzero_si256();
        const int64_t ge = std::min<int64_t>(u1, g + 4);
        for (int64_t u = g; u < ge; ++u) {
          if (h == 0) _mm_prefetch((const char*)(wt + u * 64 + kPrefetchAhead), _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32 * h));
          const __m256i lo = _mm256_and_si256(v, lo4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
          for (int c = 0; c < C; ++c) {
            const int8_t* xq = P[c]->xq + u * 8;
            a16[c] = _mm256_add_epi16(a16[c], _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_set1_epi32(*(const int32_t*)xq)),
                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(*(const int32_t*)(xq + 4)))));
          }
        }
        for (int c = 0; c < C; ++c) i32[c] = _mm256_add_epi32(i32[c], _mm256_madd_epi16(a16[c], ones));
      }
      const __m256 sc = scale8<HS>(W, W.sidx(t, W.gt[b]) + 8 * h);
      for (int c = 0; c < C; ++c)
        accf[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[c]), _mm256_mul_ps(sc, _mm256_set1_ps(P[c]->sx[b])), accf[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[c] + 8 * h, accf[c]);
  }
}

// int8: the weights take the activations' signs (vpsignb; the 4 sign bits of a unit -> a +-1 byte pattern), then
// |x| u8 x w s8 by vpmaddubsw (pairs <= 2*127*127, no saturation) and vpmaddwd into int32, per unit
alignas(64) static const int32_t kSignPattern[16] = {
    0x01010101, 0x010101FF, 0x0101FF01, 0x0101FFFF, 0x01FF0101, 0x01FF01FF, 0x01FFFF01, 0x01FFFFFF,
    (int32_t)0xFF010101, (int32_t)0xFF0101FF, (int32_t)0xFF01FF01, (int32_t)0xFF01FFFF,
    (int32_t)0xFFFF0101, (int32_t)0xFFFF01FF, (int32_t)0xFFFFFF01, (int32_t)0xFFFFFFFF};

template <int C, bool HS>
inline void tile_i8(const WMat& W, int64_t t, const Prep* const* P, float (*out)[16]) {
  const uint8_t* wt = W.tile(t);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nb = (W.in + BLK - 1) / BLK;
  if constexpr (C <= 3) {      // one pass over the tile, as tile_i4's (float accumulators in L1)
    alignas(32) float acc[C][16];
    for (int c = 0; c < C; ++c) std::memset(acc[c], 0, sizeof(acc[c]));
    for (int64_t b = 0; b < nb; ++b) {
      __m256i a0[C], a1[C];
      for (int c = 0; c < C; ++c) a0[c] = a1[c] = _mm256_setzero_si256();
      const int64_t u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 4));
      for (int64_t u = b * (BLK / 4); u < u1; ++u) {
        _mm_prefetch((const char*)(wt + u * 64 + kPrefetchAhead), _MM_HINT_T0);
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wt + u * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32));
        for (int c = 0; c < C; ++c) {
          const __m256i sg = _mm256_set1_epi32(kSignPattern[P[c]->neg[u] & 15]);
          const __m256i xa = _mm256_set1_epi32(*(const int32_t*)(P[c]->xa + u * 4));
          a0[c] = _mm256_add_epi32(a0[c], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, sg)), ones));
          a1[c] = _mm256_add_epi32(a1[c], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, sg)), ones));
        }
      }
      for (int c = 0; c < C; ++c) {
        const __m256 sx = _mm256_set1_ps(P[c]->sx[b]);
        _mm256_store_ps(acc[c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[c]), sx, _mm256_load_ps(acc[c])));
        _mm256_store_ps(acc[c] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[c]), sx, _mm256_load_ps(acc[c] + 8)));
      }
    }
    const __m256 sc0 = scale8<HS>(W, W.sidx(t)), sc1 = scale8<HS>(W, W.sidx(t) + 8);
    for (int c = 0; c < C; ++c) {
      _mm256_storeu_ps(out[c], _mm256_mul_ps(_mm256_load_ps(acc[c]), sc0));
      _mm256_storeu_ps(out[c] + 8, _mm256_mul_ps(_mm256_load_ps(acc[c] + 8), sc1));
    }
    return;
  }
  for (int h = 0; h < 2; ++h) {              // one half at a time, as tile_i4
    __m256 accf[C];
    for (int c = 0; c < C; ++c) accf[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i acc[C];
      for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_si256();
      const int64_t u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 4));
      for (int64_t u = b * (BLK / 4); u < u1; ++u) {
        if (h == 0) _mm_prefetch((const char*)(wt + u * 64 + kPrefetchAhead), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256((const __m256i*)(wt + u * 64 + 32 * h));
        for (int c = 0; c < C; ++c) {
          const __m256i sg = _mm256_set1_epi32(kSignPattern[P[c]->neg[u] & 15]);
          const __m256i xa = _mm256_set1_epi32(*(const int32_t*)(P[c]->xa + u * 4));
          acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, sg)), ones));
        }
      }
      for (int c = 0; c < C; ++c)
        accf[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[c]), _mm256_set1_ps(P[c]->sx[b]), accf[c]);
    }
    const __m256 sc = scale8<HS>(W, W.sidx(t) + 8 * h);
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[c] + 8 * h, _mm256_mul_ps(accf[c], sc));
  }
}
#else
template <int C, bool HS>
inline void tile_i4(const WMat& W, int64_t t, const Prep* const* P, float (*out)[16]) {
  const uint8_t* wt = W.tile(t);
  const int64_t nb = (W.in + BLK - 1) / BLK;
  for (int c = 0; c < C; ++c) {
    float accf[16] = {0};
    for (int64_t b = 0; b < nb; ++b) {
      int32_t lo_acc[16], hi_acc[16];
      for (int l = 0; l < 16; ++l) lo_acc[l] = P[c]->corr[b], hi_acc[l] = 0;
      const int64_t u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 8));
      for (int64_t u = b * (BLK / 8); u < u1; ++u)
        for (int l = 0; l < 16; ++l)
          for (int j = 0; j < 4; ++j) {
            const uint8_t v = wt[u * 64 + 4 * l + j];
            lo_acc[l] += (int32_t)(v & 15) * P[c]->xq[u * 8 + j];
            hi_acc[l] += (int32_t)(v & 0xF0) * P[c]->xq[u * 8 + 4 + j];
          }
      const int64_t sb = W.sidx(t, W.gt[b]);
      for (int l = 0; l < 16; ++l)
        accf[l] = std::fma((float)(lo_acc[l] + (hi_acc[l] >> 4)), scale_at<HS>(W, sb + l) * P[c]->sx[b], accf[l]);
    }
    std::memcpy(out[c], accf, sizeof(accf));
  }
}

template <int C, bool HS>
inline void tile_i8(const WMat& W, int64_t t, const Prep* const* P, float (*out)[16]) {
  const uint8_t* wt = W.tile(t);
  const int64_t sb = W.sidx(t);
  const int64_t nb = (W.in + BLK - 1) / BLK;
  for (int c = 0; c < C; ++c) {
    float accf[16] = {0};
    for (int64_t b = 0; b < nb; ++b) {
      int32_t acc[16] = {0};
      const int64_t u1 = std::min<int64_t>(W.units, (b + 1) * (BLK / 4));
      for (int64_t u = b * (BLK / 4); u < u1; ++u)
        for (int l = 0; l < 16; ++l)
          for (int j = 0; j < 4; ++j) {
            int32_t w = (int8_t)wt[u * 64 + 4 * l + j];
            if ((P[c]->neg[u] >> j) & 1) w = -w;
            acc[l] += w * P[c]->xa[u * 4 + j];
          }
      for (int l = 0; l < 16; ++l) accf[l] = std::fma((float)acc[l], P[c]->sx[b], accf[l]);
    }
    for (int l = 0; l < 16; ++l) out[c][l] = accf[l] * scale_at<HS>(W, sb + l);
  }
}
#endif

// tiles [t0, t1) of a quantized W against tokens preps[0..n) -> ys[i][rows of the tiles], 4 tokens at a time, then 3 or
// 2, then 1 (a token's result is the same whatever group it is in: exact integer sums, per-lane float operations)
template <bool HS>          // HS: f16 scales (a template argument: no branch in the tile loops)
void gemm_tiles_t(const WMat& W, int64_t t0, int64_t t1, const Prep* const* preps, int64_t n, float* const* ys) {
  alignas(64) float tmp[4][16];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t rows = std::min<int64_t>(16, W.out - 16 * t);
    auto put = [&](int64_t i, int nc) {
      for (int c = 0; c < nc; ++c) std::memcpy(ys[i + c] + 16 * t, tmp[c], rows * sizeof(float));
    };
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      W.fmt == kI4 ? tile_i4<4, HS>(W, t, preps + i, tmp) : tile_i8<4, HS>(W, t, preps + i, tmp);
      put(i, 4);
    }
    if (n - i == 3) {           // (a 3-token pass: 1.37x a 2- and a 1-token one on AVX2, measured)
      W.fmt == kI4 ? tile_i4<3, HS>(W, t, preps + i, tmp) : tile_i8<3, HS>(W, t, preps + i, tmp);
      put(i, 3);
      i += 3;
    }
    if (i + 2 <= n) {           // (a 2-token pass: 1.45x two 1-token ones on AVX2, measured)
      W.fmt == kI4 ? tile_i4<2, HS>(W, t, preps + i, tmp) : tile_i8<2, HS>(W, t, preps + i, tmp);
      put(i, 2);
      i += 2;
    }
    for (; i < n; ++i) {
      W.fmt == kI4 ? tile_i4<1, HS>(W, t, preps + i, tmp) : tile_i8<1, HS>(W, t, preps + i, tmp);
      put(i, 1);
    }
  }
}

// output rows [r0, r1) (multiples of 16 for quantized formats, except at the end) against n tokens
void gemm(const WMat& W, int64_t r0, int64_t r1, const Prep* const* preps, int64_t n, float* const* ys) {
  if (W.fmt == kF32) return gemm_float<false>(W, r0, r1, preps, n, ys);
  if (W.fmt == kBF16) return gemm_float<true>(W, r0, r1, preps, n, ys);
  if (W.half) return gemm_tiles_t<true>(W, r0 / 16, (r1 + 15) / 16, preps, n, ys);
  gemm_tiles_t<false>(W, r0 / 16, (r1 + 15) / 16, preps, n, ys);
}

// ------------------------------------------------------------------------------------------------ threads
struct ParState {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0;
  std::function<void(int64_t)> fn;
};

// Take tasks of 0..n off `next` until none is left, counting each finished one in `done` (both paths below).
void claim_tasks(std::atomic<int64_t>& next, std::atomic<int64_t>& done, int64_t n,
                 const std::function<void(int64_t)>& fn) {
  for (;;) {
    int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) return;
    fn(i);
    done.fetch_add(1, std::memory_order_release);
  }
}

void run_tasks(ParState* st) { claim_tasks(st->next, st->done, st->n, st->fn); }

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A wait on another thread's progress: a poll is a pause; every 16th poll reads the clock (``t``) and, past the first
// kYieldAfterNs, yields the CPU instead.
// With as many runnable threads as cores or more (2 vCPUs: a kernel's caller, its helper, the Python thread of the
// streamed layer loop, XLA's own threads), a pure spin can hold the very CPU that the thread it waits for was preempted
// from, until the scheduler's time slice ends: 8-12 ms stalls of a 1.5 ms MoE call, 13-17 of them in 64 tokens of the
// GLM-4.5-Air slice's fetch=loop decode (jax.profiler; docs/kernels.md).  A yield returns at once where nothing else is
// runnable, so a free machine loses nothing.
constexpr int64_t kYieldAfterNs = 20000;
struct Backoff {
  int64_t t0 = now_ns(), t = t0;        // the wait's start, the clock's last reading
  int polls = 0;
  void wait() {
    if ((++polls & 15) != 0) { _mm_pause(); return; }
    t = now_ns();
    if (t - t0 < kYieldAfterNs) _mm_pause(); else std::this_thread::yield();
  }
};

// The pool path: fn(0..n) on the calling thread plus up to threads-1 helpers scheduled on XLA's pool for this call.
// Helpers that start late find no task left and return; the caller waits only for tasks that were taken (never for a
// helper to start).
void parallel_for_pool(ffi::ThreadPool* pool, int helpers, int64_t n, std::function<void(int64_t)>& fn) {
  auto st = std::make_shared<ParState>();
  st->n = n;
  st->fn = std::move(fn);
  for (int h = 0; h < helpers; ++h) pool->Schedule([st]() { run_tasks(st.get()); });
  run_tasks(st.get());
  Backoff b;
  while (st->done.load(std::memory_order_acquire) < n) b.wait();
}

// Sticky helpers.  A decode step makes ~25 native calls of 20-600 us with a few us of XLA ops between them; a helper
// scheduled per call costs a pool hand-off each time, and one that went to sleep between calls ~40 us to wake (seen in
// a jax.profiler trace of b's decode: the MoE seam's third phase started 40 us after its second).  So a helper, once
// its call is done, keeps spinning on XLA's pool thread for the next call for up to g_spin_ns, and the next call
// schedules only the helpers that are not already waiting.  One call at a time goes through them (a try-lock; a
// concurrent call takes the pool path).  Who runs a task never changes what it computes, so results are bitwise those
// of the pool path (tests/test_kernels.py runs both).
struct Sticky {
  std::mutex m;                         // held by the call whose tasks the helpers run
  std::atomic<uint64_t> state{0};       // (call number << 1) | open
  std::atomic<int> active{0};           // helpers inside the open call
  std::atomic<int> waiting{0};          // helpers spinning for the next call
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0;
  const std::function<void(int64_t)>* fn = nullptr;
};
Sticky g_sticky;
std::atomic<int64_t> g_spin_ns{100000};

void sticky_run(Sticky* S) { claim_tasks(S->next, S->done, S->n, *S->fn); }

// Join call `s` if it is still open: registered in `active` first, so the caller (which closes, then waits for
// active == 0) cannot return while this helper reads its fn.
void sticky_join(Sticky* S, uint64_t s) {
  S->active.fetch_add(1, std::memory_order_seq_cst);
  if (S->state.load(std::memory_order_seq_cst) == s) sticky_run(S);
  S->active.fetch_sub(1, std::memory_order_seq_cst);
}

void sticky_helper(Sticky* S, uint64_t s) {
  sticky_join(S, s);
  uint64_t last = s;
  S->waiting.fetch_add(1, std::memory_order_seq_cst);
  Backoff b;                            // waiting: past 20 us the CPU goes to whatever else is runnable
  for (;;) {
    uint64_t c = S->state.load(std::memory_order_acquire);
    if ((c & 1) && c != last) {
      S->waiting.fetch_sub(1, std::memory_order_seq_cst);
      sticky_join(S, c);
      last = c;
      S->waiting.fetch_add(1, std::memory_order_seq_cst);
      b = Backoff();
      continue;
    }
    b.wait();
    if (b.t - b.t0 > g_spin_ns.load(std::memory_order_relaxed)) break;
  }
  S->waiting.fetch_sub(1, std::memory_order_seq_cst);
  uint64_t c = S->state.load(std::memory_order_seq_cst);   // a call opened as this helper stopped waiting
  if ((c & 1) && c != last) sticky_join(S, c);
}

// Run fn(0..n) on the calling thread plus up to threads-1 helpers from XLA's pool.
void parallel_for(ffi::ThreadPool* pool, int threads, int64_t n, std::function<void(int64_t)> fn) {
  if (n <= 0) return;
  if (pool == nullptr || threads <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  const int helpers = (int)std::min<int64_t>(threads - 1, n - 1);
  Sticky* S = &g_sticky;
  std::unique_lock<std::mutex> lk(S->m, std::try_to_lock);
  if (!lk.owns_lock() || g_spin_ns.load(std::memory_order_relaxed) <= 0) {
    if (lk.owns_lock()) lk.unlock();
    return parallel_for_pool(pool, helpers, n, fn);
  }
  S->n = n;
  S->fn = &fn;
  S->next.store(0, std::memory_order_relaxed);
  S->done.store(0, std::memory_order_relaxed);
  const uint64_t s = (((S->state.load(std::memory_order_relaxed) >> 1) + 1) << 1) | 1;
  S->state.store(s, std::memory_order_seq_cst);
  for (int h = S->waiting.load(std::memory_order_seq_cst); h < helpers; ++h)
    pool->Schedule([S, s]() { sticky_helper(S, s); });
  sticky_run(S);
  Backoff b;
  while (S->done.load(std::memory_order_acquire) < n) b.wait();
  S->state.store(s & ~(uint64_t)1, std::memory_order_seq_cst);
  Backoff b2;
  while (S->active.load(std::memory_order_seq_cst) > 0) b2.wait();
}

int pool_threads(ffi::ThreadPool& pool) {
  int64_t n = pool.num_threads();
  return (int)std::max<int64_t>(1, std::min<int64_t>(n, 64));
}

constexpr double kParallelMacs = 3e5;   // below this a call runs on one thread (the hand-off costs more)

// row chunks for ``threads`` workers: about 4 tasks per thread, multiples of 16 rows (one tile) at least
int64_t row_chunk(int64_t rows, int threads, int64_t per) {
  int64_t want = std::max<int64_t>(1, per);
  return std::max<int64_t>(16, ceil_to((rows + want - 1) / want, 16));
}

ffi::Error check_fmt(int32_t fmt, int64_t in, int64_t G) {
  if (fmt < kF32 || fmt > kI4) return ffi::Error::InvalidArgument("glmjax: unknown weight format");
  if (fmt == kI4) {
    if (in % 2) return ffi::Error::InvalidArgument("glmjax: int4 needs an even input dimension");
    if (G < in && G % BLK) return ffi::Error::InvalidArgument("glmjax: int4 group size must be a multiple of 64");
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------ qlinear
// A scale buffer's element type: f32 or f16 (quantized formats; a float format's placeholder is f32)
ffi::Error scale_type(const char* who, const ffi::AnyBuffer& s, bool* half) {
  *half = s.element_type() == ffi::DataType::F16;
  if (!*half && s.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(who) + ": scales must be f32 or f16");
  return ffi::Error::Success();
}

// y[g] = x[g] @ W[g]^T for Gn matrices one after another in their layout (mb bytes each; scales sstride elements
// each, f16 where `half`): x [Gn, T, in], y [Gn, T, out].  rm (optional, T entries, Gn == 1): rm[t] == 0 marks a padding row, skipped
// (its output is 0).  Every row is prepared and multiplied the same way whatever Gn, so a group's rows are bitwise a
// call on that group alone.
ffi::Error qlinear_groups(ffi::ThreadPool& pool, const char* who, const float* xp, const void* wq, size_t w_bytes,
                          const void* sp, bool half, int64_t sstride, int64_t ng, float* yp, int32_t fmt, int64_t group,
                          int64_t Gn, int64_t T, int64_t in, int64_t out, const int32_t* rm) {
  if (auto e = check_fmt(fmt, in, group > 0 ? group : in); !e.success()) return e;
  const int64_t mb = matrix_bytes(fmt, out, in);
  if ((int64_t)w_bytes != Gn * mb)
    return ffi::Error::InvalidArgument(std::string(who) + ": weight size does not match the format and shape");
  std::vector<WMat> Ws;
  Ws.reserve(Gn);
  for (int64_t g = 0; g < Gn; ++g)
    Ws.push_back(make_wmat((const uint8_t*)wq + g * mb, scale_ptr(sp, half, g * sstride), half, fmt,
                           out, in, ng, group));
  PrepLayout L = prep_layout(fmt, in);
  std::vector<uint8_t> pbuf(std::max<int64_t>(1, L.bytes * Gn * T) + 64);
  uint8_t* pb = (uint8_t*)(((uintptr_t)pbuf.data() + 63) & ~(uintptr_t)63);
  std::vector<Prep> preps(Gn * T);
  std::vector<const Prep*> pp;
  std::vector<float*> ys;
  for (int64_t i = 0; i < Gn * T; ++i) {
    if (rm != nullptr && rm[i] == 0) {
      std::memset(yp + i * out, 0, sizeof(float) * out);
      continue;
    }
    prep_row(fmt, xp + i * in, in, L, pb + i * L.bytes, &preps[i]);
    pp.push_back(&preps[i]);
    ys.push_back(yp + i * out);
  }
  const int64_t n = (int64_t)pp.size(), per = n / Gn;     // rows a group (all of them where Gn > 1)
  double macs = (double)n * out * in;
  int threads = macs >= kParallelMacs ? pool_threads(pool) : 1;
  // whole groups per task where there are enough of them, else row chunks of each
  const int64_t chunk = Gn >= 4 * threads ? ceil_to(out, 16) : row_chunk(out, threads, (4 * threads + Gn - 1) / Gn);
  const int64_t nchunks = (out + chunk - 1) / chunk;
  parallel_for(&pool, threads, Gn * nchunks, [&](int64_t k) {
    const int64_t g = k / nchunks, c = k % nchunks;
    gemm(Ws[g], c * chunk, std::min(out, (c + 1) * chunk), pp.data() + g * per, per, ys.data() + g * per);
  });
  return ffi::Error::Success();
}

ffi::Error QLinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t fmt, int64_t group,
                       int64_t out) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("glmjax_qlinear: rank");
  const int64_t T = xd[0], in = xd[1];
  auto sd = s.dimensions();
  const int64_t ng = is_float(fmt) ? 1 : sd[sd.size() - 2];
  const bool all_rows = rows.element_count() != (size_t)T;
  bool half = false;
  if (auto e = scale_type("glmjax_qlinear", s, &half); !e.success()) return e;
  return qlinear_groups(pool, "glmjax_qlinear", x.typed_data(), w.untyped_data(), w.size_bytes(), s.untyped_data(),
                        half, 0, ng, y->typed_data(), fmt, group, 1, T, in, out, all_rows ? nullptr : rows.typed_data());
}

// G independent products y[g] = x[g] @ W[g]^T (x [G, T, in], W G matrices [out, in] one after another in their
// layout, scales likewise; y [G, T, out]): MLA's absorbed per-head products (W_UK^T, W_UV), a group's rows bitwise
// one glmjax_qlinear call on that group.
ffi::Error QLinearGroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                              ffi::ResultBuffer<ffi::F32> y, int32_t fmt, int64_t group, int64_t out) {
  auto xd = x.dimensions();
  if (xd.size() != 3) return ffi::Error::InvalidArgument("glmjax_qlinear_grouped: rank");
  const int64_t Gn = xd[0], T = xd[1], in = xd[2];
  auto sd = s.dimensions();
  const int64_t ng = is_float(fmt) ? 1 : sd[sd.size() - 2];
  const int64_t sstride = is_float(fmt) ? 0 : (int64_t)s.element_count() / std::max<int64_t>(1, Gn);
  bool half = false;
  if (auto e = scale_type("glmjax_qlinear_grouped", s, &half); !e.success()) return e;
  return qlinear_groups(pool, "glmjax_qlinear_grouped", x.typed_data(), w.untyped_data(), w.size_bytes(),
                        s.untyped_data(), half, sstride, ng, y->typed_data(), fmt, group, Gn, T, in, out, nullptr);
}

// ------------------------------------------------------------------------------------------------ MoE seam
inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// The cache's elements: f32, or f16 (--kv_cache_dtype; the default where compute is f32), each converted exactly to
// f32 before use, so an f16 cache gives bitwise the f32 kernel's numbers over the same values widened to f32.
inline float kv_at(const float* p, int64_t i) { return p[i]; }
inline float kv_at(const uint16_t* p, int64_t i) { return half_to_float(p[i]); }
#if GLMJAX_VNNI
inline __m512 kv16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 kv16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif GLMJAX_AVX2
inline __m256 kv8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 kv8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  alignas(32) float f[8];
  for (int l = 0; l < 8; ++l) f[l] = half_to_float(p[l]);
  return _mm256_load_ps(f);
#endif
}
#endif

// y += w x, one fma per element (AVX-512: 16 lanes at a time, AVX2: 8, the same fma each); x f32, or f16 widened
// exactly (kv_at / kv16 / kv8)
template <typename KV>
inline void axpy(float w, const KV* x, float* y, int64_t n) {
  int64_t i = 0;
#if GLMJAX_VNNI
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, kv16(x + i), _mm512_loadu_ps(y + i)));
#elif GLMJAX_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, kv8(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] = std::fma(w, kv_at(x, i), y[i]);
}

// y = x widened to f32, exactly (the values kv_at / kv16 / kv8 give)
template <typename KV>
inline void widen(const KV* x, float* y, int64_t n) {
  int64_t i = 0;
#if GLMJAX_VNNI
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, kv16(x + i));
#elif GLMJAX_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, kv8(x + i));
#endif
  for (; i < n; ++i) y[i] = kv_at(x, i);
}

// clamp: the SwiGLU clamp (glmjax_moe_clamped): act = silu(min(gate, limit)) * min(max(up, -limit), limit), a NaN
// kept as NaN (torch's clamp); without it the act is today's silu(gate) * up, the same instructions.
ffi::Error MoeRun(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                  ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gu, ffi::AnyBuffer gus, ffi::AnyBuffer dn,
                  ffi::AnyBuffer dns, ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int64_t gu_group,
                  int64_t dn_group, int32_t mode, int64_t inter, bool clamp, float limit) {
  auto xd = x.dimensions(), sd = slots.dimensions(), gd = gu.dimensions(), dd = dn.dimensions();
  if (xd.size() != 2 || sd.size() != 2 || gd.size() < 2 || dd.size() < 2)
    return ffi::Error::InvalidArgument("glmjax_moe: rank");
  const int64_t T = xd[0], H = xd[1], K = sd[1], S = gd[0], I = inter, I2 = 2 * inter;
  if (sd[0] != T || dd[0] != S) return ffi::Error::InvalidArgument("glmjax_moe: shapes");
  if (auto e = check_fmt(fmt, H, gu_group > 0 ? gu_group : H); !e.success()) return e;
  if (auto e = check_fmt(fmt, I, dn_group > 0 ? dn_group : I); !e.success()) return e;
  const int64_t gu_slot = matrix_bytes(fmt, I2, H), dn_slot = matrix_bytes(fmt, H, I);
  if ((int64_t)gu.size_bytes() != S * gu_slot || (int64_t)dn.size_bytes() != S * dn_slot)
    return ffi::Error::InvalidArgument("glmjax_moe: expert bank size does not match the format and shapes");
  const bool quant = !is_float(fmt);
  auto gsd = gus.dimensions(), dsd = dns.dimensions();
  const int64_t gng = quant ? gsd[gsd.size() - 2] : 1, dng = quant ? dsd[dsd.size() - 2] : 1;
  const int64_t gs_slot = quant ? (int64_t)gus.element_count() / S : 0;
  const int64_t ds_slot = quant ? (int64_t)dns.element_count() / S : 0;
  const uint8_t* gq = (const uint8_t*)gu.untyped_data();
  const uint8_t* dq = (const uint8_t*)dn.untyped_data();
  bool ghalf = false, dhalf = false;
  if (auto e = scale_type("glmjax_moe", gus, &ghalf); !e.success()) return e;
  if (auto e = scale_type("glmjax_moe", dns, &dhalf); !e.success()) return e;
  const void* gs = gus.untyped_data();
  const void* ds = dns.untyped_data();
  const int32_t* sl = slots.typed_data();
  const float* wt = weights.typed_data();
  const float* xp = x.typed_data();
  float* op = out->typed_data();

  // pairs (t, k) grouped by slot (counting sort: pairs of one slot in (t, k) order)
  std::vector<int64_t> cnt(S + 1, 0);
  int64_t P = 0;
  for (int64_t i = 0; i < T * K; ++i)
    if (sl[i] >= 0 && sl[i] < S) cnt[sl[i] + 1]++, P++;
  for (int64_t s = 0; s < S; ++s) cnt[s + 1] += cnt[s];
  std::vector<int64_t> order(P), pos(T * K, -1);
  {
    std::vector<int64_t> fill(cnt.begin(), cnt.end() - 1);
    for (int64_t i = 0; i < T * K; ++i)
      if (sl[i] >= 0 && sl[i] < S) {
        pos[i] = fill[sl[i]];
        order[fill[sl[i]]++] = i;
      }
  }
  struct Grp { int64_t slot, p0, n; };
  std::vector<Grp> groups;
  for (int64_t s = 0; s < S; ++s)
    if (cnt[s + 1] > cnt[s]) groups.push_back({s, cnt[s], cnt[s + 1] - cnt[s]});

  if (mode == 1) std::memset(op, 0, sizeof(float) * T * K * H);
  else std::memset(op, 0, sizeof(float) * T * H);
  if (P == 0) return ffi::Error::Success();

  // scratch: token preps for gate_up, h [P, 2I], act [P, I] + preps for down, y [P, H]
  PrepLayout Lg = prep_layout(fmt, H), Ld = prep_layout(fmt, I);
  std::vector<uint8_t> buf_g(std::max<int64_t>(1, Lg.bytes * T) + 64), buf_d(std::max<int64_t>(1, Ld.bytes * P) + 64);
  uint8_t* pg = (uint8_t*)(((uintptr_t)buf_g.data() + 63) & ~(uintptr_t)63);
  uint8_t* pd = (uint8_t*)(((uintptr_t)buf_d.data() + 63) & ~(uintptr_t)63);
  std::vector<float> h((size_t)P * I2), act((size_t)P * I), y(mode == 1 ? 0 : (size_t)P * H);
  std::vector<Prep> tprep(T), aprep(P);
  std::vector<char> tused(T, 0);
  for (int64_t q = 0; q < P; ++q) tused[order[q] / K] = 1;
  for (int64_t t = 0; t < T; ++t)
    if (tused[t]) prep_row(fmt, xp + t * H, H, Lg, pg + t * Lg.bytes, &tprep[t]);

  double macs = (double)P * 3 * I * H;
  int threads = macs >= kParallelMacs ? pool_threads(pool) : 1;
  // tasks: (group, row chunk); chunks sized so that there are >= ~4 tasks per thread
  auto make_tasks = [&](int64_t rows, std::vector<std::array<int64_t, 3>>& tasks) {
    int64_t per_group = std::max<int64_t>(1, (4 * threads + (int64_t)groups.size() - 1) / (int64_t)groups.size());
    int64_t chunk = row_chunk(rows, threads, per_group);
    for (int64_t g = 0; g < (int64_t)groups.size(); ++g)
      for (int64_t r = 0; r < rows; r += chunk) tasks.push_back({g, r, std::min(rows, r + chunk)});
  };
  std::vector<std::array<int64_t, 3>> ta, tc;
  make_tasks(I2, ta);
  make_tasks(H, tc);

  auto task_a = [&](int64_t i) {     // h = gate_up(x)
    const Grp& g = groups[ta[i][0]];
    WMat W = make_wmat(gq + g.slot * gu_slot, quant ? scale_ptr(gs, ghalf, g.slot * gs_slot) : nullptr, ghalf, fmt,
                       I2, H, gng, gu_group);
    std::vector<const Prep*> pp(g.n);
    std::vector<float*> ys(g.n);
    for (int64_t j = 0; j < g.n; ++j) {
      int64_t q = g.p0 + j;
      pp[j] = &tprep[order[q] / K];
      ys[j] = h.data() + q * I2;
    }
    gemm(W, ta[i][1], ta[i][2], pp.data(), g.n, ys.data());
  };
  auto act_rows = [&](int64_t q0, int64_t q1) {   // act = silu(gate) * up, prepared for down
    for (int64_t q = q0; q < q1; ++q) {
      const float* hq = h.data() + q * I2;
      float* a = act.data() + q * I;
      if (clamp)
        for (int64_t i = 0; i < I; ++i) a[i] = silu(std::min(hq[i], limit)) * std::clamp(hq[I + i], -limit, limit);
      else
        for (int64_t i = 0; i < I; ++i) a[i] = silu(hq[i]) * hq[I + i];
      prep_row(fmt, a, I, Ld, pd + q * Ld.bytes, &aprep[q]);
    }
  };
  auto task_c = [&](int64_t i) {     // y = down(act)   (mode 1 writes straight into the [T, K, H] terms)
    const Grp& g = groups[tc[i][0]];
    WMat W = make_wmat(dq + g.slot * dn_slot, quant ? scale_ptr(ds, dhalf, g.slot * ds_slot) : nullptr, dhalf, fmt,
                       H, I, dng, dn_group);
    std::vector<const Prep*> pp(g.n);
    std::vector<float*> ys(g.n);
    for (int64_t j = 0; j < g.n; ++j) {
      int64_t q = g.p0 + j;
      pp[j] = &aprep[q];
      ys[j] = mode == 1 ? op + order[q] * H : y.data() + q * H;
    }
    gemm(W, tc[i][1], tc[i][2], pp.data(), g.n, ys.data());
  };
  if (P * I < 65536) {
    // few rows (decode): one parallel call.  The gate_up tasks come first; the thread that finishes a group's last
    // one computes that group's act, and the group's down tasks (taken after every gate_up task was taken) wait for
    // it.  No barrier between the phases, and no thread idles while another finishes its last gate_up.
    const int64_t G = (int64_t)groups.size(), NA = (int64_t)ta.size();
    std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[G]);
    std::unique_ptr<std::atomic<int>[]> ready(new std::atomic<int>[G]);
    for (int64_t g = 0; g < G; ++g) left[g].store(0, std::memory_order_relaxed), ready[g].store(0);
    for (const auto& t : ta) left[t[0]].fetch_add(1, std::memory_order_relaxed);
    parallel_for(&pool, threads, NA + (int64_t)tc.size(), [&](int64_t i) {
      if (i < NA) {
        task_a(i);
        const int64_t g = ta[i][0];
        if (left[g].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          act_rows(groups[g].p0, groups[g].p0 + groups[g].n);
          ready[g].store(1, std::memory_order_release);
        }
        return;
      }
      const int64_t g = tc[i - NA][0];
      Backoff b;
      while (!ready[g].load(std::memory_order_acquire)) b.wait();
      task_c(i - NA);
    });
  } else {
    parallel_for(&pool, threads, (int64_t)ta.size(), task_a);
    int64_t bchunk = std::max<int64_t>(1, (P + 4 * threads - 1) / (4 * threads));
    parallel_for(&pool, threads, (P + bchunk - 1) / bchunk,
                 [&](int64_t c) { act_rows(c * bchunk, std::min(P, (c + 1) * bchunk)); });
    parallel_for(&pool, threads, (int64_t)tc.size(), task_c);
  }
  if (mode == 1) return ffi::Error::Success();
  // combine in routing order k
  for (int64_t t = 0; t < T; ++t) {
    float* o = op + t * H;
    for (int64_t k = 0; k < K; ++k) {
      int64_t q = pos[t * K + k];
      if (q < 0) continue;
      const float w = wt[t * K + k];
      const float* yq = y.data() + q * H;
      axpy(w, yq, o, H);
    }
  }
  return ffi::Error::Success();
}

ffi::Error MoeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                   ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gu, ffi::AnyBuffer gus, ffi::AnyBuffer dn,
                   ffi::AnyBuffer dns, ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int64_t gu_group,
                   int64_t dn_group, int32_t mode, int64_t inter) {
  return MoeRun(pool, x, slots, weights, gu, gus, dn, dns, out, fmt, gu_group, dn_group, mode, inter, false, 0.f);
}

ffi::Error MoeClampedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                          ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gu, ffi::AnyBuffer gus, ffi::AnyBuffer dn,
                          ffi::AnyBuffer dns, ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int64_t gu_group,
                          int64_t dn_group, int32_t mode, int64_t inter, float limit) {
  if (!(limit > 0.f)) return ffi::Error::InvalidArgument("glmjax_moe_clamped: limit must be > 0");
  return MoeRun(pool, x, slots, weights, gu, gus, dn, dns, out, fmt, gu_group, dn_group, mode, inter, true, limit);
}

// ------------------------------------------------------------------------------------------------ attention
// glmjax_attn: GQA attention of a few query rows over the f32 or f16 K/V cache as it lies, [B, S, nkv, hd] (XLA's dots
// transposed the cache's window into [B, nkv, ...] copies every step: most of a decode step at 1K positions).
//   q [N, nh, hd] (N = B x T rows, row r of batch entry r / T), k, v [B, S, nkv, hd], pos [N] (row r attends to cache
//   positions 0..pos[r]), rows [N] (0: a padding row, its output 0) -> out [N, nh x hd]
// Per (row, head): s_j = (q . k_j) x scale (16 lanes, lane l summing elements d = l mod 16 in order, the lanes then
// added in order), m = max s, e_j = exp(s_j - m), out = (sum_j e_j v_j, j in order) / (sum_j e_j): the same operations
// whatever B, T, the other rows or the thread, in every build (AVX-512: the 16 lanes as one vector, AVX2: as two
// halves, bitwise the portable sums; the AVX-512 build had used the portable loops, 74 us a call at 50 positions on b).
template <typename KV>
inline float dot16(const float* a, const KV* b, int64_t n) {
  alignas(64) float acc[16] = {0};
  int64_t i = 0;
#if GLMJAX_VNNI
  __m512 va = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) va = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), kv16(b + i), va);
  _mm512_store_ps(acc, va);
#elif GLMJAX_AVX2
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv8(b + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), kv8(b + i + 8), hi);
  }
  _mm256_store_ps(acc, lo);
  _mm256_store_ps(acc + 8, hi);
#endif
  for (; i < n; ++i) acc[i % 16] = std::fma(a[i], kv_at(b, i), acc[i % 16]);
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += acc[l];
  return sum;
}

// exp(x) of a softmax (x = a score minus the row's maximum, <= 0): Cephes' expf (range reduction by ln 2 in two
// parts, a degree-5 polynomial, 2^n from the exponent bits; ~1 ulp), the same operations in every build and lane, so
// the vector form gives bitwise the scalar one.  Below -88.37 it is 0 (std::exp: a subnormal).
constexpr float kExpLo = -88.3762626647949f, kLog2e = 1.44269504088896341f, kExpC1 = 0.693359375f,
                kExpC2 = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f,
                            1.6666665459E-1f, 5.0000001201E-1f};
inline float exp_sm(float x) {
  x = std::max(x, kExpLo);
  const float fx = std::floor(std::fma(x, kLog2e, 0.5f));
  const float nfx = 0.f - fx;                     // (as the vector form: 0 - fx)
  x = std::fma(nfx, kExpC1, x);
  x = std::fma(nfx, kExpC2, x);
  const float z = x * x;
  float y = kExpP[0];
  for (int i = 1; i < 6; ++i) y = std::fma(y, x, kExpP[i]);
  y = std::fma(y, z, x) + 1.f;
  const uint32_t bits = (uint32_t)((int32_t)fx + 127) << 23;
  float p2;
  std::memcpy(&p2, &bits, 4);
  return y * p2;
}
#if GLMJAX_VNNI
inline __m512 exp_sm16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(kExpLo), x);      // (lo > x ? lo : x: std::max(x, lo), NaN kept)
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 nfx = _mm512_sub_ps(_mm512_setzero_ps(), fx);
  x = _mm512_fmadd_ps(nfx, _mm512_set1_ps(kExpC1), x);
  x = _mm512_fmadd_ps(nfx, _mm512_set1_ps(kExpC2), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP[i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#endif

#if GLMJAX_VNNI
// r[j][l] -> r[l][j] (16 x 16 floats in 16 registers)
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// One pair's scores at 16 positions: lane j = dot16(q, k_j, hd) x scale, bitwise (each position's 16 lanes as
// dot16 accumulates them, then added in lane order as one column of the transposed accumulators).
inline __m512 scores16(const float* q, const float* kb, int64_t hd, float scale) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < hd; i += 16) {
    const __m512 qi = _mm512_loadu_ps(q + i);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(kb + j * hd + i), a[j]);
  }
  transpose16(a);
  __m512 sum = _mm512_setzero_ps();
  for (int l = 0; l < 16; ++l) sum = _mm512_add_ps(sum, a[l]);
  return _mm512_mul_ps(sum, _mm512_set1_ps(scale));
}
#endif

constexpr int64_t kAttnRows = 4;     // glmjax_attn: rows of one batch entry a task (with every head of a KV group)

template <typename KV>
ffi::Error AttnTyped(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out, int64_t T,
                     float scale) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || v.dimensions().size() != 4) return ffi::Error::InvalidArgument("glmjax_attn: rank");
  const int64_t N = qd[0], nh = qd[1], hd = qd[2], B = kd[0], S = kd[1], nkv = kd[2];
  if (kd[3] != hd || T <= 0 || N != B * T || nkv <= 0 || nh % nkv || (int64_t)pos.element_count() != N ||
      (int64_t)rows.element_count() != N)
    return ffi::Error::InvalidArgument("glmjax_attn: shapes");
  const int64_t g = nh / nkv;
  const float* qp = q.typed_data();
  const KV* kp = (const KV*)k.untyped_data();
  const KV* vp = (const KV*)v.untyped_data();
  const int32_t* ps = pos.typed_data();
  const int32_t* rm = rows.typed_data();
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * N * nh * hd);
  // A task: one batch entry's KV head and up to kAttnRows of its rows, every query head of the group (g x rows
  // pairs).  Each cached key / value row is widened to f32 once per task and used by all of its pairs (a prefill
  // block's 32 rows x 12 heads of GLM-4.5-Air had read and widened it 384 times); each pair's sums are the ones above,
  // in the same order, so the result does not depend on which pairs share a task.
  struct Task { int64_t b, n, t0, t1; };
  std::vector<Task> tasks;
  double work = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 < T; t0 += kAttnRows) {
      const int64_t t1 = std::min<int64_t>(T, t0 + kAttnRows);
      bool any = false;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = b * T + t;
        if (rm[r] && ps[r] >= 0) {
          any = true;
          work += (double)nh * std::min<int64_t>(S, (int64_t)ps[r] + 1) * hd * 2;
        }
      }
      if (any)
        for (int64_t n = 0; n < nkv; ++n) tasks.push_back({b, n, t0, t1});
    }
  const int threads = work >= kParallelMacs ? pool_threads(pool) : 1;
  const int64_t per = std::max<int64_t>(1, (int64_t)tasks.size() / (4 * threads));
  parallel_for(&pool, threads, ((int64_t)tasks.size() + per - 1) / per, [&](int64_t c) {
    std::vector<float> sc, mx, den, kb;
    std::vector<int64_t> pr, len;                  // the task's pairs: row x nh + head, and positions attended
    for (int64_t ti = c * per; ti < std::min<int64_t>((int64_t)tasks.size(), (c + 1) * per); ++ti) {
      const Task& tk = tasks[ti];
      const int64_t b = tk.b, n = tk.n;
      pr.clear();
      len.clear();
      int64_t Lmax = 0;
      for (int64_t t = tk.t0; t < tk.t1; ++t) {
        const int64_t r = b * T + t;
        if (!rm[r] || ps[r] < 0) continue;
        const int64_t L = std::min<int64_t>(S, (int64_t)ps[r] + 1);
        for (int64_t h = n * g; h < (n + 1) * g; ++h) {
          pr.push_back(r * nh + h);
          len.push_back(L);
        }
        Lmax = std::max(Lmax, L);
      }
      const int64_t P = (int64_t)pr.size();
      const int64_t Lp = (Lmax + 15) / 16 * 16;
      sc.resize(P * Lp);
      mx.assign(P, -INFINITY);
      den.assign(P, 0.f);
      kb.resize(16 * hd);
#if GLMJAX_VNNI
      const bool blocks = hd % 16 == 0;           // one pair's 16 scores / outputs from one register block
#endif
      // 16 positions at a time: their K (then V) rows widened once (exact: f16 widened, f32 as it is) and used by
      // every pair; each pair's operations are the same in every build and path, in the same order
      for (int64_t j0 = 0; j0 < Lmax; j0 += 16) {
        const int64_t nj = std::min<int64_t>(16, Lmax - j0);
        for (int64_t j = 0; j < 16; ++j)
          if (j < nj) widen(kp + ((b * S + j0 + j) * nkv + n) * hd, kb.data() + j * hd, hd);
          else std::memset(kb.data() + j * hd, 0, sizeof(float) * hd);
        for (int64_t p = 0; p < P; ++p) {
          const int64_t m = std::min<int64_t>(nj, len[p] - j0);
          if (m <= 0) continue;
          float* sp = sc.data() + p * Lp + j0;
#if GLMJAX_VNNI
          if (blocks) _mm512_storeu_ps(sp, scores16(qp + pr[p] * hd, kb.data(), hd, scale));
          else
#endif
            for (int64_t j = 0; j < m; ++j) sp[j] = dot16(qp + pr[p] * hd, kb.data() + j * hd, hd) * scale;
          for (int64_t j = 0; j < m; ++j) mx[p] = std::max(mx[p], sp[j]);
        }
      }
      alignas(64) float e[16];
      for (int64_t j0 = 0; j0 < Lmax; j0 += 16) {
        const int64_t nj = std::min<int64_t>(16, Lmax - j0);
        for (int64_t j = 0; j < nj; ++j) widen(vp + ((b * S + j0 + j) * nkv + n) * hd, kb.data() + j * hd, hd);
        for (int64_t p = 0; p < P; ++p) {
          const int64_t m = std::min<int64_t>(nj, len[p] - j0);
          if (m <= 0) continue;
          const float* sp = sc.data() + p * Lp + j0;
#if GLMJAX_VNNI
          _mm512_store_ps(e, exp_sm16(_mm512_sub_ps(_mm512_loadu_ps(sp), _mm512_set1_ps(mx[p]))));
#else
          for (int64_t j = 0; j < m; ++j) e[j] = exp_sm(sp[j] - mx[p]);
#endif
          for (int64_t j = 0; j < m; ++j) den[p] += e[j];
          float* o = op + pr[p] * hd;
#if GLMJAX_VNNI
          if (blocks) {          // the output row in registers: axpy's fma per element, in the order of j
            for (int64_t i = 0; i < hd; i += 16) {
              __m512 oi = _mm512_loadu_ps(o + i);
              for (int64_t j = 0; j < m; ++j)
                oi = _mm512_fmadd_ps(_mm512_set1_ps(e[j]), _mm512_loadu_ps(kb.data() + j * hd + i), oi);
              _mm512_storeu_ps(o + i, oi);
            }
            continue;
          }
#endif
          for (int64_t j = 0; j < m; ++j) axpy(e[j], kb.data() + j * hd, o, hd);
        }
      }
      for (int64_t p = 0; p < P; ++p) {
        float* o = op + pr[p] * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] /= den[p];
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error AttnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out, int64_t T,
                    float scale) {
  if (k.element_type() != v.element_type()) return ffi::Error::InvalidArgument("glmjax_attn: k and v dtypes differ");
  if (k.element_type() == ffi::DataType::F32) return AttnTyped<float>(pool, q, k, v, pos, rows, out, T, scale);
  if (k.element_type() == ffi::DataType::F16) return AttnTyped<uint16_t>(pool, q, k, v, pos, rows, out, T, scale);
  return ffi::Error::InvalidArgument("glmjax_attn: the K/V cache must be f32 or f16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxQLinear, QLinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("out"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxQLinearGrouped, QLinearGroupedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("out"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxAttn, AttnImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("T")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxMoe, MoeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("gu_group")
                                  .Attr<int64_t>("dn_group")
                                  .Attr<int32_t>("mode")
                                  .Attr<int64_t>("inter"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxMoeClamped, MoeClampedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("gu_group")
                                  .Attr<int64_t>("dn_group")
                                  .Attr<int32_t>("mode")
                                  .Attr<int64_t>("inter")
                                  .Attr<float>("limit"));

extern "C" int glmjax_has_vnni() { return GLMJAX_VNNI; }

// How long (ns) a sticky helper waits for the next call; 0: every call schedules its own helpers (the pool path).
// Returns the previous value.  For the kernel tests and the benches' A/B; the engine keeps the default.
extern "C" int64_t glmjax_set_spin_ns(int64_t ns) { return g_spin_ns.exchange(ns < 0 ? 0 : ns); }

// ---------------------------------------------------------------------------------------------- Stream sink
// The scheduler's fused decode loop (one compiled while loop, many steps) streams its tokens through a sink: every
// --stream_interval steps the loop calls glmjax_sink(slot, out [C, B], cnt [B], final) which copies the tokens so far
// into the slot's snapshot, wakes the host thread waiting in glmjax_sink_wait, and returns the stop flags [B] and the
// break flag the host last set (glmjax_sink_set).  The loop never waits for the host: a host slower than the steps
// sees the latest snapshot (several steps' tokens at once), and a stop it sets takes effect at the next call.  The
// final call (after the loop, final=1) marks the snapshot done.  Python's io_callback did the same at ~2 ms a call
// (the GIL, argument transfers); this is a copy of a few hundred bytes.
namespace {
struct Sink {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> out, cnt;
  std::vector<uint8_t> stop;
  uint8_t brk = 0;
  int64_t seq = 0;
  bool done = false;
};
std::mutex g_sinks_mu;
std::map<int32_t, std::shared_ptr<Sink>> g_sinks;
int32_t g_next_slot = 1;

std::shared_ptr<Sink> find_sink(int32_t slot) {
  std::lock_guard<std::mutex> g(g_sinks_mu);
  auto it = g_sinks.find(slot);
  return it == g_sinks.end() ? nullptr : it->second;
}

ffi::Error SinkImpl(ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> out, ffi::Buffer<ffi::S32> cnt,
                    ffi::Result<ffi::Buffer<ffi::PRED>> stop, ffi::Result<ffi::Buffer<ffi::PRED>> brk,
                    int32_t final_call) {
  const int64_t B = cnt.element_count(), N = out.element_count();
  bool* st = stop->typed_data();
  std::fill(st, st + B, false);
  *brk->typed_data() = false;
  auto s = find_sink(slot.typed_data()[0]);
  if (!s) return ffi::Error::Success();          // nobody listens (a closed scheduler): the loop runs on
  {
    std::lock_guard<std::mutex> g(s->mu);
    s->out.assign(out.typed_data(), out.typed_data() + N);
    s->cnt.assign(cnt.typed_data(), cnt.typed_data() + B);
    s->seq += 1;
    if (final_call) s->done = true;
    for (int64_t i = 0; i < B && i < (int64_t)s->stop.size(); ++i) st[i] = s->stop[i] != 0;
    *brk->typed_data() = s->brk != 0;
  }
  s->cv.notify_all();
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxSink, SinkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int32_t>("final_call"));

extern "C" int32_t glmjax_sink_open() {
  std::lock_guard<std::mutex> g(g_sinks_mu);
  int32_t slot = g_next_slot++;
  g_sinks[slot] = std::make_shared<Sink>();
  return slot;
}

extern "C" void glmjax_sink_close(int32_t slot) {
  std::lock_guard<std::mutex> g(g_sinks_mu);
  g_sinks.erase(slot);
}

// Before a dispatch: no snapshot, not done, no stops (B rows).
extern "C" int glmjax_sink_reset(int32_t slot, int64_t B) {
  auto s = find_sink(slot);
  if (!s) return -1;
  std::lock_guard<std::mutex> g(s->mu);
  s->out.clear();
  s->cnt.clear();
  s->stop.assign(B, 0);
  s->brk = 0;
  s->seq = 0;
  s->done = false;
  return 0;
}

// Wait (the GIL released by ctypes) until a snapshot newer than `seen` or `timeout_ms`; copy it into out [n_out] /
// cnt [n_cnt].  Returns the snapshot's sequence number (0: none yet / timed out with nothing new), negated when the
// loop has made its final call; *done too.
extern "C" int64_t glmjax_sink_wait(int32_t slot, int64_t seen, int64_t timeout_ms, int32_t* out, int64_t n_out,
                                    int32_t* cnt, int64_t n_cnt, int32_t* done) {
  auto s = find_sink(slot);
  *done = 0;
  if (!s) return 0;
  std::unique_lock<std::mutex> g(s->mu);
  s->cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [&] { return s->seq > seen; });
  if (s->seq <= seen) return 0;
  std::memcpy(out, s->out.data(), sizeof(int32_t) * std::min<int64_t>(n_out, s->out.size()));
  std::memcpy(cnt, s->cnt.data(), sizeof(int32_t) * std::min<int64_t>(n_cnt, s->cnt.size()));
  *done = s->done ? 1 : 0;
  return s->seq;
}

// The host's answer, read by the loop's next call: rows to stop [B] (kept once set) and whether to end the loop.
extern "C" void glmjax_sink_set(int32_t slot, const uint8_t* stop, int64_t B, int32_t brk) {
  auto s = find_sink(slot);
  if (!s) return;
  std::lock_guard<std::mutex> g(s->mu);
  for (int64_t i = 0; i < B && i < (int64_t)s->stop.size(); ++i) s->stop[i] |= stop[i];
  s->brk |= brk ? 1 : 0;
}
