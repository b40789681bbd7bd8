#include "kiln/ops/arg_check.hpp"

#include <limits>

namespace kiln::ops {

std::string ArgDType::str(DType act) const {
  if (kind_ == Kind::any) return "";
  return std::string(name_of(kind_ == Kind::act ? act : fixed_));
}

namespace {
// "bf16" in "a contiguous bf16[N, C]"; "tensor" where any dtype will do.
std::string kind_str(ArgDType dtype, DType act) {
  const std::string s = dtype.str(act);
  return s.empty() ? std::string("tensor") : s;
}
}  // namespace

OpArgs::Dim OpArgs::add_dim(const char* name, bool wide) {
  if (n_dims_ == kMaxDims) KILN_THROW(op_, ": more than ", kMaxDims, " dimensions in one description");
  dims_[n_dims_] = DimState{name, wide};
  return Dim(n_dims_++);
}

std::string OpArgs::shape_str(std::initializer_list<Extent> shape) const {
  std::string s = "[";
  bool first = true;
  for (const Extent& e : shape) {
    if (!first) s += ", ";
    first = false;
    s += e.dim_ >= 0 ? std::string(dims_[e.dim_].name) : std::to_string(e.fixed_);
  }
  return s + "]";
}

// " with IC = 72 (from x), N = 5 (from x)": the dimensions of `shape` other arguments bound.
std::string OpArgs::bound_str(std::initializer_list<Extent> shape, const char* arg) const {
  std::string s;
  std::uint32_t seen = 0;
  for (const Extent& e : shape) {
    if (e.dim_ < 0 || (seen >> e.dim_ & 1u)) continue;
    seen |= 1u << e.dim_;
    const DimState& d = dims_[e.dim_];
    if (!d.bound || d.from == arg) continue;
    s += cat(s.empty() ? " with " : ", ", d.name, " = ", d.value, " (from ", d.from, ")");
  }
  return s;
}

void OpArgs::fail(const std::string& what) const { KILN_THROW(op_, ": ", what); }

void OpArgs::fail_arg(const char* arg, const std::string& expected, const TensorView& t) const {
  KILN_THROW(op_, " ", arg, ": expected ", expected, ", got ", t ? t.str() : std::string("none"));
}

bool OpArgs::plain_ok(const TensorView& t, ArgDType dtype, bool empty_ok) const {
  return (t || (empty_ok && t.numel() == 0)) && t.device == target_.device && dtype.accepts(t.dtype, target_.act) && t.contiguous();
}

bool OpArgs::bind(const char* arg, const TensorView& t, int dim, std::int64_t value) {
  DimState& d = dims_[dim];
  if (d.bound) return d.value == value;
  if (target_.int32_dims && !d.wide && value > std::numeric_limits<std::int32_t>::max())
    KILN_THROW(op_, " ", arg, ": ", d.name, " = ", value, " does not fit a 32-bit int (got ", t.str(), ")");
  d.bound = true;
  d.value = value;
  d.from = arg;
  return true;
}

// The expectation is spelled out only when it failed: the checks run on every call of every op.
void OpArgs::tensor(const char* arg, const TensorView& t, ArgDType dtype, std::initializer_list<Extent> shape) {
  bool ok = plain_ok(t, dtype, false) && t.ndim() == static_cast<int>(shape.size());
  int i = 0;
  for (auto e = shape.begin(); ok && e != shape.end(); ++e, ++i)
    ok = e->dim_ >= 0 ? bind(arg, t, e->dim_, t.size(i)) : t.size(i) == e->fixed_;
  if (!ok)
    fail_arg(arg,
             cat("a contiguous ", kind_str(dtype, target_.act), shape_str(shape), " on ", name_of(target_.device),
                 bound_str(shape, arg)),
             t);
}

bool OpArgs::optional(const char* arg, const TensorView& t, ArgDType dtype, std::initializer_list<Extent> shape) {
  if (!t) return false;
  tensor(arg, t, dtype, shape);
  return true;
}

void OpArgs::elements(const char* arg, const TensorView& t, ArgDType dtype, Dim count) {
  if (plain_ok(t, dtype, true) && bind(arg, t, count.index_, t.numel())) return;
  const DimState& d = dims_[count.index_];
  const std::string dt = dtype.str(target_.act);
  fail_arg(arg,
           cat("a contiguous ", dt, dt.empty() ? "" : " ", "tensor of ", d.name, " elements on ", name_of(target_.device),
               d.bound && d.from != arg ? cat(" with ", d.name, " = ", d.value, " (from ", d.from, ")") : std::string()),
           t);
}

std::int64_t OpArgs::operator[](Dim d) const {
  const DimState& s = dims_[d.index_];
  if (!s.bound) KILN_THROW(op_, ": dimension ", s.name, " is bound by no argument (a bug in the op's description)");
  return s.value;
}

}  // namespace kiln::ops
