#pragma once
// Argument checks that read like an op's contract: each tensor argument with its device, dtype and
// a shape of named dimensions, which bind on first use and must agree afterwards.
//
//   OpArgs c("linear_forward", target);
//   const auto N = c.dim("N"), IC = c.dim("IC"), OC = c.dim("OC");
//   c.tensor("x", a.x, Act, {N, IC});
//   c.tensor("weight", a.weight, Act, {OC, IC});
//   c.optional("bias", a.bias, Act, {OC});
//   ... c[N], c[OC]: the values the kernels take
//
// Every failure is a kiln::Error naming the op, the argument, what was expected and what came:
//   linear_forward weight: expected a contiguous bf16[OC, IC] on cuda with IC = 72 (from x), got bf16[216,73]@cuda
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kiln/core/error.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::ops {

// Where an op runs: the device its tensors must be on, the activation dtype ("act" in
// backend.hpp: bf16 on CUDA, f32 on the CPU), and whether its kernels index with 32-bit ints (then
// every dimension but wide ones must fit one).
struct ArgTarget {
  Device device = Device::cpu;
  DType act = DType::f32;
  bool int32_dims = false;
};

// The dtype an argument must have: one fixed dtype, the target's activation dtype (Act), or any.
class ArgDType {
 public:
  constexpr ArgDType(DType fixed) : fixed_(fixed), kind_(Kind::fixed) {}
  static constexpr ArgDType activation() { return ArgDType(Kind::act); }
  static constexpr ArgDType any() { return ArgDType(Kind::any); }
  // Whether t is acceptable on a target whose activation dtype is `act`.
  constexpr bool accepts(DType t, DType act) const {
    return kind_ == Kind::any || t == (kind_ == Kind::act ? act : fixed_);
  }
  std::string str(DType act) const;  // "bf16", "f32"; "" for any

 private:
  enum class Kind { fixed, act, any };
  constexpr explicit ArgDType(Kind k) : fixed_(DType::f32), kind_(k) {}
  DType fixed_;
  Kind kind_;
};
inline constexpr ArgDType Act = ArgDType::activation();

class OpArgs {
 public:
  // A named dimension of this op's arguments (a handle into the checker).
  class Dim {
    friend class OpArgs;
    explicit Dim(int i) : index_(i) {}
    int index_;
  };
  // One entry of an expected shape: a named dimension or a fixed size ({B, T, 3, H, D}).
  class Extent {
   public:
    Extent(Dim d) : dim_(d.index_) {}
    Extent(std::int64_t fixed) : fixed_(fixed) {}

   private:
    friend class OpArgs;
    int dim_ = -1;
    std::int64_t fixed_ = 0;
  };

  // `op` names the op in every message (a string that outlives the checker).
  OpArgs(const char* op, const ArgTarget& target) : op_(op), target_(target) {}

  // A dimension that must fit a 32-bit int where the target says so.
  Dim dim(const char* name) { return add_dim(name, false); }
  // A dimension the kernels index with 64 bits (an element count), never limited to 32.
  Dim wide_dim(const char* name) { return add_dim(name, true); }

  // A contiguous tensor on the target's device with this dtype and shape (given: not empty).
  void tensor(const char* arg, const TensorView& t, ArgDType dtype, std::initializer_list<Extent> shape);
  // The same when given; returns whether it is.
  bool optional(const char* arg, const TensorView& t, ArgDType dtype, std::initializer_list<Extent> shape);
  // A contiguous tensor of any shape holding `count` elements (when there are none, its data may be null).
  void elements(const char* arg, const TensorView& t, ArgDType dtype, Dim count);
  // Any other condition of the contract; the message follows "<op>: ".
  template <class... A>
  void check(bool ok, const A&... what) const {
    if (!ok) fail(cat(what...));
  }

  // The value a dimension was bound to (the dimension must be bound).
  std::int64_t operator[](Dim d) const;
  const char* op() const { return op_; }
  const ArgTarget& target() const { return target_; }

 private:
  struct DimState {
    const char* name = nullptr;
    bool wide = false;
    bool bound = false;
    std::int64_t value = 0;
    const char* from = nullptr;  // the argument that bound it
  };
  Dim add_dim(const char* name, bool wide);
  // Given (or, with empty_ok, holding no elements), on the target's device, of an accepted dtype, contiguous.
  bool plain_ok(const TensorView& t, ArgDType dtype, bool empty_ok) const;
  // Binds dimension `dim` to value on first use (checking the 32-bit limit); false if it disagrees.
  bool bind(const char* arg, const TensorView& t, int dim, std::int64_t value);
  std::string shape_str(std::initializer_list<Extent> shape) const;
  std::string bound_str(std::initializer_list<Extent> shape, const char* arg) const;
  [[noreturn]] void fail(const std::string& what) const;
  [[noreturn]] void fail_arg(const char* arg, const std::string& expected, const TensorView& t) const;

  static constexpr int kMaxDims = 8;  // per op; no heap allocation per call
  const char* op_;
  ArgTarget target_;
  std::array<DimState, kMaxDims> dims_{};
  int n_dims_ = 0;
};

}  // namespace kiln::ops
