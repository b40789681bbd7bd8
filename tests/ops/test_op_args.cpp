// The op argument checks (kiln/ops/arg_check.hpp and the one description per op both backends
// call): every op of the CPU backend refuses a wrong dtype, shape or device naming itself and the
// argument; the checker's binding, 32-bit and message rules on a CUDA target (no GPU needed).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/ops/arg_check.hpp"
#include "kiln/ops/backend.hpp"

using namespace kiln;

namespace {

// The message of the kiln::Error f throws ("" if it throws none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Host memory for the views of the cases below (stable addresses).
class Storage {
 public:
  TensorView f32(Shape s, float value = 0.5f) {
    auto& v = floats_.emplace_back(static_cast<std::size_t>(s.numel()), value);
    return TensorView(v.data(), s, DType::f32, Device::cpu);
  }
  // i32 values i % modulo.
  TensorView i32(Shape s, int modulo) {
    auto& v = ints_.emplace_back(static_cast<std::size_t>(s.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>(i % static_cast<std::size_t>(modulo));
    return TensorView(v.data(), s, DType::i32, Device::cpu);
  }

 private:
  std::deque<std::vector<float>> floats_;
  std::deque<std::vector<std::int32_t>> ints_;
};

// One op with valid arguments: run() calls it; `args` are its tensor arguments by name, which a test
// may spoil one at a time (and put back).
struct OpCase {
  std::string op;
  std::function<void(ops::Backend&)> run;
  std::vector<std::pair<std::string, TensorView*>> args;
  bool any_dtype = false;  // zero takes every dtype
  bool any_shape = false;  // zero, fill, init_normal, sum_squares take every shape
};

// The optional arguments ("op arg") of the cases below.
const std::vector<std::string> kOptional = {"linear_forward pre_gelu", "linear_forward bias", "linear_backward dx",
                                            "linear_backward dbias",   "linear_backward dx_gelu_pre", "adamw params_act",
                                            "embedding_backward dwpe"};  // a model without a position table (Llama)

// Optional only with or without another (tested on their own below).
const std::vector<std::string> kConditional = {"linear_backward dweight"};  // with dbias, without dx

constexpr std::int64_t N = 4, T = 2, C = 8, OC = 6, V = 10, P = 16;
constexpr std::int64_t B = 1, AT = 3, H = 2, D = 4;  // attention

// Every op and tensor-taking function of ops::Backend with valid CPU arguments.
std::vector<OpCase> all_ops(Storage& st) {
  std::vector<OpCase> cases;
  auto add = [&]<class A>(std::string op, std::shared_ptr<A> a, void (ops::Backend::*f)(const A&),
                          std::vector<std::pair<std::string, TensorView*>> args) {
    cases.push_back({std::move(op), [a, f](ops::Backend& b) { (b.*f)(*a); }, std::move(args)});
  };
  {
    auto a = std::make_shared<ops::EmbeddingForward>();
    *a = {st.f32({N, C}), st.i32({N}, V), st.f32({V, C}), st.f32({T, C}), T};
    add("embedding_forward", a, &ops::Backend::embedding_forward,
        {{"out", &a->out}, {"tokens", &a->tokens}, {"wte", &a->wte}, {"wpe", &a->wpe}});
  }
  {
    auto a = std::make_shared<ops::EmbeddingBackward>();
    const TensorView tokens = st.i32({N}, V);
    *a = {st.f32({V, C}), st.f32({T, C}), st.f32({N, C}), tokens, tokens.as<std::int32_t>(), T};
    add("embedding_backward", a, &ops::Backend::embedding_backward,
        {{"dwte", &a->dwte}, {"dwpe", &a->dwpe}, {"dout", &a->dout}, {"tokens", &a->tokens}});
  }
  {
    auto a = std::make_shared<ops::LayerNormForward>();
    *a = {st.f32({N, C}), st.f32({N}), st.f32({N}), st.f32({N, C}), st.f32({C}), st.f32({C})};
    add("layernorm_forward", a, &ops::Backend::layernorm_forward,
        {{"out", &a->out}, {"mean", &a->mean}, {"rstd", &a->rstd}, {"x", &a->x}, {"weight", &a->weight},
         {"bias", &a->bias}});
  }
  {
    auto a = std::make_shared<ops::LayerNormBackward>();
    *a = {st.f32({N, C}), st.f32({C}), st.f32({C}), st.f32({N, C}), st.f32({N, C}), st.f32({C}), st.f32({N}),
          st.f32({N})};
    add("layernorm_backward", a, &ops::Backend::layernorm_backward,
        {{"dx", &a->dx}, {"dweight", &a->dweight}, {"dbias", &a->dbias}, {"dout", &a->dout}, {"x", &a->x},
         {"weight", &a->weight}, {"mean", &a->mean}, {"rstd", &a->rstd}});
  }
  {
    auto a = std::make_shared<ops::LinearForward>();
    *a = {st.f32({N, OC}), st.f32({N, OC}), st.f32({N, C}), st.f32({OC, C}), st.f32({OC})};
    add("linear_forward", a, &ops::Backend::linear_forward,
        {{"out", &a->out}, {"pre_gelu", &a->pre_gelu}, {"x", &std::get<TensorView>(a->x)}, {"weight", &a->weight},
         {"bias", &a->bias}});
  }
  {
    auto a = std::make_shared<ops::LinearBackward>();
    *a = {st.f32({N, C}),  st.f32({OC, C}), st.f32({OC}),   st.f32({N, OC}),
          st.f32({N, C}),  st.f32({OC, C}), st.f32({N, C})};
    add("linear_backward", a, &ops::Backend::linear_backward,
        {{"dx", &a->dx}, {"dweight", &a->dweight}, {"dbias", &a->dbias}, {"dout", &std::get<TensorView>(a->dout)},
         {"x", &std::get<TensorView>(a->x)}, {"weight", &a->weight}, {"dx_gelu_pre", &a->dx_gelu_pre}});
  }
  {
    auto a = std::make_shared<ops::GeluForward>();
    *a = {st.f32({N, C}), st.f32({N, C})};
    add("gelu_forward", a, &ops::Backend::gelu_forward, {{"out", &a->out}, {"x", &a->x}});
  }
  {
    auto a = std::make_shared<ops::AttentionForward>();
    *a = {st.f32({B, AT, H, D}), st.f32({B, H, AT}), st.f32({B, AT, 3, H, D}), 0.5f};
    add("attention_forward", a, &ops::Backend::attention_forward, {{"out", &a->out}, {"lse", &a->lse}, {"qkv", &a->qkv}});
  }
  {
    auto a = std::make_shared<ops::AttentionBackward>();
    *a = {st.f32({B, AT, 3, H, D}), st.f32({B, AT, H, D}), st.f32({B, AT, H, D}), st.f32({B, H, AT}),
          st.f32({B, AT, 3, H, D}), 0.5f};
    add("attention_backward", a, &ops::Backend::attention_backward,
        {{"dqkv", &a->dqkv}, {"dout", &a->dout}, {"out", &a->out}, {"lse", &a->lse}, {"qkv", &a->qkv}});
  }
  {
    auto a = std::make_shared<ops::AttentionDecode>();
    *a = {st.f32({B, H, D}), st.f32({B, AT, 3, H, D}), static_cast<int>(AT), 0.5f};
    add("attention_decode", a, &ops::Backend::attention_decode, {{"out", &a->out}, {"qkv", &a->qkv}});
  }
  {
    auto a = std::make_shared<ops::ResidualForward>();
    *a = {st.f32({N, C}), st.f32({N, C}), st.f32({N, C})};
    add("residual_forward", a, &ops::Backend::residual_forward,
        {{"out", &a->out}, {"residual", &a->residual}, {"x", &a->x}});
  }
  {
    auto a = std::make_shared<ops::DropoutBackward>();
    *a = {st.f32({N, C}), st.f32({N, C})};
    add("dropout_backward", a, &ops::Backend::dropout_backward, {{"dx", &a->dx}, {"dout", &a->dout}});
  }
  {
    auto a = std::make_shared<ops::CrossEntropy>();
    *a = {st.f32({N}), st.f32({N, V}), st.i32({N}, V), static_cast<int>(V)};
    add("cross_entropy", a, &ops::Backend::cross_entropy,
        {{"losses", &a->losses}, {"logits", &a->logits}, {"targets", &a->targets}});
  }
  {
    auto a = std::make_shared<ops::CrossEntropyStats>();
    *a = {st.f32({N, 3}), st.f32({N, V}), st.i32({N}, V), 0, static_cast<int>(V)};
    add("cross_entropy_stats", a, &ops::Backend::cross_entropy_stats,
        {{"stats", &a->stats}, {"logits", &a->logits}, {"targets", &a->targets}});
  }
  {
    auto a = std::make_shared<ops::CrossEntropyFinish>();
    *a = {st.f32({N}), st.f32({N, V}), st.i32({N}, V), st.f32({1, N, 3}, 1.0f), 0, static_cast<int>(V)};
    add("cross_entropy_finish", a, &ops::Backend::cross_entropy_finish,
        {{"losses", &a->losses}, {"logits", &a->logits}, {"targets", &a->targets}, {"all_stats", &a->all_stats}});
  }
  {
    auto a = std::make_shared<ops::AdamW>();
    a->params = st.f32({P});
    a->params_act = st.f32({P});
    a->grads = st.f32({P});
    a->m = st.f32({P});
    a->v = st.f32({P}, 1.0f);
    a->segments = {{0, 10, true}, {10, P - 10, false}};
    add("adamw", a, &ops::Backend::adamw,
        {{"params", &a->params}, {"params_act", &a->params_act}, {"grads", &a->grads}, {"m", &a->m}, {"v", &a->v}});
  }
  // The tensor-taking functions that are not ops: one tensor each.
  auto one = [&](std::string op, std::string arg, std::function<void(ops::Backend&, const TensorView&)> f,
                 bool any_dtype = false) {
    auto t = std::make_shared<TensorView>(st.f32({P}));
    cases.push_back({std::move(op), [t, f](ops::Backend& b) { f(b, *t); }, {{std::move(arg), t.get()}}, any_dtype, true});
  };
  one("zero", "t", [](ops::Backend& b, const TensorView& t) { b.zero(t); }, true);
  one("fill", "dst", [](ops::Backend& b, const TensorView& t) { b.fill(t, 1.0f); });
  one("init_normal", "dst", [](ops::Backend& b, const TensorView& t) { b.init_normal(t, 0.02f, {1, 0, nullptr}, 0); });
  one("sum_squares", "x", [](ops::Backend& b, const TensorView& t) { b.sum_squares(t); });
  return cases;
}

// Runs every case with each of its arguments replaced by spoil(argument) in turn (the others
// valid), and checks that the op throws a kiln::Error that names the op and the spoiled argument:
// as the one it refuses ("linear_forward x: expected ...") or, for a dimension the spoiled argument
// bound first, as where the disagreeing value came from ("... with IC = 9 (from x), got ...").
void check_every_argument(const std::function<bool(const OpCase&, TensorView&)>& spoil) {
  auto backend = ops::make_cpu_backend({.threads = 1});
  Storage st;
  for (OpCase& c : all_ops(st)) {
    for (auto& [arg, view] : c.args) {
      const TensorView good = *view;
      if (!spoil(c, *view)) continue;
      const std::string msg = error_of([&] { c.run(*backend); });
      *view = good;
      INFO(c.op, " ", arg, ": ", msg);
      CHECK(msg.rfind(c.op + " ", 0) == 0);
      CHECK((contains(msg, " " + arg + ": expected") || contains(msg, "(from " + arg + ")")));
      CHECK(contains(msg, "got "));
    }
  }
}

}  // namespace

TEST_CASE("every op runs with the valid arguments the argument tests start from") {
  auto backend = ops::make_cpu_backend({.threads = 1});
  Storage st;
  for (OpCase& c : all_ops(st)) {
    INFO(c.op);
    CHECK(error_of([&] { c.run(*backend); }) == "");
  }
}

TEST_CASE("every op refuses an argument of the wrong dtype, naming the op and the argument") {
  check_every_argument([](const OpCase& c, TensorView& t) {
    if (c.any_dtype) return false;
    t.dtype = t.dtype == DType::i32 ? DType::f32 : DType::i32;
    return true;
  });
}

TEST_CASE("every op refuses an argument of the wrong shape, naming the op and the argument") {
  check_every_argument([](const OpCase& c, TensorView& t) {
    if (c.any_shape) return false;
    // One dimension more (twice the elements), or for a 5-D tensor a last dimension twice as long:
    // never read, the check fails first.
    Shape s = t.shape;
    if (s.ndim < kMaxDims) s.dims[s.ndim++] = 2;
    else s.dims[s.ndim - 1] *= 2;
    t = TensorView(t.data, s, t.dtype, t.device);
    return true;
  });
}

TEST_CASE("every op refuses an argument on another device, naming the op and the argument") {
  check_every_argument([](const OpCase&, TensorView& t) {
    t.device = Device::cuda;
    return true;
  });
}

TEST_CASE("every op refuses a missing required argument, naming it") {
  auto backend = ops::make_cpu_backend({.threads = 1});
  Storage st;
  for (OpCase& c : all_ops(st)) {
    for (auto& [arg, view] : c.args) {
      if (std::find(kOptional.begin(), kOptional.end(), c.op + " " + arg) != kOptional.end()) continue;
      if (std::find(kConditional.begin(), kConditional.end(), c.op + " " + arg) != kConditional.end()) continue;
      const TensorView good = *view;
      *view = TensorView();
      const std::string msg = error_of([&] { c.run(*backend); });
      *view = good;
      INFO(c.op, " ", arg, ": ", msg);
      CHECK(contains(msg, c.op + " " + arg + ": expected"));
      CHECK(contains(msg, "got none"));
    }
  }
}

TEST_CASE("a linear layer's prologues are for a LinearImpl that takes them: the backend refuses them, by name") {
  auto b = ops::make_cpu_backend({.threads = 1});
  Storage st;
  ops::LinearForward f{st.f32({N, OC}), {}, st.f32({N, C}), st.f32({OC, C})};
  f.x = ops::GeluOnLoad{st.f32({N, C})};
  CHECK(contains(error_of([&] { b->linear_forward(f); }), "linear_forward: x: the backend takes the tensor itself, got a gelu-on-load prologue"));
  f.x = ops::LayerNormOnLoad{st.f32({N, C}), st.f32({C}), st.f32({C}), st.f32({N}), st.f32({N})};
  CHECK(contains(error_of([&] { b->linear_forward(f); }), "got a layernorm-on-load prologue"));
  f.x = ops::SwigluOnLoad{st.f32({N, 2 * C})};
  CHECK(contains(error_of([&] { b->linear_forward(f); }), "got a swiglu-on-load prologue"));
  ops::LinearBackward g{st.f32({N, C}), st.f32({OC, C}), {}, st.f32({N, OC}), st.f32({N, C}), st.f32({OC, C})};
  g.dout = ops::DgeluOnLoad{st.f32({N, OC}), st.f32({N, OC})};
  CHECK(contains(error_of([&] { b->linear_backward(g); }), "linear_backward: dout: the backend takes the tensor itself, got a dgelu-on-load prologue"));
}

TEST_CASE("linear_backward without dweight computes dx alone, and refuses dbias without dweight or a call asking for nothing") {
  auto b = ops::make_cpu_backend({.threads = 1});
  Storage st;
  ops::LinearBackward g{st.f32({N, C}), {}, {}, st.f32({N, OC}), st.f32({N, C}), st.f32({OC, C})};
  CHECK_NOTHROW(b->linear_backward(g));
  g.dbias = st.f32({OC});
  CHECK(contains(error_of([&] { b->linear_backward(g); }), "linear_backward: dbias comes with dweight"));
  g.dbias = {};
  g.dx = {};
  CHECK(contains(error_of([&] { b->linear_backward(g); }), "linear_backward: asks for nothing"));
}

TEST_CASE("adamw's segments must tile the parameters exactly") {
  auto b = ops::make_cpu_backend({.threads = 1});
  Storage st;
  ops::AdamW a;
  a.params = st.f32({P});
  a.grads = st.f32({P});
  a.m = st.f32({P});
  a.v = st.f32({P}, 1.0f);
  a.segments = {{0, 6}, {8, P - 8}};  // a gap
  CHECK(contains(error_of([&] { b->adamw(a); }), "adamw: segments must tile [0, 16): a segment starts at 8 where 6"));
  a.segments = {{0, 10}, {6, P - 6}};  // an overlap whose counts add up to more than P
  CHECK(contains(error_of([&] { b->adamw(a); }), "adamw: segments must tile"));
  a.segments = {{0, 10}};  // short
  CHECK(contains(error_of([&] { b->adamw(a); }), "adamw: segments cover 10 of 16 elements"));
  a.segments = {{0, P + 2}, {P + 2, -2}};  // a negative count
  CHECK(contains(error_of([&] { b->adamw(a); }), "negative count"));
  a.segments = {{10, P - 10}, {0, 0}, {0, 10}};  // in any order, empty ones aside
  CHECK(error_of([&] { b->adamw(a); }) == "");
}

TEST_CASE("an embedding refuses rows outside its vocabulary, token ids outside it and missing host tokens") {
  auto b = ops::make_cpu_backend({.threads = 1});
  Storage st;
  const TensorView tokens = st.i32({N}, V);
  ops::EmbeddingForward f{st.f32({N, C}), tokens, st.f32({V, C}), st.f32({T, C}), T, 5, V + 4};
  CHECK(contains(error_of([&] { b->embedding_forward(f); }), "embedding_forward: rows [5, 15) outside a vocabulary of 14"));
  f.vocab_begin = 0;
  f.T = 3;  // does not divide N = 4
  CHECK(contains(error_of([&] { b->embedding_forward(f); }), "embedding_forward: T = 3 must be positive, divide N = 4"));
  std::vector<std::int32_t> bad = {0, 1, 14, 2};
  ops::EmbeddingBackward g{st.f32({V, C}), st.f32({T, C}), st.f32({N, C}), tokens, bad.data(), T, 0, V + 4};
  CHECK(contains(error_of([&] { b->embedding_backward(g); }),
                 "embedding_backward tokens_host: token 14 at position 2 outside the vocabulary of 14"));
  g.tokens_host = nullptr;
  CHECK(contains(error_of([&] { b->embedding_backward(g); }), "embedding_backward: tokens_host: expected the 4 tokens"));
}

TEST_CASE("cross-entropy refuses a vocab_real beyond its columns and targets outside the vocabulary") {
  auto b = ops::make_cpu_backend({.threads = 1});
  Storage st;
  ops::CrossEntropy a{st.f32({N}), st.f32({N, V}), st.i32({N}, V), static_cast<int>(V + 1)};
  CHECK(contains(error_of([&] { b->cross_entropy(a); }), "cross_entropy: vocab_real 11 vs V 10"));
  a.vocab_real = 3;  // the targets go up to 3
  CHECK(contains(error_of([&] { b->cross_entropy(a); }), "cross_entropy targets: target 3 at row 3 outside [0, 3)"));
  ops::CrossEntropyFinish f{st.f32({N}), st.f32({N, V}), st.i32({N}, V), st.f32({2, N, 3}, 1.0f), 0, 3};
  CHECK(contains(error_of([&] { b->cross_entropy_finish(f); }), "cross_entropy_finish targets: target 3 at row 3"));
}

TEST_CASE("attention refuses heads outside heads_total") {
  auto b = ops::make_cpu_backend({.threads = 1});
  Storage st;
  ops::AttentionForward a{st.f32({B, AT, H, D}), st.f32({B, H, AT}), st.f32({B, AT, 3, H, D}), 0.5f};
  a.head_offset = 1;
  a.heads_total = 2;
  CHECK(contains(error_of([&] { b->attention_forward(a); }), "attention_forward: heads [1, 3) outside 2"));
}

// ---------------------------------------------------------------------------------------------
// The checker itself, on a CUDA target (views are only inspected, never read).

namespace {
constexpr ops::ArgTarget kCuda{Device::cuda, DType::bf16, true};
char fake[16];  // a non-null address for views that are never read
TensorView on_cuda(Shape s, DType t = DType::bf16) { return TensorView(fake, s, t, Device::cuda); }
}  // namespace

TEST_CASE("a dimension bound by one argument must agree in every later one, and the message says where it came from") {
  ops::OpArgs c("linear_forward", kCuda);
  const auto N_ = c.dim("N"), IC = c.dim("IC"), OC_ = c.dim("OC");
  c.tensor("x", on_cuda({5, 72}), ops::Act, {N_, IC});
  CHECK(c[N_] == 5);
  CHECK(c[IC] == 72);
  const std::string msg = error_of([&] { c.tensor("weight", on_cuda({216, 73}), ops::Act, {OC_, IC}); });
  CHECK(msg == "linear_forward weight: expected a contiguous bf16[OC, IC] on cuda with IC = 72 (from x), got "
               "bf16[216,73]@cuda");
}

TEST_CASE("Act is the target's activation dtype") {
  ops::OpArgs c("gelu_forward", kCuda);
  const auto n = c.wide_dim("n");
  CHECK(error_of([&] { c.elements("x", on_cuda({7}), ops::Act, n); }) == "");
  CHECK(error_of([&] { c.elements("out", on_cuda({7}, DType::f32), ops::Act, n); }) ==
        "gelu_forward out: expected a contiguous bf16 tensor of n elements on cuda with n = 7 (from x), got f32[7]@cuda");
}

TEST_CASE("a dimension beyond a 32-bit int is refused where the target indexes with ints, a wide one is not") {
  ops::OpArgs c("cross_entropy", kCuda);
  const auto rows = c.dim("N"), P_ = c.wide_dim("P");
  CHECK(error_of([&] { c.tensor("params", on_cuda({3'000'000'000}, DType::f32), DType::f32, {P_}); }) == "");
  CHECK(c[P_] == 3'000'000'000);
  CHECK(contains(error_of([&] { c.tensor("logits", on_cuda({3'000'000'000, 2}), ops::Act, {rows, 2}); }),
                 "cross_entropy logits: N = 3000000000 does not fit a 32-bit int"));
  ops::OpArgs cpu("cross_entropy", {Device::cpu, DType::f32, false});
  const auto cpu_rows = cpu.dim("N");
  const TensorView big(fake, {3'000'000'000, 2}, DType::f32, Device::cpu);
  CHECK(error_of([&] { cpu.tensor("logits", big, ops::Act, {cpu_rows, 2}); }) == "");
}

TEST_CASE("an absent optional argument is not checked, a given one is") {
  ops::OpArgs c("linear_forward", kCuda);
  const auto OC_ = c.dim("OC");
  CHECK_FALSE(c.optional("bias", TensorView(), ops::Act, {OC_}));
  c.tensor("weight", on_cuda({6, 8}), ops::Act, {OC_, 8});
  CHECK(c.optional("bias", on_cuda({6}), ops::Act, {OC_}));
  CHECK(contains(error_of([&] { c.optional("bias", on_cuda({7}), ops::Act, {OC_}); }), "linear_forward bias: expected"));
}

TEST_CASE("a fixed extent in a shape must match exactly") {
  ops::OpArgs c("cross_entropy_stats", kCuda);
  const auto rows = c.dim("N");
  CHECK(error_of([&] { c.tensor("stats", on_cuda({4, 4}, DType::f32), DType::f32, {rows, 3}); }) ==
        "cross_entropy_stats stats: expected a contiguous f32[N, 3] on cuda, got f32[4,4]@cuda");
}

TEST_CASE("a non-contiguous argument is refused") {
  ops::OpArgs c("residual_forward", kCuda);
  const auto rows = c.dim("N"), cols = c.dim("C");
  TensorView t = on_cuda({4, 8});
  t.strides = {1, 4};  // a transposed view
  CHECK(contains(error_of([&] { c.tensor("x", t, ops::Act, {rows, cols}); }),
                 "residual_forward x: expected a contiguous bf16[N, C] on cuda, got bf16[4,8]@cuda"));
}

TEST_CASE("an op runs without its optional arguments") {
  auto backend = ops::make_cpu_backend({.threads = 1});
  Storage st;
  for (OpCase& c : all_ops(st))
    for (auto& [arg, view] : c.args)
      if (std::find(kOptional.begin(), kOptional.end(), c.op + " " + arg) != kOptional.end()) {
        const TensorView good = *view;
        *view = TensorView();
        INFO(c.op, " without ", arg);
        CHECK(error_of([&] { c.run(*backend); }) == "");
        *view = good;
      }
}

TEST_CASE("zero takes a tensor of any dtype on the backend's device") {
  auto b = ops::make_cpu_backend({.threads = 1});
  std::vector<std::int32_t> ints(4, 7);
  CHECK(error_of([&] { b->zero(TensorView(ints.data(), {4}, DType::i32, Device::cpu)); }) == "");
  CHECK(ints == std::vector<std::int32_t>(4, 0));
  CHECK(error_of([&] { b->zero(TensorView(ints.data(), {4}, DType::i32, Device::cuda)); }) ==
        "zero t: expected a contiguous tensor of n elements on cpu, got i32[4]@cuda");
}
