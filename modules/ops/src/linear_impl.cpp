#include "kiln/ops/linear_impl.hpp"

#include "kiln/core/error.hpp"

namespace kiln::ops {

LinearForward forward_rows(const LinearForward& f, std::int64_t begin, std::int64_t rows, const TensorView& out) {
  LinearForward piece = f;
  if (const TensorView x = plain_tensor(f.x)) piece.x = x.rows(begin, rows);
  piece.out = out;
  piece.pre_gelu = f.pre_gelu ? f.pre_gelu.rows(begin, rows) : TensorView{};
  return piece;
}

void forward_in_pieces(const LinearImpl& impl, const LinearForward& f, std::span<const RowsOut> pieces,
                       const PieceQueued& queued) {
  if (impl.forward_pieces) {
    impl.forward_pieces(f, pieces, queued);
    return;
  }
  KILN_CHECK(impl.splits_rows && plain_tensor(f.x), "a linear forward in pieces of rows needs an implementation that "
                                                   "takes them (forward_pieces) or calls split by rows on a plain "
                                                   "input (splits_rows)");
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    impl.forward(forward_rows(f, pieces[k].begin, pieces[k].rows, pieces[k].out));
    queued(k);
  }
}

}  // namespace kiln::ops
