// Row-wise kernels (RMSNorm, SwiGLU's activation) over torch's intra-op threads only when
// there are enough rows to pay for a parallel region: a decode batch, a few KiB of data,
// stays on the calling thread with no region to wait at; a prompt's rows are split.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace tandem_cpu {

// row(r) for every r in [0, rows), rows of `n` elements; serially while the rows hold at
// most ~`serial_elements` elements in all, else in grains of about that many.
template <typename Row>
void over_rows(int64_t rows, int64_t n, int64_t serial_elements, const Row& row) {
  const int64_t grain = std::max<int64_t>(1, serial_elements / std::max<int64_t>(1, n));
  if (rows <= grain) {
    for (int64_t r = 0; r < rows; ++r) row(r);
    return;
  }
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(r);
  });
}

}  // namespace tandem_cpu
