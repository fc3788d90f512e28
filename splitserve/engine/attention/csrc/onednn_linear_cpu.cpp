// splitserve/engine/cpu_linear.py's linear on a prepacked oneDNN weight, as one C++ op.
//
// The same steps as its Python definition (rows flattened, counts above 64 padded to the bounded
// set of shapes of cpu_linear.padded_rows, mkldnn::_linear_pointwise, the padding cut off), but
// without a trip through Python: that trip cost ~40 us of a call, and a decode step makes 120
// of them (a tenth of a small batch's step on 2 cores).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

#include "linear_rows.h"

namespace {

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  static const auto linear_pointwise =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  at::Tensor x2d = x.reshape({-1, x.size(-1)});
  const int64_t rows = x2d.size(0), padded = splitserve::padded_rows(rows);
  x2d = splitserve::pad_rows(x2d, padded);
  at::Tensor out = linear_pointwise.call(x2d, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  if (padded != rows) out = out.narrow(0, 0, rows);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  return out.reshape(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("onednn_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor");
}

// Not the CPU key: the packed weight is an MkldnnCPU tensor, and the call must reach this kernel
// whichever of the two dispatch picks.
TORCH_LIBRARY_IMPL(splitserve_cpu, CompositeExplicitAutograd, m) { m.impl("onednn_linear", &onednn_linear); }
