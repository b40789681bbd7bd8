#include "kiln/parallel/parallel_linear.hpp"

#include "kiln/core/error.hpp"
#include "kiln/parallel/comm_overlap.hpp"

namespace kiln::parallel {

ColumnParallelLinear::ColumnParallelLinear(const TensorParallel& tp, std::int64_t in, std::int64_t out, int parts,
                                           bool split)
    : tp_(tp), in_(in), out_(out), local_out_(out), split_(split && tp.size() > 1) {
  KILN_CHECK(in > 0 && out > 0 && parts > 0 && out % parts == 0, "column-parallel linear ", in, " -> ", out, " in ",
             parts, " parts");
  if (!split_) return;
  tp.require({out / parts, "column-parallel linear", cat("output features (of ", out, " in ", parts, " parts)")});
  local_out_ = out / tp.size();
  shard_ = row_shard(tp, out, parts);
}

ColumnParallelLinear::ColumnParallelLinear(const TensorParallel& tp, std::int64_t in,
                                           const std::vector<std::int64_t>& parts)
    : tp_(tp), in_(in), out_(0), local_out_(0), split_(tp.size() > 1) {
  for (const std::int64_t part : parts) {
    KILN_CHECK(part > 0, "column-parallel linear: a part of ", part, " rows");
    out_ += part;
    if (split_) tp.require({part, "column-parallel linear", cat("output features (a part of ", part, " rows)")});
  }
  KILN_CHECK(in > 0 && !parts.empty(), "column-parallel linear ", in, " -> ", out_);
  local_out_ = out_ / tp.size();
  if (split_) shard_ = row_shard(tp, parts);
}

void ColumnParallelLinear::forward(const ops::LinearImpl& impl, const ops::LinearForward& a,
                                   const TensorView& x_local, bool input_read_after) const {
  ops::LinearForward f = a;
  const TensorView full = ops::plain_tensor(a.x);
  if (tp_.sequence_parallel()) {
    KILN_CHECK(full && x_local, "a column-parallel linear under sequence parallelism gathers its input: it needs "
                                "this rank's rows and the tensor to gather them into (LinearForward::x), not a ",
               ops::name_of(ops::prologue_of(a.x)), " prologue");
    if (!input_read_after && impl.forward_gathered) {  // in its own form (FP8 codes)
      impl.forward_gathered(f, x_local, tp_.row_gather(full.size(0)));
      return;
    }
    if (CommOverlap* o = tp_.comm_overlap(); o && CommOverlap::applies(impl, f)) {
      o->gather_forward(impl, f, full, x_local);
      return;
    }
  }
  if (x_local) f.x = gather_input(full, x_local);  // without this rank's rows, a.x is the input (a prologue)
  impl.forward(f);
}

TensorView ColumnParallelLinear::backward(const ops::LinearImpl& impl, const ops::LinearBackward& a,
                                          const TensorView& dx_local) const {
  if (CommOverlap* o = tp_.comm_overlap(); o && a.dx && split_) {  // any implementation (dgrad_queued)
    const TensorView local = tp_.sequence_parallel() ? dx_local : a.dx;
    o->backward_sum(impl, a, local);
    return local;
  }
  impl.backward(a);
  if (!a.dx) return {};
  return sum_input_grad(a.dx, dx_local);
}

TensorView ColumnParallelLinear::gather_input(const TensorView& full, const TensorView& x_local) const {
  if (!tp_.sequence_parallel()) return x_local ? x_local : full;
  KILN_CHECK(full && x_local, "a column-parallel linear under sequence parallelism gathers its input into a tensor "
                              "of every rank's rows");
  tp_.enter(full, x_local);
  return full;
}

TensorView ColumnParallelLinear::sum_input_grad(const TensorView& dx, const TensorView& dx_local) const {
  if (!split_) return tp_.local_part(dx);  // every rank has the whole input gradient
  const TensorView local = tp_.sequence_parallel() ? dx_local : dx;
  tp_.enter_backward(local, dx);
  return local;
}

RowParallelLinear::RowParallelLinear(const TensorParallel& tp, std::int64_t in, std::int64_t out)
    : tp_(tp), in_(in), out_(out), local_in_(in) {
  KILN_CHECK(in > 0 && out > 0, "row-parallel linear ", in, " -> ", out);
  if (tp.size() == 1) return;
  tp.require({in, "row-parallel linear", "input features"});
  local_in_ = in / tp.size();
  shard_ = column_shard(tp, in);
}

void RowParallelLinear::forward(const ops::LinearImpl& impl, const ops::LinearForward& a,
                                const TensorView& out_local) const {
  ops::LinearForward f = a;
  if (!tp_.sequence_parallel()) f.out = out_local;
  if (tp_.rank() != 0) f.bias = {};  // the replicated bias is added once before the sum
  if (CommOverlap* o = tp_.comm_overlap(); o && CommOverlap::sums_in_pieces(impl, f)) {
    o->forward_sum(impl, f, out_local);
    return;
  }
  impl.forward(f);
  tp_.exit(out_local, f.out);
}

void RowParallelLinear::backward(const ops::LinearImpl& impl, const ops::LinearBackward& a,
                                 const TensorView& dout_local) const {
  ops::LinearBackward b = a;
  if (tp_.sequence_parallel()) {
    const TensorView full = ops::plain_tensor(a.dout);
    KILN_CHECK(full, "a row-parallel linear under sequence parallelism gathers its output gradient into "
                     "LinearBackward::dout: a tensor, not a prologue");
    if (CommOverlap* o = tp_.comm_overlap(); o && CommOverlap::applies(impl, b)) {
      o->gather_backward(impl, b, dout_local);
      return;
    }
    tp_.exit_backward(full, dout_local);
  } else {
    b.dout = dout_local;
  }
  impl.backward(b);
}

}  // namespace kiln::parallel
