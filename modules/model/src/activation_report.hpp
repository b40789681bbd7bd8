#pragma once
// model.report_activations: the saved rows of each block (activation_report.cpp).
#include <string>

#include "kiln/model/parts/activation_table.hpp"

namespace kiln::model {

// `residual`: a block's input, which the model keeps for every block besides the table's rows.
std::string activation_report(const ActivationTable& table, const TensorView& residual);

}  // namespace kiln::model
