// Fixed-order kernels for the batch-invariant mode: the same bits for a row whatever
// the other rows, the row count, the thread count, the CPU and its instruction set.
//
// Every result is defined by a scalar program, and the vector code computes exactly that
// program, one output per lane:
//
//   gemm     y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 1], w[n, 1],
//                          fma(x[m, 0], w[n, 0], 0)))          k ascending, one chain
//   gemm, bf16 x and bf16 w ("pairs"): k taken in pairs (2i, 2i+1), the odd one first:
//            acc = ftz(fma(x[2i+1], w[2i+1], acc)); acc = ftz(fma(x[2i], w[2i], acc))
//            with denormal inputs read as zero and denormal results flushed to zero: what
//            the AVX-512-BF16 instruction vdpbf16ps computes (checked bit for bit against
//            this program in tests/test_fixed_order.py), so CPUs that have it run it and
//            the others emulate it
//   row_sum  s[m]    = the same chain over x[m, k] * 1 (or * x[m, k] for squares)
//   exp      a fixed polynomial program (exp_f32 / exp_f64 below) per element
//
// fma rounds once (IEEE 754), so AVX-512, AVX2+FMA and the scalar std::fma path give
// identical bits; vectors run across outputs (n), never across k, so no lane tree or
// K blocking enters the order. Threads split the outputs, never a sum. Weights are
// converted to the accumulator type exactly (bf16 and f16 are subsets of f32).
// docs/invariance.md says why the batch-invariant mode needs this and what it costs.
#pragma once

#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fo {

enum WType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3, kBF16Pairs = 4 };
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

constexpr int64_t kPanel = 16;  // packed weights: panels of 16 outputs, [K][16] each

inline int64_t Panels(int64_t N) { return (N + kPanel - 1) / kPanel; }

// ----- scalar conversions (exact) -------------------------------------------------------

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 0x400));
    u = sign | uint32_t(112 - e) << 23 | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class W> inline float ToF32(W v);
template <> inline float ToF32<float>(float v) { return v; }

struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
template <> inline float ToF32<Bf16>(Bf16 v) { return Bf16ToF32(v.bits); }
template <> inline float ToF32<F16>(F16 v) { return F16ToF32(v.bits); }

// ----- packing -----------------------------------------------------------------------

// w element (n, k) at w[n * sn + k * sk]; packed[p][k][j] = w(p * 16 + j, k), zero past N.
template <class W>
void Pack(const W* w, int64_t N, int64_t K, int64_t sn, int64_t sk, W* packed) {
  for (int64_t p = 0; p < Panels(N); ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + j;
        W v;
        if (n < N) v = w[n * sn + k * sk];
        else std::memset(&v, 0, sizeof(W));
        packed[(p * K + k) * kPanel + j] = v;
      }
}

// ----- the scalar program (the definition) ----------------------------------------------

template <class W>
void PanelScalar(const float* x, int64_t ldx, int64_t rows, const W* panel, int64_t K,
                 float* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * ldx + k], ToF32(panel[k * kPanel + j]), acc);
      y[r * ldy + j] = acc;
    }
}

inline void PanelScalar(const double* x, int64_t ldx, int64_t rows, const double* panel, int64_t K,
                        double* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * ldx + k], panel[k * kPanel + j], acc);
      y[r * ldy + j] = acc;
    }
}

// ----- AVX-512: MR rows x NP panels, one zmm of 16 floats (or two of 8 doubles) each ------

#define FO_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define FO_AVX2 __attribute__((target("avx2,fma,f16c")))

FO_AVX512 inline __m512 Load512(const float* p) { return _mm512_loadu_ps(p); }
FO_AVX512 inline __m512 Load512(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
FO_AVX512 inline __m512 Load512(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc[r][p] to row r, columns [16 p, 16 p + 16) of y, the first `cols` columns only.
template <int MR, int NP>
FO_AVX512 inline void Store512(const __m512 (&acc)[MR][NP], float* y, int64_t ldy, int64_t cols) {
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) {
      const int64_t c = cols - p * kPanel;
      if (c >= kPanel) _mm512_storeu_ps(y + r * ldy + p * kPanel, acc[r][p]);
      else if (c > 0) _mm512_mask_storeu_ps(y + r * ldy + p * kPanel, __mmask16((1u << c) - 1), acc[r][p]);
    }
}

template <int MR, int NP, class W>
FO_AVX512 void Tile512(const float* x, int64_t ldx, const W* panels, int64_t K, float* y,
                       int64_t ldy, int64_t cols) {
  __m512 acc[MR][NP];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
    for (int p = 0; p < NP; ++p) w[p] = Load512(panels + (p * K + k) * kPanel);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
    }
  }
  Store512<MR, NP>(acc, y, ldy, cols);
}

template <int MR, int NP>
FO_AVX512 void Tile512(const double* x, int64_t ldx, const double* panels, int64_t K, double* y,
                       int64_t ldy, int64_t cols) {
  __m512d acc[MR][2 * NP];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2 * NP; ++h) acc[r][h] = _mm512_setzero_pd();
  for (int64_t k = 0; k < K; ++k) {
    __m512d w[2 * NP];
    for (int h = 0; h < 2 * NP; ++h) w[h] = _mm512_loadu_pd(panels + ((h / 2) * K + k) * kPanel + (h % 2) * 8);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512d xv = _mm512_set1_pd(x[r * ldx + k]);
      for (int h = 0; h < 2 * NP; ++h) acc[r][h] = _mm512_fmadd_pd(xv, w[h], acc[r][h]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2 * NP; ++h) {
      const int64_t c = cols - h * 8;
      if (c >= 8) _mm512_storeu_pd(y + r * ldy + h * 8, acc[r][h]);
      else if (c > 0) _mm512_mask_storeu_pd(y + r * ldy + h * 8, __mmask8((1u << c) - 1), acc[r][h]);
    }
}

// ----- AVX2 + FMA: MR rows x 1 panel (two ymm of 8 floats, or four of 4 doubles) ---------

FO_AVX2 inline __m256 Load256(const float* p) { return _mm256_loadu_ps(p); }
FO_AVX2 inline __m256 Load256(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
FO_AVX2 inline __m256 Load256(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int MR, class W>
FO_AVX2 void Tile256(const float* x, int64_t ldx, const W* panel, int64_t K, float* y, int64_t ldy,
                     int64_t cols) {
  __m256 acc[MR][2];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = Load256(panel + k * kPanel), w1 = Load256(panel + k * kPanel + 8);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  alignas(32) float tmp[16];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    if (cols >= kPanel) {
      _mm256_storeu_ps(y + r * ldy, acc[r][0]);
      _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    } else {
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
    }
  }
}

template <int MR>
FO_AVX2 void Tile256(const double* x, int64_t ldx, const double* panel, int64_t K, double* y,
                     int64_t ldy, int64_t cols) {
  __m256d acc[MR][4];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 4; ++h) acc[r][h] = _mm256_setzero_pd();
  for (int64_t k = 0; k < K; ++k) {
    __m256d w[4];
    for (int h = 0; h < 4; ++h) w[h] = _mm256_loadu_pd(panel + k * kPanel + 4 * h);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m256d xv = _mm256_broadcast_sd(x + r * ldx + k);
      for (int h = 0; h < 4; ++h) acc[r][h] = _mm256_fmadd_pd(xv, w[h], acc[r][h]);
    }
  }
  alignas(32) double tmp[16];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < 4; ++h) _mm256_store_pd(tmp + 4 * h, acc[r][h]);
    std::memcpy(y + r * ldy, tmp, (cols < kPanel ? cols : kPanel) * sizeof(double));
  }
}

// ----- bf16 x bf16 in pairs (the vdpbf16ps program) ------------------------------------

inline int64_t Pairs(int64_t K) { return (K + 1) / 2; }

// A bf16 as the pair program reads it: a denormal (exponent bits 0) is a zero of its sign.
inline Bf16 FlushBf16(Bf16 v) { return (v.bits & 0x7f80) ? v : Bf16{uint16_t(v.bits & 0x8000)}; }

// packed[p][i][j][h] = w(p * 16 + j, 2 i + h), zero past N and K. Denormal weights are flushed
// here, once (the program reads them as zeros of their sign: vdpbf16ps does, and the tiles
// without it need not flush the weights at every product).
inline void PackPairs(const Bf16* w, int64_t N, int64_t K, int64_t sn, int64_t sk, Bf16* packed) {
  for (int64_t p = 0; p < Panels(N); ++p)
    for (int64_t i = 0; i < Pairs(K); ++i)
      for (int64_t j = 0; j < kPanel; ++j)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t n = p * kPanel + j, k = 2 * i + h;
          packed[((p * Pairs(K) + i) * kPanel + j) * 2 + h] = (n < N && k < K) ? FlushBf16(w[n * sn + k * sk])
                                                                               : Bf16{0};
        }
}

inline float Ftz(float a) {
  return std::fabs(a) < 1.17549435e-38f ? std::copysign(0.0f, a) : a;
}

// x's pair i as the 32 bits vdpbf16ps broadcasts (the odd element in the high half).
inline uint32_t XPair(const Bf16* x, int64_t i, int64_t K) {
  const uint32_t lo = x[2 * i].bits, hi = 2 * i + 1 < K ? x[2 * i + 1].bits : 0;
  return lo | (hi << 16);
}

inline float PairLo(uint32_t v) { return Ftz(Bf16ToF32(uint16_t(v))); }
inline float PairHi(uint32_t v) { return Ftz(Bf16ToF32(uint16_t(v >> 16))); }

inline void PanelPairsScalar(const Bf16* x, int64_t ldx, int64_t rows, const Bf16* panel, int64_t K,
                             float* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t i = 0; i < Pairs(K); ++i) {
        const uint32_t xp = XPair(x + r * ldx, i, K);
        uint32_t wp;
        std::memcpy(&wp, panel + (i * kPanel + j) * 2, 4);
        acc = Ftz(std::fma(PairHi(xp), PairHi(wp), acc));
        acc = Ftz(std::fma(PairLo(xp), PairLo(wp), acc));
      }
      y[r * ldy + j] = acc;
    }
}

#define FO_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

template <int MR, int NP>
FO_AVX512BF16 void TilePairsBf16(const Bf16* x, int64_t ldx, const Bf16* panels, int64_t K, float* y,
                                int64_t ldy, int64_t cols) {
  const int64_t P = Pairs(K);
  __m512 acc[MR][NP];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < P; ++i) {
    __m512i w[NP];
    for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_si512(panels + (p * P + i) * kPanel * 2);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t pair;  // a whole pair straight from x, but the odd K's last half pair
      if (2 * i + 1 < K) std::memcpy(&pair, x + r * ldx + 2 * i, 4);
      else pair = int32_t(XPair(x + r * ldx, i, K));
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)xv, (__m512bh)w[p]);
    }
  }
  Store512<MR, NP>(acc, y, ldy, cols);
}

// The same program without the instruction: fma and explicit flushes, 16 lanes.
FO_AVX512 inline __m512 Ftz512(__m512 a) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(a), _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
  const __m512 sign = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  return _mm512_mask_mov_ps(a, tiny, sign);
}

template <int MR, int NP>
FO_AVX512 void TilePairs512(const Bf16* x, int64_t ldx, const Bf16* panels, int64_t K, float* y,
                            int64_t ldy, int64_t cols) {
  const int64_t P = Pairs(K);
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  __m512 acc[MR][NP];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < P; ++i) {
    __m512 wlo[NP], whi[NP];
    for (int p = 0; p < NP; ++p) {
      const __m512i v = _mm512_loadu_si512(panels + (p * P + i) * kPanel * 2);
      wlo[p] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));   // flushed when packed (PackPairs)
      whi[p] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const uint32_t xp = XPair(x + r * ldx, i, K);
      const __m512 xlo = _mm512_set1_ps(PairLo(xp)), xhi = _mm512_set1_ps(PairHi(xp));
      for (int p = 0; p < NP; ++p) {
        acc[r][p] = Ftz512(_mm512_fmadd_ps(xhi, whi[p], acc[r][p]));
        acc[r][p] = Ftz512(_mm512_fmadd_ps(xlo, wlo[p], acc[r][p]));
      }
    }
  }
  Store512<MR, NP>(acc, y, ldy, cols);
}

FO_AVX2 inline __m256 Ftz256(__m256 a) {
  const __m256 tiny = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a), _mm256_set1_ps(1.17549435e-38f),
                                    _CMP_LT_OQ);
  return _mm256_blendv_ps(a, _mm256_and_ps(a, _mm256_set1_ps(-0.0f)), tiny);
}

// NP panels side by side: each column is still one chain over the pairs in order (the same
// bits); more chains at once hide the fma -> flush latency that bounds a one-row product.
template <int MR, int NP>
FO_AVX2 void TilePairs256(const Bf16* x, int64_t ldx, const Bf16* panels, int64_t K, float* y, int64_t ldy,
                          int64_t cols) {
  const int64_t P = Pairs(K);
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  __m256 acc[MR][2 * NP];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 2 * NP; ++q) acc[r][q] = _mm256_setzero_ps();
  for (int64_t i = 0; i < P; ++i) {
    __m256 xlo[MR], xhi[MR];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const uint32_t xp = XPair(x + r * ldx, i, K);
      xlo[r] = _mm256_set1_ps(PairLo(xp));
      xhi[r] = _mm256_set1_ps(PairHi(xp));
    }
    for (int q = 0; q < 2 * NP; ++q) {   // panel q / 2, its columns 8 (q % 2) .. 8 (q % 2) + 7
      const __m256i v = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(panels + (((q / 2) * P + i) * kPanel + 8 * (q % 2)) * 2));
      const __m256 wlo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));   // flushed when packed (PackPairs)
      const __m256 whi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        acc[r][q] = Ftz256(_mm256_fmadd_ps(xhi[r], whi, acc[r][q]));
        acc[r][q] = Ftz256(_mm256_fmadd_ps(xlo[r], wlo, acc[r][q]));
      }
    }
  }
  alignas(32) float tmp[8];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 2 * NP; ++q) {
      const int64_t c = cols - 8 * q;   // columns left from this half panel on
      if (c <= 0) break;
      _mm256_store_ps(tmp, acc[r][q]);
      std::memcpy(y + r * ldy + 8 * q, tmp, (c < 8 ? c : 8) * sizeof(float));
    }
}

// Rows [0, M) x panels [p0, p1) of the pair program.
inline void ColumnsPairs(Isa isa, const Bf16* x, int64_t ldx, int64_t M, const Bf16* packed, int64_t N,
                         int64_t K, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  constexpr int64_t kRowBlock = 64;
  const int64_t stride = Pairs(K) * kPanel * 2;  // one panel
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = m0 + kRowBlock < M ? m0 + kRowBlock : M;
    for (int64_t p = p0; p < p1;) {
      // panels per tile (speed only): up to 2, and 4 for one row (a decode step's product) where
      // the program is emulated (AVX2, AVX-512 without BF16): there an fma and its flush make a
      // chain too slow for 2 panels' columns to hide
      const int64_t most = isa == kScalar ? 1 : (M == 1 && (isa == kAvx2 || isa == kAvx512) ? 4 : 2);
      const int64_t np = p + most <= p1 ? most : (most > 1 && p + 2 <= p1 ? 2 : 1);
      const Bf16* panels = packed + p * stride;
      const int64_t cols = N - p * kPanel;
      for (int64_t m = m0; m < m1;) {
        const Bf16* xr = x + m * ldx;
        float* yr = y + m * ldy + p * kPanel;
        const int64_t left = m1 - m;
        int64_t done;
        if (isa == kAvx512Bf16) {
          if (left >= 8) { np == 2 ? TilePairsBf16<8, 2>(xr, ldx, panels, K, yr, ldy, cols) : TilePairsBf16<8, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 8; }
          else if (left >= 4) { np == 2 ? TilePairsBf16<4, 2>(xr, ldx, panels, K, yr, ldy, cols) : TilePairsBf16<4, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 4; }
          else { np == 2 ? TilePairsBf16<1, 2>(xr, ldx, panels, K, yr, ldy, cols) : TilePairsBf16<1, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 1; }
        } else if (isa == kAvx512) {
          if (left >= 4) { np == 2 ? TilePairs512<4, 2>(xr, ldx, panels, K, yr, ldy, cols) : TilePairs512<4, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 4; }
          else { np == 4 ? TilePairs512<1, 4>(xr, ldx, panels, K, yr, ldy, cols) : np == 2 ? TilePairs512<1, 2>(xr, ldx, panels, K, yr, ldy, cols) : TilePairs512<1, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 1; }
        } else if (isa == kAvx2) {
          if (left >= 2) { np == 2 ? TilePairs256<2, 2>(xr, ldx, panels, K, yr, ldy, cols) : TilePairs256<2, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 2; }
          else { np == 4 ? TilePairs256<1, 4>(xr, ldx, panels, K, yr, ldy, cols) : np == 2 ? TilePairs256<1, 2>(xr, ldx, panels, K, yr, ldy, cols) : TilePairs256<1, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 1; }
        } else {
          PanelPairsScalar(xr, ldx, 1, panels, K, yr, ldy, cols < kPanel ? cols : kPanel);
          done = 1;
        }
        m += done;
      }
      p += np;
    }
  }
}

// ----- driving the tiles -------------------------------------------------------------

// Rows [0, M) x panels [p0, p1) of y = x @ w^T, w packed. Tile shapes change speed only.
template <class A, class W>
void Columns(Isa isa, const A* x, int64_t ldx, int64_t M, const W* packed, int64_t N, int64_t K,
             A* y, int64_t ldy, int64_t p0, int64_t p1) {
  constexpr int64_t kRowBlock = 64;  // rows of x kept hot in cache while panels stream
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = m0 + kRowBlock < M ? m0 + kRowBlock : M;
    for (int64_t p = p0; p < p1;) {
      const int64_t np = (isa >= kAvx512 && p + 2 <= p1) ? 2 : 1;
      const W* panels = packed + p * K * kPanel;
      const int64_t cols = N - p * kPanel;
      for (int64_t m = m0; m < m1;) {
        const A* xr = x + m * ldx;
        A* yr = y + m * ldy + p * kPanel;
        const int64_t left = m1 - m;
        int64_t done;
        if (isa >= kAvx512) {
          if constexpr (std::is_same_v<A, double>) {
            if (left >= 4) { np == 2 ? Tile512<4, 2>(xr, ldx, panels, K, yr, ldy, cols) : Tile512<4, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 4; }
            else { np == 2 ? Tile512<1, 2>(xr, ldx, panels, K, yr, ldy, cols) : Tile512<1, 1>(xr, ldx, panels, K, yr, ldy, cols); done = 1; }
          } else {
            if (left >= 8) { np == 2 ? Tile512<8, 2, W>(xr, ldx, panels, K, yr, ldy, cols) : Tile512<8, 1, W>(xr, ldx, panels, K, yr, ldy, cols); done = 8; }
            else if (left >= 4) { np == 2 ? Tile512<4, 2, W>(xr, ldx, panels, K, yr, ldy, cols) : Tile512<4, 1, W>(xr, ldx, panels, K, yr, ldy, cols); done = 4; }
            else { np == 2 ? Tile512<1, 2, W>(xr, ldx, panels, K, yr, ldy, cols) : Tile512<1, 1, W>(xr, ldx, panels, K, yr, ldy, cols); done = 1; }
          }
        } else if (isa == kAvx2) {
          if constexpr (std::is_same_v<A, double>) {
            if (left >= 2) { Tile256<2>(xr, ldx, panels, K, yr, ldy, cols); done = 2; }
            else { Tile256<1>(xr, ldx, panels, K, yr, ldy, cols); done = 1; }
          } else {
            if (left >= 6) { Tile256<6, W>(xr, ldx, panels, K, yr, ldy, cols); done = 6; }
            else if (left >= 4) { Tile256<4, W>(xr, ldx, panels, K, yr, ldy, cols); done = 4; }
            else { Tile256<1, W>(xr, ldx, panels, K, yr, ldy, cols); done = 1; }
          }
        } else {
          PanelScalar(xr, ldx, 1, panels, K, yr, ldy, cols < kPanel ? cols : kPanel);
          done = 1;
        }
        m += done;
      }
      p += np;
    }
  }
}

// ----- row sums ----------------------------------------------------------------------

// s[m] = fma chain over k of x[m, k] * (squares ? x[m, k] : 1), k ascending.
// Rows go RB at a time, their chains interleaved (independent, so the order of each is
// unchanged): one chain is bound by the fma latency, RB of them by its throughput.
template <class A>
__attribute__((always_inline)) inline void RowSumsBody(const A* x, int64_t ldx, int64_t M, int64_t K,
                                                       bool squares, A* s) {
  constexpr int64_t RB = 8;
  int64_t m = 0;
  for (; m + RB <= M; m += RB) {
    A acc[RB] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < RB; ++r) {
        const A v = x[(m + r) * ldx + k];
        acc[r] = std::fma(v, squares ? v : A(1), acc[r]);
      }
    for (int64_t r = 0; r < RB; ++r) s[m + r] = acc[r];
  }
  for (; m < M; ++m) {
    A acc = 0;
    for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * ldx + k], squares ? x[m * ldx + k] : A(1), acc);
    s[m] = acc;
  }
}

// The same code compiled with and without the fma instruction (std::fma is a library call
// on a CPU without it); the same bits either way.
template <class A>
FO_AVX2 void RowSumsFma(const A* x, int64_t ldx, int64_t M, int64_t K, bool squares, A* s) {
  RowSumsBody(x, ldx, M, K, squares, s);
}

template <class A>
void RowSums(Isa isa, const A* x, int64_t ldx, int64_t M, int64_t K, bool squares, A* s) {
  if (isa >= kAvx2) RowSumsFma(x, ldx, M, K, squares, s);
  else RowSumsBody(x, ldx, M, K, squares, s);
}

// ----- exp: one straight-line program per element (no table, no lane-dependent path) ----

inline float ExpF32(float x) {
  if (!(x == x)) return x;                     // NaN
  if (x > 88.72283935546875f) return INFINITY;
  if (x < -103.972084045410156f) return 0.0f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693145751953125f, x);  // ln2 split: hi has 16 bits
  r = std::fma(-n, 1.428606765330187045e-06f, r);
  float p = 1.0f / 40320;                      // Taylor to r^8 on |r| <= ln2 / 2
  p = std::fma(p, r, 1.0f / 5040);
  p = std::fma(p, r, 1.0f / 720);
  p = std::fma(p, r, 1.0f / 120);
  p = std::fma(p, r, 1.0f / 24);
  p = std::fma(p, r, 1.0f / 6);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  // p * 2^n in two steps (n may be below the normal range); e1 = floor(e / 2)
  const int e = int(n), e1 = e >> 1, e2 = e - e1;
  uint32_t u1 = uint32_t(e1 + 127) << 23, u2 = uint32_t(e2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &u1, 4);
  std::memcpy(&s2, &u2, 4);
  return p * s1 * s2;
}

// ExpF32's program on 16 (8) lanes: the same operations in the same order.
FO_AVX512 inline __m512 Exp512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(n), _mm512_set1_epi32(INT32_MIN)));
  __m512 r = _mm512_fmadd_ps(neg, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fmadd_ps(neg, _mm512_set1_ps(1.428606765330187045e-06f), r);
  const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  __m512 p = _mm512_set1_ps(1.0f / 40320);
  for (float ci : c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ci));
  const __m512i e = _mm512_cvtps_epi32(n), e1 = _mm512_srai_epi32(e, 1), e2 = _mm512_sub_epi32(e, e1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e2, bias), 23));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.972084045410156f), _CMP_LT_OQ), y,
                           _mm512_setzero_ps());
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ), y,
                           _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}

FO_AVX2 inline __m256 Exp256(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 neg = _mm256_xor_ps(n, _mm256_set1_ps(-0.0f));
  __m256 r = _mm256_fmadd_ps(neg, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fmadd_ps(neg, _mm256_set1_ps(1.428606765330187045e-06f), r);
  const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  __m256 p = _mm256_set1_ps(1.0f / 40320);
  for (float ci : c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ci));
  const __m256i e = _mm256_cvtps_epi32(n), e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-103.972084045410156f), _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

FO_AVX512 inline void ExpF32Avx512(const float* a, float* b, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(b + i, Exp512(_mm512_loadu_ps(a + i)));
  for (; i < n; ++i) b[i] = ExpF32(a[i]);
}

FO_AVX2 inline void ExpF32Avx2(const float* a, float* b, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(b + i, Exp256(_mm256_loadu_ps(a + i)));
  for (; i < n; ++i) b[i] = ExpF32(a[i]);
}

inline double ExpF64(double x) {
  if (!(x == x)) return x;
  if (x > 709.782712893383973) return INFINITY;
  if (x < -745.133219101941108) return 0.0;
  const double n = std::nearbyint(x * 1.44269504088896341);
  double r = std::fma(-n, 0.693147180369123816490, x);  // ln2 split: hi has 32 bits
  r = std::fma(-n, 1.90821492927058770002e-10, r);
  double p = 1.0 / 6227020800.0;                    // Taylor to r^13 on |r| <= ln2 / 2
  const double c[] = {1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                      1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0};
  for (double ci : c) p = std::fma(p, r, ci);
  const int e = int(n), e1 = e / 2, e2 = e - e1;
  uint64_t u1 = uint64_t(e1 + 1023) << 52, u2 = uint64_t(e2 + 1023) << 52;
  double s1, s2;
  std::memcpy(&s1, &u1, 8);
  std::memcpy(&s2, &u2, 8);
  return p * s1 * s2;
}

// ----- jobs: each operation as independent tasks, for any thread pool --------------------
// A task writes its own outputs and sums nothing another task sums, so the tasks may run
// in any order on any threads (the ctypes library's pool or OpenMP, XLA's intra-op pool).

inline int MaxIsa() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (avx512) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAvx2;
  return kScalar;
}

constexpr int64_t kSmall = int64_t{1} << 18;  // fewer multiply-adds run as one task

struct Gemm {
  int64_t M, N, K;
  const void* x;
  int64_t ldx;
  const void* packed;
  int wtype;
  void* y;
  int64_t ldy;
  int64_t width = 1;  // panels per task

  int64_t Tasks(int threads) {
    const int64_t panels = Panels(N);
    if (M * N * K < kSmall) threads = 1;
    const int64_t chunks = threads <= 1 ? 1 : (panels < 4 * threads ? panels : 4 * threads);
    const int64_t per = (panels + chunks - 1) / chunks;
    width = per + (per % 2);  // an even count keeps AVX-512's two-panel tiles
    return (panels + width - 1) / width;
  }

  void Run(Isa isa, int64_t t) const {
    const int64_t p0 = t * width, p1 = p0 + width < Panels(N) ? p0 + width : Panels(N);
    switch (wtype) {
      case kBF16Pairs:
        ColumnsPairs(isa, static_cast<const Bf16*>(x), ldx, M, static_cast<const Bf16*>(packed), N, K,
                     static_cast<float*>(y), ldy, p0, p1);
        break;
      case kF64:
        Columns(isa, static_cast<const double*>(x), ldx, M, static_cast<const double*>(packed), N, K,
                static_cast<double*>(y), ldy, p0, p1);
        break;
      case kBF16: Cols<Bf16>(isa, p0, p1); break;
      case kF16: Cols<F16>(isa, p0, p1); break;
      default: Cols<float>(isa, p0, p1); break;
    }
  }

  template <class W> void Cols(Isa isa, int64_t p0, int64_t p1) const {
    Columns(isa, static_cast<const float*>(x), ldx, M, static_cast<const W*>(packed), N, K,
            static_cast<float*>(y), ldy, p0, p1);
  }
};

// For i < b1, j < b2: y[i, j] = x[i, j] @ w[i, j]^T (w[i, j] element (n, k) at sn, sk),
// one task per (i, j), each packing its w into a thread-local buffer. f32 or f64 (is_f64).
struct Batched {
  int64_t b1, b2, M, N, K;
  const void* x;
  int64_t ldx, sx1, sx2;
  const void* w;
  int64_t sn, sk, sw1, sw2;
  void* y;
  int64_t ldy, sy1, sy2;
  bool is_f64;

  int64_t Tasks(int) const { return b1 * b2; }

  void Run(Isa isa, int64_t t) const {
    if (is_f64) Typed<double>(isa, t);
    else Typed<float>(isa, t);
  }

  template <class A> void Typed(Isa isa, int64_t t) const {
    const int64_t i = t / b2, j = t % b2;
    thread_local std::vector<A> packed;
    packed.resize(Panels(N) * K * kPanel);
    Pack(static_cast<const A*>(w) + i * sw1 + j * sw2, N, K, sn, sk, packed.data());
    Columns(isa, static_cast<const A*>(x) + i * sx1 + j * sx2, ldx, M, packed.data(), N, K,
            static_cast<A*>(y) + i * sy1 + j * sy2, ldy, 0, Panels(N));
  }
};

struct RowSumJob {
  int64_t M, K;
  const void* x;
  int64_t ldx;
  bool squares, is_f64;
  void* s;
  static constexpr int64_t kRows = 256;

  int64_t Tasks(int threads) const { return M * K < kSmall || threads <= 1 ? 1 : (M + kRows - 1) / kRows; }

  void Run(Isa isa, int64_t t, int64_t tasks) const {
    const int64_t rows = tasks == 1 ? M : kRows, m0 = t * rows, n = m0 + rows < M ? rows : M - m0;
    if (is_f64) RowSums(isa, static_cast<const double*>(x) + m0 * ldx, ldx, n, K, squares, static_cast<double*>(s) + m0);
    else RowSums(isa, static_cast<const float*>(x) + m0 * ldx, ldx, n, K, squares, static_cast<float*>(s) + m0);
  }
};

struct ExpJob {
  int64_t n;
  const void* x;
  bool is_f64;
  void* y;
  static constexpr int64_t kChunk = 1 << 14;

  int64_t Tasks(int threads) const { return n < 4 * kChunk || threads <= 1 ? 1 : (n + kChunk - 1) / kChunk; }

  void Run(Isa isa, int64_t t, int64_t tasks) const {
    const int64_t size = tasks == 1 ? n : kChunk, i0 = t * size, i1 = i0 + size < n ? i0 + size : n;
    if (is_f64) {
      const double* a = static_cast<const double*>(x);
      double* b = static_cast<double*>(y);
      for (int64_t i = i0; i < i1; ++i) b[i] = ExpF64(a[i]);
      return;
    }
    const float* a = static_cast<const float*>(x) + i0;
    float* b = static_cast<float*>(y) + i0;
    if (isa >= kAvx512) ExpF32Avx512(a, b, i1 - i0);
    else if (isa == kAvx2) ExpF32Avx2(a, b, i1 - i0);
    else for (int64_t i = 0; i < i1 - i0; ++i) b[i] = ExpF32(a[i]);
  }
};


// ----- causal attention of a bf16 policy (torchref's long prompts, default mode) ---------
//
// For batch row b, query t and query head hq (kv head hq / G), over keys j < n (n: the keys
// the query's tile reads, past its last visible key; every key S when it sees none):
//   s_j = bf16(gemm chain over d of q[d] * k_j[d]); with a late scale, s_j = bf16(s_j * scale)
//   s_j = -FLT_MAX where the query may not see key j (allowed 0, or j past its last visible key)
//   m = max_j s_j (NaN when any s_j is NaN);  e_j = ExpF32(s_j - m)
//   z = row_sum chain over j of e_j;  p_j = bf16(e_j / z)
//   out[d] = bf16(gemm chain over j of p_j * v_j[d])
// bf16() rounds to nearest even, as torch's casts do. A key past the query's last visible one
// has e_j = p_j = 0 and adds exact zeros to both chains (finite values), so which tile a query
// shares changes nothing: the same bits for every tile, batch, thread count and code path.
// q, k and v come as bf16 (widened exactly) or as f32 (rounded to bf16 first: the identity for
// a value that is one, as a bf16 policy's f32 KV cache holds), their products exact in f32; with
// an early scale (a power of two) the queries are bf16(q * scale) first; out is bf16.

inline float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;  // NaN stays a (quiet) NaN
  else u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// An attention operand as the products take it: a bf16 value in f32 (see above).
inline float Bf16Operand(float x) { return RoundBf16(x); }
inline float Bf16Operand(Bf16 x) { return ToF32(x); }

// x (f32 holding a bf16 value: RoundBf16's result) as bf16: its upper half.
inline uint16_t Bf16Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t(u >> 16);
}

FO_AVX2 inline __m256 RoundBf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  const __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(up), _mm256_castsi256_ps(quiet),
                                    _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_and_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0xffff0000u))));
}

// n attention operands (f32 or Bf16) as the products take them (Bf16Operand), then times scale
// and rounded again where scale is not 0: a tile's queries.
template <class Q>
inline void OperandRowScalar(const Q* src, int64_t n, float scale, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const float x = Bf16Operand(src[j]);
    dst[j] = scale != 0.0f ? RoundBf16(x * scale) : x;
  }
}

template <class Q>
FO_AVX2 inline void OperandRowAvx2(const Q* src, int64_t n, float scale, float* dst) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 x = Load256(src + j);
    if constexpr (std::is_same_v<Q, float>) x = RoundBf16x8(x);
    if (scale != 0.0f) x = RoundBf16x8(_mm256_mul_ps(x, sc));
    _mm256_storeu_ps(dst + j, x);
  }
  OperandRowScalar(src + j, n - j, scale, dst + j);
}

// n f32 values rounded to bf16 (RoundBf16) and stored as bf16.
inline void Bf16RowScalar(const float* src, int64_t n, Bf16* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = Bf16{Bf16Bits(RoundBf16(src[j]))};
}

// 8 f32 values holding bf16 ones (RoundBf16x8's results) stored as bf16: their upper halves,
// each below 2^16, which packus keeps as they are.
FO_AVX2 inline void StoreBf16x8(Bf16* dst, __m256 x) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

FO_AVX2 inline void Bf16RowAvx2(const float* src, int64_t n, Bf16* dst) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) StoreBf16x8(dst + j, RoundBf16x8(_mm256_loadu_ps(src + j)));
  Bf16RowScalar(src + j, n - j, dst + j);
}

// One row's scores [0, n) in place: rounded (and late-scaled), masked from `seen` (bytes, 0 =
// hidden) below lim and entirely from lim on, then minus their max (NaN if any is NaN).
// Score j of a row as the softmax reads it: rounded (and late-scaled), or -FLT_MAX if hidden.
inline float Score(float x, const uint8_t* seen, int64_t j, int64_t lim, float scale) {
  float v = RoundBf16(x);
  if (scale != 0.0f) v = RoundBf16(v * scale);
  return (j >= lim || !seen[j]) ? -FLT_MAX : v;
}

inline void ScoresRowScalar(float* s, const uint8_t* seen, int64_t lim, int64_t n, float scale) {
  float m = -FLT_MAX;
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = Score(s[j], seen, j, lim, scale);
    nan |= s[j] != s[j];
    m = s[j] > m ? s[j] : m;
  }
  if (nan) m = NAN;
  for (int64_t j = 0; j < n; ++j) s[j] = s[j] - m;
}

FO_AVX2 inline void ScoresRowAvx2(float* s, const uint8_t* seen, int64_t lim, int64_t n, float scale) {
  const __m256 lowest = _mm256_set1_ps(-FLT_MAX), sc = _mm256_set1_ps(scale);
  __m256 m = lowest, nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = RoundBf16x8(_mm256_loadu_ps(s + j));
    if (scale != 0.0f) v = RoundBf16x8(_mm256_mul_ps(v, sc));
    __m256 hidden;
    if (j + 8 <= lim) {
      int64_t bytes;
      std::memcpy(&bytes, seen + j, 8);
      const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
      hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
    } else {
      alignas(32) int32_t h[8];
      for (int i = 0; i < 8; ++i) h[i] = (j + i >= lim || !seen[j + i]) ? -1 : 0;
      hidden = _mm256_load_ps(reinterpret_cast<const float*>(h));
    }
    v = _mm256_blendv_ps(v, lowest, hidden);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
    _mm256_storeu_ps(s + j, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = -FLT_MAX;
  for (float l : lanes) mx = l > mx ? l : mx;
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; j < n; ++j) {
    s[j] = Score(s[j], seen, j, lim, scale);
    any_nan |= s[j] != s[j];
    mx = s[j] > mx ? s[j] : mx;
  }
  const __m256 mv = _mm256_set1_ps(any_nan ? NAN : mx);
  for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
  for (; j < n; ++j) s[j] = s[j] - (any_nan ? NAN : mx);
}

// e [0, n) / z, rounded to bf16, in place.
inline void ProbsRowScalar(float* e, int64_t n, float z) {
  for (int64_t j = 0; j < n; ++j) e[j] = RoundBf16(e[j] / z);
}

FO_AVX2 inline void ProbsRowAvx2(float* e, int64_t n, float z) {
  const __m256 zv = _mm256_set1_ps(z);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(e + j, RoundBf16x8(_mm256_div_ps(_mm256_loadu_ps(e + j), zv)));
  for (; j < n; ++j) e[j] = RoundBf16(e[j] / z);
}

template <class Q>
struct CausalAttention {
  int64_t B, T, S, Hq, Hkv, D;
  const Q* q;              // [B, T, Hq, D]: element (b, t, h, d) at b * qsb + t * qst + h * qsh + d
  int64_t qsb, qst, qsh;
  float early_scale;       // the queries' scale (0: none; then late_scale)
  const float* kp;         // keys packed: [B * Hkv][Panels(S)][D][16]
  const float* vp;         // values transposed and packed: [B * Hkv][Panels(D)][S][16]
  const uint8_t* allowed;  // [B, T, S]: element (b, t, j) at b * ab + t * at + j
  int64_t ab, at;
  float late_scale;        // the scores' scale (0: none, the queries came scaled)
  Bf16* out;               // [B, T, Hq, D], contiguous
  static constexpr int64_t kQueries = 16;  // queries per task (times G heads: its rows)

  int64_t Tiles() const { return (T + kQueries - 1) / kQueries; }
  int64_t Tasks(int) const { return B * Hkv * Tiles(); }

  void Run(Isa isa, int64_t task) const {
    const int64_t G = Hq / Hkv, bh = task % (B * Hkv), b = bh / Hkv, h = bh % Hkv;
    const int64_t tile = Tiles() - 1 - task / (B * Hkv);  // the longest rows first
    const int64_t t0 = tile * kQueries, tq = T - t0 < kQueries ? T - t0 : kQueries;
    int64_t lim[kQueries], n = 0;
    for (int64_t i = 0; i < tq; ++i) {
      const uint8_t* seen = allowed + b * ab + (t0 + i) * at;
      int64_t j = S;
      while (j > 0 && !seen[j - 1]) --j;
      lim[i] = j == 0 ? S : j;  // a query that sees nothing averages every value
      n = lim[i] > n ? lim[i] : n;
    }
    const int64_t ld = Panels(n) * kPanel, rows = G * tq;
    thread_local std::vector<float> buf, sums, qs, ys;
    buf.resize(rows * ld);
    sums.resize(rows);
    qs.resize(rows * D);  // the tile's queries as the product takes them, [G][tq][D]
    ys.resize(tq * D);    // one head's outputs before their rounding, [tq][D]
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < tq; ++i) {
        const Q* src = q + b * qsb + (t0 + i) * qst + (h * G + g) * qsh;
        float* dst = qs.data() + (g * tq + i) * D;
        if (isa >= kAvx2) OperandRowAvx2(src, D, early_scale, dst);
        else OperandRowScalar(src, D, early_scale, dst);
      }
    const float* keys = kp + bh * Panels(S) * D * kPanel;
    for (int64_t g = 0; g < G; ++g)
      Columns(isa, qs.data() + g * tq * D, D, tq, keys, n, D, buf.data() + g * tq * ld, ld, 0, Panels(n));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % tq;
      const uint8_t* seen = allowed + b * ab + (t0 + i) * at;
      if (isa >= kAvx2) ScoresRowAvx2(buf.data() + r * ld, seen, lim[i], n, late_scale);
      else ScoresRowScalar(buf.data() + r * ld, seen, lim[i], n, late_scale);
      float* row = buf.data() + r * ld;
      if (isa >= kAvx512) ExpF32Avx512(row, row, n);
      else if (isa == kAvx2) ExpF32Avx2(row, row, n);
      else for (int64_t j = 0; j < n; ++j) row[j] = ExpF32(row[j]);
    }
    RowSums(isa, buf.data(), ld, rows, n, false, sums.data());
    for (int64_t r = 0; r < rows; ++r) {
      if (isa >= kAvx2) ProbsRowAvx2(buf.data() + r * ld, n, sums[r]);
      else ProbsRowScalar(buf.data() + r * ld, n, sums[r]);
    }
    const float* values = vp + bh * Panels(D) * S * kPanel;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t p = 0; p < Panels(D); ++p) {
        const int64_t cols = D - p * kPanel < kPanel ? D - p * kPanel : kPanel;
        Columns(isa, buf.data() + g * tq * ld, ld, tq, values + p * S * kPanel, cols, n, ys.data() + p * kPanel,
                D, 0, 1);
      }
      Bf16* y = out + ((b * T + t0) * Hq + h * G + g) * D;
      for (int64_t i = 0; i < tq; ++i) {
        if (isa >= kAvx2) Bf16RowAvx2(ys.data() + i * D, D, y + i * Hq * D);
        else Bf16RowScalar(ys.data() + i * D, D, y + i * Hq * D);
      }
    }
  }
};

// 8 attention operands (f32 or Bf16) as Bf16Operand takes them.
template <class W>
FO_AVX2 inline __m256 Operand8(const W* p) {
  if constexpr (std::is_same_v<W, float>) return RoundBf16x8(_mm256_loadu_ps(p));
  else return Load256(p);
}

// r[i][j] -> r[j][i] for an 8 x 8 block of floats.
FO_AVX2 inline void Transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i .. 4i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// The first `panels` whole panels of AttentionPack::PackOperand: rows of K contiguous values
// (sk 1: keys, 8 x 8 blocks transposed) or the panel's 16 values of each k contiguous (sn 1:
// values).
template <class W>
FO_AVX2 void PackPanelsAvx2(const W* w, int64_t panels, int64_t K, int64_t sn, int64_t sk, float* packed) {
  for (int64_t p = 0; p < panels; ++p) {
    float* out = packed + p * K * kPanel;
    if (sk == 1 && K % 8 == 0) {
      for (int64_t k0 = 0; k0 < K; k0 += 8)
        for (int64_t half = 0; half < 2; ++half) {
          __m256 r[8];
          for (int i = 0; i < 8; ++i) r[i] = Operand8(w + (p * kPanel + half * 8 + i) * sn + k0);
          Transpose8x8(r);
          for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + (k0 + j) * kPanel + half * 8, r[j]);
        }
    } else {
      for (int64_t k = 0; k < K; ++k) {
        const W* src = w + p * kPanel + k * sk;
        _mm256_storeu_ps(out + k * kPanel, Operand8(src));
        _mm256_storeu_ps(out + k * kPanel + 8, Operand8(src + 8));
      }
    }
  }
}

// Packs the keys and the transposed values of each (b, kv head) for CausalAttention: task
// 2 * bh (keys) and 2 * bh + 1 (values). k, v (f32 or Bf16: Bf16Operand) element (b, s, h, d) at
// b * sb + s * ss + h * sh + d.
template <class KeyT, class ValueT>
struct AttentionPack {
  int64_t B, S, Hkv, D;
  const KeyT* k;
  const ValueT* v;
  int64_t ksb, kss, ksh, vsb, vss, vsh;
  float *kp, *vp;

  int64_t Tasks(int) const { return 2 * B * Hkv; }

  void Run(Isa isa, int64_t task) const {
    const int64_t bh = task / 2, b = bh / Hkv, h = bh % Hkv;
    if (task % 2 == 0)
      PackOperand(isa, k + b * ksb + h * ksh, S, D, kss, int64_t{1}, kp + bh * Panels(S) * D * kPanel);
    else
      PackOperand(isa, v + b * vsb + h * vsh, D, S, int64_t{1}, vss, vp + bh * Panels(D) * S * kPanel);
  }

  // Pack's layout, each element as Bf16Operand takes it (zeros past N): whole panels 8 values at
  // a time where the CPU runs AVX2 (a decode step packs every key and value of the cache), the
  // rest one by one. Moves and exact conversions only: the same packed values either way.
  template <class W>
  static void PackOperand(Isa isa, const W* w, int64_t N, int64_t K, int64_t sn, int64_t sk, float* packed) {
    int64_t p = 0;
    if (isa >= kAvx2 && ((sk == 1 && K % 8 == 0) || sn == 1)) {
      p = N / kPanel;
      PackPanelsAvx2(w, p, K, sn, sk, packed);
    }
    for (; p < Panels(N); ++p)
      for (int64_t kk = 0; kk < K; ++kk)
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t n = p * kPanel + j;
          packed[(p * K + kk) * kPanel + j] = n < N ? Bf16Operand(w[n * sn + kk * sk]) : 0.0f;
        }
  }
};

// ----- RoPE of a bf16 policy (torchref) --------------------------------------------------
//
// For a row x [D] of a query or key head and its position's tables c, s [D] (bf16, h = D / 2):
//   y[d] = bf16(bf16(x[d] * c[d]) + bf16(r[d] * s[d])),  r = rotate_half(x) = [-x[h:], x[:h]]
// torch's bf16 ops one by one (apply_rope: mul, neg, cat, mul, add), each in f32 and rounded to
// nearest even (RoundBf16): the product of two bf16 values is exact in f32, the sum is rounded
// to f32 and then to bf16 as torch's bf16 add does. The same bits as torch's ops on every CPU
// and code path (a NaN stays NaN; its sign and payload may differ).

inline void RopeRowScalar(const Bf16* x, const Bf16* c, const Bf16* s, int64_t D, Bf16* y) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float r = d < h ? -ToF32(x[d + h]) : ToF32(x[d - h]);
    const float a = RoundBf16(ToF32(x[d]) * ToF32(c[d])), b = RoundBf16(r * ToF32(s[d]));
    y[d] = Bf16{Bf16Bits(RoundBf16(a + b))};
  }
}

FO_AVX2 inline void RopeRowAvx2(const Bf16* x, const Bf16* c, const Bf16* s, int64_t D, Bf16* y) {
  const int64_t h = D / 2;
  if (h % 8 != 0) return RopeRowScalar(x, c, s, D, y);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t d = 0; d < h; d += 8) {
    const __m256 x1 = Load256(x + d), x2 = Load256(x + h + d);
    // y[:h] = x1 c1 - x2 s1, y[h:] = x2 c2 + x1 s2; negation flips the sign bit, as torch's neg
    const __m256 lo = _mm256_add_ps(RoundBf16x8(_mm256_mul_ps(x1, Load256(c + d))),
                                    RoundBf16x8(_mm256_mul_ps(_mm256_xor_ps(x2, sign), Load256(s + d))));
    const __m256 hi = _mm256_add_ps(RoundBf16x8(_mm256_mul_ps(x2, Load256(c + h + d))),
                                    RoundBf16x8(_mm256_mul_ps(x1, Load256(s + h + d))));
    StoreBf16x8(y + d, RoundBf16x8(lo));
    StoreBf16x8(y + h + d, RoundBf16x8(hi));
  }
}

// Queries [B, T, Hq, D] and keys [B, T, Hk, D] (element (b, t, h, d) at b * sb + t * st + h * sh
// + d), each with its own tables [B, T, D] (b * cb + t * ct + d), into contiguous outputs.
struct RopeJob {
  int64_t B, T, D;
  struct Part {
    int64_t H;
    const Bf16* x;
    int64_t sb, st, sh;
    const Bf16 *c, *s;
    int64_t cb, ct;
    Bf16* y;
  } parts[2];
  static constexpr int64_t kElements = int64_t{1} << 14;  // about this many outputs a task

  int64_t Positions() const {  // a task's positions
    const int64_t per = (parts[0].H + parts[1].H) * D;
    return per >= kElements ? 1 : kElements / per;
  }
  int64_t Tasks(int threads) const { return threads <= 1 ? 1 : (B * T + Positions() - 1) / Positions(); }

  void Run(Isa isa, int64_t t, int64_t tasks) const {
    const int64_t size = tasks == 1 ? B * T : Positions(), p0 = t * size, p1 = p0 + size < B * T ? p0 + size : B * T;
    for (const Part& q : parts)
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / T, i = p % T;
        const Bf16 *c = q.c + b * q.cb + i * q.ct, *s = q.s + b * q.cb + i * q.ct;
        for (int64_t hh = 0; hh < q.H; ++hh) {
          const Bf16* x = q.x + b * q.sb + i * q.st + hh * q.sh;
          Bf16* y = q.y + (p * q.H + hh) * D;
          if (isa >= kAvx2) RopeRowAvx2(x, c, s, D, y);
          else RopeRowScalar(x, c, s, D, y);
        }
      }
  }
};

// ----- torch's own order for one row of 16-bit operands (the fast backend) ------------------
// Where oneDNN does not take it, torch multiplies one row of bf16 or fp16 operands by a matrix
// with ATen's dot kernel (dot_with_fp32_arith), one dot per output, on 8 f32 lanes at every CPU
// capability (measured: tests/test_aten_order.py). A dot of x and w over K elements is this
// scalar program:
//
//   s[e], e < 64:  s[e] += x[j + e] * w[j + e] for each block j of 64 elements (8 registers of 8)
//   registers:     s[8r + l] += s[8(r + h) + l] for r < h, h = 4, 2, 1 (a tree: s[0..8) left)
//   sum = H(s[0..8)), H: the 8 lanes summed as a butterfly (l + (l ^ 4), then ^ 2, then ^ 1;
//                   lane 0) at torch's AVX2 and AVX512 capabilities, in lane order at DEFAULT
//   t[l], l < 8:   t[l] += x[j + l] w[j + l]; t[l] += x[j + 8 + l] w[j + 8 + l] for each block j
//                   of 16 elements after the 64-element blocks
//   sum += H(t); then sum += x[k] w[k] for each element after, in order
//
// Products fused with the sums (FMA) at AVX2 / AVX512, multiplied then added at DEFAULT (the
// product of two 16-bit numbers is exact in f32 unless it underflows: only there does it matter).
// The vector paths below compute this program. Unlike the rest of this file, the order follows
// torch's CPU capability (H): it gives torch's bits, not one set of bits everywhere.

constexpr int kAtenLanes = 8;

inline float AtenMadd(float a, float b, float c, bool fused) { return fused ? std::fma(a, b, c) : c + a * b; }

// H: 8 lanes summed as torch's capability does
inline float AtenLanes(const float* v, bool sequential) {
  float t[kAtenLanes];
  std::memcpy(t, v, sizeof t);
  if (sequential) {
    float a = t[0];
    for (int l = 1; l < kAtenLanes; ++l) a = a + t[l];
    return a;
  }
  for (int h = kAtenLanes / 2; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) t[l] = t[l] + t[l + h];
  return t[0];
}

// The program after the 64-element blocks (s: their 64 sums): the register tree, H, the
// 16-element tail and the scalar tail.
template <class W>
inline float AtenFinish(float* s, const W* x, const W* w, int64_t K, bool sequential) {
  constexpr int L = kAtenLanes;
  const int64_t aligned = K & ~int64_t(8 * L - 1), vec_end = K & ~int64_t(2 * L - 1);
  for (int h = 4; h >= 1; h /= 2)
    for (int r = 0; r < h; ++r)
      for (int l = 0; l < L; ++l) s[r * L + l] = s[r * L + l] + s[(r + h) * L + l];
  float sum = AtenLanes(s, sequential), t[L] = {};
  for (int64_t j = aligned; j < vec_end; j += 2 * L) {
    for (int l = 0; l < L; ++l) t[l] = AtenMadd(ToF32(x[j + l]), ToF32(w[j + l]), t[l], !sequential);
    for (int l = 0; l < L; ++l) t[l] = AtenMadd(ToF32(x[j + L + l]), ToF32(w[j + L + l]), t[l], !sequential);
  }
  sum = sum + AtenLanes(t, sequential);
  for (int64_t k = vec_end; k < K; ++k) sum = sum + ToF32(x[k]) * ToF32(w[k]);
  return sum;
}

template <class W>
inline float AtenDotScalar(const W* x, const W* w, int64_t K, bool sequential) {
  float s[8 * kAtenLanes] = {};
  const int64_t aligned = K & ~int64_t(8 * kAtenLanes - 1);
  for (int64_t j = 0; j < aligned; j += 8 * kAtenLanes)
    for (int e = 0; e < 8 * kAtenLanes; ++e) s[e] = AtenMadd(ToF32(x[j + e]), ToF32(w[j + e]), s[e], !sequential);
  return AtenFinish(s, x, w, K, sequential);
}

// H at AVX2 / AVX512 on one 8-lane register: the butterfly's three adds, lane 0
FO_AVX2 inline float AtenLanes256(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));   // l + (l ^ 4)
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));     // ^ 2
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));     // ^ 1
  return _mm256_cvtss_f32(v);
}

// The fused program after the register tree (s: register 0), in AVX2 registers
template <class W>
FO_AVX2 inline float AtenTail256(__m256 s, const W* x, const W* w, int64_t K) {
  const int64_t aligned = K & ~int64_t(63), vec_end = K & ~int64_t(15);
  __m256 t = _mm256_setzero_ps();
  for (int64_t j = aligned; j < vec_end; j += 16) {
    t = _mm256_fmadd_ps(Load256(x + j), Load256(w + j), t);
    t = _mm256_fmadd_ps(Load256(x + j + 8), Load256(w + j + 8), t);
  }
  float sum = AtenLanes256(s) + AtenLanes256(t);
  for (int64_t k = vec_end; k < K; ++k) sum = sum + ToF32(x[k]) * ToF32(w[k]);
  return sum;
}

// The fused program with the 64 sums in 4 AVX-512 registers (registers 2v and 2v + 1 of the
// program in the low and high halves of acc[v]): the tree's first two levels are two adds of
// whole AVX-512 registers, its last one the halves of acc[0]
template <class W>
FO_AVX512 inline float AtenDot512(const W* x, const W* w, int64_t K) {
  __m512 acc[4];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const int64_t aligned = K & ~int64_t(63);
  for (int64_t j = 0; j < aligned; j += 64)
    for (int v = 0; v < 4; ++v) acc[v] = _mm512_fmadd_ps(Load512(x + j + 16 * v), Load512(w + j + 16 * v), acc[v]);
  const __m512 r01 = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r01), 1));
  const __m256 r0 = _mm256_add_ps(_mm512_castps512_ps256(r01), high);
  return AtenTail256(r0, x, w, K);
}

// ... in 8 AVX2 registers
template <class W>
FO_AVX2 inline float AtenDot256(const W* x, const W* w, int64_t K) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const int64_t aligned = K & ~int64_t(63);
  for (int64_t j = 0; j < aligned; j += 64)
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(Load256(x + j + 8 * v), Load256(w + j + 8 * v), acc[v]);
  for (int h = 4; h >= 1; h /= 2)
    for (int r = 0; r < h; ++r) acc[r] = _mm256_add_ps(acc[r], acc[r + h]);
  return AtenTail256(acc[0], x, w, K);
}

// y[n] = the dot of x [K] and w[n] (row n at n * ldw) in torch's order, n < N, in f32.
struct AtenDots {
  int64_t N, K;
  const void* x;
  const void* w;
  int64_t ldw;
  bool f16, sequential;
  float* y;
  // a memory-bound product: split across threads from a few thousand multiply-adds, in at
  // most 4 tasks a thread of at least 16 outputs each
  int64_t Tasks(int threads) const {
    if (threads <= 1 || N * K < (int64_t{1} << 14)) return 1;
    const int64_t most = 4 * int64_t(threads), by_rows = (N + 15) / 16;
    return by_rows < most ? by_rows : most;
  }

  void Run(Isa isa, int64_t t, int64_t tasks) const {
    const int64_t size = (N + tasks - 1) / tasks, n0 = t * size, n1 = n0 + size < N ? n0 + size : N;
    if (f16) Rows(isa, static_cast<const F16*>(x), static_cast<const F16*>(w), n0, n1);
    else Rows(isa, static_cast<const Bf16*>(x), static_cast<const Bf16*>(w), n0, n1);
  }

  template <class W> void Rows(Isa isa, const W* xs, const W* ws, int64_t n0, int64_t n1) const {
    for (int64_t n = n0; n < n1; ++n) {
      const W* row = ws + n * ldw;
      if (!sequential && isa >= kAvx512) y[n] = AtenDot512(xs, row, K);
      else if (!sequential && isa >= kAvx2) y[n] = AtenDot256(xs, row, K);
      else y[n] = AtenDotScalar(xs, row, K, sequential);
    }
  }
};

}  // namespace fo
