// Rotary embedding of a step's queries and keys and the store of its keys and values into
// the paged cache, in one pass over the merged q/k/v projection output.
//
// In torch this is ~7 ops for the rotation (chunk, four products, a difference, a sum, a
// concatenation) and two indexed stores: ~100-130 us per layer at decode batch sizes,
// nearly all of it dispatch. The arithmetic is torch's, operation for operation:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded before the sum
// (contraction into fused multiply-adds is off for this file), so the results are
// bit-identical to the torch path and to Hugging Face's rotate_half.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>

namespace {

constexpr int64_t kSerialElements = 1 << 16;  // below this, no parallel region

// qkv [T, H + 2 KV, D]; cos, sin [T, 1, D / 2]; caches [blocks, block_size, KV, D] (the
// KV cache's strided per-layer views: a slot's heads contiguous, blocks strided);
// write_blocks / write_offsets [W]: the slot of token write_rows[w] (or of token w when
// write_rows is absent). Returns the rotated queries [T, H, D] and keys [T, KV, D].
std::tuple<at::Tensor, at::Tensor> rotary_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t num_heads, int64_t num_kv_heads, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& write_blocks,
                        const at::Tensor& write_offsets,
                        const std::optional<at::Tensor>& write_rows) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "rotary_write: float32 only");
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "rotary_write: qkv must be [T, heads, D]");
  const int64_t tokens = qkv.size(0);
  const int64_t dim = qkv.size(2);
  const int64_t half = dim / 2;
  const int64_t rotated_heads = num_heads + num_kv_heads;
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == num_heads + 2 * num_kv_heads,
              "rotary_write: qkv heads must be num_heads + 2 * num_kv_heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * half &&
                  sin.numel() == tokens * half,
              "rotary_write: cos/sin must be [T, 1, D / 2]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == dim,
              "rotary_write: caches must be [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == dim && v_cache.stride(3) == 1 &&
                  v_cache.stride(2) == dim,
              "rotary_write: a cache slot's heads must be contiguous (strided blocks are fine)");
  TORCH_CHECK(write_blocks.scalar_type() == at::kLong && write_offsets.scalar_type() == at::kLong &&
                  write_blocks.numel() == write_offsets.numel(),
              "rotary_write: write_blocks / write_offsets must be int64 of one length");
  const int64_t writes = write_blocks.numel();
  const int64_t* rows = nullptr;
  at::Tensor rows_contiguous;
  if (write_rows.has_value()) {
    rows_contiguous = write_rows->contiguous();
    TORCH_CHECK(rows_contiguous.scalar_type() == at::kLong && rows_contiguous.numel() == writes,
                "rotary_write: write_rows must be int64, one per write");
    rows = rows_contiguous.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(writes == tokens, "rotary_write: one write per token without write_rows");
  }

  auto queries = at::empty({tokens, num_heads, dim}, qkv.options());
  auto keys = at::empty({tokens, num_kv_heads, dim}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* q_out = queries.data_ptr<float>();
  float* k_out = keys.data_ptr<float>();
  const int64_t in_stride = qkv.size(1) * dim;
  const int64_t q_stride = num_heads * dim;
  const int64_t k_stride = num_kv_heads * dim;

  auto rotate_tokens = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + t * half;
      const float* s = sn + t * half;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        const float* x = src + t * in_stride + h * dim;
        float* y = h < num_heads ? q_out + t * q_stride + h * dim
                                 : k_out + t * k_stride + (h - num_heads) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i] * c[i];
          const float b = x[i + half] * s[i];
          y[i] = a - b;
        }
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i + half] * c[i];
          const float b = x[i] * s[i];
          y[i + half] = a + b;
        }
      }
    }
  };
  const int64_t grain =
      std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, rotated_heads * dim));
  if (tokens <= grain) {
    rotate_tokens(0, tokens);
  } else {
    at::parallel_for(0, tokens, grain, rotate_tokens);
  }

  const int64_t block_size = k_cache.size(1);
  const int64_t kv_bytes = k_stride * static_cast<int64_t>(sizeof(float));
  const int64_t* blocks = write_blocks.data_ptr<int64_t>();
  const int64_t* offsets = write_offsets.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0);
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t w = 0; w < writes; ++w) {
    const int64_t t = rows == nullptr ? w : rows[w];
    TORCH_CHECK(t >= 0 && t < tokens && blocks[w] >= 0 && blocks[w] < num_blocks &&
                    offsets[w] >= 0 && offsets[w] < block_size,
                "rotary_write: write ", w, " is out of range");
    std::memcpy(kc + blocks[w] * k_cache.stride(0) + offsets[w] * k_cache.stride(1),
                k_out + t * k_stride, kv_bytes);
    std::memcpy(vc + blocks[w] * v_cache.stride(0) + offsets[w] * v_cache.stride(1),
                src + t * in_stride + rotated_heads * dim, kv_bytes);
  }
  return {queries, keys};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "rotary_write(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_blocks, Tensor write_offsets, "
      "Tensor? write_rows) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("rotary_write", &rotary_write); }
