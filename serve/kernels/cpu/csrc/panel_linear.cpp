// y = x W^T (+ b) in float32 for three rows and more: decode batches and prompt chunks.
//
// W is packed once into panels of kPanel output columns, [panels, K, kPanel] (the last
// panel's missing columns zero), so one k step of the inner loop reads a panel's weights as
// a few contiguous vectors. A tile of up to kTileRows rows of x keeps its kTileRows x kPanel
// sums in registers: each weight vector loaded serves every row of the tile and each
// broadcast x value the whole panel. The work is (panel, chunk of rows) units split evenly
// between the threads, the chunks chosen so that the units divide evenly: oneDNN's split of
// the default model's narrow products (9 or 15 panels of 64 columns on two threads) left a
// thread idle for a ninth of the call, and from 43 rows it chose a slower blocking
// (RESULTS.md, "Session 41"). Against oneDNN on weights it reordered itself, the model's
// 120 linears cycled from memory on two threads: 1.6x at 3 rows, 1.2x at 16-48, 1.15x at
// 64, 1.03x at 512 (RESULTS.md, "Session 43").
//
// Each output is one chain of fused multiply-adds over k in order (K split into even blocks
// past kBlockFloats, each block's chain continuing from the last), plus the bias: a row's
// result does not depend on the other rows, on how many there are or on the split.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>

#include "ops.h"
#include "vec.h"

namespace serve_cpu {
namespace {

// Columns of a panel: four vectors with AVX-512 (6 rows x 4 sums + 4 weights + 1 broadcast
// of its 32 registers), two with AVX2 and elsewhere (6 x 2 + 2 + 1 of 16).
constexpr int kPanelVecs = kLanes == 16 ? 4 : 2;
constexpr int64_t kPanel = kPanelVecs * kLanes;
constexpr int kTileRows = 6;
// A k block's panel slice stays in L2 (256 KB) while every tile of a unit's rows reads it.
constexpr int64_t kBlockFloats = (256 * 1024 / sizeof(float)) / kPanel;
// The fewest rows a chunk of a unit takes: fewer fill too few tiles to pay for the split.
constexpr int64_t kMinChunkRows = 12;

inline floatv fma_v(floatv a, floatv b, floatv c) {
#if defined(__AVX512F__)
  return (floatv)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (floatv)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  floatv r;
  for (int i = 0; i < kLanes; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

inline floatv broadcast_v(float v) {
#if defined(__AVX512F__)
  return (floatv)_mm512_set1_ps(v);
#elif defined(__AVX2__)
  return (floatv)_mm256_set1_ps(v);
#else
  floatv r;
  for (int i = 0; i < kLanes; ++i) r[i] = v;
  return r;
#endif
}

// y[r, 0:cols] (+)= x[r, k0:k0 + klen] . panel[k0:k0 + klen, 0:cols] for r < R: the sums
// start at 0 on the first k block and from y's on the next; the bias joins after the last.
// Meanwhile `ahead`'s `ahead_lines` cache lines (the next unit's weights) are requested
// into L2, spread over the k steps: without them the next panel's first tile would wait on
// memory with nothing to overlap (the lm_head's 768 panels ran 0.91x oneDNN at 64 rows).
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t klen, float* y, int64_t ldy,
          int64_t cols, bool first, const float* bias, const char* ahead, int64_t ahead_lines) {
  floatv acc[R][kPanelVecs];
  alignas(64) float spill[R][kPanel];  // a panel's valid columns, where it has fewer than kPanel
  const bool full = cols == kPanel;
  for (int r = 0; r < R; ++r) {
    // The tile's outputs requested for writing now, to arrive while it computes: the
    // lm_head's [rows, vocabulary] outputs are not in cache (0.92x oneDNN without).
    for (int64_t c = 0; c < cols; c += 64 / sizeof(float)) __builtin_prefetch(y + r * ldy + c, 1, 3);
    if (first) {
      for (int j = 0; j < kPanelVecs; ++j) acc[r][j] = floatv{};
      continue;
    }
    const float* src = y + r * ldy;
    if (!full) {
      std::fill(spill[r], spill[r] + kPanel, 0.0f);
      std::copy(src, src + cols, spill[r]);
      src = spill[r];
    }
    for (int j = 0; j < kPanelVecs; ++j) acc[r][j] = loadv(src + kLanes * j);
  }
  int64_t line = 0;
  for (int64_t k = 0; k < klen; ++k) {
    for (; line * klen < ahead_lines * (k + 1); ++line) __builtin_prefetch(ahead + 64 * line, 0, 2);
    const float* wk = panel + k * kPanel;
    floatv w[kPanelVecs];
    for (int j = 0; j < kPanelVecs; ++j) w[j] = loadv(wk + kLanes * j);
    for (int r = 0; r < R; ++r) {
      const floatv xb = broadcast_v(x[r * ldx + k]);
      for (int j = 0; j < kPanelVecs; ++j) acc[r][j] = fma_v(w[j], xb, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* dst = full ? y + r * ldy : spill[r];
    for (int j = 0; j < kPanelVecs; ++j) {
      floatv v = acc[r][j];
      if (bias != nullptr) {
        alignas(64) float b[kLanes] = {};
        const int64_t c0 = kLanes * j;
        for (int64_t c = c0; c < std::min<int64_t>(cols, c0 + kLanes); ++c) b[c - c0] = bias[c];
        v += loadv(b);
      }
      storev(dst + kLanes * j, v);
    }
    if (!full) std::copy(spill[r], spill[r] + cols, y + r * ldy);
  }
}

// Rows [r0, r1) of one panel over one k block, in tiles of as even a size as kTileRows allows.
// `next`: the weights the thread reads after these (the same k block of its next unit's
// panel), or null; its lines are requested a share per tile.
void rows_of_panel(const float* x, int64_t K, const float* panel, int64_t k0, int64_t klen,
                   float* y, int64_t N, int64_t cols, int64_t r0, int64_t r1, bool first,
                   const float* bias, const float* next) {
  const int64_t rows = r1 - r0;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t lines = next != nullptr ? klen * kPanel * int64_t{sizeof(float)} / 64 : 0;
  for (int64_t t = 0, r = r0; t < tiles; ++t) {
    const int64_t m = rows / tiles + (t < rows % tiles ? 1 : 0);
    const float* xr = x + r * K + k0;
    const float* p = panel + k0 * kPanel;
    float* yr = y + r * N;
    const char* ahead = reinterpret_cast<const char*>(next) + 64 * (lines * t / tiles);
    const int64_t n = lines * (t + 1) / tiles - lines * t / tiles;
    switch (m) {
      case 6: tile<6>(xr, K, p, klen, yr, N, cols, first, bias, ahead, n); break;
      case 5: tile<5>(xr, K, p, klen, yr, N, cols, first, bias, ahead, n); break;
      case 4: tile<4>(xr, K, p, klen, yr, N, cols, first, bias, ahead, n); break;
      case 3: tile<3>(xr, K, p, klen, yr, N, cols, first, bias, ahead, n); break;
      case 2: tile<2>(xr, K, p, klen, yr, N, cols, first, bias, ahead, n); break;
      default: tile<1>(xr, K, p, klen, yr, N, cols, first, bias, ahead, n); break;
    }
    r += m;
  }
}

// Row chunks per panel: the count (up to rows / kMinChunkRows) whose units split most evenly
// between the threads, the fewest among equals.
int64_t row_chunks(int64_t rows, int64_t panels, int64_t threads) {
  const int64_t most = std::max<int64_t>(1, rows / kMinChunkRows);
  int64_t best = 1;
  double best_share = 2.0;
  for (int64_t c = 1; c <= most; ++c) {
    const int64_t units = panels * c;
    // The busiest thread's units over the mean: 1 when they divide evenly.
    const double share = static_cast<double>((units + threads - 1) / threads) * threads / units;
    if (share < best_share - 1e-9) best = c, best_share = share;
    if (share <= 1.0 + 1e-9) break;
  }
  return best;
}

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_panels: a float32 weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

void linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "linear_panels: float32 x, panels, out");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [M, K], contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels [P, K, ", kPanel, "] as pack_panels gives them (on this build)");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(panels.size(1) == K, "x's K ", K, " against the panels' ", panels.size(1));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.is_contiguous(), "out [M, N], contiguous");
  const int64_t P = panels.size(0);
  TORCH_CHECK(N <= P * kPanel && N > (P - 1) * kPanel, "out's N ", N, " against ", P, " panels");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias [N], float32, contiguous");
    b = bias->data_ptr<float>();
  }
  if (M == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t blocks = (K + kBlockFloats - 1) / kBlockFloats;
  const int64_t block_len = (K + blocks - 1) / std::max<int64_t>(blocks, 1);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = row_chunks(M, P, threads);
  const int64_t units = P * chunks;
  const int64_t workers = std::min(threads, units);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t u_end = units * (t + 1) / workers;
      for (int64_t u = units * t / workers; u < u_end; ++u) {
        const int64_t p = u / chunks, c = u % chunks;
        const int64_t r0 = M * c / chunks, r1 = M * (c + 1) / chunks;
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        const float* panel = wp + p * K * kPanel;
        // The next unit's panel where it is another one (a panel's chunks share it).
        const float* next = u + 1 < u_end && (u + 1) / chunks != p ? panel + K * kPanel : nullptr;
        for (int64_t k0 = 0; k0 < K; k0 += block_len) {
          const int64_t klen = std::min(block_len, K - k0);
          const bool last = k0 + klen >= K;
          rows_of_panel(xp, K, panel, k0, klen, yp + p * kPanel, N, cols, r0, r1, k0 == 0,
                        last ? (b != nullptr ? b + p * kPanel : nullptr) : nullptr,
                        next != nullptr ? next + k0 * kPanel : nullptr);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("linear_panels(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("linear_panels", &linear_panels);
}

namespace ops {

void linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                   const std::optional<at::Tensor>& bias) {
  serve_cpu::linear_panels(out, x, panels, bias);
}

}  // namespace ops

}  // namespace serve_cpu
