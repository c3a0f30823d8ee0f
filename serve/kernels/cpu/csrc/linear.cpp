// y = x W^T (+ b) for a few rows of x: the decode of one to a few sequences.
//
// With so few rows the product is a pass over the weight matrix, bound by memory
// bandwidth; MKL's sgemm runs a single row at about half the bandwidth two rows reach.
// Here each thread streams its share of W's rows, a few at a time (as many as keep every
// accumulator in registers), through vector accumulators for every row of x, so each
// weight byte is read once per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "vec.h"

namespace serve_cpu {
namespace {

// The most rows of x served here (serve calls it for one; two rows and up run in oneDNN).
constexpr int64_t kMaxRows = 4;

template <int M, int R>
void rows_times_weight(const float* x, const float* w, const float* bias, float* y, int64_t K,
                       int64_t N, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) {
    float16v acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = float16v{};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      float16v xv[M];
      for (int m = 0; m < M; ++m) xv[m] = load16(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const float16v wv = load16(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < M; ++m) {
        float s = horizontal_sum(acc[r][m]);
        for (int64_t t = k; t < K; ++t) s += w[(n + r) * K + t] * x[m * K + t];
        y[m * N + n + r] = s + (bias != nullptr ? bias[n + r] : 0.0f);
      }
    }
  }
  for (; n < n_end; ++n) {
    for (int m = 0; m < M; ++m) {
      y[m * N + n] = dot(w + n * K, x + m * K, K) + (bias != nullptr ? bias[n] : 0.0f);
    }
  }
}

void linear_few_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K], W [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), "contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "1 to ", kMaxRows, " rows");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kFloat, "out [M, N]");
  const float* b = nullptr;
  at::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->contiguous();
    TORCH_CHECK(bias_f.scalar_type() == at::kFloat && bias_f.numel() == N, "bias [N] float32");
    b = bias_f.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  // Chunks large enough that a thread streams tens of KB of W between scheduling points.
  const int64_t grain = std::max<int64_t>(4, (16384 / std::max<int64_t>(K, 1)) / 4 * 4);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: rows_times_weight<1, 8>(xp, wp, b, yp, K, N, begin, end); break;
      case 2: rows_times_weight<2, 6>(xp, wp, b, yp, K, N, begin, end); break;
      case 3: rows_times_weight<3, 4>(xp, wp, b, yp, K, N, begin, end); break;
      default: rows_times_weight<4, 3>(xp, wp, b, yp, K, N, begin, end); break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def("linear_few_rows(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) { m.impl("linear_few_rows", &linear_few_rows); }

}  // namespace serve_cpu
