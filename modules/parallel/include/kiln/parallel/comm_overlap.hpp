#pragma once
// Tensor-parallel communication overlapped with the GEMMs around it (parallel.tp_comm_overlap;
// Megatron-LM's tp_comm_overlap, TransformerEngine's userbuffers, done here with NCCL collectives on
// a second stream and GEMMs split by token rows).
//
// The token rows of a micro-batch are cut into pieces: under sequence parallelism each rank's share
// (its N/tp rows) in `chunks` consecutive pieces; without it all N rows in tp x chunks near-equal
// pieces. Then
// - a row-parallel forward computes its output piece by piece, and each piece's sum over the group
//   starts on the communication stream as soon as it is computed (an all-reduce in place), while
//   the next piece is computed; under sequence parallelism every rank's k-th piece together, written
//   in the order reduce-scatter takes them, summed by one reduce-scatter into each rank's k-th piece
//   (on two ranks, the peer's pieces first, each sent to it as computed while this rank's own are
//   computed, and added to them: the transfer hides behind the own half's GEMM, where a
//   reduce-scatter could only follow the last piece);
// - a gather (a column-parallel forward's input, or a row-parallel backward's output gradient under
//   sequence parallelism) moves every rank's k-th piece at once (grouped sends and receives, both
//   ways over each link), while the GEMM runs on the pieces already here, this rank's own first;
// - a column-parallel backward computes the input gradient first, and its sum over the group
//   (all-reduce, or reduce-scatter) runs while the weight gradients are computed: one call of the
//   implementation, which says when dx is queued (ops::LinearBackward::dgrad_queued), so every
//   implementation takes part, FP8 ones and prologue operands (a dGELU on load) included.
// Every rank issues the same collectives in the same order. A piece's result is the same product
// and the same sum as without the overlap: bit for bit on the CPU backend (and its in-process
// communicator runs the collectives in order on the host, so the schedule is the same there).
//
// A row-parallel forward computes its pieces through ops::forward_in_pieces: an implementation that
// quantises (FP8) does so once over the whole input, then one GEMM per piece (LinearImpl::
// forward_pieces); the gathers (a column-parallel forward's input, a row-parallel backward's output
// gradient under sequence parallelism) split calls by rows, for implementations whose calls split so
// (LinearImpl::splits_rows). An FP8 layer, which scales the whole gathered tensor, gathers its
// column-parallel input as its own codes instead (LinearImpl::forward_gathered), moved in the same
// pieces by gather_rows with a GEMM per piece as it arrives; its row-parallel backward's output
// gradient is gathered whole.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/communicator.hpp"
#include "kiln/parallel/stream_event.hpp"

namespace kiln::parallel {

class SideStream;

// Consecutive token rows [begin, begin + rows), kept (outside the TP regions, under sequence
// parallelism) by rank `owner`.
struct RowPiece {
  std::int64_t begin = 0, rows = 0;
  int owner = 0;
};

// The pieces of N rows over `size` ranks, `chunks` per rank's share, in the order the collectives
// run: piece k of every rank's share, then piece k + 1 (so every rank's first pieces move first).
// A share of fewer rows than `chunks` gives fewer, non-empty pieces; N must split over the ranks.
std::vector<RowPiece> row_pieces(std::int64_t N, int size, int chunks);

class CommOverlap {
 public:
  // `comm` and `backend` outlive it; chunks >= 1. The GEMMs of an overlapped call leave `comm_sms`
  // streaming multiprocessors to the collectives (ops::Backend::set_gemm_sm_margin): a GEMM that
  // fills every SM would otherwise hold the collective's kernel back until it ends.
  CommOverlap(Communicator& comm, ops::Backend& backend, bool sequence_parallel, int chunks, int comm_sms);
  ~CommOverlap();
  CommOverlap(const CommOverlap&) = delete;
  CommOverlap& operator=(const CommOverlap&) = delete;

  // Whether `impl` takes the split calls with these operands (plain tensors, not prologues). A
  // column-parallel backward (backward_sum) needs no split: it applies to every implementation.
  static bool applies(const ops::LinearImpl& impl, const ops::LinearForward& f);
  static bool applies(const ops::LinearImpl& impl, const ops::LinearBackward& b);
  // Whether a row-parallel forward's sum (forward_sum) takes `impl`: it computes in pieces itself
  // (ops::LinearImpl::forward_pieces, any prologue: an FP8 layer quantises once), or applies().
  static bool sums_in_pieces(const ops::LinearImpl& impl, const ops::LinearForward& f);

  // A row-parallel forward: f.out [N, OC] partial sums, summed over the group into `out_local`
  // (this rank's rows, under sequence parallelism, f.out then left in reduce-scatter's order; else
  // out_local is f.out, summed in place).
  void forward_sum(const ops::LinearImpl& impl, const ops::LinearForward& f, const TensorView& out_local);
  // A column-parallel forward under sequence parallelism: `full` [N, IC] (f.x) gathered from every
  // rank's `local` rows while f.out is computed on the rows already here.
  void gather_forward(const ops::LinearImpl& impl, const ops::LinearForward& f, const TensorView& full,
                      const TensorView& local);
  // A column-parallel backward: b.dx [N, IC] computed, then summed over the group into `dx_local`
  // (reduce-scatter under sequence parallelism; else dx_local is b.dx, all-reduced) while the weight
  // and bias gradients are computed (one impl.backward call; its dgrad_queued starts the sum, and
  // b's own dgrad_queued is called after).
  void backward_sum(const ops::LinearImpl& impl, const ops::LinearBackward& b, const TensorView& dx_local);
  // A row-parallel backward under sequence parallelism: b.dout [N, OC] gathered from every rank's
  // `dout_local` rows while b.dx is computed on the rows already here; then the weight gradients.
  void gather_backward(const ops::LinearImpl& impl, const ops::LinearBackward& b, const TensorView& dout_local);
  // `full`'s rows (any element type: FP8 codes) gathered from every rank's `local` under sequence
  // parallelism, as gather_forward moves them, compute(begin, rows) called for each piece once it is
  // here (ops::RowGather::gather_pieces).
  void gather_rows(const TensorView& full, const TensorView& local,
                   const std::function<void(std::int64_t, std::int64_t)>& compute);

 private:
  // forward_sum under sequence parallelism on two ranks: no reduce-scatter, each rank's partial sums
  // of the other's rows sent while its own are computed.
  void forward_sum_pair(const ops::LinearImpl& impl, const ops::LinearForward& f, const TensorView& out_local);
  void* comm_stream() const;
  void comm_waits_compute();
  void compute_waits_comm();
  // `full`'s rows gathered from every rank's `local`, block by block (every rank's k-th piece) on
  // the communication stream, each block's arrival marked by the event of its first piece.
  void start_gather(const TensorView& full, const TensorView& local);
  // The pieces this rank computes on first (its own), then the others, waiting for each.
  template <class F>
  void on_gathered(F&& compute);

  Communicator& comm_;
  ops::Backend& be_;
  bool sp_;
  int chunks_;
  int comm_sms_;
  std::unique_ptr<SideStream> side_;  // null without a device stream
  std::vector<RowPiece> pieces_;      // for the current N
  std::int64_t pieces_n_ = -1;
  std::vector<StreamEvent> arrived_;  // per piece; a gather marks each block's first
  void pieces_for(std::int64_t N);
};

}  // namespace kiln::parallel
