// Greedy sampling's argmax over each row of the logits, and top-p's edge in each row.
//
// torch's CPU argmax keeps a (value, index) pair through a scalar reduction: over a 49K
// vocabulary that is ~18x the time of the vectorised max (amax) it could be, and at 256
// rows, milliseconds a step. Here each of 16 lanes keeps its own maximum and the first
// index holding it, one vector pass, and the lanes are merged at the end, with torch's
// rules: the first index where several tie, and a NaN (larger than any number) as the
// maximum where a row has one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "vec.h"

namespace serve_cpu {
namespace {

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) return i;
  }
  return -1;
}

int64_t argmax_row(const float* row, int64_t n) {
  int64_t best = 0;
  float best_value = row[0];
  int64_t i = 0;
  if (n >= 16) {
    const int16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    float16v value = load16(row);
    int16v index = lane;
    int16v nan = value != value;
    for (i = 16; i + 16 <= n; i += 16) {
      const float16v v = load16(row + i);
      const int16v greater = v > value;  // false for NaN lanes: they are found apart
      value = greater ? v : value;
      index = greater ? lane + static_cast<int32_t>(i) : index;
      nan |= v != v;
    }
    for (int l = 0; l < 16; ++l) {
      if (nan[l]) return first_nan(row, n);
    }
    best_value = value[0];
    best = index[0];
    for (int l = 1; l < 16; ++l) {  // the largest lane; among equal ones, the first index
      if (value[l] > best_value || (value[l] == best_value && index[l] < best)) {
        best_value = value[l];
        best = index[l];
      }
    }
  } else {
    i = 1;
    if (std::isnan(best_value)) return 0;
  }
  for (; i < n; ++i) {  // the tail, past every index above: it wins only by being larger
    if (std::isnan(row[i])) return first_nan(row, n);
    if (row[i] > best_value) {
      best_value = row[i];
      best = i;
    }
  }
  return best;
}

// out[r] = argmax(x[r]), as torch.argmax(x, dim=-1).
void argmax_rows(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) > 0, "x: [rows, n], n > 0, contiguous float32");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 1 && out.size(0) == rows &&
                  out.scalar_type() == at::kLong, "out: [rows] int64");
  const float* data = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  // A row of a vocabulary is tens of microseconds: rows are shared out from a few each.
  const int64_t grain = std::max<int64_t>(1, 32768 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = argmax_row(data + r * n, n);
  });
}

// Top-p's edge: the least likely logit of a row's nucleus, the fewest most likely tokens
// whose probability reaches top_p (every token as likely as it belongs to the nucleus too).
// A sort of the row finds it in O(n log n): 110 ms for 64 rows of a 49K vocabulary on two
// cores. Here four passes: the row's max; each token's weight exp(x - max) and their
// total; the weights' mass in kBuckets buckets of equal width from the max down to the min
// (a token's bucket falls as its logit does), where the bucket that reaches top_p of the
// total holds the edge; then that bucket's tokens alone, sorted, each adding its weight to
// the mass of the buckets before, until it reaches top_p. Masses are summed in double.
// `weights` and `buckets` are the caller's scratch, n long; `edge_bucket` takes the one
// bucket's tokens.
constexpr int kBuckets = 2048;

float top_p_edge(const float* row, int64_t n, double top_p, float* weights, int32_t* buckets,
                 std::vector<std::pair<float, float>>& edge_bucket) {
  float max = -std::numeric_limits<float>::infinity(), min = -max;
  for (int64_t i = 0; i < n; ++i) {
    max = std::max(max, row[i]);
    if (row[i] != -std::numeric_limits<float>::infinity()) min = std::min(min, row[i]);
  }
  if (!(max > min)) return max;  // one distinct value (or one token not masked): all of it
  double total = 0.0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const floatv w = exp_nonpositive(loadv(row + i) - max);
    storev(weights + i, w);
    total += horizontal_sum(w);
  }
  for (; i < n; ++i) total += weights[i] = std::exp(row[i] - max);
  const double target = top_p * total;
  double mass[kBuckets] = {};
  int64_t count[kBuckets] = {};  // tokens a bucket
  const float scale = (kBuckets - 1) / (max - min);
  for (i = 0; i < n; ++i) {
    if (weights[i] == 0.0f) {  // masked, or too unlikely to count
      buckets[i] = kBuckets;
      continue;
    }
    const int32_t b =
        std::min<int32_t>(kBuckets - 1, static_cast<int32_t>((max - row[i]) * scale));
    buckets[i] = b;
    mass[b] += weights[i];
    ++count[b];
  }
  double above = 0.0;
  int32_t edge = 0;
  while (edge < kBuckets - 1 && above + mass[edge] < target) above += mass[edge++];
  edge_bucket.clear();
  edge_bucket.reserve(count[edge]);
  for (i = 0; i < n; ++i) {
    if (buckets[i] == edge) edge_bucket.emplace_back(row[i], weights[i]);
  }
  std::sort(edge_bucket.begin(), edge_bucket.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [value, weight] : edge_bucket) {
    above += weight;
    if (above >= target) return value;
  }
  return edge_bucket.empty() ? min : edge_bucket.back().first;
}

// out[r] = the edge of row r's nucleus at top_p[r] (0 < top_p[r] <= 1), float32 rows.
void top_p_cut(at::Tensor& out, const at::Tensor& logits, const at::Tensor& top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0, "logits: [rows, n], n > 0, contiguous float32");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == rows && top_p.is_contiguous() &&
                  top_p.scalar_type() == at::kFloat, "top_p: [rows] float32");
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows && out.scalar_type() == at::kFloat,
              "out: [rows] or [rows, 1] float32");
  const float* data = logits.data_ptr<float>();
  const float* limits = top_p.data_ptr<float>();
  float* result = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(n);
    std::vector<int32_t> buckets(n);
    std::vector<std::pair<float, float>> edge_bucket;
    for (int64_t r = begin; r < end; ++r)
      result[r] = top_p_edge(data + r * n, n, limits[r], weights.data(), buckets.data(),
                             edge_bucket);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.def("top_p_cut(Tensor(a!) out, Tensor logits, Tensor top_p) -> ()");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("top_p_cut", &top_p_cut);
}

}  // namespace serve_cpu
