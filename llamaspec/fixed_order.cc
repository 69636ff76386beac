// The fixed-order kernels (fixed_order.h) behind a C ABI for ctypes
// (llamaspec/fixed_order.py), with a small thread pool that splits outputs, never sums.
#include "fixed_order.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

fo::Isa g_isa = fo::kScalar;

// A host framework's OpenMP runtime (fo_use_openmp): the tasks then run on its threads,
// instead of a pool of ours competing with them for the cores.
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
GompParallel g_gomp_parallel = nullptr;

struct OmpJob {
  const std::function<void(int64_t)>* task;
  int64_t n;
  std::atomic<int64_t> next{0};
};

void OmpTrampoline(void* data) {
  auto* job = static_cast<OmpJob*>(data);
  for (int64_t i; (i = job->next.fetch_add(1)) < job->n;) (*job->task)(i);
}

// Tasks [0, n) run by the caller and up to threads - 1 workers; one job at a time.
class Pool {
 public:
  void Run(int64_t n, int threads, const std::function<void(int64_t)>& task) {
    if (threads <= 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) task(i);
      return;
    }
    if (g_gomp_parallel != nullptr) {
      OmpJob job;
      job.task = &task;
      job.n = n;
      g_gomp_parallel(OmpTrampoline, &job, unsigned(threads), 0);
      return;
    }
    std::lock_guard<std::mutex> one_job(job_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (int(workers_.size()) < threads - 1) workers_.emplace_back([this] { Work(); });
      task_ = &task;
      n_ = n;
      next_.store(0);
      left_.store(n);
      active_ = threads - 1;
      ++generation_;
    }
    wake_.notify_all();
    Drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return left_.load() == 0; });
    task_ = nullptr;
  }

 private:
  void Drain() {
    for (int64_t i; (i = next_.fetch_add(1)) < n_;) {
      (*task_)(i);
      if (left_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mu_);
        done_.notify_all();
      }
    }
  }
  void Work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen && active_ > 0; });
        seen = generation_;
        --active_;
      }
      Drain();
    }
  }
  std::mutex job_mu_, mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0}, left_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
};

Pool& ThePool() {
  static Pool* pool = new Pool;  // never destroyed: workers outlive static destructors
  return *pool;
}

template <class A, class W>
void Gemm(int64_t M, int64_t N, int64_t K, const A* x, int64_t ldx, const W* packed, A* y,
          int64_t ldy, int threads) {
  const int64_t panels = fo::Panels(N);
  // Small products run on the calling thread: a hand-off costs more than it saves.
  if (M * N * K < (int64_t{1} << 18)) threads = 1;
  const int64_t chunks = threads <= 1 ? 1 : std::min<int64_t>(panels, 4 * threads);
  const int64_t per = (panels + chunks - 1) / chunks;
  const int64_t width = per + (per % 2);  // an even count keeps AVX-512's two-panel tiles
  const int64_t n_tasks = (panels + width - 1) / width;
  ThePool().Run(n_tasks, threads, [&](int64_t t) {
    const int64_t p0 = t * width, p1 = std::min(panels, p0 + width);
    fo::Columns(g_isa, x, ldx, M, packed, N, K, y, ldy, p0, p1);
  });
}

void GemmPairs(int64_t M, int64_t N, int64_t K, const fo::Bf16* x, int64_t ldx, const fo::Bf16* packed,
               float* y, int64_t ldy, int threads) {
  const int64_t panels = fo::Panels(N);
  if (M * N * K < (int64_t{1} << 18)) threads = 1;
  const int64_t chunks = threads <= 1 ? 1 : std::min<int64_t>(panels, 4 * threads);
  const int64_t per = (panels + chunks - 1) / chunks;
  const int64_t width = per + (per % 2);
  const int64_t n_tasks = (panels + width - 1) / width;
  ThePool().Run(n_tasks, threads, [&](int64_t t) {
    const int64_t p0 = t * width, p1 = std::min(panels, p0 + width);
    fo::ColumnsPairs(g_isa, x, ldx, M, packed, N, K, y, ldy, p0, p1);
  });
}

template <class A, class W>
void Batched(int64_t b1, int64_t b2, int64_t M, int64_t N, int64_t K, const A* x, int64_t ldx,
             int64_t sx1, int64_t sx2, const W* w, int64_t sn, int64_t sk, int64_t sw1, int64_t sw2,
             A* y, int64_t ldy, int64_t sy1, int64_t sy2, int threads) {
  if (b1 * b2 * M * N * K < (int64_t{1} << 18)) threads = 1;
  ThePool().Run(b1 * b2, threads, [&](int64_t t) {
    const int64_t i = t / b2, j = t % b2;
    thread_local std::vector<W> packed;
    packed.resize(fo::Panels(N) * K * fo::kPanel);
    fo::Pack(w + i * sw1 + j * sw2, N, K, sn, sk, packed.data());
    fo::Columns(g_isa, x + i * sx1 + j * sx2, ldx, M, packed.data(), N, K, y + i * sy1 + j * sy2,
                ldy, 0, fo::Panels(N));
  });
}

template <class F>
void ForEachType(int wtype, F&& f) {
  switch (wtype) {
    case fo::kF32: f(static_cast<const float*>(nullptr)); break;
    case fo::kBF16: f(static_cast<const fo::Bf16*>(nullptr)); break;
    case fo::kF16: f(static_cast<const fo::F16*>(nullptr)); break;
    default: f(static_cast<const double*>(nullptr)); break;
  }
}

}  // namespace

extern "C" {

// 0 scalar, 1 AVX2+FMA, 2 AVX-512, 3 AVX-512 with BF16; what this CPU can run at most.
int fo_max_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("avx512bf16"))
    return fo::kAvx512Bf16;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c"))
    return fo::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return fo::kAvx2;
  return fo::kScalar;
}

// Selects the code path (never the order: every path gives the same bits); -1 if the CPU
// lacks it.
int fo_set_isa(int isa) {
  if (isa < 0 || isa > fo_max_isa()) return -1;
  g_isa = fo::Isa(isa);
  return isa;
}

int fo_isa() { return g_isa; }

// Run parallel work through this GOMP_parallel (the host's libgomp), or our pool (null).
void fo_use_openmp(void* gomp_parallel) { g_gomp_parallel = reinterpret_cast<GompParallel>(gomp_parallel); }

int64_t fo_packed_elements(int64_t N, int64_t K, int wtype) {
  return wtype == fo::kBF16Pairs ? fo::Panels(N) * fo::Pairs(K) * fo::kPanel * 2 : fo::Panels(N) * K * fo::kPanel;
}

// w (n, k) at w[n * sn + k * sk], element type wtype, into `packed` (same element type;
// kBF16Pairs: bf16 weights for the pair program, x bf16 too).
void fo_pack(const void* w, int wtype, int64_t N, int64_t K, int64_t sn, int64_t sk, void* packed) {
  if (wtype == fo::kBF16Pairs) {
    fo::PackPairs(static_cast<const fo::Bf16*>(w), N, K, sn, sk, static_cast<fo::Bf16*>(packed));
    return;
  }
  ForEachType(wtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    fo::Pack(static_cast<const W*>(w), N, K, sn, sk, static_cast<W*>(packed));
  });
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w^T, w packed by fo_pack.
// x and y are f64 when wtype is f64; x bf16 and y f32 for kBF16Pairs; else both f32.
void fo_gemm(int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx, const void* packed,
             int wtype, void* y, int64_t ldy, int threads) {
  if (wtype == fo::kBF16Pairs) {
    GemmPairs(M, N, K, static_cast<const fo::Bf16*>(x), ldx, static_cast<const fo::Bf16*>(packed),
              static_cast<float*>(y), ldy, threads);
    return;
  }
  ForEachType(wtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    using A = std::conditional_t<std::is_same_v<W, double>, double, float>;
    Gemm(M, N, K, static_cast<const A*>(x), ldx, static_cast<const W*>(packed), static_cast<A*>(y),
         ldy, threads);
  });
}

// For i < b1, j < b2: y[i, j] = x[i, j] @ w[i, j]^T with element strides s*1, s*2, and
// w[i, j] (n, k) at sn, sk. x, w and y all f32 (wtype 0) or all f64 (wtype 3).
void fo_gemm_batched(int64_t b1, int64_t b2, int64_t M, int64_t N, int64_t K, const void* x,
                     int64_t ldx, int64_t sx1, int64_t sx2, const void* w, int wtype, int64_t sn,
                     int64_t sk, int64_t sw1, int64_t sw2, void* y, int64_t ldy, int64_t sy1,
                     int64_t sy2, int threads) {
  if (wtype == fo::kF64)
    Batched(b1, b2, M, N, K, static_cast<const double*>(x), ldx, sx1, sx2, static_cast<const double*>(w),
            sn, sk, sw1, sw2, static_cast<double*>(y), ldy, sy1, sy2, threads);
  else
    Batched(b1, b2, M, N, K, static_cast<const float*>(x), ldx, sx1, sx2, static_cast<const float*>(w),
            sn, sk, sw1, sw2, static_cast<float*>(y), ldy, sy1, sy2, threads);
}

// s[m] = sum over k of x[m, k] (or x[m, k]^2), one fma chain per row; f32 or f64 (is_f64).
void fo_row_sums(int64_t M, int64_t K, const void* x, int64_t ldx, int squares, int is_f64, void* s,
                 int threads) {
  const int64_t chunk = 256;
  if (M * K < (int64_t{1} << 18)) threads = 1;
  ThePool().Run((M + chunk - 1) / chunk, threads, [&](int64_t t) {
    const int64_t m0 = t * chunk, rows = std::min(chunk, M - m0);
    if (is_f64)
      fo::RowSums(g_isa, static_cast<const double*>(x) + m0 * ldx, ldx, rows, K, squares, static_cast<double*>(s) + m0);
    else
      fo::RowSums(g_isa, static_cast<const float*>(x) + m0 * ldx, ldx, rows, K, squares, static_cast<float*>(s) + m0);
  });
}

// y[i] = exp(x[i]) by fixed_order.h's program; f32 or f64 (is_f64).
void fo_exp(int64_t n, const void* x, int is_f64, void* y, int threads) {
  const int64_t chunk = 1 << 14;
  if (n < (int64_t{1} << 16)) threads = 1;
  ThePool().Run((n + chunk - 1) / chunk, threads, [&](int64_t t) {
    const int64_t i0 = t * chunk, i1 = std::min(n, i0 + chunk);
    if (is_f64) {
      const double* a = static_cast<const double*>(x);
      double* b = static_cast<double*>(y);
      for (int64_t i = i0; i < i1; ++i) b[i] = fo::ExpF64(a[i]);
    } else {
      const float* a = static_cast<const float*>(x) + i0;
      float* b = static_cast<float*>(y) + i0;
      if (g_isa >= fo::kAvx512) fo::ExpF32Avx512(a, b, i1 - i0);
      else if (g_isa == fo::kAvx2) fo::ExpF32Avx2(a, b, i1 - i0);
      else for (int64_t i = 0; i < i1 - i0; ++i) b[i] = fo::ExpF32(a[i]);
    }
  });
}

}  // extern "C"
