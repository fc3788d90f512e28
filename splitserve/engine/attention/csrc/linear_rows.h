// The row counts the packed CPU linears run (onednn_linear_cpu.cpp, onednn_matmul_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace splitserve {

constexpr int64_t kExactRows = 64;  // cpu_linear.EXACT_ROWS

// cpu_linear.padded_rows: above 64 rows, rounded up to 8 steps an octave. oneDNN keeps a kernel per
// shape it meets, so the counts are bounded.
inline int64_t padded_rows(int64_t rows) {
  if (rows <= kExactRows) return rows;
  const int bit_length = 64 - __builtin_clzll(static_cast<uint64_t>(rows - 1));
  const int64_t step = int64_t{1} << std::max(bit_length - 4, 0);
  return (rows + step - 1) / step * step;
}

// x2d grown to `padded` rows. Not constant_pad_nd: it fills the whole new tensor before copying the
// rows in (measured: ~40 us a call at 250 x 1,536 bf16, 4 calls a layer); only the padding rows need zeros.
inline at::Tensor pad_rows(const at::Tensor& x2d, int64_t padded) {
  const int64_t rows = x2d.size(0);
  if (padded == rows) return x2d;
  at::Tensor buffer = at::empty({padded, x2d.size(1)}, x2d.options());
  buffer.narrow(0, 0, rows).copy_(x2d);
  buffer.narrow(0, rows, padded - rows).zero_();
  return buffer;
}

}  // namespace splitserve
