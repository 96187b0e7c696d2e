// Block-quantized panels: a weight whose values are exactly those of GGUF's Q4_1 or Q8_0
// blocks (32 values of k, per output column: a float16 scale d, for Q4_1 a float16 offset m)
// kept as those blocks, 16 output columns to a panel, and turned back into float32 one
// 32 x 16 block at a time (`dequantize_block`), exactly: a Q4_1 value is d * q + m with
// 0 <= q < 16, a Q8_0 value d * q with -128 <= q < 128; d * q is exact in float32 (11 + 8
// bits), so the one rounding of the fused d * q + m is the rounding of the separate add
// the checkpoint's float32 values were made with. Packed by `compact_panels.py`.
//
// A panel is [K / 32] blocks, each:
//   Q4_1: d float16[16], m float16[16], then 16 pairs of rows, 16 bytes each (byte j:
//         column j of the pair's first row in its low nibble, of its second row in its high
//         one): 320 bytes for 512 values (5 bits each). A pair widens to 16 int32 lanes in
//         one instruction, and each row is then one mask or shift away;
//   Q8_0: d float16[16], then 32 rows of 16 int8: 544 bytes (8.5 bits each).

#pragma once

#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlockK = 32;                         // values of k per block
constexpr int64_t kQ4Bytes = 32 + 32 + kBlockK * 8;     // 320
constexpr int64_t kQ8Bytes = 32 + kBlockK * 16;         // 544

template <bool Q4>
constexpr int64_t block_bytes() {
  return Q4 ? kQ4Bytes : kQ8Bytes;
}

// One block's 32 rows x 16 columns into `dst` (float32, row-major 16 wide).
template <bool Q4>
inline void dequantize_block(const uint8_t* src, float* dst) {
  const uint8_t* q = src + (Q4 ? 64 : 32);
#if defined(__AVX512F__)
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  if constexpr (Q4) {
    const __m512 m =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32)));
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int r = 0; r < kBlockK; r += 2) {
      const __m512i pair =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * 8)));
      const __m512 v0 = _mm512_cvtepi32_ps(_mm512_and_si512(pair, low));
      const __m512 v1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 4));
      _mm512_storeu_ps(dst + r * 16, _mm512_fmadd_ps(d, v0, m));
      _mm512_storeu_ps(dst + (r + 1) * 16, _mm512_fmadd_ps(d, v1, m));
    }
  } else {
    for (int r = 0; r < kBlockK; ++r) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * 16));
      _mm512_storeu_ps(dst + r * 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))));
    }
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const __m128i* half = reinterpret_cast<const __m128i*>(src);
  const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(half)), d1 = _mm256_cvtph_ps(_mm_loadu_si128(half + 1));
  if constexpr (Q4) {
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(half + 2));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(half + 3));
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int r = 0; r < kBlockK; r += 2) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * 8));
      const __m256i left = _mm256_cvtepu8_epi32(bytes);                      // columns 0-7
      const __m256i right = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));  // columns 8-15
      float* row = dst + r * 16;
      _mm256_storeu_ps(row, _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(left, low)), m0));
      _mm256_storeu_ps(row + 8, _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_and_si256(right, low)), m1));
      _mm256_storeu_ps(row + 16, _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_srli_epi32(left, 4)), m0));
      _mm256_storeu_ps(row + 24, _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_srli_epi32(right, 4)), m1));
    }
  } else {
    for (int r = 0; r < kBlockK; ++r) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * 16));
      const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      _mm256_storeu_ps(dst + r * 16, _mm256_mul_ps(d0, v0));
      _mm256_storeu_ps(dst + r * 16 + 8, _mm256_mul_ps(d1, v1));
    }
  }
#else
  const c10::Half* h = reinterpret_cast<const c10::Half*>(src);
  for (int r = 0; r < kBlockK; ++r) {
    for (int j = 0; j < 16; ++j) {
      const float d = static_cast<float>(h[j]);
      if constexpr (Q4) {
        const int byte = q[(r / 2) * 16 + j];
        const int v = r % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
        dst[r * 16 + j] = std::fma(d, static_cast<float>(v), static_cast<float>(h[16 + j]));
      } else {
        dst[r * 16 + j] = d * static_cast<float>(static_cast<int8_t>(q[r * 16 + j]));
      }
    }
  }
#endif
}

}  // namespace
