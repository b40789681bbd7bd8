// A two-layer MLP block, column-parallel then row-parallel (Megatron's split), on two ranks that are
// threads of this process, against the same block on one rank. Uses kiln::tensor_parallel without a
// World: an in-process communicator, the CPU backend, the layers.
#include <cmath>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include <kiln/ops/backend.hpp>
#include <kiln/ops/linear_impl.hpp>
#include <kiln/parallel/communicator.hpp>
#include <kiln/parallel/in_process.hpp>
#include <kiln/parallel/parallel_linear.hpp>

using namespace kiln;

constexpr std::int64_t N = 8, C = 6, H = 12;  // tokens, width, hidden

float value(std::int64_t i, int salt) { return std::sin(0.37f * static_cast<float>(i) + static_cast<float>(salt)); }

// The block's output [N, C] on the ranks of `comm`, each holding its part of both weights.
std::vector<float> mlp(parallel::Communicator& comm) {
  auto be = ops::make_cpu_backend({.threads = 1});
  const parallel::TensorParallel tp(comm, *be, {});
  const parallel::ColumnParallelLinear up(tp, C, H);
  const parallel::RowParallelLinear down(tp, H, C);
  const std::int64_t h = up.local_out();
  std::vector<float> x(N * C), w1(h * C), w2(C * h), hidden(N * h), y(N * C);
  for (std::int64_t i = 0; i < N * C; ++i) x[i] = value(i, 0);
  // Each rank's rows of W1 [H, C] and columns of W2 [C, H], by their global indices.
  up.weight_shard().for_each_block({H, C}, [&](const TensorShard::Block& b) {
    for (std::int64_t k = 0; k < b.count; ++k) w1[b.local + k] = value(b.global + k, 1);
  });
  down.weight_shard().for_each_block({C, H}, [&](const TensorShard::Block& b) {
    for (std::int64_t k = 0; k < b.count; ++k) w2[b.local + k] = value(b.global + k, 2);
  });
  auto t = [](std::vector<float>& v, Shape s) { return TensorView(v.data(), s, DType::f32, Device::cpu); };
  const ops::LinearImpl matmul = ops::backend_linear_impl(*be);
  up.forward(matmul, {t(hidden, {N, h}), {}, t(x, {N, C}), t(w1, {h, C}), {}}, {});
  down.forward(matmul, {t(y, {N, C}), {}, t(hidden, {N, h}), t(w2, {C, h}), {}}, t(y, {N, C}));  // summed over ranks
  return y;
}

int main() {
  auto one = parallel::make_self_communicator("tp", 0);
  const std::vector<float> whole = mlp(*one);

  auto hub = std::make_shared<parallel::InProcessHub>(2, std::chrono::seconds(10));
  std::vector<float> split[2];
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] { split[r] = mlp(*hub->communicator("tp", {0, 1}, r)); });
  for (auto& t : ranks) t.join();

  double worst = 0;
  for (std::size_t i = 0; i < whole.size(); ++i)
    for (const auto& s : split) worst = std::max(worst, static_cast<double>(std::fabs(s[i] - whole[i])));
  std::printf("MLP block on 2 tensor-parallel ranks vs 1: worst difference %.3g\n", worst);
  return worst < 1e-5 ? 0 : 1;
}
