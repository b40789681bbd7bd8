#include "kiln/ops/linear_impl.hpp"

#include "kiln/core/error.hpp"

namespace kiln::ops {

void forward_in_pieces(const LinearImpl& impl, const LinearForward& f, std::span<const RowsOut> pieces,
                       const PieceQueued& queued) {
  if (impl.forward_pieces) {
    impl.forward_pieces(f, pieces, queued);
    return;
  }
  const TensorView x = plain_tensor(f.x);
  KILN_CHECK(impl.splits_rows && x, "a linear forward in pieces of rows needs an implementation that takes them "
                                    "(forward_pieces) or calls split by rows on a plain input (splits_rows)");
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const RowsOut& p = pieces[k];
    LinearForward piece = f;
    piece.x = x.rows(p.begin, p.rows);
    piece.out = p.out;
    piece.pre_gelu = f.pre_gelu ? f.pre_gelu.rows(p.begin, p.rows) : TensorView{};
    impl.forward(piece);
    queued(k);
  }
}

}  // namespace kiln::ops
