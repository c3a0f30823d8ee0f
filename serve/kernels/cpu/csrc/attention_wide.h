// Attention for a tile of many queries (prompts and chunks of them), reading K/V in place.
//
// The decode kernel (paged_attention.cpp `attend_tile`) puts 16 keys in a vector's lanes
// and takes one query row at a time: each row's dot products end in a transposing sum,
// which costs more than the products once many rows share the keys. Here the lanes hold
// kLanes queries of one head instead (16 with AVX-512, 8 with AVX2: the loops carry
// scores, sums and accumulators in the target's own register, floatv, as float16v values
// spill through memory on AVX2, vec.h): with the group's keys transposed once into [D][G], a
// score vector (one key against the tile's queries) is D multiply-adds of a query column by a
// broadcast key element, the online softmax's max, exp and rescale run lane-wise (one
// query per lane, so no reduction at all), and the value product is again broadcasts of
// value elements against the probability vectors. Causality costs nothing off the
// diagonal: key groups past the tile's last query are never read, and only groups that
// reach past the tile's first query are masked.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace serve_cpu {

// Queries per wide tile: one per lane.
constexpr int64_t kWideLanes = kLanes;
// Keys per group: one score vector each, all of them in registers while the query
// columns stream past (AVX-512 has 32 vector registers; AVX2's 16 hold half as many).
#ifdef __AVX512F__
constexpr int kKeyGroup = 16;
#else
constexpr int kKeyGroup = 8;
#endif
// Output dimensions accumulated at once per key group: that many accumulator vectors
// stay in registers beside a probability vector and a broadcast value element.
constexpr int kValueDims = kLanes >= 16 ? 16 : 8;
// A masked score: finite, so a lane whose keys so far are all masked computes exp(0)
// instead of NaN; its sum and accumulator are then scaled by exp(masked - max) = 0 as
// soon as it meets a key it sees (every query sees itself), and nothing of them remains.
constexpr float kMaskedScore = -1e30f;

// What a row's accumulator is multiplied by at the end: 1 / its softmax sum (`sum` relative
// to the running max `max`), with the head's attention sink, where `sinks` is given, folded
// in as one more score whose value vector is zero: the max grows to take it in, and it adds
// exp(sink - max) to the sum and nothing to the output.
inline float output_scale(float max, float sum, const float* sinks, int64_t head) {
  if (sinks == nullptr) return 1.0f / sum;
  const float sink = sinks[head];
  const float top = std::max(max, sink);
  const float rescale = std::exp(max - top);
  return rescale / (sum * rescale + std::exp(sink - top));
}

// tanh lane by lane: (1 - e) / (1 + e) with e = exp(-2|x|), its sign restored; below
// |x| = 1/16, where 1 - e would lose digits, the series to x^5 (error < 1e-9).
inline floatv tanhv(floatv x) {
  const floatv ax = x < 0.0f ? -x : x;
  const floatv e = exp_nonpositive(-2.0f * ax);
  const floatv big = (1.0f - e) / (1.0f + e);
  const floatv x2 = ax * ax;
  const floatv small = ax * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f)));
  const floatv t = ax < 0.0625f ? small : big;
  return x < 0.0f ? -t : t;
}

// One tile of up to kWideLanes queries of one sequence, for every query head of one KV
// head; arguments as paged_attention.cpp's `attend_tile` takes them (its CacheView and
// Options structs). With the head size known at compile time (HD > 0), a key element's
// offset in a [G][HD] group is a constant, so the keys are broadcast from their rows as
// they lie: a float32 group that fills one block's run of slots is read straight from the
// cache, with no copy at all. Otherwise (HD = 0) the group is transposed into [D][G]. A cache
// narrower than the query (cache_t: --kv-cache-dtype) is widened into the copy.
template <typename scalar_t, typename cache_t, int HD, typename CacheView, typename Options>
void attend_tile_wide(
    const scalar_t* query, int64_t q_stride_token, int64_t q_stride_head,
    const cache_t* key_cache, const cache_t* value_cache, const CacheView& cache,
    const int64_t* block_table, int64_t kv_head, int64_t heads_per_kv, int64_t head_dim,
    int64_t first_query_pos, int64_t tile_tokens, int64_t first_token, const Options& opt,
    scalar_t* out, int64_t out_stride_token, int64_t out_stride_head) {
  constexpr int G = kKeyGroup;
  constexpr int64_t L = kWideLanes;
  const int64_t D = HD > 0 ? HD : head_dim;  // a multiple of 16 (the caller checks)
  const int64_t last_query_pos = first_query_pos + tile_tokens - 1;
  const int64_t first_key =
      opt.window > 0 ? std::max<int64_t>(0, first_query_pos - opt.window + 1) : 0;

  // Per thread, reused: per head a transposed scaled query [D][L], a transposed output
  // accumulator [D][L], the running max and sum [L]; the key group ([G][D] rows, or
  // transposed [D][G]), its value rows [G][D] and its probabilities [G][L].
  const int64_t per_head = 2 * D * L + 2 * L;
  thread_local std::vector<float> scratch;
  scratch.resize(heads_per_kv * per_head + 2 * G * D + G * L);
  float* const key_copy = scratch.data() + heads_per_kv * per_head;
  float* const value_copy = key_copy + G * D;
  float* const probs = value_copy + G * D;
  const auto head_query = [&](int64_t j) { return scratch.data() + j * per_head; };
  const auto head_acc = [&](int64_t j) { return head_query(j) + D * L; };
  const auto head_max = [&](int64_t j) { return head_acc(j) + D * L; };
  const auto head_sum = [&](int64_t j) { return head_max(j) + L; };

  // Lanes past the tile's tokens repeat its last query (computed, never written out), so
  // every lane sees at least one key.
  floatv query_pos;
  for (int64_t lane = 0; lane < L; ++lane)
    query_pos[lane] = static_cast<float>(first_query_pos + std::min(lane, tile_tokens - 1));
  for (int64_t j = 0; j < heads_per_kv; ++j) {
    const int64_t head = kv_head * heads_per_kv + j;
    float* qt = head_query(j);
    for (int64_t lane = 0; lane < L; ++lane) {
      const scalar_t* src = query + (first_token + std::min(lane, tile_tokens - 1)) * q_stride_token +
                            head * q_stride_head;
      for (int64_t d = 0; d < D; ++d) qt[d * L + lane] = static_cast<float>(src[d]) * opt.scale;
    }
    std::fill(head_acc(j), head_acc(j) + D * L, 0.0f);
    std::fill(head_max(j), head_max(j) + L, kMaskedScore);
    std::fill(head_sum(j), head_sum(j) + L, 0.0f);
  }

  const int64_t block_size = cache.block_size;
  const auto row_at = [&](int64_t pos) {
    return block_table[pos / block_size] * cache.stride_block + (pos % block_size) * cache.stride_slot +
           kv_head * cache.stride_head;
  };
  // Groups start at multiples of G, so with blocks of a multiple of G slots none spans
  // two blocks; keys before the first lane's window are masked like any outside it.
  for (int64_t k0 = first_key / G * G; k0 <= last_query_pos; k0 += G) {
    const int64_t n = std::min<int64_t>(G, last_query_pos + 1 - k0);
    const float* keys = key_copy;
    const float* values = value_copy;
    bool in_place = false;
    if constexpr (HD > 0 && std::is_same_v<cache_t, float>) {
      // A short group is copied: its slots past the context may hold anything, NaN too.
      in_place = n == G && block_size % G == 0 && cache.stride_slot == HD;
      if (in_place) {
        keys = key_cache + row_at(k0);
        values = value_cache + row_at(k0);
      }
    }
    if (!in_place) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = row_at(k0 + i);
        const cache_t* k = key_cache + at;
        const cache_t* v = value_cache + at;
        for (int64_t d = 0; d < D; ++d)
          key_copy[HD > 0 ? i * D + d : d * G + i] = static_cast<float>(k[d]);
        for (int64_t d = 0; d < D; ++d) value_copy[i * D + d] = static_cast<float>(v[d]);
      }
      for (int64_t i = n; i < G; ++i) {  // a short last group: zero keys and values, masked
        for (int64_t d = 0; d < D; ++d) key_copy[HD > 0 ? i * D + d : d * G + i] = 0.0f;
        std::fill(value_copy + i * D, value_copy + (i + 1) * D, 0.0f);
      }
    }
    if (k0 + G <= last_query_pos) {  // the next group's rows, while this one computes
      const int64_t next = std::min<int64_t>(G, last_query_pos + 1 - (k0 + G));
      for (int64_t i = 0; i < next; ++i) {
        const int64_t at = row_at(k0 + G + i);
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(cache_t)); b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(key_cache + at) + b);
          __builtin_prefetch(reinterpret_cast<const char*>(value_cache + at) + b);
        }
      }
    }
    // Keys past the tile's first query (causal), before its last query's window, or past
    // a short group's end are masked; groups wholly inside every lane's view are not.
    const bool masked_group = k0 + G - 1 > first_query_pos || n < G ||
                              (opt.window > 0 && last_query_pos - k0 >= opt.window);

    for (int64_t j = 0; j < heads_per_kv; ++j) {
      const int64_t head = kv_head * heads_per_kv + j;
      const float* qt = head_query(j);
      floatv s[G];
      for (int i = 0; i < G; ++i) s[i] = floatv{};
      for (int64_t d = 0; d < D; ++d) {
        const floatv q = loadv(qt + d * L);
        if constexpr (HD > 0) {
          const float* kd = keys + d;  // key i's element d at kd[i * HD]
          for (int i = 0; i < G; ++i) s[i] += q * kd[i * HD];
        } else {
          const float* kd = keys + d * G;
          for (int i = 0; i < G; ++i) s[i] += q * kd[i];
        }
      }
      if (opt.softcap > 0.0f) {
        for (int i = 0; i < G; ++i) s[i] = opt.softcap * tanhv(s[i] / opt.softcap);
      }
      if (opt.alibi_slopes != nullptr) {
        const float slope = opt.alibi_slopes[head];
        for (int i = 0; i < G; ++i) s[i] += slope * (static_cast<float>(k0 + i) - query_pos);
      }
      if (masked_group) {
        for (int i = 0; i < G; ++i) {
          const float key_pos = static_cast<float>(k0 + i);
          if (i >= n) {
            s[i] = floatv{} + kMaskedScore;
            continue;
          }
          s[i] = query_pos < key_pos ? kMaskedScore : s[i];
          if (opt.window > 0)
            s[i] = query_pos - key_pos >= static_cast<float>(opt.window) ? kMaskedScore : s[i];
        }
      }
      floatv group_max = s[0];
      for (int i = 1; i < G; ++i) group_max = group_max > s[i] ? group_max : s[i];
      float* mx = head_max(j);
      float* sm = head_sum(j);
      const floatv old_max = loadv(mx);
      const floatv new_max = old_max > group_max ? old_max : group_max;
      const floatv correction = exp_nonpositive(old_max - new_max);
      floatv sum = {};
      for (int i = 0; i < G; ++i) {
        const floatv p = exp_nonpositive(s[i] - new_max);
        storev(probs + i * L, p);
        sum += p;
      }
      storev(mx, new_max);
      storev(sm, loadv(sm) * correction + sum);

      float* acc_t = head_acc(j);
      for (int64_t d0 = 0; d0 < D; d0 += kValueDims) {
        floatv acc[kValueDims];
        for (int dd = 0; dd < kValueDims; ++dd) acc[dd] = loadv(acc_t + (d0 + dd) * L) * correction;
        for (int i = 0; i < G; ++i) {
          const floatv p = loadv(probs + i * L);
          const float* v = values + i * D + d0;
          for (int dd = 0; dd < kValueDims; ++dd) acc[dd] += p * v[dd];
        }
        for (int dd = 0; dd < kValueDims; ++dd) storev(acc_t + (d0 + dd) * L, acc[dd]);
      }
    }
  }

  for (int64_t j = 0; j < heads_per_kv; ++j) {
    const float* acc_t = head_acc(j);
    const float* sm = head_sum(j);
    const float* mx = head_max(j);
    const int64_t head = kv_head * heads_per_kv + j;
    for (int64_t t = 0; t < tile_tokens; ++t) {
      const float inv = output_scale(mx[t], sm[t], opt.sinks, head);
      scalar_t* dst = out + (first_token + t) * out_stride_token + head * out_stride_head;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc_t[d * L + t] * inv);
    }
  }
}

}  // namespace serve_cpu
