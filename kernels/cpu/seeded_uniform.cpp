// The sampler's counter-based uniforms (services/worker/seeded_noise.py `uniform`) in one
// pass: for row r with stream (offset a, odd multiplier m) and token id v,
// u = ((mix32((a + m * v) mod 2^32) >> 8) | 1) * 2^-24 as float32. Integer math is exact
// (32-bit wraparound equals the Python version's masking), so the values are bit-identical
// to the torch implementation; only the many int64 passes and their dispatch are gone.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "counter_hash.h"

#include <cstdint>

namespace {

// streams: int64 [R, 2] (offset, multiplier), each in [0, 2^32); token_ids: int64 [R or 1, C]
// (broadcast over rows when it has one row).
at::Tensor seeded_uniform(const at::Tensor& streams, const at::Tensor& token_ids) {
  TORCH_CHECK(streams.dim() == 2 && streams.size(1) == 2 && streams.scalar_type() == at::kLong,
              "streams must be int64 [R, 2]");
  const auto s = streams.contiguous();
  const int64_t rows = s.size(0);
  const int64_t* sp = s.data_ptr<int64_t>();
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong,
              "token_ids must be int64 [R or 1, C]");
  TORCH_CHECK(token_ids.size(0) == rows || token_ids.size(0) == 1, "token_ids rows");
  const auto idc = token_ids.contiguous();
  const int64_t num_cols = idc.size(1);
  const int64_t* ids = idc.data_ptr<int64_t>();
  const int64_t id_row_stride = idc.size(0) == 1 ? 0 : num_cols;
  auto out = at::empty({rows, num_cols}, streams.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t total = rows * num_cols;
  at::parallel_for(0, total, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / num_cols, c = i % num_cols;
      const uint32_t a = static_cast<uint32_t>(sp[2 * r]);
      const uint32_t m = static_cast<uint32_t>(sp[2 * r + 1]);
      const uint32_t v = static_cast<uint32_t>(ids[r * id_row_stride + c]);
      op[i] = tandem_cpu::counter_uniform(a, m, v);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("seeded_uniform(Tensor streams, Tensor token_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("seeded_uniform", &seeded_uniform);
}
