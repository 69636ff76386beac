// A matrix product whose every output is summed in one fixed order, whatever the number
// of rows: y[m, n] = sum_k x[m, k] * w[n, k] for x [M, K], w [N, K] (HF layout), f32.
// An XLA FFI custom call (jaxmodel/rowdot.py builds and registers it); the batch-invariant
// mode runs one-token-per-sequence calls (decode) on it, because XLA:CPU computes a
// 1-row product (its own matrix-vector code) in another order than 2+ rows (YNNPACK).
//
// The order, for each output: 8 partial sums, lane j taking k = j, j + 8, j + 16, ... in
// turn (each product and each sum rounded to f32: no FMA contraction, -ffp-contract=off);
// the last K % 8 products go to lanes 0, 1, ...; then the lanes are added as
// ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)). tests/test_batch_invariant.py checks this
// order against a numpy transcription of it.
//
// Speed: the weights are read once per call whatever M (outputs are computed in blocks of
// 2 rows x 4 weight rows), and the weight rows are shared out among XLA's intra-op threads.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

float Finish(__m256 acc, const float* x, const float* w, int64_t k, int64_t K) {
  alignas(32) float s[8];
  _mm256_store_ps(s, acc);
  for (int j = 0; k + j < K; ++j) s[j] = s[j] + x[k + j] * w[k + j];
  for (int j = 0; j < 4; ++j) s[j] = s[j] + s[j + 4];
  for (int j = 0; j < 2; ++j) s[j] = s[j] + s[j + 2];
  return s[0] + s[1];
}

// Outputs y[a, b] for MB rows of x and NB rows of w (y's row stride is N).
template <int MB, int NB>
void Block(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  __m256 acc[MB][NB];
  for (int a = 0; a < MB; ++a)
    for (int b = 0; b < NB; ++b) acc[a][b] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm256_loadu_ps(w + b * K + k);
    for (int a = 0; a < MB; ++a) {
      const __m256 xv = _mm256_loadu_ps(x + a * K + k);
      for (int b = 0; b < NB; ++b)
        acc[a][b] = _mm256_add_ps(acc[a][b], _mm256_mul_ps(xv, wv[b]));
    }
  }
  for (int a = 0; a < MB; ++a)
    for (int b = 0; b < NB; ++b) y[a * N + b] = Finish(acc[a][b], x + a * K, w + b * K, k, K);
}

// Columns [n0, n1) of y, every row.
void Columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) Block<2, 4>(x + m * K, w + n * K, y + m * N + n, K, N);
    for (; m < M; ++m) Block<1, 4>(x + m * K, w + n * K, y + m * N + n, K, N);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) Block<1, 1>(x + m * K, w + n * K, y + m * N + n, K, N);
}

ffi::Error RowDotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("row_dot: expected x [M, K] and w [N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Weight rows in chunks, taken from a shared counter by this thread and by helpers on
  // XLA's pool. This thread waits only for chunks another thread has started, never for a
  // helper to start: a pool busy with other work cannot deadlock the call, and a helper
  // that starts late finds nothing left (the state it reads is shared, not on this stack).
  int64_t threads = pool.num_threads();
  if (threads < 1 || N * K < (int64_t{1} << 16)) threads = 1;  // small: not worth a hand-off
  const int64_t chunks = threads == 1 ? 1 : 4 * threads;
  const int64_t width = ((N + chunks - 1) / chunks + 3) / 4 * 4;
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [=] {
    for (int64_t c; (c = progress->next.fetch_add(1)) < chunks;) {
      Columns(xp, wp, yp, M, K, N, std::min(N, c * width), std::min(N, (c + 1) * width));
      progress->done.fetch_add(1);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work] { work(); });
  work();
  while (progress->done.load() < chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowDot, RowDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
