// Decode-sized float32 matrix products for CPU workers: y[M, N] = x[M, K] @ W[K, N] (+ b)
// for the few dozen rows of a decode step, with W packed once at load into panels of 16
// output columns, [ceil(N / 16), K, 16] (the last panel zero-padded).
//
// Why not oneDNN's or MKL's packed GEMM: at 16 rows on a 2-core AVX2 EPYC they ran a decode
// step's projections at ~80 GFLOPS, under half the FMA peak, and the weights (read once per
// step, ~4x the last-level cache) do not stream while the later rows compute. Here:
// - each thread takes whole panels from its own contiguous share (one sequential stream),
//   then any a preempted thread has not started (claimed_parallel.h);
// - rows go through in blocks of 6 (12 accumulator registers: 6 rows x 16 columns), each
//   block over a 128-deep chunk of the panel while that chunk sits in L1;
// - every block of a chunk prefetches its share of the weights 512 rows ahead (the first
//   of three blocks two rows (lines) per four values of k, the others one), so memory
//   streams evenly while the blocks compute from L1;
// - x is repacked per call as [K][rows of the block], so a block's broadcasts read one
//   contiguous run instead of 6 rows a whole row apart.
// Each output is a float32 sum over k in order (FMA-contracted), like any BLAS product's
// rounding, not bit-identical to torch.mm.
//
// Panels may hold bfloat16 instead of float32 (pack_linear_weight given a bfloat16 weight):
// each panel row is widened to float32 in registers (a bfloat16 is the top half of a float32)
// and multiplied exactly as a float32 panel would be. For a weight whose every value is a
// bfloat16 (a bf16 checkpoint read into float32) the products are bit-identical to the
// float32 panels' and read half the bytes: decode-sized products are bound by the weights'
// bandwidth, so they take less time. Block-quantized panels (quant_panels.h: a weight whose
// values are exactly GGUF Q4_1 or Q8_0 blocks) are dequantized a 128-deep chunk at a time
// into L1 and multiplied from there: again the float32 panels' products, from 5 or 8.5 bits
// a value.
//
// Built with -march=native: AVX-512 where the CPU has it (a panel row is one 512-bit register;
// blocks of up to 16 rows keep 16 accumulators in flight: against 12, prompt-sized products
// 7-8% faster on SmolLM2's shapes at 128 rows, 4% at 48, decode sizes equal), else AVX2+FMA
// (two 256-bit halves, blocks of up to 6 rows), else a plain loop the compiler vectorizes. Every output is the
// same sum in the same order on all three: the results are bit-identical.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "claimed_parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "packed_microkernel.h"
#include "quant_panels.h"

namespace {

constexpr int64_t kQuantAhead = 8 * 1024;  // bytes of blocks prefetched ahead

// Prompt-sized products (more than kFewRows rows): x is too big to sweep once per 128-deep
// chunk of a panel from L1 (2048 rows x 512 features is 4 MiB), so the loops turn around.
// Threads claim groups of panels that fit in L2 (~256 KiB of float32); each block of 6 rows
// of x (read in place, 12 KiB at K = 512: in L1) goes over every panel of the group for the
// whole depth, its accumulators in registers. The weights come from memory once per
// group, prefetched by the first block; x comes from L3 once per group. Every block widens
// a bfloat16 group's rows again (128 rows: as fast as float32 panels; widening each group
// once into a float32 copy in L2 was 15% slower).
template <typename W>
void many_rows(const float* xs, int64_t ldx, int64_t rows, const W* w_base, int64_t depth,
               int64_t panels, const float* start, float* o_base, int64_t out_features) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (depth * kPanel * 4));
  const int64_t groups = (panels + group - 1) / group;
  tandem_cpu::claimed_parallel_for(groups, 1, [&](int64_t g_begin, int64_t g_end) {
    std::vector<float> tail;  // the last panel's outputs when N is not a multiple of 16
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t p0 = g * group, p1 = std::min(panels, p0 + group);
      const bool partial = p1 * kPanel > out_features;
      if (partial) tail.resize(rows * kPanel);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m = b * kRowBlock, r = std::min(kRowBlock, rows - m);
        for (int64_t p = p0; p < p1; ++p) {
          const bool last = (p + 1) * kPanel > out_features;
          float* c = last ? tail.data() + m * kPanel : o_base + m * out_features + p * kPanel;
          const int64_t ldc = last ? kPanel : out_features;
          const W* w = w_base + p * depth * kPanel;
          // The first block streams the group's weights in: it prefetches every row ahead.
          if (b == 0) {
            run_block<true, 1>(r, xs + m * ldx, ldx, w, depth, c, ldc, start + p * kPanel);
          } else {
            run_block<true, 0>(r, xs + m * ldx, ldx, w, depth, c, ldc, start + p * kPanel);
          }
        }
      }
      if (partial) {
        const int64_t p = p1 - 1, width = out_features - p * kPanel;
        for (int64_t i = 0; i < rows; ++i) {
          std::copy_n(tail.data() + i * kPanel, width, o_base + i * out_features + p * kPanel);
        }
      }
    }
  });
}

// weight_t: float32 or bfloat16 [K, N] (a linear layer's transposed weight) ->
// [ceil(N / 16), K, 16] of the same type.
at::Tensor pack_linear_weight(const at::Tensor& weight_t) {
  TORCH_CHECK(weight_t.dim() == 2 && (weight_t.scalar_type() == at::kFloat ||
                                      weight_t.scalar_type() == at::kBFloat16),
              "weight_t must be a float32 or bfloat16 [in, out] matrix");
  const at::Tensor source = weight_t.contiguous();
  const int64_t depth = source.size(0), n = source.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, depth, kPanel}, source.options());
  const int64_t size = source.element_size();
  const char* src = static_cast<const char*>(source.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t width = std::min(kPanel, n - p * kPanel);
      for (int64_t k = 0; k < depth; ++k) {
        std::memcpy(dst + ((p * depth + k) * kPanel) * size, src + (k * n + p * kPanel) * size,
                    width * size);
      }
    }
  });
  return packed;
}

// rows <= kFewRows: the decode-sized loop order (x repacked per block, panels claimed).
template <typename W>
void few_rows(const RowBlocks& xb, int64_t rows, int64_t depth, const W* w_base, int64_t panels,
              const float* start, float* o_base, int64_t out_features) {
  const int blocks = xb.count;
  // Lines each block prefetches per four values of k: four panel rows are `per_four` lines
  // (4 of float32, 2 of bfloat16), shared out 4 | 2 + 2 | 2 + 1 + 1 | 1 + 1 + 1 + 1 (+ 0 ...);
  // and where in the chunk ahead its share starts, in lines per four values of k.
  constexpr int per_four = static_cast<int>(4 * kPanel * sizeof(W) / 64);
  std::vector<int> fetch_lines(blocks, 0), fetch_first_line(blocks, 0);
  for (int line = 0; line < per_four; ++line) {
    ++fetch_lines[blocks >= per_four ? line : line * blocks / per_four];
  }
  for (int b = 1; b < blocks; ++b) fetch_first_line[b] = fetch_first_line[b - 1] + fetch_lines[b - 1];
  // Panels are claimed ~64 KiB of weights at a time (claimed_parallel.h): a thread that is
  // preempted holds up the others by at most that much.
  const int64_t grain =
      std::max<int64_t>(1, kClaimBytes / (depth * kPanel * static_cast<int64_t>(sizeof(W))));
  tandem_cpu::claimed_parallel_for(panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> tail;  // the last panel's outputs when N is not a multiple of 16
    for (int64_t p = begin; p < end; ++p) {
      const W* w = w_base + p * depth * kPanel;
      const bool partial = (p + 1) * kPanel > out_features;
      if (partial) tail.resize(rows * kPanel);  // every element is written by k0 == 0
      float* c = partial ? tail.data() : o_base + p * kPanel;
      const int64_t ldc = partial ? kPanel : out_features;
      for (int64_t k0 = 0; k0 < depth; k0 += kChunk) {
        const int64_t chunk = std::min(kChunk, depth - k0);
        // The first chunk starts every row from the panel's one row of `start`; later
        // chunks add to what the block stored.
        const float* first = k0 == 0 ? start + p * kPanel : nullptr;
        // Every block asks for its share of the chunk 512 rows ahead (lines spread
        // evenly over the chunk's time: a burst from one block runs out of misses).
        const char* ahead = reinterpret_cast<const char*>(w + k0 * kPanel + kAhead);
        for (int b = 0; b < blocks; ++b) {
          const char* at = ahead + fetch_first_line[b] * (chunk / 4) * 64;
          run_fetching_block(fetch_lines[b], xb.rows_in(b), xb.at(b, k0), w + k0 * kPanel,
                             chunk, c + xb.first(b) * ldc, ldc, first, at);
        }
      }
      if (partial) {
        const int64_t width = out_features - p * kPanel;
        for (int64_t i = 0; i < rows; ++i) {
          std::copy_n(tail.data() + i * kPanel, width, o_base + i * out_features + p * kPanel);
        }
      }
    }
  });
}

// rows <= kFewRows over block-quantized panels: each 128-deep chunk of a panel is
// dequantized once into L1 (prefetching the blocks ~8 KiB ahead) and every block of rows
// multiplies it there, so the dequantizing is paid once per chunk, not once per block.
template <bool Q4>
void few_rows_quant(const RowBlocks& xb, int64_t rows, int64_t depth, const uint8_t* base,
                    int64_t panels, const float* start, float* o_base, int64_t out_features) {
  constexpr int64_t bytes = block_bytes<Q4>();
  const int64_t per_panel = depth / kBlockK * bytes;
  const int64_t grain = std::max<int64_t>(1, kClaimBytes / per_panel);
  tandem_cpu::claimed_parallel_for(panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> tail;  // the last panel's outputs when N is not a multiple of 16
    alignas(64) float values[kChunk * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = base + p * per_panel;
      const bool partial = (p + 1) * kPanel > out_features;
      if (partial) tail.resize(rows * kPanel);
      float* c = partial ? tail.data() : o_base + p * kPanel;
      const int64_t ldc = partial ? kPanel : out_features;
      for (int64_t k0 = 0; k0 < depth; k0 += kChunk) {
        const int64_t chunk = std::min(kChunk, depth - k0);
        for (int64_t kb = 0; kb < chunk / kBlockK; ++kb) {
          const uint8_t* src = panel + (k0 / kBlockK + kb) * bytes;
          for (int64_t line = 0; line < bytes; line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(src + kQuantAhead + line), _MM_HINT_T0);
          }
          dequantize_block<Q4>(src, values + kb * kBlockK * kPanel);
        }
        const float* first = k0 == 0 ? start + p * kPanel : nullptr;
        for (int b = 0; b < xb.count; ++b) {
          run_block<false, 0>(xb.rows_in(b), xb.at(b, k0), 0, values, chunk,
                              c + xb.first(b) * ldc, ldc, first);
        }
      }
      if (partial) {
        const int64_t width = out_features - p * kPanel;
        for (int64_t i = 0; i < rows; ++i) {
          std::copy_n(tail.data() + i * kPanel, width, o_base + i * out_features + p * kPanel);
        }
      }
    }
  });
}

// x: float32 [M, K]; packed: pack_linear_weight's [P, K, 16] (float32 or bfloat16) or
// compact_panels.py's uint8 [P, K / 32, 320 (Q4_1) or 544 (Q8_0)]; bias: float32 [N] or none.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a float32 matrix");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const bool quantized = packed.scalar_type() == at::kByte;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  (quantized ? packed.size(2) == kQ4Bytes || packed.size(2) == kQ8Bytes
                             : (bf16 || packed.scalar_type() == at::kFloat) &&
                                   packed.size(2) == kPanel),
              "packed must be pack_linear_weight's [panels, in, 16] or compact_panels' "
              "[panels, in / 32, block bytes]");
  const int64_t rows = x.size(0), depth = x.size(1), panels = packed.size(0);
  const int64_t weight_depth = quantized ? packed.size(1) * kBlockK : packed.size(1);
  TORCH_CHECK(weight_depth == depth, "x has ", depth, " features, the weight ", weight_depth);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the packed panels");
  // Each panel's starting values: its bias columns, or zeros (padded to whole panels).
  std::vector<float> start(panels * kPanel, 0.0f);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features,
                "bias must be float32 [out_features]");
    const at::Tensor b = bias->contiguous();
    std::copy_n(b.data_ptr<float>(), out_features, start.begin());
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const at::Tensor xc = x.contiguous();
  const float* xs = xc.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const float* first = start.data();
  const auto stored = [&](auto* w_base) {
    if (rows > kFewRows) {
      many_rows(xs, depth, rows, w_base, depth, panels, first, o_base, out_features);
    } else {
      few_rows(RowBlocks(xs, rows, depth), rows, depth, w_base, panels, first, o_base,
               out_features);
    }
  };
  const auto blocks = [&](auto q4) {
    constexpr bool Q4 = decltype(q4)::value;
    const auto* base = packed.data_ptr<uint8_t>();
    // Block panels pay for small products (compact_panels.BLOCK_PANEL_ROWS); larger ones
    // take the decode loop kFewRows rows at a time (dequantizing a group of panels into L2
    // for the prompt loop order was 6-10% slower than float32 panels).
    for (int64_t m = 0; m < rows; m += kFewRows) {
      const int64_t r = std::min(kFewRows, rows - m);
      few_rows_quant<Q4>(RowBlocks(xs + m * depth, r, depth), r, depth, base, panels, first,
                         o_base + m * out_features, out_features);
    }
  };
  if (quantized && packed.size(2) == kQ4Bytes) {
    blocks(std::true_type{});
  } else if (quantized) {
    blocks(std::false_type{});
  } else if (bf16) {
    stored(reinterpret_cast<const Bf16*>(packed.data_ptr()));
  } else {
    stored(packed.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("pack_linear_weight(Tensor weight_t) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
