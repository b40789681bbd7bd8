// parallel.copy_engine's communicator on N GPUs (N processes, default 2) against the exact host
// reduction: every rank regenerates every rank's random data, so the expected bits are known. Small
// slots (64 KiB, two per peer) so that messages are cut into many; awkward sizes (1, 7, odd, larger
// than a slot); f32, bf16, i32; sum, max, avg; all-reduce (in one transfer, and as reduce-scatter
// then all-gather), reduce-scatter, all-gather, grouped
// send/recv with several transfers per peer (empty ones and one to itself); and the same calls
// captured into a CUDA graph, replayed on fresh data with eager calls in between. The ranks run with
// CUDA_DEVICE_MAX_CONNECTIONS=1 (all streams on one hardware queue, in the order queued), and messages
// of more pieces than slots, so a send that waits for a slot ahead of the receives it depends on hangs.
// Prints KILN_SKIP and exits 0 with fewer than two GPUs; exits 1 naming the first mismatch.
// usage: gpu_copy_engine_main [--nproc N]
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kiln/parallel/copy_engine.hpp"
#include "kiln/parallel/launch.hpp"
#include "kiln/parallel/nccl.hpp"
#include "kiln/parallel/rendezvous.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

using namespace kiln;
using parallel::ReduceOp;

namespace {

// Element i of rank r's data for `seed`, as the bits of `dtype` (u32 holds f32 / bf16 / i32 bits).
std::vector<std::uint32_t> data_of(int r, std::uint64_t seed, std::size_t count, DType dtype) {
  std::mt19937_64 g(seed * 1000003 + static_cast<std::uint64_t>(r));
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::vector<std::uint32_t> v(count);
  for (auto& x : v) {
    const float f = u(g);
    if (dtype == DType::i32) {
      const auto i = static_cast<std::int32_t>(f * 1000);
      std::memcpy(&x, &i, 4);
    } else if (dtype == DType::bf16) {
      x = float_to_bf16_bits(f);
    } else {
      std::memcpy(&x, &f, 4);
    }
  }
  return v;
}

float as_float(std::uint32_t bits, DType dtype) {
  if (dtype == DType::bf16) return bf16_bits_to_float(static_cast<std::uint16_t>(bits));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The reduction over ranks 0..n-1, left to right (floats in f32, bf16 rounded once at the end).
std::vector<std::uint32_t> reduced(int n, std::uint64_t seed, std::size_t count, DType dtype, ReduceOp op) {
  std::vector<std::vector<std::uint32_t>> all;
  for (int r = 0; r < n; ++r) all.push_back(data_of(r, seed, count, dtype));
  std::vector<std::uint32_t> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (dtype == DType::i32) {
      std::int32_t acc;
      std::memcpy(&acc, &all[0][i], 4);
      for (int r = 1; r < n; ++r) {
        std::int32_t v;
        std::memcpy(&v, &all[r][i], 4);
        acc = op == ReduceOp::max ? std::max(acc, v) : acc + v;
      }
      std::memcpy(&out[i], &acc, 4);
      continue;
    }
    float acc = as_float(all[0][i], dtype);
    for (int r = 1; r < n; ++r) {
      const float v = as_float(all[r][i], dtype);
      acc = op == ReduceOp::max ? std::max(acc, v) : acc + v;
    }
    if (op == ReduceOp::avg) acc /= static_cast<float>(n);
    if (dtype == DType::bf16)
      out[i] = float_to_bf16_bits(acc);
    else
      std::memcpy(&out[i], &acc, 4);
  }
  return out;
}

struct DevArray {
  Buffer buf;
  std::size_t count = 0;
  DType dtype = DType::f32;
  TensorView view(std::size_t offset = 0, std::size_t n = 0) const {
    return TensorView(static_cast<char*>(buf.data()) + offset * size_of(dtype),
                      {static_cast<std::int64_t>(n ? n : count - offset)}, dtype, kiln::Device::cuda);
  }
};

void upload(const TensorView& t, const std::vector<std::uint32_t>& bits, cudaStream_t s) {
  std::vector<char> raw(bits.size() * size_of(t.dtype));
  for (std::size_t i = 0; i < bits.size(); ++i)
    std::memcpy(raw.data() + i * size_of(t.dtype), &bits[i], size_of(t.dtype));  // little-endian low bytes
  KILN_CUDA_CHECK(cudaMemcpyAsync(t.data, raw.data(), raw.size(), cudaMemcpyHostToDevice, s));
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
}

std::vector<std::uint32_t> download(const TensorView& t, cudaStream_t s) {
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<char> raw(t.bytes());
  KILN_CUDA_CHECK(cudaMemcpy(raw.data(), t.data, raw.size(), cudaMemcpyDeviceToHost));
  std::vector<std::uint32_t> bits(static_cast<std::size_t>(t.numel()), 0);
  for (std::size_t i = 0; i < bits.size(); ++i) std::memcpy(&bits[i], raw.data() + i * size_of(t.dtype), size_of(t.dtype));
  return bits;
}

int checks = 0;
void expect_equal(const std::vector<std::uint32_t>& got, const std::vector<std::uint32_t>& want, const std::string& what,
                  int rank) {
  ++checks;
  if (got.size() != want.size()) KILN_THROW("rank ", rank, ": ", what, ": ", got.size(), " elements, expected ", want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      KILN_THROW("rank ", rank, ": ", what, ": element ", i, " has bits ", got[i], ", expected ", want[i]);
}

std::vector<std::uint32_t> slice(const std::vector<std::uint32_t>& v, std::size_t at, std::size_t n) {
  return {v.begin() + static_cast<std::ptrdiff_t>(at), v.begin() + static_cast<std::ptrdiff_t>(at + n)};
}

// Elements rank `from` sends rank `to` in transfer t (0, 1 or 2) of a send_recv round.
std::size_t transfer_size(int from, int to, int t) {
  const std::size_t sizes[3] = {0, 40000, 777};
  return sizes[t] + static_cast<std::size_t>(from * 13 + to * 5) * (t > 0);
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
  parallel::CopyEngineOptions opt;
  opt.min_bytes = 0;
  opt.slot_bytes = 64 << 10;
  opt.slots = 2;
  opt.min_piece_bytes = 4096;
  opt.timeout_s = 30;
  auto ce = parallel::make_copy_engine_communicator(world->group("ce", 0, all), world, opt);
  opt.one_shot = false;  // all-reduces as a reduce-scatter and an all-gather, as with more ranks
  auto ce_two = parallel::make_copy_engine_communicator(world->group("ce2", 0, all), world, opt);
  const int n = env.world, me = env.rank;
  cudaStream_t s;
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  std::uint64_t seed = 1;
  const std::size_t counts[] = {1, 7, 1000, 33333, 100003};
  const DType dtypes[] = {DType::f32, DType::bf16, DType::i32};
  for (DType dt : dtypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg}) {
      if (dt == DType::i32 && op == ReduceOp::avg) continue;
      for (std::size_t count : counts) {
        const std::string what = cat(name_of(dt), " ", parallel::reduce_op_name(op), " of ", count);
        // all_reduce
        DevArray a{Buffer(kiln::Device::cuda, count * 4), count, dt};
        upload(a.view(), data_of(me, ++seed, count, dt), s);
        ce->all_reduce(a.view(), op, s);
        const auto want = reduced(n, seed, count, dt, op);
        expect_equal(download(a.view(), s), want, "all_reduce " + what, me);
        upload(a.view(), data_of(me, seed, count, dt), s);
        ce_two->all_reduce(a.view(), op, s);
        expect_equal(download(a.view(), s), want, "all_reduce in two phases, " + what, me);
        // reduce_scatter of n x count
        DevArray in{Buffer(kiln::Device::cuda, n * count * 4), n * count, dt}, out{Buffer(kiln::Device::cuda, count * 4), count, dt};
        upload(in.view(), data_of(me, ++seed, n * count, dt), s);
        ce->reduce_scatter(out.view(), in.view(), op, s);
        expect_equal(download(out.view(), s), slice(reduced(n, seed, n * count, dt, op), me * count, count),
                     "reduce_scatter " + what, me);
      }
    }
  // all_gather, bf16 and f32
  for (DType dt : {DType::bf16, DType::f32})
    for (std::size_t count : counts) {
      DevArray in{Buffer(kiln::Device::cuda, count * 4), count, dt}, out{Buffer(kiln::Device::cuda, n * count * 4), n * count, dt};
      upload(in.view(), data_of(me, ++seed, count, dt), s);
      ce->all_gather(out.view(), in.view(), s);
      std::vector<std::uint32_t> want;
      for (int r = 0; r < n; ++r) {
        auto v = data_of(r, seed, count, dt);
        want.insert(want.end(), v.begin(), v.end());
      }
      expect_equal(download(out.view(), s), want, cat("all_gather ", name_of(dt), " of ", count), me);
    }
  // send_recv: three transfers to every rank (this one too), one of them empty.
  auto exchange = [&](std::uint64_t sd, auto&& call) {
    std::vector<Buffer> keep;
    std::vector<parallel::Communicator::Transfer> sends, recvs;
    for (int p = 0; p < n; ++p)
      for (int t = 0; t < 3; ++t) {
        const std::size_t m = transfer_size(me, p, t), m_in = transfer_size(p, me, t);
        keep.emplace_back(kiln::Device::cuda, std::max<std::size_t>(m, 1) * 2);
        TensorView sv(keep.back().data(), {static_cast<std::int64_t>(m)}, DType::bf16, kiln::Device::cuda);
        upload(sv, data_of(me * 100 + p * 10 + t, sd, m, DType::bf16), s);
        sends.push_back({p, sv});
        keep.emplace_back(kiln::Device::cuda, std::max<std::size_t>(m_in, 1) * 2);
        recvs.push_back({p, TensorView(keep.back().data(), {static_cast<std::int64_t>(m_in)}, DType::bf16, kiln::Device::cuda)});
      }
    call(sends, recvs);
    for (const auto& r : recvs) {
      const int t = static_cast<int>(&r - recvs.data()) % 3;
      expect_equal(download(r.buf, s), data_of(r.peer * 100 + me * 10 + t, sd, static_cast<std::size_t>(r.buf.numel()), DType::bf16),
                   cat("send_recv from rank ", r.peer, ", transfer ", t), me);
    }
  };
  exchange(++seed, [&](auto& sends, auto& recvs) { ce->send_recv(sends, recvs, s); });

  // Captured: an all_reduce (bf16, many slots) and an all_gather, replayed three times on fresh data,
  // with an eager all_reduce between replays.
  {
    const std::size_t count = 100003;
    DevArray a{Buffer(kiln::Device::cuda, count * 2), count, DType::bf16};
    DevArray g_out{Buffer(kiln::Device::cuda, static_cast<std::size_t>(n) * 4000), static_cast<std::size_t>(n) * 1000, DType::f32}, g_in{Buffer(kiln::Device::cuda, 4000), 1000, DType::f32};
    DevArray e{Buffer(kiln::Device::cuda, 33333 * 4), 33333, DType::f32};
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KILN_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    ce->all_reduce(a.view(), ReduceOp::sum, s);
    ce->all_gather(g_out.view(), g_in.view(), s);
    KILN_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    KILN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      upload(a.view(), data_of(me, ++seed, count, DType::bf16), s);
      const std::uint64_t ar_seed = seed;
      upload(g_in.view(), data_of(me, ++seed, 1000, DType::f32), s);
      KILN_CUDA_CHECK(cudaGraphLaunch(exec, s));
      world->track(s, "the test's replayed graph");
      expect_equal(download(a.view(), s), reduced(n, ar_seed, count, DType::bf16, ReduceOp::sum),
                   cat("captured all_reduce, replay ", replay), me);
      std::vector<std::uint32_t> want;
      for (int r = 0; r < n; ++r) {
        auto v = data_of(r, seed, 1000, DType::f32);
        want.insert(want.end(), v.begin(), v.end());
      }
      expect_equal(download(g_out.view(), s), want, cat("captured all_gather, replay ", replay), me);
      upload(e.view(), data_of(me, ++seed, 33333, DType::f32), s);
      ce->all_reduce(e.view(), ReduceOp::sum, s);
      expect_equal(download(e.view(), s), reduced(n, seed, 33333, DType::f32, ReduceOp::sum),
                   cat("eager all_reduce after replay ", replay), me);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  world->check();
  std::printf("rank %d: %d checks passed (%d ranks, copy engines)\n", me, checks, n);
  ce.reset();
  ce_two.reset();
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
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < nproc) {
      std::printf("KILN_SKIP: needs %d GPUs, found %d\n", nproc, gpus);
      return 0;
    }
    // Every stream on one hardware queue: commands then run in the order queued across streams, the
    // case where a send queued before the receives it waits for would hang both ranks.
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);
    return parallel::run_local_processes(nproc, {}, 120.0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_copy_engine_main: %s\n", e.what());
    return 1;
  }
}
