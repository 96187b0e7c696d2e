// The micro-kernel of Tandem's packed CPU products (`packed_linear.cpp`,
// `quant_panels.h`): R rows of x times one 16-column panel of a weight, accumulators in
// registers, AVX-512 / AVX2+FMA / plain C++; and x's rows repacked into the blocks it takes.
// Included by one compilation unit (an anonymous namespace: its own copy).

#pragma once

#include <ATen/ATen.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;         // output columns per panel (two AVX2 registers)
#if defined(__AVX512F__)
constexpr int64_t kRowBlock = 16;      // rows per micro-kernel call (16 accumulators)
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
#define TANDEM_ROWS(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
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
    case 16: block<16, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 15: block<15, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 14: block<14, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
    case 13: block<13, Rows, Fetch, W>(x, ldx, w, depth, c, ldc, init, fetch); break;
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

// x's rows as blocks of at most kRowBlock rows, as even as can be (16 rows: 6 + 5 + 5, not
// 6 + 6 + 4; 32: 6 + 6 + 5 + 5 + 5 + 5, not ... + 2: a 2-row block has too few
// accumulators to hide the FMA latency), each stored [K][rows in the block].
struct RowBlocks {
  RowBlocks(const float* xs, int64_t rows, int64_t depth)
      : count(static_cast<int>((rows + kRowBlock - 1) / kRowBlock)), depth(depth),
        first_row(count + 1, 0), xp(rows * depth) {
    for (int b = 0; b < count; ++b) {
      first_row[b + 1] = first_row[b] + rows / count + (b < rows % count);
    }
    for (int b = 0; b < count; ++b) {
      const int64_t m = first_row[b], r = rows_in(b);
      float* dst = xp.data() + m * depth;
      for (int64_t i = 0; i < r; ++i) {
        const float* src = xs + (m + i) * depth;
        for (int64_t k = 0; k < depth; ++k) dst[k * r + i] = src[k];
      }
    }
  }
  int64_t first(int b) const { return first_row[b]; }
  int64_t rows_in(int b) const { return first_row[b + 1] - first_row[b]; }
  // Block b's values from k0 on ([depth - k0][rows in the block]).
  const float* at(int b, int64_t k0) const { return xp.data() + first_row[b] * depth + k0 * rows_in(b); }

  const int count;
  const int64_t depth;
  std::vector<int64_t> first_row;
  std::vector<float> xp;
};

}  // namespace
