// Root-mean-square norm of each row of a float32 matrix, alone and fused with the residual
// add before it (a decoder layer's `hidden + attention output`, then its second norm).
//
// The composite `F.rms_norm` dispatches ~7 ops per call (pow, mean, add, rsqrt, two muls,
// copies): ~90 us for a decode batch whose data is a few KiB, 17-25 calls per step. Here
// a row is one pass: its sum of squares in 16 independent float lanes combined pairwise,
// then out = weight * (x * rsqrt(mean + eps)) in Hugging Face's order. Rows run over
// torch's intra-op threads only when there are enough of them (prompts); a decode batch
// stays on the calling thread, with no parallel region to wait at.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "row_parallel.h"

#include <cmath>
#include <tuple>

namespace {

constexpr int kLanes = 16;
constexpr int64_t kSerialElements = 1 << 15;  // below this, no parallel region

float sum_of_squares(const float* x, int64_t n) {
  float lanes[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) lanes[l] += x[i] * x[i];
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

void normalize_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float mean = sum_of_squares(x, n) / static_cast<float>(n);
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * scale);
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, name,
              ": float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), name, ": contiguous tensors only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), name,
              ": weight must match the last dimension");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  tandem_cpu::over_rows(rows, n, kSerialElements, [&](int64_t r) {
    normalize_row(xs + r * n, ws, os + r * n, n, e);
  });
  return out;
}

// (residual + x, rms_norm(residual + x)): the sum is the float add torch would make.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& x,
                                                const at::Tensor& weight, double eps) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous(),
              "add_rms_norm: residual must be a contiguous float32 tensor of x's shape");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* rs = residual.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  float* ss = sum.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  tandem_cpu::over_rows(rows, n, kSerialElements, [&](int64_t r) {
    float* s = ss + r * n;
    for (int64_t i = 0; i < n; ++i) s[i] = rs[r * n + i] + xs[r * n + i];
    normalize_row(s, ws, os + r * n, n, e);
  });
  return {sum, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
