// Collective bandwidth, nccl-tests style: all-reduce and reduce-scatter of 1 MiB .. 1 GiB (bf16),
// through kiln's Communicator and through raw NCCL calls on a communicator of its own, on N GPUs.
// bus bandwidth = bytes / time x 2(n-1)/n for all-reduce, x (n-1)/n for reduce-scatter.
// usage: bench_collectives --nproc N      (starts N ranks itself; rank 0 prints the table)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

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
  const std::size_t max_bytes = std::size_t(1) << 30;
  Buffer in(Device::cuda, max_bytes), out(Device::cuda, max_bytes);
  KILN_CUDA_CHECK(cudaMemset(in.data(), 0x3c, max_bytes));  // bf16 ~ 0.0115: finite, not zero
  const double n = env.world;
  if (env.rank == 0) {
    std::printf("%d x %s, bf16, busbw in GB/s (median of 20)\n", env.world, "GPU");
    std::printf("%10s | %12s %12s %12s | %12s %12s\n", "size", "AR blocking", "AR kiln", "AR raw NCCL",
                "reduce_scat", "raw NCCL");
  }
  for (std::size_t bytes = 1u << 20; bytes <= max_bytes; bytes *= 4) {
    const std::int64_t count = static_cast<std::int64_t>(bytes / 2);
    TensorView buf(in.data(), {count}, DType::bf16, Device::cuda);
    TensorView rs_out(out.data(), {count / env.world}, DType::bf16, Device::cuda);
    const int iters = 20;
    double ar = median_ms(s, [&] { comm->all_reduce(buf, parallel::ReduceOp::sum, s); }, iters);
    double ar_nb = median_ms(s, [&] { nonblocking->all_reduce(buf, parallel::ReduceOp::sum, s); }, iters);
    double ar_raw = median_ms(s, [&] { ncclAllReduce(in.data(), in.data(), count, ncclBfloat16, ncclSum, raw, s); }, iters);
    double rs = median_ms(s, [&] { comm->reduce_scatter(rs_out, buf, parallel::ReduceOp::sum, s); }, iters);
    double rs_raw = median_ms(
        s, [&] { ncclReduceScatter(in.data(), out.data(), count / env.world, ncclBfloat16, ncclSum, raw, s); }, iters);
    auto bus = [&](double ms, double factor) { return bytes / (ms * 1e-3) / 1e9 * factor; };
    if (env.rank == 0)
      std::printf("%7zu MiB | %12.1f %12.1f %12.1f | %12.1f %12.1f\n", bytes >> 20, bus(ar, 2 * (n - 1) / n),
                  bus(ar_nb, 2 * (n - 1) / n), bus(ar_raw, 2 * (n - 1) / n), bus(rs, (n - 1) / n),
                  bus(rs_raw, (n - 1) / n));
  }
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
  ncclCommDestroy(raw);
  comm.reset();
  nonblocking.reset();
  world.reset();
  rdv->finish();
  return 0;
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
