// The compute cost of tensor parallelism's overlapped schedule (parallel.tp_comm_overlap), on one
// GPU: the CUDA backend's linear calls of one 1.3B layer at TP = 2 (d 2048, FFN 8192, 8,192 token
// rows, this rank's share of the weights). Three tables:
// - each TP linear whole, as plain TP calls it, against the pieces parallel::CommOverlap calls on two
//   ranks under sequence parallelism (the forwards in two halves of 4,096 rows; the row-parallel
//   backwards, attention projection and FC2 with its dGELU, as two dx halves then the weights);
// - the eight calls of a layer through CommOverlap itself on rank 0 of two, with a communicator that
//   moves nothing, against the same calls plain: the split GEMMs, the two-rank sum's add and the
//   side stream's synchronisation, without communication;
// - what one synchronisation with an idle side stream costs between GEMMs.
// Back-to-back calls on one stream, medians of CUDA-event timings (L2 not flushed: the calls follow
// each other in a step); random bf16 data (never zeros). A sustained GEMM load lowers the clocks:
// compare rows of one run.
//   bench_tp_split [autotune 0|1]
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_timer.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/comm_overlap.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::bench {
namespace {

constexpr std::int64_t kN = 8192, kHalf = kN / 2;

Buffer random_bf16(std::int64_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<std::uint16_t> host(static_cast<std::size_t>(n));
  for (auto& h : host) h = float_to_bf16_bits(d(rng));
  Buffer b(Device::cuda, host.size() * 2);
  KILN_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  return b;
}

struct Linear {
  const char* name;
  std::int64_t in, out;
  bool gelu_out = false;  // the forward's GELU epilogue (FC1)
  bool gelu_in = false;   // the input was a GELU's output: dx with the dGELU epilogue (FC2)
  bool row_parallel = false;
};

// Rank 0 of two whose collectives move nothing: the overlapped schedule's compute and stream
// synchronisation alone.
class NullCommunicator final : public parallel::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& members() const override { return members_; }
  void all_reduce(const TensorView&, parallel::ReduceOp, void*) override {}
  void all_gather(const TensorView&, const TensorView&, void*) override {}
  void reduce_scatter(const TensorView&, const TensorView&, parallel::ReduceOp, void*) override {}
  void broadcast(const TensorView&, int, void*) override {}
  void send_recv(const std::vector<Transfer>&, const std::vector<Transfer>&, void*) override {}
  void p2p(const std::vector<Transfer>&, const std::vector<Transfer>&, void*, const std::string&) override {}
  void barrier() override {}

 private:
  std::string name_ = "null";
  std::vector<int> members_ = {0, 1};
};

// One layer's eight TP linear calls, forward then backward, as plain TP makes them (whole, no
// collective) and as CommOverlap makes them on rank 0 of two under sequence parallelism with a
// communicator that moves nothing.
void schedule(ops::Backend& be, EventTimer& timer) {
  std::mt19937 rng(11);
  const std::int64_t N = kN, Nl = kHalf, C = 2048, F = 4096, Q = 3072, A = 1024;
  std::vector<Buffer> keep;
  auto t = [&](Shape sh, DType d = DType::bf16) {
    const std::int64_t n = sh.numel();
    keep.push_back(d == DType::bf16 ? random_bf16(n, rng, 0.5f) : Buffer(Device::cuda, n * 4));
    if (d == DType::f32) KILN_CUDA_CHECK(cudaMemset(keep.back().data(), 0, n * 4));
    return TensorView(keep.back().data(), sh, d, Device::cuda);
  };
  const TensorView full1 = t({N, C}), full2 = t({N, C}), qkv = t({N, Q}), ctx = t({N, A}), row_out = t({N, C}),
                   local = t({Nl, C}), h = t({N, F}), pre = t({N, F}), dfull = t({N, C}), dact = t({N, F}),
                   col_dx = t({N, C}), dpre = t({N, F}), dctx = t({N, A}), dqkv = t({N, Q});
  const TensorView wq = t({Q, C}), bq = t({Q}), wp = t({C, A}), bp = t({C}), w1 = t({F, C}), bias1 = t({F}),
                   w2 = t({C, F}), bias2 = t({C});
  const TensorView dwq = t({Q, C}, DType::f32), dbq = t({Q}, DType::f32), dwp = t({C, A}, DType::f32),
                   dbp = t({C}, DType::f32), dw1 = t({F, C}, DType::f32), db1 = t({F}, DType::f32),
                   dw2 = t({C, F}, DType::f32), db2 = t({C}, DType::f32);
  const ops::LinearImpl impl = ops::backend_linear_impl(be);
  NullCommunicator comm;
  parallel::CommOverlap o(comm, be, true, 1, 0);
  const ops::LinearForward fq{qkv, {}, full1, wq, bq}, fp{row_out, {}, ctx, wp, bp}, f1{h, pre, full2, w1, bias1},
      f2{row_out, {}, h, w2, bias2};
  const ops::LinearBackward g2{.dx = dact, .dweight = dw2, .dbias = db2, .dout = dfull, .x = h, .weight = w2,
                               .dx_gelu_pre = pre},
      g1{.dx = col_dx, .dweight = dw1, .dbias = db1, .dout = dpre, .x = full2, .weight = w1},
      bp_{.dx = dctx, .dweight = dwp, .dbias = dbp, .dout = dfull, .x = ctx, .weight = wp},
      bq_{.dx = col_dx, .dweight = dwq, .dbias = dbq, .dout = dqkv, .x = full1, .weight = wq};
  const TensorView own = dfull.rows(0, Nl);
  auto plain = [&] {
    impl.forward(fq);
    impl.forward(fp);
    impl.forward(f1);
    impl.forward(f2);
    impl.backward(g2);
    impl.backward(g1);
    impl.backward(bp_);
    impl.backward(bq_);
  };
  auto lapped = [&] {
    o.gather_forward(impl, fq, full1, full1.rows(0, Nl));
    o.forward_sum(impl, fp, local);
    o.gather_forward(impl, f1, full2, full2.rows(0, Nl));
    o.forward_sum(impl, f2, local);
    o.gather_backward(impl, g2, own);
    o.backward_sum(impl, g1, local);
    o.gather_backward(impl, bp_, own);
    o.backward_sum(impl, bq_, local);
  };
  auto host_us = [&](const std::function<void()>& f) {
    KILN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto a = std::chrono::steady_clock::now();
    f();
    const auto b = std::chrono::steady_clock::now();
    KILN_CUDA_CHECK(cudaDeviceSynchronize());
    return std::chrono::duration<double, std::micro>(b - a).count();
  };
  const std::pair<const char*, std::pair<std::function<void()>, std::function<void()>>> calls[] = {
      {"qkv forward, gathered", {[&] { impl.forward(fq); }, [&] { o.gather_forward(impl, fq, full1, full1.rows(0, Nl)); }}},
      {"proj forward, summed", {[&] { impl.forward(fp); }, [&] { o.forward_sum(impl, fp, local); }}},
      {"fc1 forward, gathered", {[&] { impl.forward(f1); }, [&] { o.gather_forward(impl, f1, full2, full2.rows(0, Nl)); }}},
      {"fc2 forward, summed", {[&] { impl.forward(f2); }, [&] { o.forward_sum(impl, f2, local); }}},
      {"fc2 backward, gathered", {[&] { impl.backward(g2); }, [&] { o.gather_backward(impl, g2, own); }}},
      {"fc1 backward, summed", {[&] { impl.backward(g1); }, [&] { o.backward_sum(impl, g1, local); }}},
      {"proj backward, gathered", {[&] { impl.backward(bp_); }, [&] { o.gather_backward(impl, bp_, own); }}},
      {"qkv backward, summed", {[&] { impl.backward(bq_); }, [&] { o.backward_sum(impl, bq_, local); }}},
  };
  std::printf("\n%-26s %10s %12s %9s\n", "call", "plain us", "overlap us", "+us");
  for (const auto& [name, fns] : calls) {
    const double a = timer.median_ms(fns.first) * 1e3, b = timer.median_ms(fns.second) * 1e3;
    std::printf("%-26s %10.1f %12.1f %+9.1f\n", name, a, b, b - a);
  }
  const double p = timer.median_ms(plain) * 1e3, l = timer.median_ms(lapped) * 1e3;
  const double ph = host_us(plain), lh = host_us(lapped);
  std::printf("\none layer's eight TP linears, forward and backward (rank 0 of 2, SP, nothing moved)\n");
  std::printf("%-44s %10s %12s\n", "schedule", "GPU us", "host us");
  std::printf("%-44s %10.1f %12.1f\n", "plain (whole calls, no collectives)", p, ph);
  std::printf("%-44s %10.1f %12.1f\n", "CommOverlap, null communicator", l, lh);
  std::printf("difference %+.1f us a layer, x 24 layers %+.2f ms a step\n", l - p, (l - p) * 24 / 1e3);
  // The same calls captured into a CUDA graph (as backend.cuda_graph captures a step) and replayed.
  auto captured = [&](const std::function<void()>& f) {
    const auto st = static_cast<cudaStream_t>(be.stream());
    cudaGraph_t g = nullptr;
    cudaGraphExec_t x = nullptr;
    KILN_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    f();
    KILN_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    KILN_CUDA_CHECK(cudaGraphInstantiate(&x, g, 0));
    std::size_t nodes = 0;
    KILN_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
    const double us = timer.median_ms([&] { KILN_CUDA_CHECK(cudaGraphLaunch(x, st)); }) * 1e3;
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    return std::make_pair(us, nodes);
  };
  const auto [pg, pn] = captured(plain);
  const auto [lg, ln] = captured(lapped);
  std::printf("%-44s %10.1f %12s (%zu nodes)\n", "plain, captured", pg, "", pn);
  std::printf("%-44s %10.1f %12s (%zu nodes)\n", "CommOverlap, null communicator, captured", lg, "", ln);

  // What one synchronisation with an idle side stream costs between two GEMMs: 32 attention
  // projections back to back, then with the side stream waiting for compute and compute for it
  // after each (at the side stream's greatest and least priority), then with the side stream's
  // wait alone.
  const int K = 32;
  auto gemms = [&](parallel::SideStream* side, bool back) {
    for (int k = 0; k < K; ++k) {
      impl.forward(fp);
      if (side) {
        side->wait_for_compute();
        if (back) side->compute_waits();
      }
    }
  };
  const double g0 = timer.median_ms([&] { gemms(nullptr, false); }) * 1e3;
  std::printf("\n%d attention-projection GEMMs (%.1f us each alone)\n", K, g0 / K);
  for (const bool high : {true, false}) {
    auto side = parallel::SideStream::create(be.stream(), high);
    const double both = timer.median_ms([&] { gemms(side.get(), true); }) * 1e3;
    const double one = timer.median_ms([&] { gemms(side.get(), false); }) * 1e3;
    std::printf("side stream at %s priority: each GEMM followed by side-waits-compute and compute-waits-side %+.2f us, "
                "by side-waits-compute alone %+.2f us\n",
                high ? "the greatest" : "the least", (both - g0) / K, (one - g0) / K);
  }
}
}  // namespace
}  // namespace kiln::bench

int main(int argc, char** argv) {
  using namespace kiln;
  using namespace kiln::bench;
  try {
    ops::CudaOptions o;
    o.gemm_autotune = argc > 1 && std::atoi(argv[1]) != 0;
    auto be = ops::make_cuda_backend(0, o);
    auto s = static_cast<cudaStream_t>(be->stream());
    EventTimer timer(s, false, 3, 21);
    std::mt19937 rng(7);
    const Linear layers[] = {{"qkv", 2048, 3072},
                             {"attn proj", 1024, 2048, false, false, true},
                             {"fc1 (GELU epilogue)", 2048, 4096, true},
                             {"fc2 (dGELU in dx)", 4096, 2048, false, true, true}};
    auto view = [](Buffer& b, Shape shape, DType t = DType::bf16) { return TensorView(b.data(), shape, t, Device::cuda); };
    std::printf("%s, GEMM autotune %s\n", be->name().c_str(), o.gemm_autotune ? "on" : "off");
    std::printf("%-22s %-9s %10s %10s %9s\n", "linear", "pass", "whole us", "pieces us", "+us");
    double total = 0;
    for (const Linear& l : layers) {
      Buffer x = random_bf16(kN * l.in, rng, 1.0f), w = random_bf16(l.out * l.in, rng, 0.02f),
             b = random_bf16(l.out, rng, 0.02f), out(Device::cuda, kN * l.out * 2), pre(Device::cuda, kN * l.out * 2),
             dout = random_bf16(kN * l.out, rng, 1.0f), dx(Device::cuda, kN * l.in * 2),
             xpre = random_bf16(kN * l.in, rng, 1.0f), dw(Device::cuda, l.out * l.in * 4), db(Device::cuda, l.out * 4);
      const TensorView X = view(x, Shape{kN, l.in}), W = view(w, Shape{l.out, l.in}), B = view(b, Shape{l.out}),
                       O = view(out, Shape{kN, l.out}), P = view(pre, Shape{kN, l.out}), DO = view(dout, Shape{kN, l.out}),
                       DX = view(dx, Shape{kN, l.in}), XP = view(xpre, Shape{kN, l.in}), DW = view(dw, Shape{l.out, l.in}, DType::f32),
                       DB = view(db, Shape{l.out}, DType::f32);
      auto fwd = [&](std::int64_t r0, std::int64_t n) {
        ops::LinearForward f{O.rows(r0, n), l.gelu_out ? P.rows(r0, n) : TensorView{}, X.rows(r0, n), W, B};
        be->linear_forward(f);
      };
      const double fw = timer.median_ms([&] { fwd(0, kN); }) * 1e3;
      const double fp = timer.median_ms([&] {
        fwd(0, kHalf);
        fwd(kHalf, kHalf);
      }) * 1e3;
      std::printf("%-22s %-9s %10.1f %10.1f %+9.1f\n", l.name, "forward", fw, fp, fp - fw);
      total += fp - fw;
      if (!l.row_parallel) continue;
      auto bwd = [&](std::int64_t r0, std::int64_t n, bool dxs, bool weights) {
        ops::LinearBackward a;
        if (dxs) {
          a.dx = DX.rows(r0, n);
          if (l.gelu_in) a.dx_gelu_pre = XP.rows(r0, n);
        }
        if (weights) {
          a.dweight = DW;
          a.dbias = DB;
        }
        a.dout = DO.rows(r0, n);
        a.x = X.rows(r0, n);
        a.weight = W;
        be->linear_backward(a);
      };
      const double bw = timer.median_ms([&] { bwd(0, kN, true, true); }) * 1e3;
      const double bp = timer.median_ms([&] {
        bwd(0, kHalf, true, false);
        bwd(kHalf, kHalf, true, false);
        bwd(0, kN, false, true);
      }) * 1e3;
      std::printf("%-22s %-9s %10.1f %10.1f %+9.1f\n", l.name, "backward", bw, bp, bp - bw);
      total += bp - bw;
    }
    std::printf("per layer %+.1f us, x 24 layers %+.2f ms a step\n", total, total * 24 / 1e3);
    schedule(*be, timer);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tp_split: %s\n", e.what());
    return 1;
  }
}
