#pragma once
// A replacement for the backend's linear ops on one linear layer. A module (fp8, for example)
// attaches it as a component to a Linear entity; the model then calls it instead of
// Backend::linear_forward / linear_backward for that layer, and knows nothing else about it.
// The arguments and their contract are those of the backend ops; what an implementation adds is
// said by two values: the prologues it takes, and whether it keeps its own copy of its input.
#include <cstdint>
#include <functional>
#include <span>

#include "kiln/ops/backend.hpp"

namespace kiln::ops {

// A piece of a forward's output (LinearImpl::forward_pieces): its rows [begin, begin + rows) of the
// whole call's output, written to `out` [rows, OC] (anywhere: a reduce-scatter's order, say).
struct RowsOut {
  std::int64_t begin = 0, rows = 0;
  TensorView out;
};
using PieceQueued = std::function<void(std::size_t)>;

// What a sequence-parallel column-parallel layer lends an implementation that gathers its input
// itself (LinearImpl::forward_gathered); both run on the compute stream, on every rank of the group.
struct RowGather {
  std::int64_t first_row = 0;  // where this rank's rows start in the gathered tensor
  // full [N, C] (one-byte codes, say) = every rank's rows in rank order, this rank's `local` among
  // them at first_row (in place where local is those rows of full).
  std::function<void(const TensorView& full, const TensorView& local)> all_gather;
  // One f32 (on the device where the backend has one) replaced by its maximum over the group.
  std::function<void(float* value)> max;
  // Where given (tensor-parallel communication overlapped with the GEMMs): the same gather in pieces
  // of rows on a communication stream, `compute(begin, rows)` called for each piece once it is here
  // (this rank's own first), on the compute stream; use it instead of all_gather.
  std::function<void(const TensorView& full, const TensorView& local,
                     const std::function<void(std::int64_t begin, std::int64_t rows)>& compute)>
      gather_pieces;
};

struct LinearImpl {
  std::function<void(const LinearForward&)> forward;
  std::function<void(const LinearBackward&)> backward;
  // The operands it takes through a prologue (prologue.hpp), forward and backward alike: the model
  // may then hand it, say, a GELU's pre-activation instead of writing (or recomputing) the GELU's
  // output. The backend's own ops take the plain tensors alone.
  PrologueSet prologues = {Prologue::plain};
  // backward never reads LinearBackward::x: the forward kept what the backward needs (an FP8 copy
  // of the input, say), so the model need not store or recompute x for this layer.
  bool keeps_input = false;
  // The calls may be split by token rows: a forward on consecutive rows of x and out (and pre_gelu)
  // gives those rows of the whole call's output (bit for bit where a product does not depend on the
  // row count, as on the CPU backend; cuBLASLt may choose another algorithm); a backward without dweight (dx alone)
  // on consecutive rows of dout, x and dx gives those rows of dx; a backward without dx computes the
  // weight and bias gradients alone. Tensor-parallel layers then overlap their communication with
  // the GEMMs (parallel.tp_comm_overlap); an implementation that cannot (it keeps per-call state, or
  // scales by the whole input's amax) runs the layers without overlap.
  bool splits_rows = false;
  // Takes a forward on some token rows followed at once by the backward of those rows (the weight
  // gradient written by the first pair, added to by the others), pair after pair: an LM head that
  // makes its logits a chunk of rows at a time (model.head_chunk_rows). An implementation that
  // splits_rows takes it; one that keeps state from a forward to its backward (its input's FP8
  // copy, say) takes it where each call quantises by its own amax, its own blocks or a scale fixed
  // before the step (delayed scaling, whose amax the calls max-accumulate).
  bool pairs_on_rows = false;
  // The rows of each such pair (and of the whole call) are a multiple of this: an FP8 weight
  // gradient's inner dimension is the tokens, a multiple of 16 for cuBLASLt's FP8 GEMMs.
  std::int64_t pair_rows_multiple = 1;
  // The forward in pieces of rows (a row-parallel output's sum started piece by piece): piece k's
  // rows of the whole call's output written to its `out` (and those rows of pre_gelu), then
  // queued(k) called, so the caller may move them while the next piece is computed. An implementation
  // that quantises its input does it once, over the whole input (one scale, one amax, any prologue),
  // then one GEMM per piece. Empty: the caller splits `forward` calls where splits_rows allows it.
  std::function<void(const LinearForward&, std::span<const RowsOut>, const PieceQueued&)> forward_pieces;
  // Under sequence parallelism: f's forward with the input gathered by the implementation from this
  // rank's rows `local`, in its own form (FP8 codes: one byte an element over the links instead of
  // two). f.x gives the whole input's shape and is left unwritten: the layer uses this only where
  // nothing reads the gathered input afterwards (the backward gathers it again, or the
  // implementation keeps its own copy, keeps_input). The same results as gathering f.x and calling
  // forward.
  std::function<void(const LinearForward& f, const TensorView& local, const RowGather& g)> forward_gathered;
};

// Whether `impl` takes forward and backward pairs on chunks of rows (splits_rows or pairs_on_rows).
inline bool takes_row_pairs(const LinearImpl& impl) { return impl.splits_rows || impl.pairs_on_rows; }

// f on its rows [begin, begin + rows): the output written to `out`, those rows of pre_gelu and of
// a plain input (an input through a prologue stays whole: only an implementation that quantised
// all of it already, forward_pieces, multiplies such a piece).
LinearForward forward_rows(const LinearForward& f, std::int64_t begin, std::int64_t rows, const TensorView& out);

// f's output in `pieces` (impl.forward_pieces, else one forward call per piece on its rows of f.x,
// a plain tensor, and of pre_gelu), queued(k) after each.
void forward_in_pieces(const LinearImpl& impl, const LinearForward& f, std::span<const RowsOut> pieces,
                       const PieceQueued& queued);

// The backend's own linear ops as a LinearImpl (plain operands only), for layers that take one.
inline LinearImpl backend_linear_impl(Backend& be) {
  return {.forward = [&be](const LinearForward& a) { be.linear_forward(a); },
          .backward = [&be](const LinearBackward& a) { be.linear_backward(a); },
          .splits_rows = true};
}

}  // namespace kiln::ops
