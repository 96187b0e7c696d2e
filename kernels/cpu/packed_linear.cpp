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
// bandwidth, so they take less time.
//
// Built with -march=native: AVX-512 where the CPU has it (a panel row is one 512-bit register;
// blocks of up to 12 rows keep 12 accumulators in flight), else AVX2+FMA (two 256-bit halves,
// blocks of up to 6 rows), else a plain loop the compiler vectorizes. Every output is the
// same sum in the same order on all three: the results are bit-identical.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "claimed_parallel.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;         // output columns per panel (two AVX2 registers)
#if defined(__AVX512F__)
constexpr int64_t kRowBlock = 12;      // rows per micro-kernel call (12 accumulators)
#else
constexpr int64_t kRowBlock = 6;       // rows per micro-kernel call (12 accumulators)
#endif
constexpr int64_t kChunk = 128;        // panel rows (k) per pass: 8 KiB, stays in L1
constexpr int64_t kAhead = 512 * kPanel;  // values ahead of the row being multiplied
constexpr int64_t kClaimBytes = 64 * 1024;  // weights a thread claims at a time
constexpr int64_t kFewRows = 64;             // above: many_rows' loop order (prompts)
constexpr int64_t kGroupBytes = 256 * 1024;  // weights of one many_rows claim (in L2)

// Row i's value at k: from a block repacked as [depth][R] (`Rows` false), or straight from
// x's rows, `ldx` apart (`Rows` true: prompt-sized products, whose blocks stay in L1).
#define X_AT(i, k) (Rows ? x + (i) * ldx + (k) : x + (k) * R + (i))

// One block of R rows times one panel over `depth` values of k. `x`: the block's packed
// rows [depth][R]; `w`: the panel's rows [depth][16]; `c`: the R output rows (row stride
// `ldc`), read back unless `init` (one row, for every row: the bias or zeros) starts them.
// Prefetching: a prompt-sized block (x read in place, 6 rows a whole row apart; one k at a
// time: unrolled, 128 rows went 48.7 -> 53.9 ms) with `Fetch` != 0 asks for the weight
// row kAhead floats ahead of each k. A decode-sized block (x repacked) takes k four at a
// time and asks for `Fetch` consecutive lines from `fetch` per four values of k. How many
// is a template argument, not a per-k countdown: the countdown's branch cost the decode
// loop ~25% of its arithmetic (6x16 block over a 128-deep chunk in L1, one thread: 60-67
// -> 80-94 GFLOPS, against ~93 for bare FMAs). Spread over the blocks, not all from the
// first: that burst ran out of outstanding misses and memory idled while the later blocks
// computed (a 16-row product over a 32m model's weights, 2 threads, interleaved in one
// process: 9.97 -> 8.67 and 11.98 -> 9.36 ms; 32 rows 18.9 -> 16.1).
// One panel row (16 values of k's weights) as float32: a float32 panel's as stored, a
// bfloat16 panel's widened (its 16 bits become a float32's top half: exact).
using Bf16 = uint16_t;
inline float widen(float v) { return v; }
inline float widen(Bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
#if defined(__AVX512F__)
inline __m512 load_row(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load_row(const Bf16* w) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load_half(const float* w) { return _mm256_load_ps(w); }
inline __m256 load_half(const Bf16* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

// The vector micro-kernel: `R` rows' accumulators for one 16-column panel held in registers
// (TANDEM_DECL/STEP/K/STORE, per instruction set below), one shared loop.
#if defined(__AVX512F__)
#define TANDEM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define TANDEM_DECL(i)                                          \
  __m512 c##i = _mm512_setzero_ps();                            \
  if (R > i) {                                                  \
    const float* from = init != nullptr ? init : c + i * ldc;   \
    c##i = _mm512_loadu_ps(from);                               \
  }
#define TANDEM_STEP(i) \
  if (R > i) c##i = _mm512_fmadd_ps(_mm512_set1_ps(*X_AT(i, k)), w0, c##i);
#define TANDEM_K                                          \
  {                                                       \
    const __m512 w0 = load_row(w + k * kPanel);           \
    TANDEM_ROWS(TANDEM_STEP)                              \
    ++k;                                                  \
  }
#define TANDEM_STORE(i) \
  if (R > i) _mm512_storeu_ps(c + i * ldc, c##i);
#elif defined(__AVX2__) && defined(__FMA__)
#define TANDEM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define TANDEM_DECL(i)                                                   \
  __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps(); \
  if (R > i) {                                                         \
    const float* from = init != nullptr ? init : c + i * ldc;          \
    c##i##0 = _mm256_loadu_ps(from);                                   \
    c##i##1 = _mm256_loadu_ps(from + 8);                               \
  }
#define TANDEM_STEP(i)                                       \
  if (R > i) {                                               \
    const __m256 xi = _mm256_broadcast_ss(X_AT(i, k));       \
    c##i##0 = _mm256_fmadd_ps(xi, w0, c##i##0);              \
    c##i##1 = _mm256_fmadd_ps(xi, w1, c##i##1);              \
  }
#define TANDEM_K                                                         \
  {                                                                      \
    const __m256 w0 = load_half(w + k * kPanel);                         \
    const __m256 w1 = load_half(w + k * kPanel + 8);                     \
    TANDEM_ROWS(TANDEM_STEP)                                             \
    ++k;                                                                 \
  }
#define TANDEM_STORE(i)                          \
  if (R > i) {                                   \
    _mm256_storeu_ps(c + i * ldc, c##i##0);      \
    _mm256_storeu_ps(c + i * ldc + 8, c##i##1);  \
  }
#endif
#if defined(TANDEM_ROWS)
template <int R, bool Rows, int Fetch, typename W>
inline void block(const float* __restrict x, int64_t ldx, const W* __restrict w,
                  int64_t depth, float* __restrict c, int64_t ldc, const float* init,
                  const char* fetch) {
  TANDEM_ROWS(TANDEM_DECL)
  int64_t k = 0;
  if (Rows) {  // prompts: x's rows read in place
    for (; k < depth;) {
      if (Fetch != 0) {
        _mm_prefetch(reinterpret_cast<const char*>(w + k * kPanel + kAhead), _MM_HINT_T0);
      }
      TANDEM_K
    }
  } else {
    for (; k + 4 <= depth;) {
      if (Fetch >= 1) _mm_prefetch(fetch, _MM_HINT_T0);
      if (Fetch >= 2) _mm_prefetch(fetch + 64, _MM_HINT_T0);
      if (Fetch >= 4) {
        _mm_prefetch(fetch + 128, _MM_HINT_T0);
        _mm_prefetch(fetch + 192, _MM_HINT_T0);
      }
      fetch += Fetch * 64;
      TANDEM_K TANDEM_K TANDEM_K TANDEM_K
    }
    while (k < depth) TANDEM_K
  }
  TANDEM_ROWS(TANDEM_STORE)
}
#undef TANDEM_DECL
#undef TANDEM_STEP
#undef TANDEM_K
#undef TANDEM_STORE
#undef TANDEM_ROWS
#else
template <int R, bool Rows, int Fetch, typename W>
inline void block(const float* x, int64_t ldx, const W* w, int64_t depth, float* c,
                  int64_t ldc, const float* init, const char* fetch) {
  float acc[R][kPanel];
  for (int i = 0; i < R; ++i) {
    const float* from = init != nullptr ? init : c + i * ldc;
    for (int64_t j = 0; j < kPanel; ++j) acc[i][j] = from[j];
  }
  for (int64_t k = 0; k < depth; ++k) {
    for (int i = 0; i < R; ++i) {
      const float xi = *X_AT(i, k);
      for (int64_t j = 0; j < kPanel; ++j) acc[i][j] += xi * widen(w[k * kPanel + j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int64_t j = 0; j < kPanel; ++j) c[i * ldc + j] = acc[i][j];
  }
}
#endif

template <bool Rows, int Fetch, typename W>
void run_block(int64_t rows, const float* x, int64_t ldx, const W* w, int64_t depth,
               float* c, int64_t ldc, const float* init, const char* fetch = nullptr) {
  switch (rows) {
#if defined(__AVX512F__)
    case 12: block<12, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 11: block<11, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 10: block<10, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 9: block<9, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 8: block<8, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 7: block<7, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
#endif
    case 6: block<6, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 5: block<5, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 4: block<4, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 3: block<3, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 2: block<2, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    default: block<1, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
  }
}

// A decode-sized block (x repacked) prefetching `lines` lines per four values of k.
template <typename W>
void run_fetching_block(int lines, int64_t rows, const float* x, const W* w, int64_t depth,
                        float* c, int64_t ldc, const float* init, const char* fetch) {
  switch (lines) {
    case 4: run_block<false, 4>(rows, x, 0, w, depth, c, ldc, init, fetch); break;
    case 2: run_block<false, 2>(rows, x, 0, w, depth, c, ldc, init, fetch); break;
    case 1: run_block<false, 1>(rows, x, 0, w, depth, c, ldc, init, fetch); break;
    default: run_block<false, 0>(rows, x, 0, w, depth, c, ldc, init, fetch); break;
  }
}

// Prompt-sized products (more than kFewRows rows): x is too big to sweep once per 128-deep
// chunk of a panel from L1 (2048 rows x 512 features is 4 MiB), so the loops turn around.
// Threads claim groups of panels that fit in L2 (~256 KiB); each block of 6 rows of x
// (read in place, 12 KiB at K = 512: in L1) goes over every panel of the group for the
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
void few_rows(const float* xs, int64_t rows, int64_t depth, const W* w_base, int64_t panels,
              const float* start, float* o_base, int64_t out_features) {
  // x as blocks of at most kRowBlock rows, as even as can be (16 rows: 6 + 5 + 5, not
  // 6 + 6 + 4; 32: 6 + 6 + 5 + 5 + 5 + 5, not ... + 2: a 2-row block has too few
  // accumulators to hide the FMA latency), each stored [K][rows in the block].
  const int blocks = static_cast<int>((rows + kRowBlock - 1) / kRowBlock);
  std::vector<int64_t> first_row(blocks + 1, 0);
  for (int b = 0; b < blocks; ++b) first_row[b + 1] = first_row[b] + rows / blocks + (b < rows % blocks);
  std::vector<float> xp(rows * depth);
  for (int b = 0; b < blocks; ++b) {
    const int64_t m = first_row[b], r = first_row[b + 1] - m;
    float* dst = xp.data() + m * depth;
    for (int64_t i = 0; i < r; ++i) {
      const float* src = xs + (m + i) * depth;
      for (int64_t k = 0; k < depth; ++k) dst[k * r + i] = src[k];
    }
  }
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
          const int64_t m = first_row[b], r = first_row[b + 1] - m;
          const float* xb = xp.data() + m * depth + k0 * r;
          const char* at = ahead + fetch_first_line[b] * (chunk / 4) * 64;
          run_fetching_block(fetch_lines[b], r, xb, w + k0 * kPanel, chunk, c + m * ldc, ldc,
                             first, at);
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

// x: float32 [M, K]; packed: pack_linear_weight's [P, K, 16] (float32 or bfloat16); bias:
// float32 [N] or none.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a float32 matrix");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && (bf16 || packed.scalar_type() == at::kFloat) &&
                  packed.size(2) == kPanel && packed.is_contiguous(),
              "packed must be pack_linear_weight's [panels, in, 16]");
  const int64_t rows = x.size(0), depth = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == depth, "x has ", depth, " features, the weight ",
              packed.size(1));
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
  const auto run = [&](auto* w_base) {
    if (rows > kFewRows) {
      many_rows(xs, depth, rows, w_base, depth, panels, start.data(), o_base, out_features);
    } else {
      few_rows(xs, rows, depth, w_base, panels, start.data(), o_base, out_features);
    }
  };
  if (bf16) {
    run(reinterpret_cast<const Bf16*>(packed.data_ptr()));
  } else {
    run(packed.data_ptr<float>());
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
