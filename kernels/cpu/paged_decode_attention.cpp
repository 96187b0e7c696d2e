// Paged decode attention for CPU workers: one query token per sequence, keys and values
// read in place from the paged KV cache (no gather copy), grouped-query heads.
//
// Work items are sequences (or single KV heads of them when sequences are too few), claimed
// by torch's intra-op threads as they go (claimed_parallel.h). Each item scores its query
// heads against every cached position (float32 dot products), takes a max-subtracted softmax and
// accumulates the values. With AVX2 and float32 keys whose head_dim is a multiple of 8, a
// position's scores for up to 8 heads come from 8 independent multiply-add chains and one
// transposing sum (a chain and a horizontal sum per head were the kernel's per-thread
// bound), and the softmax takes 8 scores at a time with a polynomial exp (within 2 ulp of
// expf) for any cache dtype.
// Only positions below the sequence length are read, so nothing needs masking; the rows
// a few positions ahead are prefetched. A sliding window W > 0 (0: none) reads only the
// last W positions [len - W, len): the query (at len - 1) and the W - 1 before it. A score
// soft-cap c > 0 (Gemma 2; 0: none) turns every score s into c * tanh(s / c) before the
// softmax, as Hugging Face's eager attention does. Attention sinks (gpt-oss; an optional
// float32 [heads] of logits) join each head's softmax as one more score with no value: the
// maximum subtracted covers the sink, and exp(sink - max) is added to the denominator.
//
// Caches are the strided per-layer views [num_blocks, block_size, kv_heads, head_dim] of
// the block-major pool (last dimension contiguous); float32, bfloat16 or float8 (e4m3fn).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "claimed_parallel.h"
#include "vec_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// fp8 (e4m3fn) caches: a 256-entry table (the conversion's bit twiddling costs more than
// the load it replaces). Scales are applied by the caller (query and output pre-scaled).
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      value[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i),
                                                       c10::Float8_e4m3fn::from_bits()));
    }
  }
};
const Fp8Table kFp8;

template <>
inline float to_float<c10::Float8_e4m3fn>(c10::Float8_e4m3fn x) { return kFp8.value[x.x]; }

// A cached position's keys (or values) of one item are a short contiguous run inside a
// 4 KiB page of a scattered block: the hardware prefetcher restarts at every block and
// page, so the loops ask for the run a few positions ahead themselves (8 layers, 16
// sequences of 192 positions, fp32: 7.7 -> 5.5-6.5 ms on one thread, 2.6-3.4 -> 2.1 ms on
// two; 2 positions ahead was as good as 4 or 8).
constexpr int64_t kPrefetchAhead = 2;

inline void prefetch_row(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x for x <= 0 (a score minus its row's maximum), 8 lanes (vec_exp.h); below -87.3
// (where expf leaves the normal range) the lane gives e^-87.3 ~ 1e-38 instead of a
// denormal or 0: a weight that small vanishes in the sum next to the maximum's 1.
inline __m256 exp_nonpositive(__m256 x) {
  return tandem_cpu::exp_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)));
}

// The eight sums of eight vectors' lanes, as one vector (lane j: the sum of v[j]).
inline __m256 lane_sums(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Float32 keys, head_dim a multiple of 8: the scores of C query heads [h, h + C) (C <= 8)
// against one position's keys at once, C independent multiply-add chains and one
// transposing sum instead of a chain and a horizontal sum per head. `q`: the item's scaled
// queries [heads][head_dim]; `k_pos`: the position's first key of the item; out[j] = score
// of head h + j. C is a template argument so the accumulators stay in registers.
template <int C>
inline void score_heads(const float* q, const float* k_pos, int64_t h, int64_t group,
                        int64_t k_head, int64_t head_dim, float* out) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      const __m256 k = _mm256_loadu_ps(k_pos + ((h + j) / group) * k_head + d);
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (h + j) * head_dim + d), k, acc[j]);
    }
  }
  _mm256_storeu_ps(out, lane_sums(acc));
}
#endif

// Scores -> exp(score - max) in place; returns their sum plus exp(sink - max) (the softmax's
// denominator), where the maximum also covers `sink` (-inf: no sink, adding 0).
inline float softmax_numerators(float* sc, int64_t len, float sink) {
  int64_t pos = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  if (len >= 8) {
    __m256 high = _mm256_loadu_ps(sc);
    for (pos = 8; pos + 8 <= len; pos += 8) high = _mm256_max_ps(high, _mm256_loadu_ps(sc + pos));
    float lanes[8];
    _mm256_storeu_ps(lanes, high);
    float top = std::max(*std::max_element(lanes, lanes + 8), sink);
    for (; pos < len; ++pos) top = std::max(top, sc[pos]);
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (pos = 0; pos + 8 <= len; pos += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + pos), vtop));
      _mm256_storeu_ps(sc + pos, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
    for (int j = 0; j < 8; ++j) sum += lanes[j];
    if (pos < len) {  // the last len % 8 scores, through the same approximation
      float tail[8] = {};
      const int64_t count = len - pos;
      for (int64_t j = 0; j < count; ++j) tail[j] = sc[pos + j] - top;
      _mm256_storeu_ps(tail, exp_nonpositive(_mm256_loadu_ps(tail)));
      for (int64_t j = 0; j < count; ++j) {
        sc[pos + j] = tail[j];
        sum += tail[j];
      }
    }
    return sum + std::exp(sink - top);
  }
#endif
  const float top = std::max(*std::max_element(sc, sc + len), sink);
  for (; pos < len; ++pos) {
    sc[pos] = std::exp(sc[pos] - top);
    sum += sc[pos];
  }
  return sum + std::exp(sink - top);
}

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                   const float* sinks) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv = k_cache.size(2);
  const int64_t group = num_heads / num_kv;
  const int64_t k_block = k_cache.stride(0), k_slot = k_cache.stride(1), k_head = k_cache.stride(2);
  const int64_t v_block = v_cache.stride(0), v_slot = v_cache.stride(1), v_head = v_cache.stride(2);
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const T* k_base = k_cache.data_ptr<T>();
  const T* v_base = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  // A work item is one sequence's KV heads [h0, h0 + span): whole sequences (each position's
  // keys of every head are one contiguous run) unless there are too few to keep every
  // thread busy, then single KV heads.
  const int64_t threads = at::get_num_threads();
  const int64_t span = num_seqs >= 2 * threads ? num_kv : 1;
  const int64_t splits = num_kv / span;
  // Bytes from an item's first key (or value) of a position to the end of its last.
  const int64_t row_bytes =
      ((span - 1) * std::max(k_head, v_head) + head_dim) * static_cast<int64_t>(sizeof(T));

  // Items are claimed one at a time (claimed_parallel.h): a preempted thread holds up the
  // others by at most the item it is in.
  tandem_cpu::claimed_parallel_for(num_seqs * splits, 1, [&](int64_t begin, int64_t end) {
    const int64_t heads = span * group;  // query heads of one item
    std::vector<float> q(heads * head_dim), acc(heads * head_dim), total(heads), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits, h0 = (item % splits) * span;
      const int64_t first = window > 0 ? std::max<int64_t>(lens[seq] - window, 0) : 0;
      const int64_t len = lens[seq] - first;  // positions read: [first, lens[seq])
      const int64_t* table = tables + seq * table_stride;
      // The item's first key/value of the `pos`-th position read, in a cache with these
      // strides.
      auto at = [&](const T* base, int64_t block, int64_t slot, int64_t head, int64_t pos) {
        pos += first;
        return base + table[pos / block_size] * block + (pos % block_size) * slot + h0 * head;
      };
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = q_base + seq * q_seq + (h0 * group + h) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) q[h * head_dim + d] = src[d] * fscale;
      }
      scores.resize(heads * len);
      for (int64_t pos = 0; pos < len; ++pos) {
        const T* k_pos = at(k_base, k_block, k_slot, k_head, pos);
        if (pos + kPrefetchAhead < len) {
          prefetch_row(at(k_base, k_block, k_slot, k_head, pos + kPrefetchAhead), row_bytes);
        }
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<T, float>) {
          if (head_dim % 8 == 0) {
            float lane[8];
            for (int64_t h = 0; h < heads;) {
              const int64_t left = heads - h;
              const int64_t count = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
              switch (count) {
                case 8: score_heads<8>(q.data(), k_pos, h, group, k_head, head_dim, lane); break;
                case 4: score_heads<4>(q.data(), k_pos, h, group, k_head, head_dim, lane); break;
                case 2: score_heads<2>(q.data(), k_pos, h, group, k_head, head_dim, lane); break;
                default: score_heads<1>(q.data(), k_pos, h, group, k_head, head_dim, lane);
              }
              for (int64_t j = 0; j < count; ++j) scores[(h + j) * len + pos] = lane[j];
              h += count;
            }
            continue;
          }
        }
#endif
        for (int64_t h = 0; h < heads; ++h) {
          const T* k = k_pos + (h / group) * k_head;
          const float* qh = q.data() + h * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(k[d]);
          scores[h * len + pos] = dot;
        }
      }
      if (cap > 0.0f) {
        for (int64_t i = 0; i < heads * len; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float sink = sinks != nullptr ? sinks[h0 * group + h] : -INFINITY;
        total[h] = softmax_numerators(scores.data() + h * len, len, sink);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const T* v_pos = at(v_base, v_block, v_slot, v_head, pos);
        if (pos + kPrefetchAhead < len) {
          prefetch_row(at(v_base, v_block, v_slot, v_head, pos + kPrefetchAhead), row_bytes);
        }
        for (int64_t h = 0; h < heads; ++h) {
          const T* v = v_pos + (h / group) * v_head;
          const float w = scores[h * len + pos];
          float* a = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * to_float(v[d]);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* dst = o_base + seq * o_seq + (h0 * group + h) * o_head;
        const float inv = 1.0f / total[h];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[h * head_dim + d] * inv;
      }
    }
  });
}

// out: float32 [n, heads, head_dim] (written); query: float32 [n, heads, head_dim];
// caches: [num_blocks, block_size, kv_heads, head_dim] float32, bfloat16 or float8_e4m3fn;
// block_tables: int64 [n, max_blocks]; seq_lens: int64 [n] (>= 1); window: the sliding
// window (0: full attention); softcap: the scores' tanh cap (0: none); sinks: float32
// [heads], each head's sink logit (None: none).
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [n, H, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "query and out must be float32");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out head_dim must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be 4-d, equal");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache head_dim must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim mismatch");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == query.size(0),
              "block_tables must be [n, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) == query.size(0),
              "seq_lens must be [n]");
  const float* sink_logits = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->is_contiguous() && sinks->size(0) == query.size(1),
                "sinks must be a contiguous float32 [heads]");
    sink_logits = sinks->data_ptr<float>();
  }
  if (k_cache.scalar_type() == at::kFloat) {
    decode_kernel<float>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                         softcap, sink_logits);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, scale,
                                window, softcap, sink_logits);
  } else if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    decode_kernel<c10::Float8_e4m3fn>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                      scale, window, softcap, sink_logits);
  } else {
    TORCH_CHECK(false, "caches must be float32, bfloat16 or float8_e4m3fn");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0, "
        "float softcap=0.0, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
