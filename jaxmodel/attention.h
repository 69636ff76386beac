// Attention in one pass per block of queries, on fixed_order.h's tiles: jaxmodel's CPU
// attention (ops.fused_attention) with the policy's rounding points and none of the
// [T, S] passes XLA makes over materialised scores.
//
// For one query row (query t, head g of KV head h) the result is defined by this program,
// in the accumulator A (f32, or f64 for an f64 policy), "round" meaning a rounding to the
// compute dtype (bf16; nothing for f32 and f64):
//
//   keys      the allowed ones, from the first to the last allowed slot (lo..hi); a query
//             that may see no key at all averages every value, as ops.attention does (its
//             probabilities are all 1/S there), with p = round(1 / S)
//   scores    s_j = round(q . k_j), q . k_j one fma chain (fixed_order's gemm) per block of
//             kDimBlock dims ascending, the blocks' sums added in order (one chain over all
//             64 dims of SmolLM2's heads was 1.8x XLA's error, measured); then, unless the
//             queries came scaled (`early`), s_j = round(s_j * scale)
//   softmax   masked s_j = -inf; m = max of the allowed s_j (NaN if one is NaN);
//             e_j = exp(s_j - m) by fixed_order's exp program; sum = the e_j added in 16
//             lanes (lane = j mod 16, keys ascending), the lanes then added pairwise
//             (lane i + lane i + 8, then + 4, + 2, + 1); p_j = round(e_j * (1 / sum)), as
//             torch's softmax kernel (XLA divides: one rounding apart)
//   p . v     per block of kKeyBlock keys (slots [64 i, 64 i + 64)) one fma chain over
//             the block's keys ascending; the blocks' sums added in order; then round
//
// Masked keys and keys past a row's own last one have p = 0 exactly and add +0 to a chain
// (their values finite), so the result does not depend on which rows share a block, on the
// batch, on the thread count, or on the instruction set (the vector code computes the scalar
// program lane by lane; the exp and rounding programs are straight-line). A non-finite value
// makes 0 * inf = NaN for the queries of a block that do not see it, as ops.attention does
// for every query. Against ops.attention (XLA's reductions and products) only the order of
// the sums differs (and one division is a reciprocal's product): drift, not the policy.
#pragma once

#include <string.h>  // memrchr

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fixed_order.h"

namespace fa {

using fo::Bf16;
using fo::Isa;

enum DType : int { kF32 = 0, kBF16 = 1, kF64 = 3 };  // fixed_order's WType numbers

constexpr int64_t kLanes = 16;      // the softmax sum's lanes
constexpr int64_t kKeyBlock = 64;   // keys per chain of p . v
constexpr int64_t kDimBlock = 16;   // dims per chain of q . k
constexpr int64_t kQueries = 16;    // queries per task (times G heads: the rows of its tiles)

// ----- rounding to bf16 (round to nearest even; NaN stays NaN, quiet) -----------------

inline float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = x != x ? ((u | 0x00400000u) & 0xFFFF0000u) : ((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  std::memcpy(&x, &u, 4);
  return x;
}

FO_AVX512 inline __m512 RoundBf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x), high = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), high);
  const __m512i nan = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), high);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, nan));
}

FO_AVX2 inline __m256 RoundBf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x), high = _mm256_set1_epi32(int(0xFFFF0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), high);
  const __m256i nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), high);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

template <class A> inline A Exp(A x);
template <> inline float Exp<float>(float x) { return fo::ExpF32(x); }
template <> inline double Exp<double>(double x) { return fo::ExpF64(x); }

template <class A> inline A LanesSum(A (&lanes)[kLanes]) {
  for (int64_t w = kLanes / 2; w >= 1; w /= 2)
    for (int64_t i = 0; i < w; ++i) lanes[i] = lanes[i] + lanes[i + w];
  return lanes[0];
}

// x rounded to bf16 when the compute dtype is bf16 (an f32 or f64 one: x as it is)
template <class A> inline A Round(A x, bool bf16) {
  if constexpr (std::is_same_v<A, float>) return bf16 ? RoundBf16(x) : x;
  return x;
}

// ----- one row's scores -> probabilities, in place (n a multiple of kLanes) -----------

struct RowSpec {
  bool bf16, early;
  double scale;
};

// The definition (and the f64 path).
template <class A>
void RowScalar(A* s, const uint8_t* allowed, int64_t n, const RowSpec& spec) {
  const A inf = std::numeric_limits<A>::infinity(), scale = A(spec.scale);
  auto round = [&](A x) { return Round(x, spec.bf16); };
  A m = -inf;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    A x = round(s[i]);
    if (!spec.early) x = round(x * scale);
    if (!allowed[i]) x = -inf;
    else if (x != x) nan = true;
    else if (x > m) m = x;
    s[i] = x;
  }
  if (nan) m = std::numeric_limits<A>::quiet_NaN();
  A lanes[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    s[i] = Exp<A>(s[i] - m);
    lanes[i % kLanes] = lanes[i % kLanes] + s[i];
  }
  const A r = A(1) / LanesSum(lanes);
  for (int64_t i = 0; i < n; ++i) s[i] = round(s[i] * r);
}

FO_AVX512 void Row512(float* s, const uint8_t* allowed, int64_t n, const RowSpec& spec) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(float(spec.scale));
  __m512 mx = ninf;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(allowed + i));
    const __mmask16 ok = _mm512_cmpneq_epi32_mask(_mm512_cvtepu8_epi32(bytes), _mm512_setzero_si512());
    __m512 x = _mm512_loadu_ps(s + i);
    if (spec.bf16) x = RoundBf16x16(x);
    if (!spec.early) {
      x = _mm512_mul_ps(x, scale);
      if (spec.bf16) x = RoundBf16x16(x);
    }
    nan |= ok & _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    x = _mm512_mask_blend_ps(ok, ninf, x);
    mx = _mm512_max_ps(mx, x);
    _mm512_storeu_ps(s + i, x);
  }
  const float m = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m512 e = fo::Exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
    acc = _mm512_add_ps(acc, e);
    _mm512_storeu_ps(s + i, e);
  }
  float lanes[kLanes];
  _mm512_storeu_ps(lanes, acc);
  const __m512 r = _mm512_set1_ps(1.0f / LanesSum(lanes));
  for (int64_t i = 0; i < n; i += kLanes) {
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(s + i), r);
    if (spec.bf16) p = RoundBf16x16(p);
    _mm512_storeu_ps(s + i, p);
  }
}

FO_AVX2 void Row256(float* s, const uint8_t* allowed, int64_t n, const RowSpec& spec) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY), scale = _mm256_set1_ps(float(spec.scale));
  __m256 mx = ninf, nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(allowed + i));
    const __m256 ok = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256()));
    __m256 x = _mm256_loadu_ps(s + i);
    if (spec.bf16) x = RoundBf16x8(x);
    if (!spec.early) {
      x = _mm256_mul_ps(x, scale);
      if (spec.bf16) x = RoundBf16x8(x);
    }
    nan = _mm256_or_ps(nan, _mm256_and_ps(ok, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    x = _mm256_blendv_ps(ninf, x, ok);
    mx = _mm256_max_ps(mx, x);
    _mm256_storeu_ps(s + i, x);
  }
  float lanes[kLanes];
  _mm256_storeu_ps(lanes, mx);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = lanes[i] > m ? lanes[i] : m;
  if (_mm256_movemask_ps(nan)) m = std::numeric_limits<float>::quiet_NaN();
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0-7 and 8-15
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = fo::Exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    acc[(i / 8) % 2] = _mm256_add_ps(acc[(i / 8) % 2], e);
    _mm256_storeu_ps(s + i, e);
  }
  _mm256_storeu_ps(lanes, acc[0]);
  _mm256_storeu_ps(lanes + 8, acc[1]);
  const __m256 r = _mm256_set1_ps(1.0f / LanesSum(lanes));
  for (int64_t i = 0; i < n; i += 8) {
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(s + i), r);
    if (spec.bf16) p = RoundBf16x8(p);
    _mm256_storeu_ps(s + i, p);
  }
}

template <class A>
void Row(Isa isa, A* s, const uint8_t* allowed, int64_t n, const RowSpec& spec) {
  if constexpr (std::is_same_v<A, float>) {
    if (isa >= fo::kAvx512) return Row512(s, allowed, n, spec);
    if (isa == fo::kAvx2) return Row256(s, allowed, n, spec);
  }
  RowScalar(s, allowed, n, spec);
}

// ----- q . k on AVX-512 and AVX2: the block sums kept in the tile ----------------------

// Rows [0, MR) of x (ldx apart) against NP panels of 16 keys from panel `first` on: y = the
// sum over the blocks of kDimBlock dims, in order, of one fma chain per block (the first
// block's chain as it is). The same program as fixed_order's Columns per block followed by
// an in-order add, which the scalar path runs; here without writing each block's sums.
template <int MR, int NP, class W>
FO_AVX512 void Scores512(const float* x, int64_t ldx, const W* keys, int64_t panels, int64_t first, int64_t D,
                         float* y, int64_t ldy, int64_t cols) {
  __m512 total[MR][NP];
  for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
    const int64_t dims = std::min(kDimBlock, D - d0);
    const W* block = keys + panels * fo::kPanel * d0 + first * dims * fo::kPanel;
    __m512 acc[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t k = 0; k < dims; ++k) {
      __m512 w[NP];
      for (int p = 0; p < NP; ++p) w[p] = fo::Load512(block + (p * dims + k) * fo::kPanel);
      for (int r = 0; r < MR; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + d0 + k]);
        for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) total[r][p] = d0 == 0 ? acc[r][p] : _mm512_add_ps(total[r][p], acc[r][p]);
  }
  fo::Store512<MR, NP>(total, y, ldy, cols);
}

// The same program on AVX2, rows [0, MR) against one panel of 16 keys (two ymm): the chains of
// a block in registers (fixed_order's 6-row AVX2 tile), the blocks' running sums in a tile of
// the stack (L1; 12 more registers do not fit), added in order after each block.
template <int MR, class W>
FO_AVX2 void Scores256(const float* x, int64_t ldx, const W* keys, int64_t panels, int64_t first, int64_t D,
                       float* y, int64_t ldy, int64_t cols) {
  alignas(32) float total[MR][fo::kPanel];
  for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
    const int64_t dims = std::min(kDimBlock, D - d0);
    const W* block = keys + panels * fo::kPanel * d0 + first * dims * fo::kPanel;
    __m256 acc[MR][2];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < dims; ++k) {
      const __m256 w0 = fo::Load256(block + k * fo::kPanel), w1 = fo::Load256(block + k * fo::kPanel + 8);
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + d0 + k);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) {
        float* t = total[r] + 8 * h;
        _mm256_store_ps(t, d0 == 0 ? acc[r][h] : _mm256_add_ps(_mm256_load_ps(t), acc[r][h]));
      }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(y + r * ldy, total[r], std::min<int64_t>(cols, fo::kPanel) * sizeof(float));
}

// y[R, width] = q . k for rows x [R, D] against the keys from panel `first` on, in
// PrepareTyped's layout (`panels` panels of 16 keys for each block of dims).
template <class A, class W>
void Scores(Isa isa, const A* x, int64_t R, int64_t D, const W* keys, int64_t panels, int64_t first, int64_t width,
            A* y, A* part) {
  if constexpr (std::is_same_v<A, float>) {
    if (isa >= fo::kAvx512) {
      for (int64_t p = 0; p < fo::Panels(width); p += 2) {  // width is a multiple of 32
        float* out = y + p * fo::kPanel;
        const int64_t cols = width - p * fo::kPanel;
        for (int64_t r = 0; r < R;) {
          const int64_t left = R - r;
          if (left >= 6) Scores512<6, 2>(x + r * D, D, keys, panels, first + p, D, out + r * width, width, cols), r += 6;
          else if (left >= 3) Scores512<3, 2>(x + r * D, D, keys, panels, first + p, D, out + r * width, width, cols), r += 3;
          else Scores512<1, 2>(x + r * D, D, keys, panels, first + p, D, out + r * width, width, cols), r += 1;
        }
      }
      return;
    }
    if (isa == fo::kAvx2) {
      for (int64_t p = 0; p < fo::Panels(width); ++p) {
        float* out = y + p * fo::kPanel;
        const int64_t cols = width - p * fo::kPanel;
        for (int64_t r = 0; r < R;) {
          const int64_t left = R - r;
          if (left >= 6) Scores256<6>(x + r * D, D, keys, panels, first + p, D, out + r * width, width, cols), r += 6;
          else if (left >= 3) Scores256<3>(x + r * D, D, keys, panels, first + p, D, out + r * width, width, cols), r += 3;
          else Scores256<1>(x + r * D, D, keys, panels, first + p, D, out + r * width, width, cols), r += 1;
        }
      }
      return;
    }
  }
  for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
    const int64_t dims = std::min(kDimBlock, D - d0);
    const W* block = keys + panels * fo::kPanel * d0 + first * dims * fo::kPanel;
    A* out = d0 == 0 ? y : part;
    fo::Columns(isa, x + d0, D, R, block, width, dims, out, width, 0, fo::Panels(width));
    if (d0 > 0)
      for (int64_t i = 0; i < R * width; ++i) y[i] = y[i] + part[i];
  }
}

template <class A, class V> inline A Load(V v) {
  if constexpr (std::is_same_v<V, Bf16>) return A(fo::Bf16ToF32(v.bits));
  else return A(v);
}

inline int64_t Up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ----- the job -----------------------------------------------------------------------
// q, out [B, T, Hkv, G, D] in the compute dtype (q already scaled when early); k, v
// [B, S, Hkv, D] in the compute dtype or (bf16) as f32 copies of bf16 values; allowed
// [B, T, S] bytes (0 or 1). Two phases, each a set of independent tasks:
//   Prepare(b, h): pack head h's keys and values (and, for h = 0, find each query's first
//                  and last allowed key) into the scratch the caller gives (ScratchBytes)
//   Run(task):     kQueries queries of one KV head of one row of the batch
struct AttentionJob {
  int64_t B, T, S, Hkv, G, D;
  const void* q;
  int qtype;
  const void* k;
  const void* v;
  int kvtype;
  const uint8_t* allowed;
  void* out;
  double scale;
  bool early;
  void* scratch = nullptr;

  int64_t Slots() const { return Up(S, kKeyBlock); }  // packed keys, zero past S
  int64_t KvBytes() const { return kvtype == kBF16 ? 2 : kvtype == kF64 ? 8 : 4; }
  int64_t PackedKeys() const { return fo::Panels(Slots()) * D * fo::kPanel; }          // elements, per head
  int64_t PackedValues() const { return Slots() * fo::Panels(D) * fo::kPanel; }       // elements, per head
  int64_t ScratchBytes() const { return B * T * 2 * 8 + B * Hkv * (PackedKeys() + PackedValues()) * KvBytes(); }
  int64_t* Bounds() const { return static_cast<int64_t*>(scratch); }  // [B, T, 2]: first, last (-1: none)
  template <class V> V* Keys(int64_t bh) const {
    return reinterpret_cast<V*>(static_cast<char*>(scratch) + B * T * 2 * 8) + bh * (PackedKeys() + PackedValues());
  }
  template <class V> V* Values(int64_t bh) const { return Keys<V>(bh) + PackedKeys(); }

  int64_t Blocks() const { return (T + kQueries - 1) / kQueries; }
  int64_t Tasks(int) const { return B * Hkv * Blocks(); }

  struct Prepare {
    const AttentionJob* job;
    void Run(Isa, int64_t t, int64_t) const {
      if (job->kvtype == kBF16) job->PrepareTyped<Bf16>(t);
      else if (job->kvtype == kF64) job->PrepareTyped<double>(t);
      else job->PrepareTyped<float>(t);
    }
  };

  // Keys as fixed_order's panels of 16 keys [D][16]; values per block of kKeyBlock keys as
  // panels of 16 of D [kKeyBlock][16]; zeros past S.
  template <class V> void PrepareTyped(int64_t bh) const {
    const int64_t b = bh / Hkv, h = bh % Hkv, ld = Hkv * D, blocks = Slots() / kKeyBlock;
    const V* kb = static_cast<const V*>(k) + b * S * ld + h * D;
    const V* vb = static_cast<const V*>(v) + b * S * ld + h * D;
    V* keys = Keys<V>(bh);
    const int64_t panels = fo::Panels(Slots());
    for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {  // one set of panels per block of dims
      const int64_t dims = std::min(kDimBlock, D - d0);
      V* block = keys + panels * fo::kPanel * d0;
      fo::Pack(kb + d0, S, dims, ld, 1, block);
      std::memset(static_cast<void*>(block + fo::Panels(S) * dims * fo::kPanel), 0,
                  (panels - fo::Panels(S)) * dims * fo::kPanel * sizeof(V));
    }
    V* values = Values<V>(bh);
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t n = std::min(kKeyBlock, S - j * kKeyBlock);
      for (int64_t p = 0; p < fo::Panels(D); ++p) {  // one panel at a time: its rows kKeyBlock apart
        V* panel = values + (j * fo::Panels(D) + p) * kKeyBlock * fo::kPanel;
        fo::Pack(vb + j * kKeyBlock * ld + p * fo::kPanel, std::min(fo::kPanel, D - p * fo::kPanel), n, 1, ld, panel);
        std::memset(static_cast<void*>(panel + n * fo::kPanel), 0, (kKeyBlock - n) * fo::kPanel * sizeof(V));
      }
    }
    if (h == 0)
      for (int64_t t = 0; t < T; ++t) {
        const uint8_t* row = allowed + (b * T + t) * S;
        const void* first = std::memchr(row, 1, S);
        const void* last = memrchr(row, 1, S);
        Bounds()[(b * T + t) * 2] = first ? static_cast<const uint8_t*>(first) - row : -1;
        Bounds()[(b * T + t) * 2 + 1] = last ? static_cast<const uint8_t*>(last) - row : -1;
      }
  }

  // The last query blocks first: under a causal mask they have the most keys.
  void Run(Isa isa, int64_t t, int64_t) const {
    const int64_t block = Blocks() - 1 - t / (B * Hkv), bh = t % (B * Hkv);
    const int64_t t0 = block * kQueries, t1 = std::min(T, t0 + kQueries);
    if (qtype == kF64) return Typed<double, double, double>(isa, bh, t0, t1);
    if (qtype == kF32) return Typed<float, float, float>(isa, bh, t0, t1);
    if (kvtype == kBF16) return Typed<float, Bf16, Bf16>(isa, bh, t0, t1);
    Typed<float, Bf16, float>(isa, bh, t0, t1);
  }

  template <class A, class Q, class V>
  void Typed(Isa isa, int64_t bh, int64_t t0, int64_t t1) const {
    thread_local std::vector<A> qs, scores, sums, part;
    thread_local std::vector<uint8_t> masks;
    const int64_t b = bh / Hkv;
    const bool bf16 = qtype == kBF16;
    const int64_t* bounds = Bounds() + b * T * 2;
    int64_t lo = S, hi = -1, seen = 0, blind = 0;
    for (int64_t t = t0; t < t1; ++t) {
      if (bounds[2 * t] < 0) { ++blind; continue; }
      lo = std::min(lo, bounds[2 * t]), hi = std::max(hi, bounds[2 * t + 1]), ++seen;
    }
    const int64_t ldq = Hkv * G * D;  // between queries, in q and out
    const Q* qb = static_cast<const Q*>(q) + b * T * ldq + (bh % Hkv) * G * D;
    Q* ob = static_cast<Q*>(out) + b * T * ldq + (bh % Hkv) * G * D;
    auto store = [&](bool blinds) {
      for (int64_t t = t0, r = 0; t < t1; ++t) {
        if ((bounds[2 * t] < 0) != blinds) continue;
        for (int64_t i = 0; i < G * D; ++i) ob[t * ldq + i] = Store<Q>(Round(sums[r * D + i], bf16));
        r += G;
      }
    };
    if (seen) {
      lo = lo / kKeyBlock * kKeyBlock;
      const int64_t width = Up(hi + 1 - lo, kKeyBlock), R = seen * G, n = std::min(width, S - lo);
      qs.resize(R * D), scores.resize(R * width), sums.resize(R * D), part.resize(R * std::max(width, D));
      masks.assign(seen * width, 0);
      for (int64_t t = t0, r = 0; t < t1; ++t) {
        if (bounds[2 * t] < 0) continue;
        std::memcpy(masks.data() + (r / G) * width, allowed + (b * T + t) * S + lo, n);
        for (int64_t i = 0; i < G * D; ++i) qs[r * D + i] = Load<A>(qb[t * ldq + i]);
        r += G;
      }
      Scores(isa, qs.data(), R, D, Keys<V>(bh), fo::Panels(Slots()), lo / fo::kPanel, width, scores.data(),
             part.data());
      const RowSpec spec{bf16, early, scale};
      for (int64_t i = 0; i < R; ++i) Row(isa, scores.data() + i * width, masks.data() + (i / G) * width, width, spec);
      ValueSums<A, V>(isa, bh, scores.data(), width, R, lo, lo + width, sums.data(), part.data());
      store(false);
    }
    if (blind) {  // every value, each with p = round(1 / S)
      const int64_t R = blind * G, width = Slots();
      scores.assign(R * width, Round(A(1) / A(S), bf16));
      for (int64_t r = 0; r < R; ++r) std::fill(scores.begin() + r * width + S, scores.begin() + (r + 1) * width, A(0));
      sums.resize(R * D), part.resize(R * D);
      ValueSums<A, V>(isa, bh, scores.data(), width, R, 0, width, sums.data(), part.data());
      store(true);
    }
  }

  // sums[R, D] = p[R, slots a..z) . v (a, z multiples of kKeyBlock; p's column 0 is slot a),
  // one chain per block, the blocks' sums added in order.
  template <class A, class V>
  void ValueSums(Isa isa, int64_t bh, const A* p, int64_t ldp, int64_t R, int64_t a, int64_t z, A* sums,
                 A* part) const {
    std::fill(sums, sums + R * D, A(0));
    for (int64_t j0 = a; j0 < z; j0 += kKeyBlock) {
      const V* block = Values<V>(bh) + (j0 / kKeyBlock) * fo::Panels(D) * kKeyBlock * fo::kPanel;
      fo::Columns(isa, p + (j0 - a), ldp, R, block, D, kKeyBlock, part, D, 0, fo::Panels(D));
      for (int64_t i = 0; i < R * D; ++i) sums[i] = sums[i] + part[i];
    }
  }

  template <class Q, class A> static Q Store(A x) {
    if constexpr (std::is_same_v<Q, Bf16>) {
      uint32_t u;
      std::memcpy(&u, &x, 4);  // x already rounded to bf16
      return Bf16{uint16_t(u >> 16)};
    } else {
      return Q(x);
    }
  }
};

}  // namespace fa
