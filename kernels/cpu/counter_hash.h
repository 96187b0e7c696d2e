// The sampler's counter-based uniforms (services/worker/seeded_noise.py `uniform`): for a
// row's stream (offset a, odd multiplier m) and token id v,
// u = ((mix32((a + m * v) mod 2^32) >> 8) | 1) * 2^-24 as float32, mix32 being
// hash-prospector's 32-bit avalanche hash [16 21f0aaad 15 735a2d97 15] (`mix32_`). Shared
// by the kernels that draw them (seeded_uniform.cpp, gumbel_race.cpp), so both draw alike.
// The 8-lane version gives the same bits lane by lane (integer math, an exact conversion).

#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem_cpu {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

inline float counter_uniform(uint32_t a, uint32_t m, uint32_t v) {
  return static_cast<float>((mix32(a + m * v) >> 8) | 1u) * 0x1p-24f;
}

#if defined(__AVX2__)
// counter_uniform for the 8 token ids in `v`, with a and m broadcast.
inline __m256 counter_uniform8(__m256i a, __m256i m, __m256i v) {
  __m256i x = _mm256_add_epi32(a, _mm256_mullo_epi32(m, v));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x21F0AAAD));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x735A2D97));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  const __m256i bits = _mm256_or_si256(_mm256_srli_epi32(x, 8), _mm256_set1_epi32(1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(0x1p-24f));
}
#endif

}  // namespace tandem_cpu
