#include "cudnn_attention.hpp"

#include "kiln/core/error.hpp"

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#include <dlfcn.h>

#include <array>
#include <type_traits>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>
#include <vector>

namespace kiln::ops::cuda_impl {

namespace {

// The entry points of libcudnn.so.9 this file uses, resolved with dlsym.
struct Api {
  void* lib = nullptr;
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnGetLastErrorString) last_error = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnDestroy) destroy = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) create_desc = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy_desc = nullptr;
  decltype(&cudnnBackendSetAttribute) set_attr = nullptr;
  decltype(&cudnnBackendGetAttribute) get_attr = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;

  Api() {
    lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      KILN_THROW("cannot open libcudnn.so.9: ", e ? e : "not found on the library path");
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) {
        dlclose(lib);
        lib = nullptr;
        KILN_THROW("libcudnn.so.9 has no ", name);
      }
    };
    sym(get_version, "cudnnGetVersion");
    sym(error_string, "cudnnGetErrorString");
    sym(last_error, "cudnnGetLastErrorString");
    sym(create, "cudnnCreate");
    sym(destroy, "cudnnDestroy");
    sym(set_stream, "cudnnSetStream");
    sym(create_desc, "cudnnBackendCreateDescriptor");
    sym(destroy_desc, "cudnnBackendDestroyDescriptor");
    sym(set_attr, "cudnnBackendSetAttribute");
    sym(get_attr, "cudnnBackendGetAttribute");
    sym(finalize, "cudnnBackendFinalize");
    sym(execute, "cudnnBackendExecute");
  }
  ~Api() {
    if (lib) dlclose(lib);
  }
  Api(const Api&) = delete;
  Api& operator=(const Api&) = delete;

  // Throws with cuDNN's status and its last error message.
  void check(cudnnStatus_t s, const char* what) const {
    if (s == CUDNN_STATUS_SUCCESS) return;
    char msg[1024] = {0};
    last_error(msg, sizeof msg);
    KILN_THROW("cuDNN: ", what, ": ", error_string(s), msg[0] ? cat(" (", msg, ")") : std::string());
  }
};

// An owned backend descriptor.
class Desc {
 public:
  Desc(const Api& api, cudnnBackendDescriptorType_t type) : api_(&api) {
    api.check(api.create_desc(type, &d_), "create descriptor");
  }
  Desc(Desc&& o) noexcept : api_(o.api_), d_(o.d_) { o.d_ = nullptr; }
  Desc& operator=(Desc&&) = delete;
  Desc(const Desc&) = delete;
  ~Desc() {
    if (d_) api_->destroy_desc(d_);
  }
  cudnnBackendDescriptor_t get() const { return d_; }
  const cudnnBackendDescriptor_t* ptr() const { return &d_; }
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::int64_t n, const void* v) {
    api_->check(api_->set_attr(d_, name, type, n, v), "set attribute");
  }
  void finalize(const char* what) { api_->check(api_->finalize(d_), what); }

 private:
  const Api* api_;
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<std::int64_t, 4>;

// Tensor unique ids of the graphs; virtual tensors count up from kFirstVirtual.
enum Uid : std::int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSoftmaxSum,
  kDQAccum,
  kOne,
  kFirstVirtual = 100
};

// An execution plan with every descriptor it was built from (kept alive with it).
struct Plan {
  std::vector<Desc> keep;
  cudnnBackendDescriptor_t plan = nullptr;
  std::int64_t workspace = 0;
};

// Builds one operation graph, node by node, and finalizes it into the first plan cuDNN's heuristics
// offer that finalizes.
class GraphBuilder {
 public:
  explicit GraphBuilder(const Api& api) : api_(api) {}

  cudnnBackendDescriptor_t tensor(std::int64_t uid, cudnnDataType_t type, Dims dims, Dims strides, bool is_virtual,
                                  bool by_value = false) {
    Desc t(api_, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const std::int64_t align = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    t.finalize("tensor descriptor");
    return keep(std::move(t));
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, Dims dims, Dims strides) {
    return tensor(next_virtual_++, type, dims, strides, true);
  }
  cudnnBackendDescriptor_t scalar(std::int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  // y = mode(x[, b[, t]]), computed in `prec`.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t prec = CUDNN_DATA_FLOAT,
                 std::int64_t axis = -1) {
    Desc pw(api_, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    pw.finalize("pointwise descriptor");
    Desc op(api_, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, pw.ptr());
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    op.finalize("pointwise operation");
    keep(std::move(pw));
    ops_.push_back(keep(std::move(op)));
  }
  void unary(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    pointwise(mode, x, nullptr, nullptr, y);
  }
  void binary(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
              cudnnBackendDescriptor_t y) {
    pointwise(mode, x, b, nullptr, y);
  }
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc r(api_, CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    r.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    r.finalize("reduction descriptor");
    Desc op(api_, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, r.ptr());
    op.finalize("reduction operation");
    keep(std::move(r));
    ops_.push_back(keep(std::move(op)));
  }
  // c = a @ b (batched over the first two dims), fp32 accumulation.
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Desc m(api_, CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    m.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    m.finalize("matmul descriptor");
    Desc op(api_, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, m.ptr());
    op.finalize("matmul operation");
    keep(std::move(m));
    ops_.push_back(keep(std::move(op)));
  }
  // y = x seen through other dims / strides (a transpose, for the graph).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc op(api_, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    op.finalize("reshape operation");
    ops_.push_back(keep(std::move(op)));
  }

  Plan build(cudnnHandle_t handle, const char* what) && {
    Desc graph(api_, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<std::int64_t>(ops_.size()),
              ops_.data());
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    graph.finalize(what);
    Desc heur(api_, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, graph.ptr());
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    heur.finalize(what);
    std::int64_t count = 0;
    api_.check(api_.get_attr(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                             nullptr),
               what);
    KILN_CHECK(count > 0, "cuDNN offers no engine for the ", what);
    std::vector<Desc> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (std::int64_t i = 0; i < count; ++i) {
      configs.emplace_back(api_, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      raw.push_back(configs.back().get());
    }
    api_.check(api_.get_attr(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                             raw.data()),
               what);
    std::string reasons;
    for (std::int64_t i = 0; i < count; ++i) {
      Desc plan(api_, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw[i]);
      const cudnnStatus_t s = api_.finalize(plan.get());
      if (s != CUDNN_STATUS_SUCCESS) {
        char msg[512] = {0};
        api_.last_error(msg, sizeof msg);
        reasons += cat("; engine config ", i, ": ", api_.error_string(s), " ", msg);
        continue;
      }
      Plan p;
      api_.check(api_.get_attr(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &count,
                               &p.workspace),
                 what);
      p.plan = plan.get();
      p.keep = std::move(keep_);
      p.keep.push_back(std::move(graph));
      p.keep.push_back(std::move(heur));
      for (auto& c : configs) p.keep.push_back(std::move(c));
      p.keep.push_back(std::move(plan));
      return p;
    }
    KILN_THROW("cuDNN finalizes no plan for the ", what, reasons);
  }

 private:
  cudnnBackendDescriptor_t keep(Desc d) {
    keep_.push_back(std::move(d));
    return keep_.back().get();
  }
  const Api& api_;
  std::vector<Desc> keep_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  std::int64_t next_virtual_ = kFirstVirtual;
};

// Dims and strides (elements) of one shape's tensors in kiln's layouts. qkv is [B, T, H + 2 Hkv, D]:
// the H query heads, then Hkv key heads, then Hkv value heads of each position ([B, T, 3, H, D] when
// Hkv == H). A query head h reads key / value head h / (H / Hkv), which cuDNN's fused attention
// infers from the head counts of the matmuls' operands.
struct Layout {
  std::int64_t B, T, H, Hkv, D;
  std::int64_t W() const { return (H + 2 * Hkv) * D; }  // elements per position of qkv
  Dims bhtd() const { return {B, H, T, D}; }
  Dims bhdt() const { return {B, H, D, T}; }
  Dims kv_btd() const { return {B, Hkv, T, D}; }
  Dims kv_bdt() const { return {B, Hkv, D, T}; }
  Dims bhtt() const { return {B, H, T, T}; }
  Dims bht1() const { return {B, H, T, 1}; }
  // A head part of qkv (and of its gradient), as [b, head, T, D] and transposed [b, head, D, T].
  Dims qkv_strides() const { return {T * W(), D, W(), 1}; }
  Dims qkv_t_strides() const { return {T * W(), D, 1, W()}; }
  // out [B, T, H, D] as [B, H, T, D].
  Dims out_strides() const { return {T * H * D, D, H * D, 1}; }
  Dims dense_bhtd() const { return {H * T * D, T * D, D, 1}; }
  Dims dense_bhtt() const { return {H * T * T, T * T, T, 1}; }
  Dims dense_bhtt_t() const { return {H * T * T, T * T, 1, T}; }  // [B, H, T, T] read transposed
  Dims dense_bht1() const { return {H * T, T, 1, 1}; }
  bool grouped() const { return Hkv != H; }
};

// scores -> scores with the keys after each query (j > i) set to -inf.
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, const Layout& l, cudnnBackendDescriptor_t s) {
  auto row = g.virt(CUDNN_DATA_INT32, l.bhtt(), l.dense_bhtt());
  auto col = g.virt(CUDNN_DATA_INT32, l.bhtt(), l.dense_bhtt());
  auto keep = g.virt(CUDNN_DATA_BOOLEAN, l.bhtt(), l.dense_bhtt());
  auto out = g.virt(CUDNN_DATA_FLOAT, l.bhtt(), l.dense_bhtt());
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, g.scalar(kNegInf), keep, out);
  return out;
}

// The tensors both graphs read or write as the forward left them.
struct Common {
  cudnnBackendDescriptor_t q, kt, o, stats, scale;
};
Common common_tensors(GraphBuilder& g, const Layout& l) {
  return {g.tensor(kQ, CUDNN_DATA_BFLOAT16, l.bhtd(), l.qkv_strides(), false),
          g.tensor(kK, CUDNN_DATA_BFLOAT16, l.kv_bdt(), l.qkv_t_strides(), false),
          g.tensor(kO, CUDNN_DATA_BFLOAT16, l.bhtd(), l.out_strides(), false),
          g.tensor(kStats, CUDNN_DATA_FLOAT, l.bht1(), l.dense_bht1(), false), g.scalar(kScale)};
}

// q k^T * scale, [B, H, T, T] in fp32.
cudnnBackendDescriptor_t scaled_scores(GraphBuilder& g, const Layout& l, const Common& c) {
  auto s = g.virt(CUDNN_DATA_FLOAT, l.bhtt(), l.dense_bhtt());
  g.matmul(c.q, c.kt, s);
  auto scaled = g.virt(CUDNN_DATA_FLOAT, l.bhtt(), l.dense_bhtt());
  g.binary(CUDNN_POINTWISE_MUL, s, c.scale, scaled);
  return scaled;
}

// grad = a @ b for a key or value gradient: straight into `grad` when every query head has its own
// key and value head; else into a per-query-head [B, H, T, D] that the graph then sums over each
// group of H / Hkv query heads into `grad` (the pattern cuDNN's fused attention takes for
// grouped-query attention).
void matmul_into_kv_grad(GraphBuilder& g, const Layout& l, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                         cudnnBackendDescriptor_t grad) {
  if (!l.grouped()) {
    g.matmul(a, b, grad);
    return;
  }
  auto full = g.virt(CUDNN_DATA_BFLOAT16, l.bhtd(), l.dense_bhtd());
  g.matmul(a, b, full);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, grad);
}

Plan forward_plan(const Api& api, cudnnHandle_t handle, const Layout& l) {
  GraphBuilder g(api);
  const auto F = CUDNN_DATA_FLOAT, BF = CUDNN_DATA_BFLOAT16;
  const Common c = common_tensors(g, l);
  auto v = g.tensor(kV, BF, l.kv_btd(), l.qkv_strides(), false);
  auto masked = causal_mask(g, l, scaled_scores(g, l, c));
  // softmax, keeping log-sum-exp = max + log(sum(exp(s - max)))
  auto mx = g.virt(F, l.bht1(), l.dense_bht1());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, mx);
  auto centred = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.binary(CUDNN_POINTWISE_SUB, masked, mx, centred);
  auto e = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.unary(CUDNN_POINTWISE_EXP, centred, e);
  auto sum = g.virt(F, l.bht1(), l.dense_bht1());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  auto log_sum = g.virt(F, l.bht1(), l.dense_bht1());
  g.unary(CUDNN_POINTWISE_LOG, sum, log_sum);
  g.binary(CUDNN_POINTWISE_ADD, mx, log_sum, c.stats);
  auto p = g.virt(BF, l.bhtt(), l.dense_bhtt());
  g.binary(CUDNN_POINTWISE_DIV, e, sum, p);
  g.matmul(p, v, c.o);
  return std::move(g).build(handle, "attention forward graph");
}

Plan backward_plan(const Api& api, cudnnHandle_t handle, const Layout& l, bool deterministic) {
  GraphBuilder g(api);
  const auto F = CUDNN_DATA_FLOAT, BF = CUDNN_DATA_BFLOAT16;
  const Common c = common_tensors(g, l);
  auto vt = g.tensor(kV, BF, l.kv_bdt(), l.qkv_t_strides(), false);
  auto dout = g.tensor(kDO, BF, l.bhtd(), l.out_strides(), false);
  auto dq = g.tensor(kDQ, BF, l.bhtd(), l.qkv_strides(), false);
  auto dk = g.tensor(kDK, BF, l.kv_btd(), l.qkv_strides(), false);
  auto dv = g.tensor(kDV, BF, l.kv_btd(), l.qkv_strides(), false);
  // D_i = sum_d dO_id O_id
  auto dout_o = g.virt(F, l.bhtd(), l.dense_bhtd());
  g.binary(CUDNN_POINTWISE_MUL, dout, c.o, dout_o);
  auto row_dot = g.virt(F, l.bht1(), l.dense_bht1());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dout_o, row_dot);
  auto softmax_sum = g.tensor(kSoftmaxSum, F, l.bht1(), l.dense_bht1(), false);
  g.binary(CUDNN_POINTWISE_MUL, row_dot, g.scalar(kOne), softmax_sum);
  // P = exp(mask(q k^T * scale) - lse)
  auto centred = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.binary(CUDNN_POINTWISE_SUB, scaled_scores(g, l, c), c.stats, centred);
  auto masked = causal_mask(g, l, centred);
  auto p = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.unary(CUDNN_POINTWISE_EXP, masked, p);
  // dV = P^T dO
  auto pt = g.virt(BF, {l.B, l.H, l.T, l.T}, l.dense_bhtt_t());
  g.reshape(p, pt);
  matmul_into_kv_grad(g, l, pt, dout, dv);
  // dS = P * (dO V^T - D) * scale
  auto dp = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.matmul(dout, vt, dp);
  auto dp_centred = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.binary(CUDNN_POINTWISE_SUB, dp, softmax_sum, dp_centred);
  auto ds_unscaled = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.binary(CUDNN_POINTWISE_MUL, dp_centred, p, ds_unscaled);
  auto ds = g.virt(F, l.bhtt(), l.dense_bhtt());
  g.binary(CUDNN_POINTWISE_MUL, ds_unscaled, c.scale, ds);
  // dK = dS^T Q
  auto dst = g.virt(BF, {l.B, l.H, l.T, l.T}, l.dense_bhtt_t());
  g.reshape(ds, dst);
  matmul_into_kv_grad(g, l, dst, c.q, dk);
  // dQ = dS K: written per query tile (deterministic), or accumulated in fp32 with atomics.
  auto k = g.virt(BF, l.kv_btd(), l.qkv_strides());
  g.reshape(c.kt, k);
  if (deterministic) {
    g.matmul(ds, k, dq);
  } else {
    auto dq_accum = g.tensor(kDQAccum, F, l.bhtd(), l.dense_bhtd(), false);
    g.matmul(ds, k, dq_accum);
    g.unary(CUDNN_POINTWISE_IDENTITY, dq_accum, dq);
  }
  return std::move(g).build(handle, "attention backward graph");
}

constexpr std::size_t kAlign = 256;
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Byte offsets in the backward's scratch: cuDNN's workspace, then D_i (softmax_sum), then (atomic
// variant only) the fp32 dQ accumulator.
struct BackwardScratch {
  std::size_t softmax_sum, dq_accum, total;
  BackwardScratch(const Plan& plan, const CudnnAttention::Shape& s, bool deterministic) {
    const std::size_t rows = static_cast<std::size_t>(s.B) * s.H * s.T;
    softmax_sum = round_up(static_cast<std::size_t>(plan.workspace));
    dq_accum = softmax_sum + round_up(rows * sizeof(float));
    total = deterministic ? dq_accum : dq_accum + round_up(rows * s.D * sizeof(float));
  }
};

// Where the query, key and value heads of a position start in qkv (or dqkv), in bytes.
struct HeadOffsets {
  std::size_t k, v;
  explicit HeadOffsets(const CudnnAttention::Shape& s)
      : k(static_cast<std::size_t>(s.H) * s.D * 2), v(k + static_cast<std::size_t>(s.Hkv) * s.D * 2) {}
};

}  // namespace

struct CudnnAttention::Impl {
  Api api;
  cudnnHandle_t handle = nullptr;
  bool deterministic;
  struct Plans {
    Plan fwd, bwd;
  };
  std::map<std::tuple<int, int, int, int, int>, Plans> plans;

  Impl(cudaStream_t stream, bool det) : deterministic(det) {
    KILN_CHECK(api.get_version() >= 90000, "cuDNN ", api.get_version(), " is older than 9.0");
    api.check(api.create(&handle), "cudnnCreate");
    api.check(api.set_stream(handle, stream), "cudnnSetStream");
  }
  ~Impl() {
    plans.clear();
    if (handle) api.destroy(handle);
  }
  Plans& get(const Shape& s) {
    const auto key = std::make_tuple(s.B, s.T, s.H, s.Hkv, s.D);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    KILN_CHECK(s.D % 8 == 0 && s.D <= 256,
               "cuDNN attention needs a head dim that is a multiple of 8, at most 256; got ", s.D);
    KILN_CHECK(s.Hkv >= 1 && s.H % s.Hkv == 0, "cuDNN attention: ", s.Hkv, " key/value heads do not divide ", s.H,
               " query heads");
    const Layout l{s.B, s.T, s.H, s.Hkv, s.D};
    Plans p{forward_plan(api, handle, l), backward_plan(api, handle, l, deterministic)};
    return plans.emplace(key, std::move(p)).first->second;
  }
  void run(const Plan& plan, const std::vector<std::int64_t>& uids, const std::vector<void*>& ptrs, void* workspace) {
    Desc pack(api, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<std::int64_t>(uids.size()), uids.data());
    pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<std::int64_t>(ptrs.size()),
             ptrs.data());
    pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    pack.finalize("variant pack");
    api.check(api.execute(handle, plan.plan, pack.get()), "execute attention plan");
  }
};

CudnnAttention::CudnnAttention(cudaStream_t stream, bool deterministic)
    : impl_(std::make_unique<Impl>(stream, deterministic)) {}
CudnnAttention::~CudnnAttention() = default;

std::string CudnnAttention::version() const {
  const std::size_t v = impl_->api.get_version();
  return cat("cuDNN ", v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

void CudnnAttention::prepare(const Shape& s) { impl_->get(s); }

std::size_t CudnnAttention::forward_workspace_bytes(const Shape& s) {
  return round_up(static_cast<std::size_t>(impl_->get(s).fwd.workspace));
}

std::size_t CudnnAttention::backward_workspace_bytes(const Shape& s) {
  return BackwardScratch(impl_->get(s).bwd, s, impl_->deterministic).total;
}

void CudnnAttention::forward(void* out, float* lse, const void* qkv, const Shape& s, float scale, void* workspace) {
  const auto& plan = impl_->get(s).fwd;
  auto* base = static_cast<char*>(const_cast<void*>(qkv));
  const HeadOffsets at(s);
  float neg_inf = -std::numeric_limits<float>::infinity();
  impl_->run(plan, {kQ, kK, kV, kO, kStats, kScale, kNegInf},
             {base, base + at.k, base + at.v, out, lse, &scale, &neg_inf}, workspace);
}

void CudnnAttention::backward(void* dqkv, const void* dout, const void* out, const float* lse, const void* qkv,
                              const Shape& s, float scale, void* workspace) {
  const auto& plan = impl_->get(s).bwd;
  auto* base = static_cast<char*>(const_cast<void*>(qkv));
  auto* dbase = static_cast<char*>(dqkv);
  const HeadOffsets at(s);
  const BackwardScratch scratch(plan, s, impl_->deterministic);
  auto* ws = static_cast<char*>(workspace);
  float neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  std::vector<std::int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kScale, kNegInf, kOne};
  std::vector<void*> ptrs{base,
                          base + at.k,
                          base + at.v,
                          const_cast<void*>(out),
                          const_cast<void*>(dout),
                          const_cast<float*>(lse),
                          dbase,
                          dbase + at.k,
                          dbase + at.v,
                          ws + scratch.softmax_sum,
                          &scale,
                          &neg_inf,
                          &one};
  if (!impl_->deterministic) {
    uids.push_back(kDQAccum);
    ptrs.push_back(ws + scratch.dq_accum);
  }
  impl_->run(plan, uids, ptrs, ws);
}

}  // namespace kiln::ops::cuda_impl

#else  // no cuDNN headers at build time

namespace kiln::ops::cuda_impl {

struct CudnnAttention::Impl {};
CudnnAttention::CudnnAttention(cudaStream_t, bool) {
  KILN_THROW("this kiln was built without cuDNN's headers (cudnn_graph.h); attention runs kiln's kernels");
}
CudnnAttention::~CudnnAttention() = default;
std::string CudnnAttention::version() const { return {}; }
void CudnnAttention::prepare(const Shape&) {}
std::size_t CudnnAttention::forward_workspace_bytes(const Shape&) { return 0; }
std::size_t CudnnAttention::backward_workspace_bytes(const Shape&) { return 0; }
void CudnnAttention::forward(void*, float*, const void*, const Shape&, float, void*) {}
void CudnnAttention::backward(void*, const void*, const void*, const float*, const void*, const Shape&, float, void*) {}

}  // namespace kiln::ops::cuda_impl

#endif
