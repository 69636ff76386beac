// llamaspec/fixed_order.h's kernels as XLA FFI custom calls (jaxmodel/kernels.py builds and
// registers them): the same programs, so the same bits, as torchref's invariant mode gets
// through ctypes; and attention.h's fused attention. Work is shared out on XLA's intra-op
// thread pool; tasks never split a sum.
#include <atomic>
#include <memory>
#include <thread>

#include "attention.h"
#include "fixed_order.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

fo::Isa g_isa = fo::Isa(fo::MaxIsa());

// Tasks taken from a shared counter by this thread and by helpers on XLA's pool. This
// thread waits only for tasks another thread has started, never for a helper to start: a
// pool busy with other work cannot deadlock the call, and a helper that starts late finds
// nothing left (the state it reads is shared, not on this stack).
template <class JobT>
void RunOnPool(ffi::ThreadPool pool, const JobT& job, int64_t tasks, bool parallel = true) {
  struct Shared {
    JobT job;
    int64_t tasks;
    fo::Isa isa;
    std::atomic<int64_t> next{0}, done{0};
    Shared(const JobT& j, int64_t t) : job(j), tasks(t), isa(g_isa) {}
  };
  auto shared = std::make_shared<Shared>(job, tasks);
  auto work = [shared] {
    for (int64_t t; (t = shared->next.fetch_add(1)) < shared->tasks;) {
      if constexpr (std::is_same_v<JobT, fo::Gemm> || std::is_same_v<JobT, fo::Batched>) shared->job.Run(shared->isa, t);
      else shared->job.Run(shared->isa, t, shared->tasks);
      shared->done.fetch_add(1);
    }
  };
  const int64_t helpers = parallel ? std::min<int64_t>(pool.num_threads(), tasks - 1) : 0;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work(); });
  work();
  while (shared->done.load() < tasks) std::this_thread::yield();
}

int Threads(ffi::ThreadPool pool) { return int(std::max<int64_t>(1, pool.num_threads() + 1)); }

bool IsF64(ffi::DataType t) { return t == ffi::DataType::F64; }

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> y,
                    int64_t n, int32_t wtype) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("fixed_order gemm: x must be [M, K]");
  fo::Gemm job{xd[0], n, xd[1], x.untyped_data(), xd[1], packed.untyped_data(), wtype, y->untyped_data(), n};
  const int64_t tasks = job.Tasks(Threads(pool));
  RunOnPool(pool, job, tasks);
  return ffi::Error::Success();
}

// x [P, Qx, M, K] (Qx 1: one x for every q), w [P, Q, N, K] (or [P, Q, K, N] with w_kn),
// y [P, Q, M, N]; all f32 or all f64.
ffi::Error BatchedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                       int32_t w_kn) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 4 || wd.size() != 4)
    return ffi::Error::InvalidArgument("fixed_order gemm_batched: x and w must be rank 4");
  const int64_t P = wd[0], Q = wd[1], M = xd[2], K = xd[3];
  const int64_t N = w_kn ? wd[3] : wd[2];
  fo::Batched job{P, Q, M, N, K, x.untyped_data(), K, xd[1] * M * K, xd[1] == 1 ? 0 : M * K,
                  w.untyped_data(), w_kn ? 1 : K, w_kn ? N : 1, Q * N * K, N * K,
                  y->untyped_data(), N, Q * M * N, M * N, IsF64(x.element_type())};
  RunOnPool(pool, job, P * Q, P * Q * M * N * K >= fo::kSmall);
  return ffi::Error::Success();
}

ffi::Error RowSumsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> s, int32_t squares) {
  const auto xd = x.dimensions();
  const int64_t K = xd.size() == 0 ? 1 : xd[xd.size() - 1];
  const int64_t M = K == 0 ? 0 : int64_t(x.element_count()) / K;
  fo::RowSumJob job{M, K, x.untyped_data(), K, squares != 0, IsF64(x.element_type()), s->untyped_data()};
  const int64_t tasks = job.Tasks(Threads(pool));
  RunOnPool(pool, job, tasks);
  return ffi::Error::Success();
}

ffi::Error ExpImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  fo::ExpJob job{int64_t(x.element_count()), x.untyped_data(), IsF64(x.element_type()), y->untyped_data()};
  const int64_t tasks = job.Tasks(Threads(pool));
  RunOnPool(pool, job, tasks);
  return ffi::Error::Success();
}

// attention.h's program: q, out [B, T, Hkv, G, D] (f32, bf16 or f64); k, v [B, S, Hkv, D] in
// q's dtype or (bf16 q) f32; allowed [B, T, S] (pred).
ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer allowed, ffi::Result<ffi::AnyBuffer> out, double scale, int32_t early) {
  using T = ffi::DataType;
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), ad = allowed.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || ad.size() != 3)
    return ffi::Error::InvalidArgument("fused attention: q must be [B, T, Hkv, G, D], k and v [B, S, Hkv, D], "
                                       "allowed [B, T, S]");
  const int64_t B = qd[0], T_ = qd[1], Hkv = qd[2], G = qd[3], D = qd[4], S = kd[1];
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("fused attention: k and v differ in shape");
  if (kd[0] != B || kd[2] != Hkv || kd[3] != D || ad[0] != B || ad[1] != T_ || ad[2] != S)
    return ffi::Error::InvalidArgument("fused attention: q, k, v and allowed disagree in B, T, S, Hkv or D");
  const T qt = q.element_type(), kt = k.element_type();
  const bool types = allowed.element_type() == T::PRED && v.element_type() == kt &&
                     ((qt == T::F32 && kt == T::F32) || (qt == T::F64 && kt == T::F64) ||
                      (qt == T::BF16 && (kt == T::BF16 || kt == T::F32)));
  if (!types) return ffi::Error::InvalidArgument("fused attention: unsupported dtypes");
  auto code = [](T t) { return t == T::F64 ? fa::kF64 : t == T::BF16 ? fa::kBF16 : fa::kF32; };
  fa::AttentionJob job{B, T_, S, Hkv, G, D, q.untyped_data(), code(qt), k.untyped_data(), v.untyped_data(),
                       code(kt), static_cast<const uint8_t*>(allowed.untyped_data()), out->untyped_data(),
                       scale, early != 0};
  const int64_t tasks = job.Tasks(Threads(pool));
  if (tasks == 0 || S == 0) return ffi::Error::Success();
  thread_local std::vector<int64_t> scratch;  // this thread's, kept between calls (no fresh pages each call)
  scratch.resize((job.ScratchBytes() + 7) / 8);
  job.scratch = scratch.data();
  RunOnPool(pool, fa::AttentionJob::Prepare{&job}, B * Hkv, B * Hkv > 1);
  RunOnPool(pool, job, tasks, tasks > 1);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<double>("scale")
                                  .Attr<int32_t>("early"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("wtype"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoGemmBatched, BatchedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("w_kn"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoRowSums, RowSumsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("squares"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoExp, ExpImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

extern "C" {
int fo_max_isa() { return fo::MaxIsa(); }
int fo_set_isa(int isa) {
  if (isa < 0 || isa > fo::MaxIsa()) return -1;
  g_isa = fo::Isa(isa);
  return isa;
}
int fo_isa() { return g_isa; }
}
