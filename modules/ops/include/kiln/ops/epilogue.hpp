#pragma once
// What a GEMM does to its product before storing it, for the bf16 GEMMs (kiln::cuda::GemmDesc) and
// the FP8 GEMMs (kiln::fp8::GemmArgs, CPU and CUDA) alike. The product is r = op(A) @ op(B) (the
// dequantised operands for FP8); D and aux are row-major [M, N] activations, bias has N elements,
// and epilogues write D (never accumulate into it).
namespace kiln::ops {

enum class Epilogue {
  none,   // D = r
  bias,   // D = r + bias[n] (none when no bias is given)
  gelu,   // aux = r (+ bias[n] when given), then D = gelu(aux): aux keeps the pre-activation
  dgelu,  // D = r * gelu'(aux), aux the forward's pre-activation (the GELU's backward)
};

constexpr const char* name_of(Epilogue e) {
  switch (e) {
    case Epilogue::none: return "none";
    case Epilogue::bias: return "bias";
    case Epilogue::gelu: return "gelu";
    case Epilogue::dgelu: return "dgelu";
  }
  return "?";
}

}  // namespace kiln::ops
