// y = x W^T (+ b) for a few rows of x: the decode of one to a few sequences.
//
// With so few rows the product is a pass over the weight matrix, bound by memory
// bandwidth; MKL's sgemm runs a single row at about half the bandwidth two rows reach.
// Here each thread streams its share of W's rows through vector accumulators for every
// row of x, so each weight byte is read once per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace serve_cpu {
namespace {

// The most rows of x served here (serve calls it for one or two rows, float32 or
// bfloat16; more run in oneDNN: serve/kernels/cpu/__init__.py `NATIVE_MAX_ROWS`).
constexpr int64_t kMaxRows = 4;

// The weights a register at a time, widened to float32.
inline floatv load_weights(const float* p) { return loadv(p); }
inline floatv load_weights(const at::BFloat16* p) {
  return loadv_bf16(reinterpret_cast<const uint16_t*>(p));
}

// Float32 x and accumulators; the weights float32 or bfloat16 (widened as they stream in,
// so a bfloat16 model reads half the bytes). Each row of W is read in memory order, its
// dot products with every row of x taken in one pass (x stays in L1); the rows follow
// each other as `rows_times_weight` below orders them. Taking several rows of W at once,
// k outer, read them as as many interleaved streams, each a row long, and ran 1.1-1.2x
// slower in float32 and 1.6x in bfloat16.
// The vectors are the target's own registers (floatv): 16-float values on AVX2, two
// registers each, were kept in memory by GCC and copied through on every add.
template <int M, typename weight_t>
inline void row_times_weight(const float* x, const weight_t* w, const float* bias, weight_t* y,
                             int64_t K, int64_t N, int64_t n) {
  constexpr int64_t L = kLanes;
  const weight_t* row = w + n * K;
  // Two accumulators per row of x: two chains of adds, so one does not wait on the other.
  floatv even[M], odd[M];
  for (int m = 0; m < M; ++m) even[m] = odd[m] = floatv{};
  int64_t k = 0;
  for (; k + 2 * L <= K; k += 2 * L) {
    const floatv w0 = load_weights(row + k);
    const floatv w1 = load_weights(row + k + L);
    for (int m = 0; m < M; ++m) {
      even[m] += w0 * loadv(x + m * K + k);
      odd[m] += w1 * loadv(x + m * K + k + L);
    }
  }
  if (k + L <= K) {
    const floatv w0 = load_weights(row + k);
    for (int m = 0; m < M; ++m) even[m] += w0 * loadv(x + m * K + k);
    k += L;
  }
  for (int m = 0; m < M; ++m) {
    float s = horizontal_sum(even[m] + odd[m]);
    for (int64_t t = k; t < K; ++t) s += static_cast<float>(row[t]) * x[m * K + t];
    // bfloat16 y: rounded once, from the float32 sum (as a copy of float32 y would).
    y[m * N + n] = static_cast<weight_t>(s + (bias != nullptr ? bias[n] : 0.0f));
  }
}

// A thread's rows [n_begin, n_end) as two streams, the first half's rows taken in turn
// with the second half's, each row still read in one pass: one stream per core left some
// of its read bandwidth unused (the default model's decode step: 1.07x at two rows, 6 of
// 6 alternating rounds faster; ~1.03x at one row, within the host's noise).
template <int M, typename weight_t>
void rows_times_weight(const float* x, const weight_t* w, const float* bias, weight_t* y, int64_t K,
                       int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t half = (n_end - n_begin + 1) / 2;
  for (int64_t i = 0; i < half; ++i) {
    row_times_weight<M>(x, w, bias, y, K, N, n_begin + i);
    if (n_begin + half + i < n_end) row_times_weight<M>(x, w, bias, y, K, N, n_begin + half + i);
  }
}

template <typename weight_t>
void run_rows(const float* x, const weight_t* w, const float* b, weight_t* y, int64_t M, int64_t K,
              int64_t N, int64_t grain) {
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: rows_times_weight<1>(x, w, b, y, K, N, begin, end); break;
      case 2: rows_times_weight<2>(x, w, b, y, K, N, begin, end); break;
      case 3: rows_times_weight<3>(x, w, b, y, K, N, begin, end); break;
      default: rows_times_weight<4>(x, w, b, y, K, N, begin, end); break;
    }
  });
}

void linear_few_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 weights");
  TORCH_CHECK(x.scalar_type() == dtype && out.scalar_type() == dtype, "x, weight, out: one dtype");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K], W [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), "contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "1 to ", kMaxRows, " rows");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out [M, N]");
  // The sums are float32 whatever the dtype: bfloat16 x and bias are widened into float32
  // buffers here (a few KB, without the allocations and copy ops of tensors), and y is
  // rounded once at the end, as oneDNN's bfloat16 matmul does.
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == dtype && bias->is_contiguous(),
                "bias [N], contiguous, the weight's dtype");
  // Chunks large enough that a thread streams tens of KB of W between scheduling points.
  const int64_t grain = std::max<int64_t>(4, (16384 / std::max<int64_t>(K, 1)) / 4 * 4);
  if (dtype == at::kFloat) {
    run_rows(x.data_ptr<float>(), weight.data_ptr<float>(),
             bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K, N,
             grain);
    return;
  }
  using T = at::BFloat16;
  std::vector<float> x32(M * K), bias32(bias.has_value() ? N : 0);
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < M * K; ++i) x32[i] = static_cast<float>(xp[i]);
  if (bias.has_value()) {
    const T* bp = bias->data_ptr<T>();
    for (int64_t i = 0; i < N; ++i) bias32[i] = static_cast<float>(bp[i]);
  }
  run_rows(x32.data(), weight.data_ptr<T>(), bias.has_value() ? bias32.data() : nullptr,
           out.data_ptr<T>(), M, K, N, grain);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def("linear_few_rows(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) { m.impl("linear_few_rows", &linear_few_rows); }

namespace ops {

void linear_few_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  serve_cpu::linear_few_rows(out, x, weight, bias);
}

}  // namespace ops

}  // namespace serve_cpu
