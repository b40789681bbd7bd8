// Collective bandwidth, nccl-tests style: all-reduce and reduce-scatter of 1 MiB .. 1 GiB (bf16),
// through kiln's Communicator (NCCL, and parallel.copy_engine's copy engines) and through raw NCCL calls on a
// communicator of its own, on N GPUs.
// bus bandwidth = bytes / time x 2(n-1)/n for all-reduce, x (n-1)/n for reduce-scatter.
// Then an all-reduce beside a GEMM (tensor parallelism's overlap): each alone, then the all-reduce on a
// second stream while the GEMM runs, with the GEMM's SM count target and the stream's priority varied.
// Then (two ranks) expert parallelism's all-to-all, whole or in pieces, its own rows through NCCL or copied.
// usage: bench_collectives --nproc N      (starts N ranks itself; rank 0 prints the table;
//   KILN_BENCH_A2A_ONLY=1: the all-to-all tables alone)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kiln/ops/cuda/gemm.hpp"
#include "kiln/parallel/copy_engine.hpp"
#include "kiln/parallel/launch.hpp"
#include "kiln/parallel/nccl.hpp"
#include "kiln/parallel/rendezvous.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "bench_timer.hpp"

using namespace kiln;

namespace {

template <class F>
double median_ms(cudaStream_t s, F&& f, int iters) {
  return bench::EventTimer(s, false, 3, iters).median_ms(f);
}

// An all-reduce of a [8192, 2048] bf16 activation beside a [8192, 2048] x [2048, 4096]^T GEMM.
void overlap_table(const parallel::LaunchEnv& env, parallel::Communicator& comm, cudaStream_t s, const char* label) {
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  const std::size_t ws_bytes = 64u << 20;
  Buffer ws(Device::cuda, ws_bytes);
  cuda::GemmRunner gemm(lt, ws.data(), ws_bytes);
  const int M = 8192, N = 2048, K = 4096;
  Buffer a(Device::cuda, std::size_t(M) * K * 2), b(Device::cuda, std::size_t(N) * K * 2),
      d(Device::cuda, std::size_t(M) * N * 2), x(Device::cuda, std::size_t(M) * N * 2);
  KILN_CUDA_CHECK(cudaMemset(a.data(), 0x3c, a.bytes()));
  KILN_CUDA_CHECK(cudaMemset(b.data(), 0x3c, b.bytes()));
  KILN_CUDA_CHECK(cudaMemset(x.data(), 0x3c, x.bytes()));
  int sms = 0, least = 0, greatest = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, env.local_rank);
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStream_t side_lo, side_hi;
  KILN_CUDA_CHECK(cudaStreamCreateWithPriority(&side_lo, cudaStreamNonBlocking, least));
  KILN_CUDA_CHECK(cudaStreamCreateWithPriority(&side_hi, cudaStreamNonBlocking, greatest));
  cudaEvent_t go, done;
  KILN_CUDA_CHECK(cudaEventCreateWithFlags(&go, cudaEventDisableTiming));
  KILN_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  const TensorView act(x.data(), {std::int64_t(M) * N}, DType::bf16, Device::cuda);
  auto run_gemm = [&](int sm_count) {
    cuda::GemmDesc g;
    g.M = M;
    g.N = N;
    g.K = K;
    g.A = static_cast<const cuda::bf16*>(a.data());
    g.B = static_cast<const cuda::bf16*>(b.data());
    g.trans_b = true;
    g.D = d.data();
    g.sm_count = sm_count;
    gemm.run(g, s);
  };
  if (env.rank == 0)
    std::printf("\nall-reduce (%s) of %d x %d bf16 beside a GEMM %d x %d x %d (ms, median of 20; %d SMs)\n", label, M,
                N, M, N, K, sms);
  if (env.rank == 0)
    std::printf("%10s %9s | %8s %8s %8s %8s %8s\n", "GEMM SMs", "priority", "GEMM", "AR", "both", "sum", "hidden");
  const double ar = median_ms(s, [&] { comm.all_reduce(act, parallel::ReduceOp::sum, s); }, 20);
  for (int margin : {0, 8, 16, 32})
    for (bool high : {false, true}) {
      const int target = margin ? sms - margin : 0;
      cudaStream_t side = high ? side_hi : side_lo;
      const double g = median_ms(s, [&] { run_gemm(target); }, 20);
      const double both = median_ms(s, [&] {
        KILN_CUDA_CHECK(cudaEventRecord(go, s));
        KILN_CUDA_CHECK(cudaStreamWaitEvent(side, go, 0));
        comm.all_reduce(act, parallel::ReduceOp::sum, side);
        run_gemm(target);
        KILN_CUDA_CHECK(cudaEventRecord(done, side));
        KILN_CUDA_CHECK(cudaStreamWaitEvent(s, done, 0));
      }, 20);
      if (env.rank == 0)
        std::printf("%10d %9s | %8.3f %8.3f %8.3f %8.3f %7.0f%%\n", target ? target : sms, high ? "high" : "normal", g,
                    ar, both, g + ar, 100.0 * (g + ar - both) / std::min(g, ar));
    }
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaStreamDestroy(side_lo);
  cudaStreamDestroy(side_hi);
  cudaEventDestroy(go);
  cudaEventDestroy(done);
  cublasLtDestroy(lt);
}

// Expert parallelism's all-to-all on two ranks, as moe-1b's dispatch moves rows: each rank sends
// `mib` MiB to the other and as much to itself, cut into `pieces` transfers a peer (one per local
// expert), or with its own rows copied by the copy engine outside NCCL (ms a call, median of 20).
void all_to_all_table(const parallel::LaunchEnv& env, parallel::Communicator& comm, cudaStream_t s,
                      const char* label) {
  if (env.world != 2) return;
  const std::size_t max_bytes = std::size_t(64) << 20;
  Buffer send(Device::cuda, 2 * max_bytes), recv(Device::cuda, 2 * max_bytes);
  KILN_CUDA_CHECK(cudaMemset(send.data(), 0x3c, send.bytes()));
  if (env.rank == 0) {
    std::printf("\nall-to-all on 2 ranks (%s): ms a call, median of 20 (GB/s to the peer)\n", label);
    std::printf("%8s | %16s %16s %16s %16s\n", "MiB/peer", "4 pieces+self", "1 piece+self", "4 pieces,self cp",
                "1 piece,self cp");
  }
  for (std::size_t mib : {8, 32, 64}) {
    const std::size_t bytes = mib << 20;
    auto view = [&](Buffer& b, std::size_t at, std::size_t n) {
      return TensorView(static_cast<char*>(b.data()) + at, {static_cast<std::int64_t>(n / 2)}, DType::bf16,
                        Device::cuda);
    };
    double ms[4];
    int col = 0;
    for (bool self_by_copy : {false, true})
      for (int pieces : {4, 1}) {
        std::vector<parallel::Communicator::Transfer> sends, recvs;
        const std::size_t piece = bytes / pieces;
        for (int q = 0; q < 2; ++q) {
          if (self_by_copy && q == env.rank) continue;
          for (int i = 0; i < pieces; ++i) {
            sends.push_back({q, view(send, q * max_bytes + i * piece, piece)});
            recvs.push_back({q, view(recv, q * max_bytes + i * piece, piece)});
          }
        }
        ms[col++] = median_ms(s, [&] {
          if (self_by_copy)
            KILN_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv.data()) + env.rank * max_bytes,
                                            static_cast<char*>(send.data()) + env.rank * max_bytes, bytes,
                                            cudaMemcpyDeviceToDevice, s));
          comm.send_recv(sends, recvs, s);
        }, 20);
      }
    if (env.rank == 0) {
      std::printf("%8zu |", mib);
      for (double m : ms) std::printf(" %7.3f (%5.0f) ", m, bytes / (m * 1e-3) / 1e9);
      std::printf("\n");
    }
  }
}

int rank_main(const parallel::LaunchEnv& env) {
  parallel::use_device(env.local_rank);
  const auto timeout = std::chrono::milliseconds(120000);
  auto rdv = std::make_shared<parallel::Rendezvous>(env.master_addr, env.master_port, env.rank, env.world,
                                                    env.rank == 0 ? parallel::NcclWorld::make_unique_id() : "",
                                                    timeout);
  auto world = std::make_shared<parallel::NcclWorld>(env.rank, env.world, env.local_rank, rdv, timeout);
  std::vector<int> all(env.world);
  for (int i = 0; i < env.world; ++i) all[i] = i;
  auto comm = world->group("world-b", 0, all, true);  // blocking (see NcclWorld::group)
  auto nonblocking = world->group("world", 0, all);   // kiln's default
  auto copy_engine = parallel::make_copy_engine_communicator(world->group("world-ce", 0, all), world);

  // A raw NCCL communicator of the same ranks, from a second id handed out through kiln's broadcast.
  ncclUniqueId id;
  if (env.rank == 0) ncclGetUniqueId(&id);
  std::vector<std::int32_t> idbuf(sizeof id.internal / 4 + 1, 0);
  std::memcpy(idbuf.data(), id.internal, sizeof id.internal);
  comm->broadcast(TensorView(idbuf.data(), {static_cast<std::int64_t>(idbuf.size())}, DType::i32, Device::cpu), 0,
                  nullptr);
  std::memcpy(id.internal, idbuf.data(), sizeof id.internal);
  ncclComm_t raw;
  if (ncclCommInitRank(&raw, env.world, id, env.rank) != ncclSuccess) KILN_THROW("ncclCommInitRank failed");

  cudaStream_t s;
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  all_to_all_table(env, *nonblocking, s, "NCCL, non-blocking");
  all_to_all_table(env, *comm, s, "NCCL, blocking");
  all_to_all_table(env, *copy_engine, s, "copy engines");
  const auto finish = [&] {
    KILN_CUDA_CHECK(cudaStreamSynchronize(s));
    ncclCommDestroy(raw);
    comm.reset();
    nonblocking.reset();
    copy_engine.reset();
    world.reset();
    rdv->finish();
    return 0;
  };
  if (std::getenv("KILN_BENCH_A2A_ONLY")) return finish();
  const std::size_t max_bytes = std::size_t(1) << 30;
  Buffer in(Device::cuda, max_bytes), out(Device::cuda, max_bytes);
  KILN_CUDA_CHECK(cudaMemset(in.data(), 0x3c, max_bytes));  // bf16 ~ 0.0115: finite, not zero
  const double n = env.world;
  if (env.rank == 0) {
    std::printf("%d x %s, bf16, busbw in GB/s (median of 20)\n", env.world, "GPU");
    std::printf("%10s | %12s %12s %12s %12s | %12s %12s %12s | %14s %14s\n", "size", "AR blocking", "AR kiln",
                "AR raw NCCL", "AR copy eng", "reduce_scat", "raw NCCL", "RS copy eng", "host us kiln", "host us c.e.");
  }
  for (std::size_t mib : {1, 4, 16, 32, 64, 256, 1024}) {
    const std::size_t bytes = mib << 20;
    const std::int64_t count = static_cast<std::int64_t>(bytes / 2);
    TensorView buf(in.data(), {count}, DType::bf16, Device::cuda);
    TensorView rs_out(out.data(), {count / env.world}, DType::bf16, Device::cuda);
    const int iters = 20;
    double ar = median_ms(s, [&] { comm->all_reduce(buf, parallel::ReduceOp::sum, s); }, iters);
    double ar_nb = median_ms(s, [&] { nonblocking->all_reduce(buf, parallel::ReduceOp::sum, s); }, iters);
    double ar_raw = median_ms(s, [&] { ncclAllReduce(in.data(), in.data(), count, ncclBfloat16, ncclSum, raw, s); }, iters);
    // The host's time to queue one call (kiln's NCCL communicator, the copy engines' one).
    double host_nb = 0, host_ce = 0;
    int calls_nb = 0, calls_ce = 0;
    auto host_timed = [](double& total, int& calls, auto&& call) {
      const auto t0 = std::chrono::steady_clock::now();
      call();
      total += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      ++calls;
    };
    median_ms(s, [&] { host_timed(host_nb, calls_nb, [&] { nonblocking->all_reduce(buf, parallel::ReduceOp::sum, s); }); }, iters);
    double ar_ce = median_ms(
        s, [&] { host_timed(host_ce, calls_ce, [&] { copy_engine->all_reduce(buf, parallel::ReduceOp::sum, s); }); }, iters);
    double rs = median_ms(s, [&] { comm->reduce_scatter(rs_out, buf, parallel::ReduceOp::sum, s); }, iters);
    double rs_ce = median_ms(s, [&] { copy_engine->reduce_scatter(rs_out, buf, parallel::ReduceOp::sum, s); }, iters);
    double rs_raw = median_ms(
        s, [&] { ncclReduceScatter(in.data(), out.data(), count / env.world, ncclBfloat16, ncclSum, raw, s); }, iters);
    auto bus = [&](double ms, double factor) { return bytes / (ms * 1e-3) / 1e9 * factor; };
    if (env.rank == 0)
      std::printf("%7zu MiB | %12.1f %12.1f %12.1f %12.1f | %12.1f %12.1f %12.1f | %14.1f %14.1f\n", bytes >> 20,
                  bus(ar, 2 * (n - 1) / n), bus(ar_nb, 2 * (n - 1) / n), bus(ar_raw, 2 * (n - 1) / n),
                  bus(ar_ce, 2 * (n - 1) / n), bus(rs, (n - 1) / n), bus(rs_raw, (n - 1) / n), bus(rs_ce, (n - 1) / n),
                  host_nb / std::max(calls_nb, 1), host_ce / std::max(calls_ce, 1));
  }
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
  overlap_table(env, *nonblocking, s, "NCCL");
  overlap_table(env, *copy_engine, s, "copy engines");
  return finish();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    auto env = parallel::detect_launch_env();
    if (env.world > 1) return rank_main(env);
    int nproc = 2;
    for (int i = 1; i + 1 < argc; ++i)
      if (std::string(argv[i]) == "--nproc") nproc = std::stoi(argv[i + 1]);
    return parallel::run_local_processes(nproc, {}, 120.0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", e.what());
    return 1;
  }
}
