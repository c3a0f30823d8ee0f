// Paged attention on CPU that reads each sequence's K/V where they lie in the block cache,
// and the write of each new token's K/V into it.
//
// The torch reference gathers a sequence's blocks into a contiguous copy for every layer
// and step before attending; at decode that copy costs more than the attention itself.
// Here one work item is (sequence, KV head, tile of queries): the query heads that share
// the KV head and the tile's tokens are scored against each key row straight from its
// block, block by block, with an online softmax (a running max and sum per row), and the
// value rows of the same block are accumulated at once. The query heads of one token are
// scored and accumulated together (up to four), so each key and value row is loaded and
// widened once for all of them: 1.2x decode attention at the default model's 3 heads per
// KV head (benchmarks/RESULTS.md, "Session 27"). A sequence with many queries (a
// prompt or a chunk of one) runs its tiles through `attend_tile_wide` (attention_wide.h)
// instead, one query per vector lane. Items run in parallel on torch's intra-op threads.
//
// Contract (serve/kernels/reference.py `paged_attention` is the oracle): query
// [num_tokens, num_heads, head_dim] with unit stride along head_dim; caches
// [num_blocks, block_size, num_kv_heads, head_dim], any strides, unit along head_dim;
// block_tables [num_seqs, max_blocks] int64; seq_lens and query_start_loc int64 on the
// CPU. Options as the reference scores them: soft-cap, then ALiBi, then the window; a
// head's attention sink (GPT-OSS) joins each row's softmax once, after its last key.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_wide.h"
#include "ops.h"
#include "vec.h"

namespace serve_cpu {
namespace {

// Query tokens per work item: a tile's rows share every key row read from the cache.
constexpr int64_t kQueryTile = kWideLanes;
// Sequences with at least this many queries take the wide tiles (where head_dim is a
// multiple of 16); fewer fill too few of a wide tile's lanes to pay for them.
constexpr int64_t kWideMinQueries = 8;
// The largest block size served (block tables hold at most this many slots per block).
constexpr int64_t kMaxBlockSize = 256;
// Blocks are scattered in memory, so the hardware's stream prefetchers do not see the
// next one coming: it is requested this many blocks ahead (1 to 4 measure within 3% of
// each other on 2 cores; 2 was the best).
constexpr int64_t kPrefetchBlocks = 2;
// The most query heads of one KV head attended together (`score_keys_heads`).
constexpr int kMaxGroup = 4;

// 16 elements of a cache row as floats: float32 rows as they are, narrower ones widened in
// the register (vec.h), so a narrow cache is read at its own bytes with no copy.
inline float16v load_row16(const float* p) { return load16(p); }
inline float16v load_row16(const at::BFloat16* p) {
  return load16_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline float16v load_row16(const at::Half* p) {
  return load16_f16(reinterpret_cast<const uint16_t*>(p));
}
inline float16v load_row16(const at::Float8_e5m2* p) {
  return load16_e5m2(reinterpret_cast<const uint8_t*>(p));
}
inline float16v load_row16(const at::Float8_e4m3fn* p) {
  return load16_e4m3fn(reinterpret_cast<const uint8_t*>(p));
}

// kLanes elements of a row the kernels read in place (`row_type`: float32 or bfloat16) as
// the target's own register. The loops below carry their sums and accumulators in floatv:
// float16v values there spill through memory on AVX2 (vec.h), 5-9x slower.
inline floatv load_rowv(const float* p) { return loadv(p); }
inline floatv load_rowv(const at::BFloat16* p) {
  return loadv_bf16(reinterpret_cast<const uint16_t*>(p));
}

// s[0:16] = q . k[i] for a group of m <= 16 keys (lanes past m: 0), head_dim = 16 * SL,
// which is V = 16 * SL / kLanes vectors of the target's width. The query stays in
// registers; each key's products stay a vector (two chains, so one key's adds do not wait
// on each other) until transposing reductions sum kLanes keys at once (all 16 in one with
// AVX-512): a horizontal sum per key costs more than the key's products.
template <int SL, typename row_t>
inline void score_keys(const float* q, const row_t* const* k, int64_t m, float* s) {
  constexpr int V = 16 * SL / kLanes;
  floatv qv[V];
  for (int j = 0; j < V; ++j) qv[j] = loadv(q + kLanes * j);
  floatv part[16];
  for (int64_t i = 0; i < m; ++i) {
    floatv even = qv[0] * load_rowv(k[i]);
    floatv odd = {};
    for (int j = 1; j < V; j += 2) {
      odd += qv[j] * load_rowv(k[i] + kLanes * j);
      if (j + 1 < V) even += qv[j + 1] * load_rowv(k[i] + kLanes * (j + 1));
    }
    part[i] = even + odd;
  }
  for (int64_t i = m; i < 16; ++i) part[i] = floatv{};
  for (int i = 0; i < 16; i += kLanes) storev(s + i, transpose_sumv(part + i));
}

// The same for any head_dim: a dot product per key.
template <typename row_t>
inline void score_keys_any(const float* q, const row_t* const* k, int64_t m, int64_t head_dim,
                           float* s) {
  for (int64_t i = 0; i < m; ++i) {
    floatv acc = {};
    int64_t d = 0;
    for (; d + kLanes <= head_dim; d += kLanes) acc += loadv(q + d) * load_rowv(k[i] + d);
    float tail = 0.0f;
    for (; d < head_dim; ++d) tail += q[d] * static_cast<float>(k[i][d]);
    s[i] = horizontal_sum(acc) + tail;
  }
  for (int64_t i = m; i < 16; ++i) s[i] = 0.0f;
}

// The query heads that share a KV head, scored and accumulated together: each key and
// value row is loaded (and widened) once for all of them, where one head at a time loads
// it once per head. Each head's products and sums run in the same order as above, so the
// results are the same to the bit. R heads at most (R * SL query vectors in registers).
template <int SL>
constexpr int kFusedHeads = SL <= 4 ? kMaxGroup : 16 / SL;

// s[r][0:16] = q[r] . k[i] for r < g <= R.
template <int SL, int R, typename row_t>
inline void score_keys_heads(const float* const* q, int64_t g, const row_t* const* k, int64_t m,
                             float* const* s) {
  constexpr int V = 16 * SL / kLanes;
  floatv qv[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) qv[r][j] = r < g ? loadv(q[r] + kLanes * j) : floatv{};
  floatv part[R][16];
  for (int64_t i = 0; i < m; ++i) {
    floatv kv[V];
    for (int j = 0; j < V; ++j) kv[j] = load_rowv(k[i] + kLanes * j);
    for (int r = 0; r < R; ++r) {
      if (r >= g) break;
      floatv even = qv[r][0] * kv[0];
      floatv odd = {};
      for (int j = 1; j < V; j += 2) {
        odd += qv[r][j] * kv[j];
        if (j + 1 < V) even += qv[r][j + 1] * kv[j + 1];
      }
      part[r][i] = even + odd;
    }
  }
  for (int r = 0; r < g; ++r) {
    for (int64_t i = m; i < 16; ++i) part[r][i] = floatv{};
    for (int i = 0; i < 16; i += kLanes) storev(s[r] + i, transpose_sumv(part[r] + i));
  }
}

// acc[r][d0 : d0 + kLanes * S] += sum_i p[r][i] * v[i][d0 : d0 + kLanes * S] for r < g <=
// R, the slices in registers across the keys: S * g independent chains of adds.
template <int S, int R, typename row_t>
inline void accumulate_slices_heads(float* const* acc, int64_t g, const row_t* const* v,
                                    const float* const* p, int64_t n, int64_t d0) {
  floatv slice[R][S];
  for (int r = 0; r < g; ++r)
    for (int j = 0; j < S; ++j) slice[r][j] = loadv(acc[r] + d0 + kLanes * j);
  for (int64_t i = 0; i < n; ++i) {
    floatv vv[S];
    for (int j = 0; j < S; ++j) vv[j] = load_rowv(v[i] + d0 + kLanes * j);
    for (int r = 0; r < R; ++r) {
      if (r >= g) break;
      const float w = p[r][i];
      for (int j = 0; j < S; ++j) slice[r][j] += w * vv[j];
    }
  }
  for (int r = 0; r < g; ++r)
    for (int j = 0; j < S; ++j) storev(acc[r] + d0 + kLanes * j, slice[r][j]);
}

// Slices of 4 vectors (64 floats with AVX-512, 32 with AVX2: three heads' 12 accumulators
// and 4 value vectors fill AVX2's 16 registers).
template <int R, typename row_t>
inline void accumulate_values_heads(float* const* acc, int64_t g, const row_t* const* v,
                                    const float* const* p, int64_t n, int64_t head_dim) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= head_dim; d += 4 * kLanes)
    accumulate_slices_heads<4, R>(acc, g, v, p, n, d);
  switch ((head_dim - d) / kLanes) {
    case 3: accumulate_slices_heads<3, R>(acc, g, v, p, n, d); break;
    case 2: accumulate_slices_heads<2, R>(acc, g, v, p, n, d); break;
    case 1: accumulate_slices_heads<1, R>(acc, g, v, p, n, d); break;
    default: break;
  }
  for (d += (head_dim - d) / kLanes * kLanes; d < head_dim; ++d) {
    for (int r = 0; r < g; ++r)
      for (int64_t i = 0; i < n; ++i) acc[r][d] += p[r][i] * static_cast<float>(v[i][d]);
  }
}

// How the decode tile reads a cache row: float32 and bfloat16 rows where they lie
// (`load_rowv` widens bfloat16 with one shift as it loads); float16 and fp8 rows, whose
// widening takes ~10 vector ops, converted once into a float32 copy that every query row
// of the tile then reads (widening in place, once per query row, measured 1.5-2x slower);
// float64 (tests only) likewise.
template <typename cache_t>
using row_type = std::conditional_t<
    std::is_same_v<cache_t, float> || std::is_same_v<cache_t, at::BFloat16>, cache_t, float>;

template <typename cache_t>
inline const row_type<cache_t>* as_row(const cache_t* row, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<row_type<cache_t>, cache_t>) {
    return row;
  } else {
    int64_t i = 0;
    if constexpr (!std::is_same_v<cache_t, double>) {
      for (; i + 16 <= n; i += 16) store16(scratch + i, load_row16(row + i));
    }
    for (; i < n; ++i) scratch[i] = static_cast<float>(row[i]);
    return scratch;
  }
}

struct Options {
  float scale;
  const float* alibi_slopes;  // [num_heads] or null
  int64_t window;             // keys with query_pos - key_pos >= window are masked; 0: none
  float softcap;              // 0: none
  const float* sinks;         // [num_heads] sink logits or null: folded in by output_scale
};

struct CacheView {
  int64_t block_size, stride_block, stride_slot, stride_head;
};

// Pull a block's rows for one KV head towards the cache before they are read.
inline void prefetch_rows(const void* first_row, int64_t rows, int64_t row_stride_bytes,
                          int64_t row_bytes) {
  const char* p = static_cast<const char*>(first_row);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + r * row_stride_bytes + b);
  }
}

// scalar_t: the query's and the output's dtype; cache_t: the KV cache's (the same, or a
// narrower one under --kv-cache-dtype). Scores and sums are float32 either way.
template <typename scalar_t, typename cache_t>
void attend_tile(
    const scalar_t* query, int64_t q_stride_token, int64_t q_stride_head,
    const cache_t* key_cache, const cache_t* value_cache, const CacheView& cache,
    const int64_t* block_table, int64_t kv_head, int64_t heads_per_kv, int64_t head_dim,
    int64_t first_query_pos, int64_t tile_tokens, int64_t first_token, const Options& opt,
    scalar_t* out, int64_t out_stride_token, int64_t out_stride_head) {
  const int64_t rows = tile_tokens * heads_per_kv;  // row = token * heads_per_kv + j
  const int64_t last_query_pos = first_query_pos + tile_tokens - 1;
  const int64_t first_key =
      opt.window > 0 ? std::max<int64_t>(0, first_query_pos - opt.window + 1) : 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t block_size = cache.block_size;
  // Rows scored together: as many heads as keep their query vectors in registers, by the
  // head sizes `score_keys_heads` is dispatched for below; one at a time for the rest.
  const int64_t group = head_dim == 32    ? kFusedHeads<2>
                        : head_dim == 64  ? kFusedHeads<4>
                        : head_dim == 80  ? kFusedHeads<5>
                        : head_dim == 96  ? kFusedHeads<6>
                        : head_dim == 128 ? kFusedHeads<8>
                                          : 1;

  // Per-thread scratch, reused item after item.
  thread_local std::vector<float> q, acc, row_max, row_sum, scores, k_rows, v_rows;
  q.resize(rows * head_dim);
  acc.assign(rows * head_dim, 0.0f);
  row_max.assign(rows, neg_inf);
  row_sum.assign(rows, 0.0f);
  const int64_t padded = (block_size + 15) / 16 * 16;
  scores.resize(kMaxGroup * padded);
  k_rows.resize(block_size * head_dim);
  v_rows.resize(block_size * head_dim);
  for (int64_t t = 0; t < tile_tokens; ++t) {
    for (int64_t j = 0; j < heads_per_kv; ++j) {
      const int64_t head = kv_head * heads_per_kv + j;
      const scalar_t* src = query + (first_token + t) * q_stride_token + head * q_stride_head;
      float* dst = q.data() + (t * heads_per_kv + j) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * opt.scale;
    }
  }

  // One pass over the context, block by block, with the softmax kept online (a running
  // max and sum per row; the accumulator rescaled when the max grows), so each block's K
  // and V rows are read from memory once and reused by every row of the tile from L1.
  const int64_t last_block = last_query_pos / block_size;
  const int64_t slot_bytes = cache.stride_slot * static_cast<int64_t>(sizeof(cache_t));
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
  const auto prefetch_block = [&](int64_t blk) {
    const int64_t at = block_table[blk] * cache.stride_block + kv_head * cache.stride_head;
    prefetch_rows(key_cache + at, block_size, slot_bytes, row_bytes);
    prefetch_rows(value_cache + at, block_size, slot_bytes, row_bytes);
  };
  const int64_t first_block = first_key / block_size;
  for (int64_t blk = first_block; blk < std::min(first_block + kPrefetchBlocks, last_block + 1); ++blk)
    prefetch_block(blk);
  for (int64_t blk = first_block; blk <= last_block; ++blk) {
    const int64_t base = block_table[blk] * cache.stride_block + kv_head * cache.stride_head;
    if (blk + kPrefetchBlocks <= last_block) prefetch_block(blk + kPrefetchBlocks);
    const int64_t key_begin = std::max(first_key, blk * block_size);
    const int64_t key_end = std::min(last_query_pos + 1, (blk + 1) * block_size);
    const int64_t n = key_end - key_begin;
    const int64_t slot0 = key_begin - blk * block_size;
    const row_type<cache_t>* k[kMaxBlockSize];
    const row_type<cache_t>* v[kMaxBlockSize];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = base + (slot0 + i) * cache.stride_slot;
      k[i] = as_row(key_cache + at, k_rows.data() + i * head_dim, head_dim);
      v[i] = as_row(value_cache + at, v_rows.data() + i * head_dim, head_dim);
    }
    // Rows in groups of the heads of one query token (they share its position), scored
    // and accumulated together, each key and value row loaded once for the group.
    for (int64_t row0 = 0, g; row0 < rows; row0 += g) {
      const int64_t token_end = (row0 / heads_per_kv + 1) * heads_per_kv;
      g = std::min<int64_t>(group, token_end - row0);
      const int64_t query_pos = first_query_pos + row0 / heads_per_kv;
      const float* qs[kMaxGroup];
      float* ss[kMaxGroup];
      float* as[kMaxGroup];
      for (int64_t r = 0; r < g; ++r) {
        qs[r] = q.data() + (row0 + r) * head_dim;
        ss[r] = scores.data() + r * padded;
        as[r] = acc.data() + (row0 + r) * head_dim;
      }
      for (int64_t gk = 0; gk < n; gk += 16) {  // keys in groups of 16, a vector of scores each
        const int64_t m = std::min<int64_t>(16, n - gk);
        float* sg[kMaxGroup];
        for (int r = 0; r < g; ++r) sg[r] = ss[r] + gk;
        switch (head_dim) {
          case 64: score_keys_heads<4, kFusedHeads<4>>(qs, g, k + gk, m, sg); break;
          case 128: score_keys_heads<8, kFusedHeads<8>>(qs, g, k + gk, m, sg); break;
          case 32: score_keys_heads<2, kFusedHeads<2>>(qs, g, k + gk, m, sg); break;
          case 80: score_keys_heads<5, kFusedHeads<5>>(qs, g, k + gk, m, sg); break;
          case 96: score_keys_heads<6, kFusedHeads<6>>(qs, g, k + gk, m, sg); break;
          case 256: score_keys<16>(qs[0], k + gk, m, sg[0]); break;
          default: score_keys_any(qs[0], k + gk, m, head_dim, sg[0]); break;
        }
      }
      for (int r = 0; r < g; ++r) {
        const int64_t row = row0 + r;
        const int64_t head = kv_head * heads_per_kv + row % heads_per_kv;
        float block_max = neg_inf;
        for (int64_t gk = 0; gk < n; gk += 16) {
          const int64_t m = std::min<int64_t>(16, n - gk);
          float* s = ss[r] + gk;
          const int64_t first = key_begin + gk;
          const bool plain = m == 16 && first + 15 <= query_pos &&
                             (opt.window == 0 || query_pos - first < opt.window) &&
                             opt.softcap == 0.0f && opt.alibi_slopes == nullptr;
          if (!plain) {  // lanes past the block, masked keys (-inf: exp gives 0), the options
            for (int64_t i = 0; i < 16; ++i) {
              const int64_t key = first + i;
              if (i >= m || key > query_pos || (opt.window > 0 && query_pos - key >= opt.window)) {
                s[i] = neg_inf;
                continue;
              }
              if (opt.softcap > 0.0f) s[i] = opt.softcap * std::tanh(s[i] / opt.softcap);
              if (opt.alibi_slopes != nullptr)
                s[i] += opt.alibi_slopes[head] * static_cast<float>(key - query_pos);
            }
          }
          floatv group_max = loadv(s);
          for (int i = kLanes; i < 16; i += kLanes) {
            const floatv x = loadv(s + i);
            group_max = group_max > x ? group_max : x;
          }
          block_max = std::max(block_max, horizontal_max(group_max));
        }
        if (block_max == neg_inf) {  // every key of this block is masked for the row: it
          std::fill(ss[r], ss[r] + padded, 0.0f);  // adds nothing (its values weigh 0)
          continue;
        }
        float* a = as[r];
        const float new_max = std::max(row_max[row], block_max);
        if (new_max > row_max[row]) {
          const float correction = std::exp(row_max[row] - new_max);  // 0 for the first block
          row_sum[row] *= correction;
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
          row_max[row] = new_max;
        }
        floatv sum = {};
        for (int64_t i = 0; i < n; i += kLanes) {
          const floatv e = exp_nonpositive(loadv(ss[r] + i) - new_max);
          storev(ss[r] + i, e);
          sum += e;
        }
        row_sum[row] += horizontal_sum(sum);
      }
      accumulate_values_heads<kMaxGroup>(as, g, v, ss, n, head_dim);
    }
  }

  for (int64_t t = 0; t < tile_tokens; ++t) {
    for (int64_t j = 0; j < heads_per_kv; ++j) {
      const int64_t row = t * heads_per_kv + j, head = kv_head * heads_per_kv + j;
      const float inv = output_scale(row_max[row], row_sum[row], opt.sinks, head);
      scalar_t* dst = out + (first_token + t) * out_stride_token + head * out_stride_head;
      const float* src = acc.data() + row * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv);
    }
  }
}

// The caches' dtype under K/V (or queries) of `dtype`: the same, a 16-bit one under float32
// (--kv-cache-dtype bfloat16 / float16), or fp8 under any but float64 (--kv-cache-dtype
// fp8*); serve/kernels/cache_dtypes.py `cache_fits` is the same rule in Python.
bool narrower_cache_fits(at::ScalarType dtype, at::ScalarType cache) {
  if (cache == dtype) return true;
  if (cache == at::kFloat8_e4m3fn || cache == at::kFloat8_e5m2) return dtype != at::kDouble;
  return dtype == at::kFloat && (cache == at::kBFloat16 || cache == at::kHalf);
}

void paged_attention(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    double scale, const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
    double logit_softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, H, D], caches [N, B, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "head_dim must be the innermost, unit-stride dimension");
  TORCH_CHECK(key_cache.strides() == value_cache.strides(), "K and V caches share one layout");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "K and V caches share a dtype");
  TORCH_CHECK(narrower_cache_fits(query.scalar_type(), key_cache.scalar_type()),
              "the cache's dtype must be the query's, bfloat16 or float16 under a float32 query, "
              "or fp8 (e4m3fn, e5m2)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables: contiguous int64");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(key_cache.size(1) <= kMaxBlockSize, "block size above ", kMaxBlockSize);
  const int64_t heads_per_kv = num_heads / num_kv_heads;
  at::Tensor slopes;
  if (alibi_slopes.has_value()) {
    slopes = alibi_slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(slopes.numel() == num_heads, "one ALiBi slope per query head");
  }
  at::Tensor sink_logits;
  if (sinks.has_value()) {
    sink_logits = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_logits.numel() == num_heads, "one attention sink per query head");
  }
  const Options opt{static_cast<float>(scale), slopes.defined() ? slopes.data_ptr<float>() : nullptr,
                    sliding_window, static_cast<float>(logit_softcap),
                    sink_logits.defined() ? sink_logits.data_ptr<float>() : nullptr};
  const CacheView cache{key_cache.size(1), key_cache.stride(0), key_cache.stride(1),
                        key_cache.stride(2)};

  const auto lens = seq_lens.to(at::kLong).contiguous();
  const auto starts = query_start_loc.to(at::kLong).contiguous();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* starts_p = starts.data_ptr<int64_t>();
  const int64_t num_seqs = lens.numel();

  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 &&
                  out.scalar_type() == query.scalar_type(),
              "out: the query's shape and dtype, unit stride along head_dim");

  // Work items (sequence, first query of its tile); each runs every KV head. The most
  // keys first (a tile reads up to its last query), and each thread takes the next item
  // when it finishes one: a static split of the items into a contiguous range per thread
  // left one core waiting on the other whenever the contexts differed in length (a
  // batch's usual state).
  std::vector<std::pair<int64_t, int64_t>> tiles;
  std::vector<int64_t> tile_keys;
  for (int64_t b = 0; b < num_seqs; ++b) {
    for (int64_t t = starts_p[b]; t < starts_p[b + 1]; t += kQueryTile) {
      tiles.emplace_back(b, t);
      tile_keys.push_back(lens_p[b] - starts_p[b + 1] + std::min(t + kQueryTile, starts_p[b + 1]));
    }
  }
  std::vector<int64_t> order(tiles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return tile_keys[x] > tile_keys[y]; });
  const bool wide_fits = head_dim % 16 == 0;
  const int64_t items = static_cast<int64_t>(tiles.size()) * num_kv_heads;

  // Every (query, cache) dtype pair the check above admits: the cache's own dtype, a
  // float32 query over a bfloat16 or float16 cache, or any but float64 over fp8.
  const auto run = [&](auto query_tag, auto cache_tag) {
    using scalar_t = decltype(query_tag);
    using cache_t = decltype(cache_tag);
    const scalar_t* q = query.data_ptr<scalar_t>();
    const cache_t* k = key_cache.data_ptr<cache_t>();
    const cache_t* v = value_cache.data_ptr<cache_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t max_blocks = block_tables.size(1);
    std::atomic<int64_t> next_item{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      for (int64_t item; (item = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const auto [b, token] = tiles[order[item / num_kv_heads]];
        const int64_t kv_head = item % num_kv_heads;
        const int64_t query_len = starts_p[b + 1] - starts_p[b];
        const int64_t tile_tokens = std::min(kQueryTile, starts_p[b + 1] - token);
        const int64_t first_query_pos = lens_p[b] - query_len + (token - starts_p[b]);
        auto attend = &attend_tile<scalar_t, cache_t>;
        if (wide_fits && query_len >= kWideMinQueries) {
          attend = head_dim == 64    ? &attend_tile_wide<scalar_t, cache_t, 64, CacheView, Options>
                   : head_dim == 128 ? &attend_tile_wide<scalar_t, cache_t, 128, CacheView, Options>
                                     : &attend_tile_wide<scalar_t, cache_t, 0, CacheView, Options>;
        }
        attend(q, query.stride(0), query.stride(1), k, v, cache, tables + b * max_blocks,
               kv_head, heads_per_kv, head_dim, first_query_pos, tile_tokens, token, opt, o,
               out.stride(0), out.stride(1));
      }
    });
  };
  const auto cache_dtype = key_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    if (cache_dtype == at::kFloat8_e4m3fn) {
      if constexpr (!std::is_same_v<scalar_t, double>) run(scalar_t{}, at::Float8_e4m3fn{});
    } else if (cache_dtype == at::kFloat8_e5m2) {
      if constexpr (!std::is_same_v<scalar_t, double>) run(scalar_t{}, at::Float8_e5m2{});
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      if (cache_dtype == at::kBFloat16) run(float{}, at::BFloat16{});
      else if (cache_dtype == at::kHalf) run(float{}, at::Half{});
      else run(float{}, float{});
    } else {
      run(scalar_t{}, scalar_t{});
    }
  });
}


// Store each new token's K and V rows at its slot (block * block_size + offset) of the
// caches, skipping slots of -1: one copy per (token, KV head) row, where torch needed a
// mask, a check of it and two index_copy_ calls. key/value [T, Hkv, D], any strides with
// unit stride along D (views of the fused QKV output); caches as paged_attention takes them.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key, value: [T, Hkv, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(), "caches: [N, B, Hkv, D], one layout");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "key rows must match the cache's heads and head_dim");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1,
              "unit stride along head_dim");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(), "one dtype for K/V, one for the caches");
  const bool narrowing = key.scalar_type() != key_cache.scalar_type();
  TORCH_CHECK(narrower_cache_fits(key.scalar_type(), key_cache.scalar_type()),
              "the caches' dtype must be K/V's, bfloat16 or float16 under float32 K/V, or fp8");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == key.size(0), "one slot per token");
  const int64_t tokens = key.size(0), heads = key.size(1);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot_p[t] < num_slots, "slot ", slot_p[t], " past the cache's ", num_slots);
  // write(t, h, at): token t's head h into the caches' element offset `at`, for every
  // token with a slot.
  const auto each_row = [&](auto&& write) {
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slot_p[t];
        if (slot < 0) continue;
        const int64_t at_slot = (slot / block_size) * key_cache.stride(0) + (slot % block_size) * key_cache.stride(1);
        for (int64_t h = 0; h < heads; ++h) write(t, h, at_slot + h * key_cache.stride(2));
      }
    });
  };
  if (narrowing) {  // rows rounded (to nearest even) into the cache's dtype; fp8 saturates
    const auto store = [&](auto src_tag, auto cache_tag) {
      using src_t = decltype(src_tag);
      using cache_t = decltype(cache_tag);
      // fp8 e4m3fn has no infinity (out of range is NaN), so fp8 writes saturate at the
      // largest finite value, as vLLM's fp8 cache writes do (NaN stays NaN); 16-bit ones
      // round as `Tensor.to` does.
      constexpr bool fp8 = sizeof(cache_t) == 1;
      const float limit = static_cast<float>(std::numeric_limits<cache_t>::max());
      const auto narrow = [limit](float x) {
        return static_cast<cache_t>(fp8 && !std::isnan(x) ? std::clamp(x, -limit, limit) : x);
      };
      const int64_t D = key.size(2);
      cache_t* kc = key_cache.data_ptr<cache_t>();
      cache_t* vc = value_cache.data_ptr<cache_t>();
      const src_t* k = key.data_ptr<src_t>();
      const src_t* v = value.data_ptr<src_t>();
      each_row([&](int64_t t, int64_t h, int64_t at) {
        const src_t* ks = k + t * key.stride(0) + h * key.stride(1);
        const src_t* vs = v + t * value.stride(0) + h * value.stride(1);
        for (int64_t d = 0; d < D; ++d) kc[at + d] = narrow(static_cast<float>(ks[d]));
        for (int64_t d = 0; d < D; ++d) vc[at + d] = narrow(static_cast<float>(vs[d]));
      });
    };
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
      if constexpr (!std::is_same_v<scalar_t, double>) {
        switch (key_cache.scalar_type()) {
          case at::kBFloat16: store(scalar_t{}, at::BFloat16{}); break;
          case at::kHalf: store(scalar_t{}, at::Half{}); break;
          case at::kFloat8_e4m3fn: store(scalar_t{}, at::Float8_e4m3fn{}); break;
          default: store(scalar_t{}, at::Float8_e5m2{}); break;
        }
      }
    });
    return;
  }
  const int64_t es = key.element_size(), row_bytes = key.size(2) * es;
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  each_row([&](int64_t t, int64_t h, int64_t at) {
    std::memcpy(kc + at * es, k + (t * key.stride(0) + h * key.stride(1)) * es, row_bytes);
    std::memcpy(vc + at * es, v + (t * value.stride(0) + h * value.stride(1)) * es, row_bytes);
  });
}

}  // namespace

TORCH_LIBRARY(serve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "Tensor? alibi_slopes, int sliding_window, float logit_softcap, Tensor? sinks=None) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}

namespace ops {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  serve_cpu::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                     double logit_softcap, const std::optional<at::Tensor>& sinks) {
  serve_cpu::paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                             query_start_loc, scale, alibi_slopes, sliding_window, logit_softcap,
                             sinks);
}

}  // namespace ops

}  // namespace serve_cpu
