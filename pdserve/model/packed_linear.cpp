// pdserve::packed_linear's CPU kernel: oneDNN's product by a packed weight, called from C++.
//
// Registered for the keys its inputs dispatch as (the input CPU, the packed weight MkldnnCPU), it
// takes the place of the operator's Python kernel (packed_linear.py): a call from compiled code
// (inductor's C++ wrapper, which runs without the GIL) stays in C++ instead of taking the GIL for a
// Python frame, and an eager call skips that frame too.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   std::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<std::string_view>);

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  static const auto product = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                                  .typed<LinearPointwise>();
  (void)out_features;  // the shape function's: the packed weight knows its own
  return product.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("packed_linear", &packed_linear); }
TORCH_LIBRARY_IMPL(pdserve, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
