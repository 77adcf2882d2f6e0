// glm-jax native CPU kernels, registered with XLA through jax.ffi (they run inside the jitted step).
//
//   glmjax_qlinear : y[T, out] = x[T, in] @ W[out, in]^T          (W in one storage format, see below)
//   glmjax_moe     : the MoE seam: for every valid (t, k), e = slots[t, k]:
//                      y_tk = down_e( silu(gate_e x_t) * up_e x_t ),  out[t] = sum_k weights[t, k] * y_tk
//                    (mode 0: out [T, H]; mode 1: the per-(t, k) terms y [T, K, H], invalid entries 0)
//
// Weight formats (glm_jax/quant.py is the reference):
//   0 f32, 1 bf16                      : float rows; activations stay f32 (exact f32 FMA dot products)
//   2 int8_row  ([out, in] int8, scale [out, 1]) : activations quantized to int8 per 64-block (scale amax/127)
//   3 int4_g<G> ([out, in/2] uint8, two nibbles per byte, even element low, offset-binary q+8; scale [out, ng])
//                                       : activations quantized to int8 per 64-block; G a multiple of 64 or >= in
// Quantized formats multiply int8 activations by the integer weights with AVX-512 VNNI (vpdpbusd) where the CPU has
// it (llama.cpp's Q4_0 x Q8_0 scheme), otherwise with portable loops (same integer sums, same float order).
//
// Determinism: every (row, token) dot product is computed by the same instruction sequence whatever the tile it sits
// in, the number of tokens, rows or experts in the call, or the thread that runs it (one 16-lane accumulator per
// (row, token), blocks in order, one fixed horizontal sum), and the MoE output sums a token's experts in routing
// order k.  So a row's result is bitwise independent of the batch around it (the engine's batch-invariance tests).
//
// Threads: work is split into tasks shared with XLA's intra-op thread pool (ffi::ThreadPool); the calling thread runs
// tasks too and never waits for a helper that has not started, so a busy pool costs nothing but parallelism.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Fmt : int32_t { kF32 = 0, kBF16 = 1, kI8 = 2, kI4 = 3 };
constexpr int64_t BLK = 64;   // activation quantization block (elements)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GLMJAX_VNNI 1
#else
#define GLMJAX_VNNI 0
#endif

// ------------------------------------------------------------------------------------------------ weights
struct WMat {
  const uint8_t* q = nullptr;   // [out, row_bytes]
  const float* s = nullptr;     // [out, ng] (quantized formats)
  int64_t out = 0, in = 0, ng = 1, G = 0, row_bytes = 0;
  int fmt = kF32;
  const int32_t* gt = nullptr;  // int4: group of each 64-block (gemm_rows fills it)
  const uint8_t* row(int64_t r) const { return q + r * row_bytes; }
  const float* srow(int64_t r) const { return s + r * ng; }
};

int64_t row_bytes_of(int fmt, int64_t in) {
  switch (fmt) {
    case kF32: return in * 4;
    case kBF16: return in * 2;
    case kI8: return in;
    default: return in / 2;
  }
}

// ------------------------------------------------------------------------------------------------ activations
// One token row prepared for a weight format.  Float formats use x itself.
struct Prep {
  const float* xf = nullptr;
  // int4: per pair of blocks j: 128 bytes [even b0 | even b1 | odd b0 | odd b1] (a lone last block: [even | odd]),
  //       16 f32 lane scales (lanes 0-7 block 2j, 8-15 block 2j+1) and 16 int32 lane offsets (-8 * the lane's x sum)
  // int8: per block: 64 bytes |x|, a 64-bit mask of negative x, the block scale
  int8_t* xq = nullptr;
  float* sx = nullptr;
  int32_t* init = nullptr;
  uint64_t* neg = nullptr;
};

struct PrepLayout {
  int64_t nb = 0, npair = 0, bytes = 0;
  int64_t off_xq = 0, off_sx = 0, off_init = 0, off_neg = 0;
};

PrepLayout prep_layout(int fmt, int64_t in) {
  PrepLayout L;
  L.nb = (in + BLK - 1) / BLK;
  L.npair = (L.nb + 1) / 2;
  auto al = [](int64_t n) { return (n + 63) / 64 * 64; };
  if (fmt == kI4) {
    L.off_xq = 0;
    L.off_sx = al(L.npair * 128);
    L.off_init = L.off_sx + al(L.npair * 16 * 4);
    L.bytes = L.off_init + al(L.npair * 16 * 4);
  } else if (fmt == kI8) {
    L.off_xq = 0;
    L.off_neg = al(L.nb * 64);
    L.off_sx = L.off_neg + al(L.nb * 8);
    L.bytes = L.off_sx + al(L.nb * 4);
  }
  return L;
}

inline float block_quant(const float* x, int64_t n, int8_t* q /* 64 */) {
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
  if (fmt == kF32 || fmt == kBF16) return;
  alignas(64) int8_t q[BLK];
  if (fmt == kI8) {
    p->xq = (int8_t*)(buf + L.off_xq);
    p->neg = (uint64_t*)(buf + L.off_neg);
    p->sx = (float*)(buf + L.off_sx);
    for (int64_t b = 0; b < L.nb; ++b) {
      int64_t n = std::min(BLK, in - b * BLK);
      p->sx[b] = block_quant(x + b * BLK, n, q);
      uint64_t m = 0;
      uint8_t* a = (uint8_t*)p->xq + b * BLK;
      for (int i = 0; i < BLK; ++i) {
        a[i] = (uint8_t)(q[i] < 0 ? -q[i] : q[i]);
        if (q[i] < 0) m |= (uint64_t)1 << i;
      }
      p->neg[b] = m;
    }
    return;
  }
  // int4
  p->xq = (int8_t*)(buf + L.off_xq);
  p->sx = (float*)(buf + L.off_sx);
  p->init = (int32_t*)(buf + L.off_init);
  for (int64_t j = 0; j < L.npair; ++j) {
    int8_t* d = p->xq + j * 128;
    std::memset(d, 0, 128);
    int nblk = (2 * j + 1 < L.nb) ? 2 : 1;
    for (int h = 0; h < nblk; ++h) {
      int64_t b = 2 * j + h;
      int64_t n = std::min(BLK, in - b * BLK);
      float s = block_quant(x + b * BLK, n, q);
      int8_t* ev = nblk == 2 ? d + 32 * h : d;
      int8_t* od = nblk == 2 ? d + 64 + 32 * h : d + 32;
      for (int i = 0; i < 32; ++i) {
        ev[i] = q[2 * i];
        od[i] = q[2 * i + 1];
      }
      for (int l = 0; l < 8; ++l) {
        int32_t sum = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) sum += ev[i] + od[i];
        p->sx[j * 16 + 8 * h + l] = s;
        p->init[j * 16 + 8 * h + l] = -8 * sum;
      }
    }
    for (int h = nblk; h < 2; ++h)
      for (int l = 0; l < 8; ++l) {
        p->sx[j * 16 + 8 * h + l] = 0.f;
        p->init[j * 16 + 8 * h + l] = 0;
      }
  }
}

// ------------------------------------------------------------------------------------------------ dot kernels
// dot_rows<R>(W, r0, p): R consecutive rows against one prepared token.  One 16-lane accumulator per row, blocks in
// order, one horizontal sum: the per-(row, token) sequence never depends on R.

#if GLMJAX_VNNI
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// R rows x C tokens.  out[c * R + r].  Every (r, c) pair runs the same instruction sequence as in the R=1, C=1 case.
template <int R, int C>
inline void dot_f32(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t n = W.in;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(P[c]->xf + i);
    for (int r = 0; r < R; ++r) {
      __m512 w = _mm512_loadu_ps((const float*)W.row(r0 + r) + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
    }
  }
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_maskz_loadu_ps(m, P[c]->xf + i);
    for (int r = 0; r < R; ++r) {
      __m512 w = _mm512_maskz_loadu_ps(m, (const float*)W.row(r0 + r) + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * R + r] = hsum(acc[r][c]);
}

inline __m512 bf16x16(const void* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, int C>
inline void dot_bf16(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t n = W.in;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(P[c]->xf + i);
    for (int r = 0; r < R; ++r) {
      __m512 w = bf16x16((const uint16_t*)W.row(r0 + r) + i, 0xFFFF);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
    }
  }
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_maskz_loadu_ps(m, P[c]->xf + i);
    for (int r = 0; r < R; ++r) {
      __m512 w = bf16x16((const uint16_t*)W.row(r0 + r) + i, m);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * R + r] = hsum(acc[r][c]);
}

template <int R, int C>
inline void dot_i8(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t nb = (W.in + BLK - 1) / BLK;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n = std::min(BLK, W.in - b * BLK);
    const __mmask64 lm = n == BLK ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
    __m512i xa[C];
    __mmask64 neg[C];
    __m512 sx[C];
    for (int c = 0; c < C; ++c) {
      xa[c] = _mm512_load_si512((const void*)(P[c]->xq + b * BLK));
      neg[c] = (__mmask64)P[c]->neg[b];
      sx[c] = _mm512_set1_ps(P[c]->sx[b]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i w = n == BLK ? _mm512_loadu_si512((const void*)(W.row(r0 + r) + b * BLK))
                                 : _mm512_maskz_loadu_epi8(lm, W.row(r0 + r) + b * BLK);
      for (int c = 0; c < C; ++c) {
        __m512i ws = _mm512_mask_sub_epi8(w, neg[c], zero, w);             // w * sign(x)
        __m512i d = _mm512_dpbusd_epi32(zero, xa[c], ws);                   // |x| * (w sign(x))
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sx[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * R + r] = hsum(acc[r][c]) * W.srow(r0 + r)[0];
}

// int4: pairs of 64-blocks (64 packed bytes); the weight scales of the pair's two blocks as one 16-lane vector
inline __m512 i4_scales(const WMat& W, const float* sw, int64_t b0, bool two) {
  if (W.G == BLK && two) {       // int4_g64: the pair's two groups are adjacent floats
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m128 s2 = _mm_castpd_ps(_mm_load_sd((const double*)(sw + b0)));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s2));
  }
  const int64_t g0 = W.gt[b0], g1 = two ? W.gt[b0 + 1] : g0;
  if (g0 == g1) return _mm512_set1_ps(sw[g0]);
  return _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(sw[g0]), _mm512_set1_ps(sw[g1]));
}

template <int R, int C, bool TAIL>
inline void i4_pair(const WMat& W, int64_t r0, const Prep* const* P, int64_t j, int64_t nb, __m512 (&acc)[R][C]) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const int64_t b0 = 2 * j, byte0 = b0 * 32;
  const bool two = b0 + 1 < nb;
  __mmask64 lm = ~(__mmask64)0;
  if (TAIL) {
    const int64_t nbytes = std::min<int64_t>(64, W.row_bytes - byte0);
    lm = nbytes == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nbytes) - 1);
  }
  __m512i xe[C], xo[C], ini[C];
  __m512 sx[C];
  for (int c = 0; c < C; ++c) {
    const int8_t* q = P[c]->xq + j * 128;
    if (!TAIL || two) {
      xe[c] = _mm512_load_si512((const void*)q);
      xo[c] = _mm512_load_si512((const void*)(q + 64));
    } else {   // lone last block: [even 32 | odd 32] -> low 256 bits of xe / xo, high halves 0
      xe[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i*)q)),
                                 _mm256_setzero_si256(), 1);
      xo[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(q + 32))),
                                 _mm256_setzero_si256(), 1);
    }
    ini[c] = _mm512_load_si512((const void*)(P[c]->init + j * 16));
    sx[c] = _mm512_load_ps(P[c]->sx + j * 16);
  }
  for (int r = 0; r < R; ++r) {
    const uint8_t* wp = W.row(r0 + r) + byte0;
    const __m512i v = TAIL ? _mm512_maskz_loadu_epi8(lm, wp) : _mm512_loadu_si512((const void*)wp);
    const __m512i lo = _mm512_and_si512(v, lo4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    const __m512 swv = i4_scales(W, W.srow(r0 + r), b0, two);
    for (int c = 0; c < C; ++c) {
      __m512i d = _mm512_dpbusd_epi32(ini[c], lo, xe[c]);
      d = _mm512_dpbusd_epi32(d, hi, xo[c]);
      acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sx[c], swv), acc[r][c]);
    }
  }
}

template <int R, int C>
inline void dot_i4(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t nb = (W.in + BLK - 1) / BLK, npair = (nb + 1) / 2, nfull = W.in / (2 * BLK);
  for (int64_t j = 0; j < nfull; ++j) i4_pair<R, C, false>(W, r0, P, j, nb, acc);
  for (int64_t j = nfull; j < npair; ++j) i4_pair<R, C, true>(W, r0, P, j, nb, acc);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * R + r] = hsum(acc[r][c]);
}

#else   // ------------------------------------------------------------------ portable (no AVX-512 VNNI)
// The same arithmetic in plain loops: 16 float lanes per (row, token), blocks in order, lanes summed in one order.
inline float hsum16(const float* a) {
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += a[l];
  return s;
}

template <int R>
inline void dot1_f32(const WMat& W, int64_t r0, const Prep& p, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc[16] = {0};
    const float* w = (const float*)W.row(r0 + r);
    for (int64_t i = 0; i < W.in; ++i) acc[i % 16] = std::fma(w[i], p.xf[i], acc[i % 16]);
    out[r] = hsum16(acc);
  }
}

inline float bf16f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int R>
inline void dot1_bf16(const WMat& W, int64_t r0, const Prep& p, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc[16] = {0};
    const uint16_t* w = (const uint16_t*)W.row(r0 + r);
    for (int64_t i = 0; i < W.in; ++i) acc[i % 16] = std::fma(bf16f(w[i]), p.xf[i], acc[i % 16]);
    out[r] = hsum16(acc);
  }
}

template <int R>
inline void dot1_i8(const WMat& W, int64_t r0, const Prep& p, float* out) {
  const int64_t nb = (W.in + BLK - 1) / BLK;
  for (int r = 0; r < R; ++r) {
    float acc[16] = {0};
    const int8_t* w = (const int8_t*)W.row(r0 + r);
    for (int64_t b = 0; b < nb; ++b) {
      int64_t n = std::min(BLK, W.in - b * BLK);
      const uint8_t* xa = (const uint8_t*)p.xq + b * BLK;
      for (int l = 0; l < 16; ++l) {
        int32_t d = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) {
          if (i >= n) break;
          int32_t wi = w[b * BLK + i];
          if ((p.neg[b] >> i) & 1) wi = -wi;
          d += (int32_t)xa[i] * wi;
        }
        acc[l] = std::fma((float)d, p.sx[b], acc[l]);
      }
    }
    out[r] = hsum16(acc) * W.srow(r0 + r)[0];
  }
}

template <int R>
inline void dot1_i4(const WMat& W, int64_t r0, const Prep& p, float* out) {
  const int64_t nb = (W.in + BLK - 1) / BLK, npair = (nb + 1) / 2;
  for (int r = 0; r < R; ++r) {
    float acc[16] = {0};
    const uint8_t* w = W.row(r0 + r);
    const float* sw = W.srow(r0 + r);
    for (int64_t j = 0; j < npair; ++j) {
      const int64_t b0 = 2 * j;
      const bool two = b0 + 1 < nb;
      const int8_t* xe = p.xq + j * 128;
      const int8_t* xo = two ? xe + 64 : xe + 32;
      const int64_t g0 = W.gt[b0], g1 = two ? W.gt[b0 + 1] : g0;
      for (int l = 0; l < 16; ++l) {
        if (!two && l >= 8) break;
        int32_t d = p.init[j * 16 + l];
        for (int i = 4 * l; i < 4 * l + 4; ++i) {
          int64_t byte = b0 * 32 + i;
          uint8_t v = byte < W.row_bytes ? w[byte] : 0;
          d += (int32_t)(v & 15) * xe[i] + (int32_t)(v >> 4) * xo[i];
        }
        float s = p.sx[j * 16 + l] * sw[l < 8 ? g0 : g1];
        acc[l] = std::fma((float)d, s, acc[l]);
      }
    }
    out[r] = hsum16(acc);
  }
}
#define GLMJAX_RC(name)                                                                \
  template <int R, int C>                                                               \
  inline void dot_##name(const WMat& W, int64_t r0, const Prep* const* P, float* out) { \
    for (int c = 0; c < C; ++c) dot1_##name<R>(W, r0, *P[c], out + c * R);             \
  }
GLMJAX_RC(f32)
GLMJAX_RC(bf16)
GLMJAX_RC(i8)
GLMJAX_RC(i4)
#undef GLMJAX_RC
#endif

template <int R, int C>
inline void dot_rows(const WMat& W, int64_t r0, const Prep* const* P, float* out) {
  switch (W.fmt) {
    case kF32: dot_f32<R, C>(W, r0, P, out); break;
    case kBF16: dot_bf16<R, C>(W, r0, P, out); break;
    case kI8: dot_i8<R, C>(W, r0, P, out); break;
    default: dot_i4<R, C>(W, r0, P, out); break;
  }
}

// rows [r0, r1) of W against tokens preps[0..n) -> ys[i][row].  Tiles of 4 rows x 4 (float) or 2 (quantized)
// tokens: the tile's weights are loaded (and unpacked) once for its tokens; every (row, token) result is the same
// instruction sequence whatever the tile, so a token's output never depends on the others.
void gemm_rows(const WMat& W0, int64_t r0, int64_t r1, const Prep* const* preps, int64_t n, float* const* ys) {
  WMat W = W0;
  std::vector<int32_t> gt((W.in + BLK - 1) / BLK + 1);
  for (size_t b = 0; b < gt.size(); ++b) gt[b] = (int32_t)std::min<int64_t>((b * BLK) / W.G, W.ng - 1);
  W.gt = gt.data();
  const int CT = (W.fmt == kF32 || W.fmt == kBF16) ? 4 : 2;
  float tmp[16];
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    int64_t i = 0;
    if (CT == 4)
      for (; i + 4 <= n; i += 4) {
        dot_rows<4, 4>(W, r, preps + i, tmp);
        for (int c = 0; c < 4; ++c) std::memcpy(ys[i + c] + r, tmp + 4 * c, 4 * sizeof(float));
      }
    for (; i + 2 <= n; i += 2) {
      dot_rows<4, 2>(W, r, preps + i, tmp);
      for (int c = 0; c < 2; ++c) std::memcpy(ys[i + c] + r, tmp + 4 * c, 4 * sizeof(float));
    }
    for (; i < n; ++i) {
      dot_rows<4, 1>(W, r, preps + i, tmp);
      std::memcpy(ys[i] + r, tmp, 4 * sizeof(float));
    }
  }
  for (; r < r1; ++r)
    for (int64_t i = 0; i < n; ++i) dot_rows<1, 1>(W, r, preps + i, ys[i] + r);
}

// ------------------------------------------------------------------------------------------------ threads
struct ParState {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0;
  std::function<void(int64_t)> fn;
};

void run_tasks(ParState* st) {
  for (;;) {
    int64_t i = st->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= st->n) return;
    st->fn(i);
    st->done.fetch_add(1, std::memory_order_release);
  }
}

// Run fn(0..n) on the calling thread plus up to threads-1 helpers from XLA's pool.  Helpers that start late find no
// task left and return; the caller waits only for tasks that were taken (never for a helper to start).
void parallel_for(ffi::ThreadPool* pool, int threads, int64_t n, std::function<void(int64_t)> fn) {
  if (n <= 0) return;
  if (pool == nullptr || threads <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto st = std::make_shared<ParState>();
  st->n = n;
  st->fn = std::move(fn);
  int helpers = (int)std::min<int64_t>(threads - 1, n - 1);
  for (int h = 0; h < helpers; ++h) pool->Schedule([st]() { run_tasks(st.get()); });
  run_tasks(st.get());
  while (st->done.load(std::memory_order_acquire) < n) _mm_pause();
}

int pool_threads(ffi::ThreadPool& pool) {
  int64_t n = pool.num_threads();
  return (int)std::max<int64_t>(1, std::min<int64_t>(n, 64));
}

constexpr double kParallelMacs = 3e5;   // below this a call runs on one thread (the hand-off costs more)

WMat make_wmat(const void* q, const float* s, int fmt, int64_t out, int64_t in, int64_t ng, int64_t G) {
  WMat W;
  W.q = (const uint8_t*)q;
  W.s = s;
  W.out = out;
  W.in = in;
  W.ng = ng;
  W.G = G > 0 ? G : in;
  W.fmt = fmt;
  W.row_bytes = row_bytes_of(fmt, in);
  return W;
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
ffi::Error QLinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> s,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t fmt, int64_t group) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("glmjax_qlinear: rank");
  const int64_t T = xd[0], in = xd[1], out = wd[0];
  auto sd = s.dimensions();
  const int64_t ng = sd.size() == 2 ? sd[1] : 1;
  if (auto e = check_fmt(fmt, in, group > 0 ? group : in); !e.success()) return e;
  if (wd[1] != row_bytes_of(fmt, in) / (fmt == kF32 ? 4 : fmt == kBF16 ? 2 : 1))
    return ffi::Error::InvalidArgument("glmjax_qlinear: weight shape does not match the format");
  WMat W = make_wmat(w.untyped_data(), s.typed_data(), fmt, out, in, ng, group);
  PrepLayout L = prep_layout(fmt, in);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  std::vector<uint8_t> pbuf(std::max<int64_t>(1, L.bytes * T) + 64);
  uint8_t* pb = (uint8_t*)(((uintptr_t)pbuf.data() + 63) & ~(uintptr_t)63);
  // rows[t] == 0: a padding row, skipped (its output is 0)
  const int32_t* rm = rows.typed_data();
  const bool all_rows = rows.element_count() != (size_t)T;
  std::vector<Prep> preps(T);
  std::vector<const Prep*> pp;
  std::vector<float*> ys;
  for (int64_t t = 0; t < T; ++t) {
    if (!all_rows && rm[t] == 0) {
      std::memset(yp + t * out, 0, sizeof(float) * out);
      continue;
    }
    prep_row(fmt, xp + t * in, in, L, pb + t * L.bytes, &preps[t]);
    pp.push_back(&preps[t]);
    ys.push_back(yp + t * out);
  }
  const int64_t n = (int64_t)pp.size();
  double macs = (double)n * out * in;
  int threads = macs >= kParallelMacs ? pool_threads(pool) : 1;
  // row chunks (multiples of 4 rows), about 4 per thread
  int64_t chunk = std::max<int64_t>(4, ((out + 4 * threads - 1) / (4 * threads) + 3) / 4 * 4);
  int64_t nchunks = (out + chunk - 1) / chunk;
  parallel_for(&pool, threads, nchunks, [&](int64_t c) {
    int64_t r0 = c * chunk, r1 = std::min(out, r0 + chunk);
    gemm_rows(W, r0, r1, pp.data(), n, ys.data());
  });
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------ MoE seam
inline float silu(float v) { return v / (1.f + std::exp(-v)); }

ffi::Error MoeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                   ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gu, ffi::Buffer<ffi::F32> gus, ffi::AnyBuffer dn,
                   ffi::Buffer<ffi::F32> dns, ffi::ResultBuffer<ffi::F32> out, int32_t fmt, int64_t gu_group,
                   int64_t dn_group, int32_t mode) {
  auto xd = x.dimensions(), sd = slots.dimensions(), gd = gu.dimensions(), dd = dn.dimensions();
  if (xd.size() != 2 || sd.size() != 2 || gd.size() != 3 || dd.size() != 3)
    return ffi::Error::InvalidArgument("glmjax_moe: rank");
  const int64_t T = xd[0], H = xd[1], K = sd[1], S = gd[0], I2 = gd[1], I = I2 / 2;
  if (sd[0] != T || dd[0] != S || dd[1] != H) return ffi::Error::InvalidArgument("glmjax_moe: shapes");
  if (auto e = check_fmt(fmt, H, gu_group > 0 ? gu_group : H); !e.success()) return e;
  if (auto e = check_fmt(fmt, I, dn_group > 0 ? dn_group : I); !e.success()) return e;
  auto gsd = gus.dimensions(), dsd = dns.dimensions();
  const bool quant = fmt == kI8 || fmt == kI4;
  const int64_t gng = quant ? gsd[2] : 1, dng = quant ? dsd[2] : 1;
  const int64_t gu_rb = row_bytes_of(fmt, H), dn_rb = row_bytes_of(fmt, I);
  const int64_t gu_slot = I2 * gu_rb, dn_slot = H * dn_rb;
  const uint8_t* gq = (const uint8_t*)gu.untyped_data();
  const uint8_t* dq = (const uint8_t*)dn.untyped_data();
  const float* gs = gus.typed_data();
  const float* ds = dns.typed_data();
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
    int64_t want = 4 * threads;
    int64_t per_group = std::max<int64_t>(1, (want + (int64_t)groups.size() - 1) / (int64_t)groups.size());
    int64_t chunk = std::max<int64_t>(16, ((rows + per_group - 1) / per_group + 3) / 4 * 4);
    for (int64_t g = 0; g < (int64_t)groups.size(); ++g)
      for (int64_t r = 0; r < rows; r += chunk) tasks.push_back({g, r, std::min(rows, r + chunk)});
  };
  std::vector<std::array<int64_t, 3>> ta, tc;
  make_tasks(I2, ta);
  make_tasks(H, tc);

  // phase A: h = gate_up(x)
  parallel_for(&pool, threads, (int64_t)ta.size(), [&](int64_t i) {
    const Grp& g = groups[ta[i][0]];
    WMat W = make_wmat(gq + g.slot * gu_slot, quant ? gs + g.slot * I2 * gng : nullptr, fmt, I2, H, gng, gu_group);
    std::vector<const Prep*> pp(g.n);
    std::vector<float*> ys(g.n);
    for (int64_t j = 0; j < g.n; ++j) {
      int64_t q = g.p0 + j;
      pp[j] = &tprep[order[q] / K];
      ys[j] = h.data() + q * I2;
    }
    gemm_rows(W, ta[i][1], ta[i][2], pp.data(), g.n, ys.data());
  });
  // phase B: act = silu(gate) * up, prepared for down
  int64_t bchunk = std::max<int64_t>(1, (P + 4 * threads - 1) / (4 * threads));
  parallel_for(&pool, P * I >= 65536 ? threads : 1, (P + bchunk - 1) / bchunk, [&](int64_t c) {
    for (int64_t q = c * bchunk; q < std::min(P, (c + 1) * bchunk); ++q) {
      const float* hq = h.data() + q * I2;
      float* a = act.data() + q * I;
      for (int64_t i = 0; i < I; ++i) a[i] = silu(hq[i]) * hq[I + i];
      prep_row(fmt, a, I, Ld, pd + q * Ld.bytes, &aprep[q]);
    }
  });
  // phase C: y = down(act)   (mode 1 writes straight into the [T, K, H] terms)
  parallel_for(&pool, threads, (int64_t)tc.size(), [&](int64_t i) {
    const Grp& g = groups[tc[i][0]];
    WMat W = make_wmat(dq + g.slot * dn_slot, quant ? ds + g.slot * H * dng : nullptr, fmt, H, I, dng, dn_group);
    std::vector<const Prep*> pp(g.n);
    std::vector<float*> ys(g.n);
    for (int64_t j = 0; j < g.n; ++j) {
      int64_t q = g.p0 + j;
      pp[j] = &aprep[q];
      ys[j] = mode == 1 ? op + order[q] * H : y.data() + q * H;
    }
    gemm_rows(W, tc[i][1], tc[i][2], pp.data(), g.n, ys.data());
  });
  if (mode == 1) return ffi::Error::Success();
  // combine in routing order k
  for (int64_t t = 0; t < T; ++t) {
    float* o = op + t * H;
    for (int64_t k = 0; k < K; ++k) {
      int64_t q = pos[t * K + k];
      if (q < 0) continue;
      const float w = wt[t * K + k];
      const float* yq = y.data() + q * H;
      for (int64_t i = 0; i < H; ++i) o[i] = std::fma(w, yq[i], o[i]);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxQLinear, QLinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmJaxMoe, MoeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("gu_group")
                                  .Attr<int64_t>("dn_group")
                                  .Attr<int32_t>("mode"));

extern "C" int glmjax_has_vnni() { return GLMJAX_VNNI; }
