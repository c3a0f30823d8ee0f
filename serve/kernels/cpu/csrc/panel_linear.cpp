// y = x W^T (+ b) for three rows and more: decode batches and prompt chunks. float32 on any
// target; bfloat16 where the target has AVX512_BF16 (`panels_fit`).
//
// W is packed once into panels of kPanel output columns (the last panel's missing columns
// zero): float32 as [panels, K, kPanel], so one k step of the inner loop reads a panel's
// weights as a few contiguous vectors; bfloat16 as [panels, K / 2, kPanel, 2], the pairs of
// k that one `vdpbf16ps` multiplies and adds into a float32 lane. A tile of up to kTileRows
// rows of x keeps its kTileRows x kPanel sums in registers: each weight vector loaded serves
// every row of the tile and each broadcast x value (or pair) the whole panel. The work is
// (panel, chunk of rows) units split evenly between the threads, the chunks chosen so that
// the units divide evenly: oneDNN's split of the default model's narrow products (9 or 15
// panels of 64 columns on two threads) left a thread idle for a ninth of the call, and from
// 43 rows it chose a slower blocking (RESULTS.md, "Session 41"). Against oneDNN on weights it
// reordered itself, a layer's four linears cycled from memory on two threads, float32: 1.4x
// at 3-16 rows, 1.5x at 43, 1.2x at 64, 1.04x at 512 (RESULTS.md, "Session 43").
//
// Each output is one chain of fused multiply-adds over k in order (K split into even blocks
// past a panel slice of 256 KB, each block's chain continuing from the last in float32),
// plus the bias, rounded once to y's dtype: a row's result does not depend on the other
// rows, on how many there are or on the split.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

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
constexpr int64_t kBlockBytes = 256 * 1024;
// The fewest rows a chunk of a unit takes: fewer fill too few tiles to pay for the split.
constexpr int64_t kMinChunkRows = 12;

#if defined(__AVX512BF16__)
constexpr bool kBf16Panels = true;
#else
constexpr bool kBf16Panels = false;
#endif

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

// acc[r][j] += the panel's k steps [0, klen) for the R rows of x: float32, one k a step.
template <int R>
inline void accumulate(floatv (&acc)[R][kPanelVecs], const float* x, int64_t ldx,
                       const float* panel, int64_t klen, const char* ahead, int64_t ahead_lines) {
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
}

#if defined(__AVX512BF16__)
// The same for bfloat16: a pair of k a step (`panel` at the block's first pair, `klen`
// elements: even, or odd at K's end, whose last x pairs with 0 as its weight does).
template <int R>
inline void accumulate(floatv (&acc)[R][kPanelVecs], const at::BFloat16* x, int64_t ldx,
                       const at::BFloat16* panel, int64_t klen, const char* ahead,
                       int64_t ahead_lines) {
  const int64_t steps = (klen + 1) / 2;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(panel);
  int64_t line = 0;
  for (int64_t kk = 0; kk < steps; ++kk) {
    for (; line * steps < ahead_lines * (kk + 1); ++line) __builtin_prefetch(ahead + 64 * line, 0, 2);
    const uint16_t* wk = ws + kk * 2 * kPanel;
    __m512bh w[kPanelVecs];
    for (int j = 0; j < kPanelVecs; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wk + 2 * kLanes * j);
    const bool half = 2 * kk + 1 == klen;  // K odd: the last x alone
    for (int r = 0; r < R; ++r) {
      const uint16_t* xp = xs + r * ldx + 2 * kk;
      const uint32_t pair = half ? xp[0] : xp[0] | static_cast<uint32_t>(xp[1]) << 16;
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
      for (int j = 0; j < kPanelVecs; ++j)
        acc[r][j] = (floatv)_mm512_dpbf16_ps((__m512)acc[r][j], xb, w[j]);
    }
  }
}
#endif

inline void store_row(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }
inline void store_row(at::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<at::BFloat16>(src[c]);  // nearest even
}

// Sums of one panel's k block for the R rows of a tile, started at 0 on the first block and
// from `part` (float32, row stride ldp) on the next; after the last block, with the bias
// (float32), into y, else back into `part`. Meanwhile `ahead`'s `ahead_lines` cache lines
// (the next unit's weights) are requested into L2, spread over the k steps: without them the
// next panel's first tile waits on memory with nothing to overlap.
template <int R, typename T>
void tile(const T* x, int64_t ldx, const T* panel, int64_t klen, float* part, int64_t ldp,
          bool first, bool last, T* y, int64_t ldy, int64_t cols, const float* bias,
          const char* ahead, int64_t ahead_lines) {
  floatv acc[R][kPanelVecs];
  alignas(64) float row[kPanel];
  for (int r = 0; r < R; ++r) {
    // The tile's outputs requested for writing now, to arrive while it computes: the
    // lm_head's [rows, vocabulary] outputs are not in cache.
    if (last) {
      for (int64_t c = 0; c < cols; c += 64 / sizeof(T)) __builtin_prefetch(y + r * ldy + c, 1, 3);
    }
    if (first) {
      for (int j = 0; j < kPanelVecs; ++j) acc[r][j] = floatv{};
      continue;
    }
    std::fill(row, row + kPanel, 0.0f);
    std::copy(part + r * ldp, part + r * ldp + cols, row);
    for (int j = 0; j < kPanelVecs; ++j) acc[r][j] = loadv(row + kLanes * j);
  }
  accumulate<R>(acc, x, ldx, panel, klen, ahead, ahead_lines);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kPanelVecs; ++j) storev(row + kLanes * j, acc[r][j]);
    if (!last) {
      std::copy(row, row + cols, part + r * ldp);
      continue;
    }
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) row[c] += bias[c];
    store_row(y + r * ldy, row, cols);
  }
}

struct Problem {
  int64_t M, K, N, panels;
  int64_t block_len;   // k elements a block (even)
  int64_t panel_size;  // elements of one panel (all of K)
};

// Rows [r0, r1) of one panel over the k block at k0, in tiles of as even a size as kTileRows
// allows. `next`: the weights the thread reads after these (the same k block of its next
// unit's panel), or null; its lines are requested a share per tile.
template <typename T>
void rows_of_panel(const Problem& pr, const T* x, const T* panel, int64_t k0, int64_t klen,
                   float* part, int64_t ldp, T* y, int64_t cols, int64_t r0, int64_t r1,
                   const float* bias, const T* next) {
  const bool first = k0 == 0, last = k0 + klen >= pr.K;
  const int64_t rows = r1 - r0;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t bytes = (klen + (klen & 1)) * kPanel * int64_t{sizeof(T)};
  const int64_t lines = next != nullptr ? bytes / 64 : 0;
  for (int64_t t = 0, r = r0; t < tiles; ++t) {
    const int64_t m = rows / tiles + (t < rows % tiles ? 1 : 0);
    const T* xr = x + r * pr.K + k0;
    const T* p = panel + k0 * kPanel;
    float* pp = part != nullptr ? part + (r - r0) * ldp : nullptr;
    T* yr = y + r * pr.N;
    const char* ahead = reinterpret_cast<const char*>(next) + 64 * (lines * t / tiles);
    const int64_t n = lines * (t + 1) / tiles - lines * t / tiles;
#define SERVE_PANEL_TILE(R) \
  tile<R, T>(xr, pr.K, p, klen, pp, ldp, first, last, yr, pr.N, cols, bias, ahead, n)
    switch (m) {
      case 6: SERVE_PANEL_TILE(6); break;
      case 5: SERVE_PANEL_TILE(5); break;
      case 4: SERVE_PANEL_TILE(4); break;
      case 3: SERVE_PANEL_TILE(3); break;
      case 2: SERVE_PANEL_TILE(2); break;
      default: SERVE_PANEL_TILE(1); break;
    }
#undef SERVE_PANEL_TILE
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

template <typename T>
void run(const Problem& pr, const T* x, const T* w, T* y, const float* bias) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = row_chunks(pr.M, pr.panels, threads);
  const int64_t units = pr.panels * chunks;
  const int64_t workers = std::min(threads, units);
  // float32 sums carried between k blocks: y's own rows where y is float32; a scratch
  // [chunk rows, kPanel] a thread for a narrower y.
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t u_end = units * (t + 1) / workers;
      for (int64_t u = units * t / workers; u < u_end; ++u) {
        const int64_t p = u / chunks, c = u % chunks;
        const int64_t r0 = pr.M * c / chunks, r1 = pr.M * (c + 1) / chunks;
        const int64_t cols = std::min(kPanel, pr.N - p * kPanel);
        const T* panel = w + p * pr.panel_size;
        float* part = nullptr;  // a single k block keeps its sums in registers throughout
        int64_t ldp = 0;
        if constexpr (std::is_same_v<T, float>) {
          part = y + r0 * pr.N + p * kPanel;
          ldp = pr.N;
        } else if (pr.block_len < pr.K) {
          scratch.resize((r1 - r0) * kPanel);
          part = scratch.data();
          ldp = kPanel;
        }
        // The next unit's panel where it is another one (a panel's chunks share it).
        const T* next = u + 1 < u_end && (u + 1) / chunks != p ? panel + pr.panel_size : nullptr;
        for (int64_t k0 = 0; k0 < pr.K; k0 += pr.block_len) {
          const int64_t klen = std::min(pr.block_len, pr.K - k0);
          const bool last = k0 + klen >= pr.K;
          rows_of_panel<T>(pr, x, panel, k0, klen, part, ldp, y + p * kPanel, cols, r0, r1,
                           last && bias != nullptr ? bias + p * kPanel : nullptr,
                           next != nullptr ? next + k0 * kPanel : nullptr);
        }
      }
    }
  });
}

bool panels_fit(at::ScalarType dtype) {
  return dtype == at::kFloat || (dtype == at::kBFloat16 && kBf16Panels);
}

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && panels_fit(weight.scalar_type()),
              "pack_panels: a weight [N, K], float32", kBf16Panels ? " or bfloat16" : "",
              " (bfloat16 needs a build for AVX512_BF16)");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  if (weight.scalar_type() == at::kFloat) {
    at::Tensor padded = at::zeros({panels * kPanel, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
    return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
  }
  const int64_t pairs = (K + 1) / 2;
  at::Tensor padded = at::zeros({panels * kPanel, 2 * pairs}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

void linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                   const std::optional<at::Tensor>& bias) {
  const auto dtype = panels.scalar_type();
  TORCH_CHECK(panels_fit(dtype) && x.scalar_type() == dtype && out.scalar_type() == dtype,
              "linear_panels: x, panels and out of one dtype the panels take here");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [M, K], contiguous");
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == (bf16 ? 4 : 3) &&
                  panels.size(2) == kPanel && (!bf16 || panels.size(3) == 2),
              "panels as pack_panels gives them on this build");
  const int64_t stored_k = bf16 ? 2 * panels.size(1) : panels.size(1);
  TORCH_CHECK(stored_k == K || (bf16 && stored_k == K + 1), "x's K ", K, " against the panels'");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.is_contiguous(), "out [M, N], contiguous");
  const int64_t P = panels.size(0);
  TORCH_CHECK(N <= P * kPanel && N > (P - 1) * kPanel, "out's N ", N, " against ", P, " panels");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == dtype, "bias [N], x's dtype");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  if (M == 0) return;
  const int64_t element = bf16 ? 2 : 4;
  const int64_t most = kBlockBytes / (kPanel * element) / 2 * 2;
  const int64_t blocks = (K + most - 1) / most;
  Problem pr{M, K, N, P, 0, stored_k * kPanel};
  pr.block_len = ((K + blocks - 1) / blocks + 1) / 2 * 2;  // even: a block starts at a pair
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  if (!bf16) {
    run<float>(pr, x.data_ptr<float>(), panels.data_ptr<float>(), out.data_ptr<float>(), b);
    return;
  }
  if constexpr (kBf16Panels) {
    run<at::BFloat16>(pr, x.data_ptr<at::BFloat16>(), panels.data_ptr<at::BFloat16>(),
                      out.data_ptr<at::BFloat16>(), b);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def("panels_fit(ScalarType dtype) -> bool", &panels_fit);
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
