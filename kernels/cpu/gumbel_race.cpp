// The sampler's exponential race over a whole vocabulary in one pass (services/worker/
// sampler.py `_draw_dense`, rows with a temperature and no top-k / top-p / min-p): per row r,
// argmax over v of logits[r, v] / T[r] + g(r, v), g = -log(-log u) with u the counter-based
// uniform (counter_hash.h, as `seeded_uniform.cpp` draws it). The torch path makes six
// passes over [R, V] (uniforms, two logs, a negation, the division, the add) and an argmax,
// each an OpenMP region; here each row is one pass, rows claimed by torch's threads as they
// go (claimed_parallel.h).
//
// The logs are a Cephes-style float32 polynomial (within ~1 ulp of logf), 8 lanes at a time
// with AVX2, so g may differ from torch's in the last bit: the same seed picks the same
// token as the torch path except where two candidates' scores tie to within that rounding.
// Ties go to the lowest token id, as torch's argmax.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "claimed_parallel.h"
#include "counter_hash.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kSqrtHalf = 0.707106781186547524f;
constexpr float kLogP[9] = {7.0376836292e-2f,  -1.1514610310e-1f, 1.1676998740e-1f,
                            -1.2420140846e-1f, 1.4249322787e-1f,  -1.6668057665e-1f,
                            2.0000714765e-1f,  -2.4999993993e-1f, 3.3333331174e-1f};

// log(x) for a positive normal float, the same polynomial as the vector version.
inline float log_positive(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 126);
  bits = (bits & 0x007FFFFFu) | 0x3F000000u;  // mantissa in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, 4);
  if (m < kSqrtHalf) {
    m = m + m;
    e -= 1.0f;
  }
  const float f = m - 1.0f, z = f * f;
  float y = kLogP[0];
  for (int i = 1; i < 9; ++i) y = y * f + kLogP[i];
  y = y * f * z;
  y += e * kLn2Lo;
  y -= 0.5f * z;
  return f + y + e * kLn2Hi;
}

inline float gumbel_of(uint32_t a, uint32_t m, uint32_t v) {
  return -log_positive(-log_positive(tandem_cpu::counter_uniform(a, m, v)));
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 log_positive8(__m256 x) {
  __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(
      _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  bits = _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                         _mm256_set1_epi32(0x3F000000));
  __m256 m = _mm256_castsi256_ps(bits);
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(kSqrtHalf), _CMP_LT_OQ);
  m = _mm256_blendv_ps(m, _mm256_add_ps(m, m), small);
  e = _mm256_sub_ps(e, _mm256_and_ps(small, _mm256_set1_ps(1.0f)));
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 y = _mm256_set1_ps(kLogP[0]);
  for (int i = 1; i < 9; ++i) y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kLogP[i]));
  y = _mm256_mul_ps(_mm256_mul_ps(y, f), z);
  y = _mm256_add_ps(y, _mm256_mul_ps(e, _mm256_set1_ps(kLn2Lo)));
  y = _mm256_sub_ps(y, _mm256_mul_ps(_mm256_set1_ps(0.5f), z));
  return _mm256_add_ps(_mm256_add_ps(f, y), _mm256_mul_ps(e, _mm256_set1_ps(kLn2Hi)));
}

#endif

// One row: the first v with the largest logits[v] / t + g(v).
int64_t race_row(const float* logits, int64_t vocab, float t, uint32_t a, uint32_t m) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t pick = 0;
  int64_t v = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (vocab >= 8) {
    __m256 lane_best = _mm256_set1_ps(best);
    __m256i lane_pick = _mm256_setzero_si256();
    __m256i ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i eight = _mm256_set1_epi32(8);
    const __m256i va = _mm256_set1_epi32(static_cast<int32_t>(a));
    const __m256i vm = _mm256_set1_epi32(static_cast<int32_t>(m));
    const __m256 vt = _mm256_set1_ps(t);
    for (; v + 8 <= vocab; v += 8) {
      const __m256 u = tandem_cpu::counter_uniform8(va, vm, ids);
      const __m256 zero = _mm256_setzero_ps();
      const __m256 g = _mm256_sub_ps(zero, log_positive8(_mm256_sub_ps(zero, log_positive8(u))));
      const __m256 score = _mm256_add_ps(g, _mm256_div_ps(_mm256_loadu_ps(logits + v), vt));
      const __m256 better = _mm256_cmp_ps(score, lane_best, _CMP_GT_OQ);
      lane_best = _mm256_blendv_ps(lane_best, score, better);
      lane_pick = _mm256_blendv_epi8(lane_pick, ids, _mm256_castps_si256(better));
      ids = _mm256_add_epi32(ids, eight);
    }
    float values[8];
    int32_t picks[8];
    _mm256_storeu_ps(values, lane_best);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(picks), lane_pick);
    for (int j = 0; j < 8; ++j) {
      if (values[j] > best || (values[j] == best && picks[j] < pick)) {
        best = values[j];
        pick = picks[j];
      }
    }
  }
#endif
  for (; v < vocab; ++v) {
    const float score = gumbel_of(a, m, static_cast<uint32_t>(v)) + logits[v] / t;
    if (score > best) {
      best = score;
      pick = v;
    }
  }
  return pick;
}

// logits: float32 [R, V]; temperature: float32 [R] (> 0); streams: int64 [R, 2] (offset,
// odd multiplier), as seeded_noise.row_streams gives. Returns int64 [R] token ids.
at::Tensor gumbel_race(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& streams) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logits must be float32 [R, V]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab < (int64_t{1} << 31), "vocabulary too large");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows &&
                  temperature.scalar_type() == at::kFloat,
              "temperature must be float32 [R]");
  TORCH_CHECK(streams.dim() == 2 && streams.size(0) == rows && streams.size(1) == 2 &&
                  streams.scalar_type() == at::kLong,
              "streams must be int64 [R, 2]");
  const at::Tensor x = logits.contiguous(), t = temperature.contiguous(), s = streams.contiguous();
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const int64_t* sp = s.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  tandem_cpu::claimed_parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      op[r] = race_row(xp + r * vocab, vocab, tp[r], static_cast<uint32_t>(sp[2 * r]),
                       static_cast<uint32_t>(sp[2 * r + 1]));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("gumbel_race(Tensor logits, Tensor temperature, Tensor streams) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("gumbel_race", &gumbel_race);
}
