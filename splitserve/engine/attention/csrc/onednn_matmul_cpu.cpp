// Linears on oneDNN's matmul primitive, from the oneDNN of the `onednn-cpu-gomp` wheel (torch keeps
// the oneDNN it links to itself: its symbols are not exported).
//
// Why not torch's `mkldnn::_linear_pointwise` (oneDNN's inner product on a packed weight): a decode
// step reads every weight once, and on 2 AMX Xeon cores all of SmolLM2-135M's linears (269 MB of
// bf16 weights, each its own, in layer order) took 18.5 ms at 1-8 rows through the inner product,
// 16.6 ms through this primitive, which reads at the speed of a plain 2-thread sum over memory
// (16 GB/s); in fp32 29-37 ms against 33-42. (docs/performance.md, "A decode step reads the
// weights at the memory's speed".)
//
// A packed weight is a plain uint8 tensor holding oneDNN's blocked layout for (in, out, dtype,
// batch hint): the layout comes from the primitive oneDNN picks for `batch_hint` rows, and every
// row count's primitive is then created on that same layout. Primitives are kept per shape; the
// callers feed a bounded set of row counts (cpu_linear.padded_rows), as with the inner product.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <dnnl.hpp>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "linear_rows.h"

namespace {

using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::data_type data_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return memory::data_type::f32;
    case at::kBFloat16: return memory::data_type::bf16;
    default: TORCH_CHECK(false, "onednn_matmul: float32 or bfloat16 only, got ", t);
  }
}

dnnl::matmul::primitive_desc describe(int64_t rows, int64_t in, int64_t out, memory::data_type dt,
                                      const memory::desc& weights, std::optional<memory::data_type> bias) {
  memory::desc src({rows, in}, dt, memory::format_tag::ab);
  memory::desc dst({rows, out}, dt, memory::format_tag::ab);
  if (bias) {
    memory::desc b({1, out}, *bias, memory::format_tag::ab);
    return dnnl::matmul::primitive_desc(cpu_engine(), src, weights, b, dst);
  }
  return dnnl::matmul::primitive_desc(cpu_engine(), src, weights, dst);
}

using WeightKey = std::tuple<int64_t, int64_t, int, int64_t>;  // in, out, dtype, hint
using PrimitiveKey = std::tuple<int64_t, int64_t, int, int64_t, int64_t, int>;  // + rows, bias dtype (-1: none)

// A primitive with the weight layout it reads, so that a call looks both up once.
struct Matmul {
  dnnl::matmul primitive;
  memory::desc weights;
};

std::mutex cache_lock;  // guards both maps
std::map<WeightKey, memory::desc> weight_layouts;
std::map<PrimitiveKey, Matmul> primitives;

// The caller holds cache_lock.
const memory::desc& weight_layout_locked(int64_t in, int64_t out, memory::data_type dt, int64_t hint) {
  WeightKey key{in, out, static_cast<int>(dt), hint};
  auto it = weight_layouts.find(key);
  if (it == weight_layouts.end()) {
    memory::desc any({in, out}, dt, memory::format_tag::any);
    it = weight_layouts.emplace(key, describe(hint, in, out, dt, any, std::nullopt).weights_desc()).first;
  }
  return it->second;
}

memory::desc weight_layout(int64_t in, int64_t out, memory::data_type dt, int64_t hint) {
  std::lock_guard<std::mutex> guard(cache_lock);
  return weight_layout_locked(in, out, dt, hint);
}

Matmul matmul(int64_t rows, int64_t in, int64_t out, memory::data_type dt, int64_t hint,
              std::optional<memory::data_type> bias) {
  std::lock_guard<std::mutex> guard(cache_lock);
  PrimitiveKey key{in, out, static_cast<int>(dt), hint, rows, bias ? static_cast<int>(*bias) : -1};
  auto it = primitives.find(key);
  if (it == primitives.end()) {
    const memory::desc weights = weight_layout_locked(in, out, dt, hint);
    it = primitives.emplace(key, Matmul{dnnl::matmul(describe(rows, in, out, dt, weights, bias)), weights}).first;
  }
  return it->second;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

// weight [out, in] (float32 or bfloat16) -> its bytes in the layout `linear` reads.
at::Tensor pack(const at::Tensor& weight, int64_t batch_hint) {
  TORCH_CHECK(weight.dim() == 2, "onednn_matmul_pack: a 2-D weight");
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  const memory::data_type dt = data_type(w.scalar_type());
  const memory::desc layout = weight_layout(in, out, dt, batch_hint);
  at::Tensor packed = at::empty({static_cast<int64_t>(layout.get_size())}, w.options().dtype(at::kByte));
  memory plain(memory::desc({in, out}, dt, memory::format_tag::ba), cpu_engine(), w.data_ptr());
  memory blocked(layout, cpu_engine(), packed.data_ptr());
  dnnl::stream& stream = thread_stream();
  dnnl::reorder(plain, blocked).execute(stream, plain, blocked);
  stream.wait();
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t in_features, int64_t out_features, int64_t batch_hint) {
  TORCH_CHECK(x.size(-1) == in_features, "onednn_matmul_linear: input has ", x.size(-1), " features, not ",
              in_features);
  at::Tensor x2d = x.reshape({-1, in_features}).contiguous();
  const int64_t rows = x2d.size(0), padded = splitserve::padded_rows(rows);  // a bounded set of primitives
  const memory::data_type dt = data_type(x2d.scalar_type());
  x2d = splitserve::pad_rows(x2d, padded);
  at::Tensor b;
  std::optional<memory::data_type> bias_dt;
  if (bias && bias->defined()) {
    b = bias->contiguous();
    bias_dt = data_type(b.scalar_type());
  }
  at::Tensor y = at::empty({padded, out_features}, x2d.options());
  if (padded > 0) {
    const Matmul mm = matmul(padded, in_features, out_features, dt, batch_hint, bias_dt);
    const memory::desc& layout = mm.weights;
    TORCH_CHECK(packed.numel() == static_cast<int64_t>(layout.get_size()),
                "onednn_matmul_linear: the packed weight was not packed for this shape, dtype and hint");
    memory src(memory::desc({padded, in_features}, dt, memory::format_tag::ab), cpu_engine(), x2d.data_ptr());
    memory dst(memory::desc({padded, out_features}, dt, memory::format_tag::ab), cpu_engine(), y.data_ptr());
    memory weights(layout, cpu_engine(), packed.data_ptr());
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}};
    if (bias_dt) args.emplace(DNNL_ARG_BIAS, memory(memory::desc({1, out_features}, *bias_dt, memory::format_tag::ab),
                                                    cpu_engine(), b.data_ptr()));
    dnnl::stream& stream = thread_stream();
    mm.primitive.execute(stream, args);
    stream.wait();
  }
  if (padded != rows) y = y.narrow(0, 0, rows);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  return y.reshape(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_dnnl, m) {
  m.def("pack(Tensor weight, int batch_hint) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features, int batch_hint) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_dnnl, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
