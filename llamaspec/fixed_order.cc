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

template <class JobT>
void RunJob(JobT job, int threads) {
  const int64_t n = job.Tasks(threads);
  ThePool().Run(n, threads, [&](int64_t t) { job.Run(g_isa, t); });
}

// The element type a pointer type points to, without const (a job's template argument).
template <class P>
using Pointee = std::remove_const_t<std::remove_pointer_t<P>>;

template <class JobT>
void RunChunked(const JobT& job, int threads) {
  const int64_t n = job.Tasks(threads);
  ThePool().Run(n, threads, [&](int64_t t) { job.Run(g_isa, t, n); });
}

}  // namespace

extern "C" {

// 0 scalar, 1 AVX2+FMA, 2 AVX-512, 3 AVX-512 with BF16; what this CPU can run at most.
int fo_max_isa() { return fo::MaxIsa(); }

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
  switch (wtype) {
    case fo::kBF16Pairs:
      fo::PackPairs(static_cast<const fo::Bf16*>(w), N, K, sn, sk, static_cast<fo::Bf16*>(packed));
      break;
    case fo::kF64: fo::Pack(static_cast<const double*>(w), N, K, sn, sk, static_cast<double*>(packed)); break;
    case fo::kF32: fo::Pack(static_cast<const float*>(w), N, K, sn, sk, static_cast<float*>(packed)); break;
    default:  // bf16 and f16 move as 16-bit patterns
      fo::Pack(static_cast<const uint16_t*>(w), N, K, sn, sk, static_cast<uint16_t*>(packed));
  }
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w^T, w packed by fo_pack.
// x and y are f64 when wtype is f64; x bf16 and y f32 for kBF16Pairs; else both f32.
void fo_gemm(int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx, const void* packed,
             int wtype, void* y, int64_t ldy, int threads) {
  RunJob(fo::Gemm{M, N, K, x, ldx, packed, wtype, y, ldy}, threads);
}

// For i < b1, j < b2: y[i, j] = x[i, j] @ w[i, j]^T with element strides s*1, s*2, and
// w[i, j] (n, k) at sn, sk. x, w and y all f32 (wtype 0) or all f64 (wtype 3).
void fo_gemm_batched(int64_t b1, int64_t b2, int64_t M, int64_t N, int64_t K, const void* x,
                     int64_t ldx, int64_t sx1, int64_t sx2, const void* w, int wtype, int64_t sn,
                     int64_t sk, int64_t sw1, int64_t sw2, void* y, int64_t ldy, int64_t sy1,
                     int64_t sy2, int threads) {
  fo::Batched job{b1, b2, M, N, K, x, ldx, sx1, sx2, w, sn, sk, sw1, sw2, y, ldy, sy1, sy2, wtype == fo::kF64};
  if (b1 * b2 * M * N * K < fo::kSmall) threads = 1;
  RunJob(job, threads);
}

// s[m] = sum over k of x[m, k] (or x[m, k]^2), one fma chain per row; f32 or f64 (is_f64).
void fo_row_sums(int64_t M, int64_t K, const void* x, int64_t ldx, int squares, int is_f64, void* s,
                 int threads) {
  RunChunked(fo::RowSumJob{M, K, x, ldx, squares != 0, is_f64 != 0, s}, threads);
}

// y[i] = exp(x[i]) by fixed_order.h's program; f32 or f64 (is_f64).
void fo_exp(int64_t n, const void* x, int is_f64, void* y, int threads) {
  RunChunked(fo::ExpJob{n, x, is_f64 != 0, y}, threads);
}

// RoPE of a bf16 policy (fixed_order.h's RopeJob): queries q [B, T, Hq, D] and keys k [B, T, Hk, D]
// (element (b, t, h, d) at b * sb + t * st + h * sh + d) with their tables [B, T, D] (b * cb + t * ct
// + d), all bf16, into contiguous qy, ky.
void fo_rope_bf16(int64_t B, int64_t T, int64_t D, int64_t Hq, const void* q, int64_t qsb, int64_t qst,
                  int64_t qsh, const void* qc, const void* qs, int64_t qcb, int64_t qct, void* qy, int64_t Hk,
                  const void* k, int64_t ksb, int64_t kst, int64_t ksh, const void* kc, const void* ks,
                  int64_t kcb, int64_t kct, void* ky, int threads) {
  using fo::Bf16;
  const auto in = [](const void* p) { return static_cast<const Bf16*>(p); };
  RunChunked(fo::RopeJob{B, T, D,
                         {{Hq, in(q), qsb, qst, qsh, in(qc), in(qs), qcb, qct, static_cast<Bf16*>(qy)},
                          {Hk, in(k), ksb, kst, ksh, in(kc), in(ks), kcb, kct, static_cast<Bf16*>(ky)}}},
             threads);
}

// Causal attention of a bf16 policy (fixed_order.h's CausalAttention): q, k and v bf16 (its
// flag set) or f32, element (b, t or s, h, d) at b * sb + t * st + h * sh + d; allowed [B, T, S]
// bytes at b * ab + t * at + j; early_scale 0 or late_scale 0 (which one scales); out [B, T, Hq, D]
// contiguous bf16.
void fo_attention(int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, const void* q, int q_bf16,
                  int64_t qsb, int64_t qst, int64_t qsh, float early_scale, const void* k, int k_bf16, int64_t ksb,
                  int64_t kss, int64_t ksh, const void* v, int v_bf16, int64_t vsb, int64_t vss, int64_t vsh,
                  const uint8_t* allowed, int64_t ab, int64_t at, float late_scale, void* out, int threads) {
  // the packed keys and values, kept per calling thread and grown only: a decode step's call
  // would otherwise fault fresh pages in every time
  thread_local std::vector<float> kp, vp;
  kp.resize(std::max<size_t>(kp.size(), B * Hkv * fo::Panels(S) * D * fo::kPanel));
  vp.resize(std::max<size_t>(vp.size(), B * Hkv * fo::Panels(D) * S * fo::kPanel));
  const auto pack = [&](auto* ks, auto* vs) {
    RunJob(fo::AttentionPack<Pointee<decltype(ks)>, Pointee<decltype(vs)>>{
               B, S, Hkv, D, ks, vs, ksb, kss, ksh, vsb, vss, vsh, kp.data(), vp.data()},
           threads);
  };
  using fo::Bf16;
  if (k_bf16 && v_bf16) pack(static_cast<const Bf16*>(k), static_cast<const Bf16*>(v));
  else if (k_bf16) pack(static_cast<const Bf16*>(k), static_cast<const float*>(v));
  else if (v_bf16) pack(static_cast<const float*>(k), static_cast<const Bf16*>(v));
  else pack(static_cast<const float*>(k), static_cast<const float*>(v));
  const auto attend = [&](auto* qs) {
    RunJob(fo::CausalAttention<Pointee<decltype(qs)>>{
               B, T, S, Hq, Hkv, D, qs, qsb, qst, qsh, early_scale, kp.data(), vp.data(), allowed, ab, at,
               late_scale, static_cast<Bf16*>(out)},
           threads);
  };
  if (q_bf16) attend(static_cast<const Bf16*>(q));
  else attend(static_cast<const float*>(q));
}

// y[n] = x . w[n] for n < N (w's rows ldw apart), x and w bf16 (or fp16: is_f16), y f32, in torch's
// one-row order, its 8 lanes summed in order (sequential: torch's DEFAULT capability) or as a
// butterfly (AVX2, AVX512): fixed_order.h, AtenDots.
void fo_aten_dots(int64_t N, int64_t K, const void* x, const void* w, int64_t ldw, int is_f16, int sequential,
                  void* y, int threads) {
  RunChunked(fo::AtenDots{N, K, x, w, ldw, is_f16 != 0, sequential != 0, static_cast<float*>(y)}, threads);
}

}  // extern "C"
