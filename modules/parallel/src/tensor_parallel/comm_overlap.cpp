#include "kiln/parallel/comm_overlap.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"
#include "kiln/parallel/grad_buckets.hpp"

namespace kiln::parallel {

namespace {

TensorView rows_of(const TensorView& t, const RowPiece& p) { return t ? t.rows(p.begin, p.rows) : t; }

// The two halves of a backward call (ops::LinearImpl::splits_rows): dx alone, and the weight and bias
// gradients alone.
ops::LinearBackward dx_alone(const ops::LinearBackward& b) {
  ops::LinearBackward d = b;
  d.dweight = {};
  d.dbias = {};
  d.dweight_overwrite = false;
  return d;
}
ops::LinearBackward weights_alone(const ops::LinearBackward& b) {
  ops::LinearBackward w = b;
  w.dx = {};
  w.dx_gelu_pre = {};
  return w;
}

// The GEMMs of an overlapped call leave SMs to the collectives beside them.
class SmMargin {
 public:
  SmMargin(ops::Backend& be, int sms) : be_(be) { be_.set_gemm_sm_margin(sms); }
  ~SmMargin() { be_.set_gemm_sm_margin(0); }
  SmMargin(const SmMargin&) = delete;
  SmMargin& operator=(const SmMargin&) = delete;

 private:
  ops::Backend& be_;
};

}  // namespace

std::vector<RowPiece> row_pieces(std::int64_t N, int size, int chunks) {
  KILN_CHECK(size > 0 && chunks > 0 && N > 0 && N % size == 0, N, " token rows do not split over ", size,
             " ranks (in ", chunks, " pieces each)");
  const std::int64_t share = N / size, k = std::min<std::int64_t>(chunks, share);
  std::vector<RowPiece> out;
  for (std::int64_t c = 0; c < k; ++c)
    for (int r = 0; r < size; ++r) {
      const std::int64_t b = c * share / k, e = (c + 1) * share / k;  // near-equal, never empty
      out.push_back({r * share + b, e - b, r});
    }
  return out;
}

CommOverlap::CommOverlap(Communicator& comm, ops::Backend& backend, bool sequence_parallel, int chunks, int comm_sms)
    : comm_(comm),
      be_(backend),
      sp_(sequence_parallel),
      chunks_(chunks),
      comm_sms_(comm_sms),
      side_(SideStream::create(backend.stream(), true)) {
  KILN_CHECK(chunks > 0 && comm_sms >= 0, "tensor-parallel communication overlap: ", chunks,
             " pieces per rank's rows, ", comm_sms, " SMs left to the collectives");
}

CommOverlap::~CommOverlap() = default;

bool CommOverlap::applies(const ops::LinearImpl& impl, const ops::LinearForward& f) {
  return impl.splits_rows && ops::plain_tensor(f.x);
}

bool CommOverlap::sums_in_pieces(const ops::LinearImpl& impl, const ops::LinearForward& f) {
  return impl.forward_pieces || applies(impl, f);
}

bool CommOverlap::applies(const ops::LinearImpl& impl, const ops::LinearBackward& b) {
  return impl.splits_rows && ops::plain_tensor(b.x) && ops::plain_tensor(b.dout);
}

void* CommOverlap::comm_stream() const { return side_ ? side_->stream() : nullptr; }

void CommOverlap::comm_waits_compute() {
  if (side_) side_->wait_for_compute();
}

void CommOverlap::compute_waits_comm() {
  if (side_) side_->compute_waits();
}

void CommOverlap::pieces_for(std::int64_t N) {
  if (N == pieces_n_) return;
  // Without sequence parallelism the rows have no owners (and need not split over the ranks): the
  // same number of near-equal pieces over all N.
  pieces_ = sp_ ? row_pieces(N, comm_.size(), chunks_) : row_pieces(N, 1, comm_.size() * chunks_);
  pieces_n_ = N;
  if (arrived_.size() < pieces_.size()) arrived_.resize(pieces_.size());
}

void CommOverlap::forward_sum(const ops::LinearImpl& impl, const ops::LinearForward& f, const TensorView& out_local) {
  KILN_CHECK(!f.pre_gelu, "a row-parallel output is a partial sum: no GELU epilogue before the sum");
  const SmMargin margin(be_, comm_sms_);
  pieces_for(f.out.size(0));
  const auto size = static_cast<std::size_t>(comm_.size());
  std::vector<ops::RowsOut> outs;
  outs.reserve(pieces_.size());
  if (!sp_) {
    for (const RowPiece& p : pieces_) outs.push_back({p.begin, p.rows, rows_of(f.out, p)});
    ops::forward_in_pieces(impl, f, outs, [&](std::size_t k) {
      comm_waits_compute();
      comm_.all_reduce(outs[k].out, ReduceOp::sum, comm_stream());
    });
    compute_waits_comm();
    return;
  }
  if (size == 2) {  // two ranks: each sends its partial sums of the peer's rows as soon as they are computed
    forward_sum_pair(impl, f, out_local);
    return;
  }
  // Block k (every rank's k-th piece, each of r rows at b within its share) is written to f.out's rows
  // [size b, size (b + r)) in rank order, as reduce-scatter takes it: this rank receives the sum of
  // its own k-th piece, once the block's last piece is queued. (f.out holds partial sums nobody reads
  // in row order.)
  for (std::size_t k = 0; k < pieces_.size(); k += size) {
    const std::int64_t b = pieces_[k].begin, r = pieces_[k].rows;
    for (std::size_t j = 0; j < size; ++j) {
      const RowPiece& p = pieces_[k + j];
      outs.push_back({p.begin, p.rows, f.out.rows(static_cast<std::int64_t>(size) * b + static_cast<std::int64_t>(j) * r, r)});
    }
  }
  ops::forward_in_pieces(impl, f, outs, [&](std::size_t i) {
    if (i % size != size - 1) return;
    const std::size_t k = i - (size - 1);
    const std::int64_t b = pieces_[k].begin, r = pieces_[k].rows, n = static_cast<std::int64_t>(size);
    comm_waits_compute();
    comm_.reduce_scatter(out_local.rows(b, r), f.out.rows(n * b, n * r), ReduceOp::sum, comm_stream());
  });
  compute_waits_comm();
}

void CommOverlap::forward_sum_pair(const ops::LinearImpl& impl, const ops::LinearForward& f,
                                   const TensorView& out_local) {
  // The peer's pieces first, each sent to the peer once computed while the next is computed (a
  // transfer of the partial sums of its rows, and the peer's of this rank's matching rows received
  // into out_local), then this rank's own pieces; out_local += its own partial sums once the peer's
  // are in. The sum of two values is the same in either order, so this is reduce-scatter's result.
  const int me = comm_.rank(), peer = 1 - me;
  const std::int64_t share = f.out.size(0) / 2;
  std::vector<ops::RowsOut> outs;
  std::vector<TensorView> into;  // per peer piece: where the peer's partial sums of this rank's rows go
  outs.reserve(pieces_.size());
  for (const int owner : {peer, me})
    for (const RowPiece& p : pieces_)
      if (p.owner == owner) {
        outs.push_back({p.begin, p.rows, rows_of(f.out, p)});
        if (owner == peer) into.push_back(out_local.rows(p.begin - static_cast<std::int64_t>(peer) * share, p.rows));
      }
  ops::forward_in_pieces(impl, f, outs, [&](std::size_t i) {
    if (i >= into.size()) return;
    comm_waits_compute();
    comm_.send_recv({{peer, outs[i].out}}, {{peer, into[i]}}, comm_stream());
  });
  compute_waits_comm();
  const TensorView own = f.out.rows(static_cast<std::int64_t>(me) * share, share);
  be_.residual_forward({out_local, out_local, own, {}});
}

void CommOverlap::start_gather(const TensorView& full, const TensorView& local) {
  pieces_for(full.size(0));
  const int size = comm_.size(), me = comm_.rank();
  const std::int64_t share = full.size(0) / size;
  const TensorView own = full.rows(static_cast<std::int64_t>(me) * share, share);
  if (own.data != local.data) be_.copy(own, local);
  comm_waits_compute();  // this rank's rows are in place before they are sent
  // Block k: this rank's k-th piece to every other rank, theirs from them, both ways at once.
  for (std::size_t k = 0; k < pieces_.size(); k += static_cast<std::size_t>(size)) {
    std::vector<Communicator::Transfer> sends, recvs;
    for (int j = 0; j < size; ++j)
      if (j != me) {
        sends.push_back({j, rows_of(full, pieces_[k + static_cast<std::size_t>(me)])});
        recvs.push_back({j, rows_of(full, pieces_[k + static_cast<std::size_t>(j)])});
      }
    comm_.send_recv(sends, recvs, comm_stream());
    arrived_[k].record(comm_stream());
  }
}

template <class F>
void CommOverlap::on_gathered(F&& compute) {
  const int me = comm_.rank();
  const auto size = static_cast<std::size_t>(comm_.size());
  for (const RowPiece& p : pieces_)
    if (p.owner == me) compute(p);
  for (std::size_t k = 0; k < pieces_.size(); k += size) {
    arrived_[k].wait(be_.stream());
    for (std::size_t j = 0; j < size; ++j)
      if (pieces_[k + j].owner != me) compute(pieces_[k + j]);
  }
  compute_waits_comm();  // this rank's own sends have left before its rows may change
}

void CommOverlap::gather_forward(const ops::LinearImpl& impl, const ops::LinearForward& f, const TensorView& full,
                                 const TensorView& local) {
  const SmMargin margin(be_, comm_sms_);
  start_gather(full, local);
  on_gathered([&](const RowPiece& p) { impl.forward(ops::forward_rows(f, p.begin, p.rows, rows_of(f.out, p))); });
}

void CommOverlap::gather_rows(const TensorView& full, const TensorView& local,
                              const std::function<void(std::int64_t, std::int64_t)>& compute) {
  KILN_CHECK(sp_, "a gather of rows in pieces outside sequence parallelism");
  const SmMargin margin(be_, comm_sms_);
  start_gather(full, local);
  on_gathered([&](const RowPiece& p) { compute(p.begin, p.rows); });
}

void CommOverlap::backward_sum(const ops::LinearImpl& impl, const ops::LinearBackward& b, const TensorView& dx_local) {
  const SmMargin margin(be_, comm_sms_);
  bool summing = false;
  const auto sum = [&] {
    if (summing) return;
    summing = true;
    comm_waits_compute();
    if (sp_)
      comm_.reduce_scatter(dx_local, b.dx, ReduceOp::sum, comm_stream());
    else
      comm_.all_reduce(b.dx, ReduceOp::sum, comm_stream());
  };
  // One call: the sum starts once dx is queued, beside the weight gradient (any operands, prologues
  // included: an FP8 implementation quantises its output gradient once for both GEMMs).
  ops::LinearBackward whole = b;
  whole.dgrad_queued = [&] {
    sum();
    if (b.dgrad_queued) b.dgrad_queued();
  };
  impl.backward(whole);
  sum();  // an implementation that did not say (the sum then runs after the weight gradients)
  compute_waits_comm();
}

void CommOverlap::gather_backward(const ops::LinearImpl& impl, const ops::LinearBackward& b,
                                  const TensorView& dout_local) {
  const SmMargin margin(be_, comm_sms_);
  const TensorView dout = ops::plain_tensor(b.dout), x = ops::plain_tensor(b.x);
  start_gather(dout, dout_local);
  on_gathered([&](const RowPiece& p) {  // every piece has arrived afterwards, with or without dx
    if (!b.dx) return;
    ops::LinearBackward piece = dx_alone(b);
    piece.dout = rows_of(dout, p);
    piece.x = rows_of(x, p);
    piece.dx = rows_of(b.dx, p);
    piece.dx_gelu_pre = rows_of(b.dx_gelu_pre, p);
    impl.backward(piece);
  });
  impl.backward(weights_alone(b));
}

}  // namespace kiln::parallel
