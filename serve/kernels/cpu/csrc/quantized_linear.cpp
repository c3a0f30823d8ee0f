// y = x W^T (+ b) with W a quantized checkpoint's weight in serve's packed layout
// (serve/kernels/packed_weight.py): codes uint4 or fp4 e2m1 (two per byte), uint8 or fp8
// e4m3fn, and float32 scales and zero points per output and group of inputs:
//
//     W[n, k] = (code(n, k) - zeros[n, g(k)]) * scales[n, g(k)],  g(k) = g_idx[k] or k / group
//
// The codes are read in place: no call holds the whole float weight.
//
// Few rows (decode, up to kFewRowsMax): each thread streams its share of the codes once,
// decodes them in registers and takes their products with every row of x there. Reading
// a byte per two weights (uint4) where float32 reads four is the gain; decoding the codes
// bounds it as much as memory does (one row of a 7B-sized layer on Zen 4, 2 threads:
// uint4 3.5x float32's speed, uint8 3x, fp8 2.8x, fp4 in groups of 32 4x;
// benchmarks/quantized_linear.py).
//
// More rows (prefill, decode batches): each thread dequantizes a tile of outputs x a block
// of inputs into float32 scratch in its L2, then multiplies every row of x by the tile in
// register tiles of 4 x 4 dot products (AVX2: 2 x 4): a weight is dequantized once per
// call, not once per row, and the products run at 75-95% of oneDNN's float32 matmul on a
// prepacked weight (16 to 256 rows). bfloat16 x on a CPU with AVX512_BF16 gets bfloat16
// tiles and the bfloat16 dot-product instruction instead (tiles_bf16).
//
// Groups: where no g_idx is given and the group size is a multiple of 32, a run of 32
// inputs never straddles two groups, and the codes are decoded 32 at a time with one scale
// and zero point; otherwise (GPTQ's act order, odd group sizes) each input looks its group
// up (quantized_codecs.h's dequantize_each).
//
// Vector width: the kernels are written once over vec.h's floatv, the target's own
// register, 16 floats with AVX-512 and 8 with AVX2 (x86-64-v3, the Docker images' target),
// a run of 32 codes being kVecs = 2 or 4 of them; the decoding of codes has code per
// instruction set (quantized_codecs.h: the codecs, and rows dequantized with them), and
// this file holds the loops over them. (Written for 16-float values, the AVX2 build kept
// its sums in memory: 4096 x 4096 uint4, one row, 2 threads, 3.9 ms where AVX-512 took 0.54.)
//
// The sums are float32 whatever x's dtype; a bfloat16 y is rounded once, from them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quantized_codecs.h"
#include "vec.h"

namespace serve_cpu {
namespace {

// The most rows that stream the codes; more go to the tiles. With 2 threads on Zen 4
// (uint4, groups of 128), streaming is up to 2x faster at 1 to 4 rows (as fast at 4 rows
// of the default model's down projection); from 8 rows the tiles are faster at the
// default model's shapes (576 x 1536: 0.12 ms against 0.18), streaming still 15% faster
// at 7B's (4096 x 4096: 2.2 ms against 2.6), and from 12 rows the tiles win everywhere.
constexpr int kFewRowsMax = 4;
// The tile path's scratch: outputs x inputs of a tile, 64 x 2048 float32 = 512 KB, in L2
// (on Zen 4, one thread, 4096 x 4096, 256 rows: 101 GFLOP/s against 96 for
// 128 x 1024 and 85 for 128 x 4096; smaller blocks of inputs pay more for the sums of
// lanes at their ends: 128 x 256, 83).
constexpr int64_t kTileOutputs = 64;
constexpr int64_t kTileInputs = 2048;
// A core's L1 data cache, the least of those we run on (AMD's; Intel's are 48 KB).
constexpr int64_t kL1Bytes = 32 << 10;

// Pins a loaded value to a register. GCC otherwise folds the load into each FMA that uses
// it, as a memory operand, so a run of x meeting four outputs is read four times, and
// the loads, not the FMAs, bound the loop (AVX-512: 45 of 111 GFLOP/s in the tiles).
template <typename vector_t>
inline void in_register(vector_t& v) {
#if defined(__AVX512F__) || defined(__AVX2__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// x as float32 [M, K], each full run of 32 inputs reordered as Uint4::decode yields its
// codes (the 16 even inputs, then the 16 odd ones) where `permute`; the inputs past the
// last full run stay in order.
template <typename x_t>
void x_as_float(const x_t* x, float* dst, int64_t M, int64_t K, bool permute) {
  const int64_t runs_end = permute ? K / kRun * kRun : 0;
  for (int64_t m = 0; m < M; ++m) {
    const x_t* src = x + m * K;
    float* out = dst + m * K;
    for (int64_t k = 0; k < runs_end; k += kRun) {
      for (int64_t t = 0; t < 16; ++t) {
        out[k + t] = static_cast<float>(src[k + 2 * t]);
        out[k + 16 + t] = static_cast<float>(src[k + 2 * t + 1]);
      }
    }
    for (int64_t k = runs_end; k < K; ++k) out[k] = static_cast<float>(src[k]);
  }
}

template <typename out_t>
inline void write(out_t* y, float v) {
  *y = static_cast<out_t>(v);  // bfloat16: rounded to nearest even, once
}

// R outputs from n0 on, for M <= 4 rows of x (float32, runs permuted as the codec
// decodes them). Each decoded run of codes is multiplied by its group's scale and then
// meets every row of x; each run of x, loaded once, meets all R outputs' codes, so the
// loads of x are shared R ways and the decoding M ways. The zero points come out of the
// sums, group by group,
//
//     sum_k (c_k - z) s x_k = sum_k (c_k s) x_k - z s sum_k x_k,
//
// with `x_sums` holding sum_k x_k for each row of x and group [M, groups]. (The reference
// rounds (c - z) s before the products; the two differ by float32 rounding of the sums.)
//
// kGroupSums (one output and row, groups of several runs): the codes' products are summed
// unscaled in chains of their own, which are scaled into the sums once per group, saving a
// multiply per decoded vector (decoding bounds one row; 256 x 4096 uint4 in groups of
// 128, one thread, weight in L2: AVX2 53 us against 61, AVX-512 55 against 58). More
// rows or outputs have no registers for the second set of sums.
template <int I>
using Index = std::integral_constant<int, I>;

// sum_g z[g] s[g] xs[g] over n groups: the zero points' part of an output's sum for a row
// of x, taken apart from the loop over the codes, where its scalars would take registers.
inline float zero_point_sum(const float* z, const float* s, const float* xs, int64_t n) {
  floatv acc{};
  int64_t g = 0;
  for (; g + kLanes <= n; g += kLanes) acc += loadv(z + g) * loadv(s + g) * loadv(xs + g);
  float sum = horizontal_sum(acc);
  for (; g < n; ++g) sum += z[g] * s[g] * xs[g];
  return sum;
}

template <typename Codec, int R, int M, int C, bool kGroupSums, typename out_t>
void stream_block(const Packed& w, const float* x, const float* x_sums, const float* bias,
                  out_t* y, int64_t n0) {
  static_assert(!kGroupSums || (R == 1 && M == 1));
  const int64_t K = w.K, N = w.N;
  const int64_t groups = (K + w.group_size - 1) / w.group_size;
  const uint8_t* rows[R];
  const float* scales[R];
  const float* zeros[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = w.codes + (n0 + r) * w.row_bytes;
    scales[r] = w.scales + (n0 + r) * w.num_groups;
    zeros[r] = w.zeros != nullptr ? w.zeros + (n0 + r) * w.num_groups : nullptr;
  }
  // C chains of sums per output and row of x: an FMA waits on the one before it in its
  // chain, 4 cycles, so a single output and row needs 4 chains to keep the FMA unit busy.
  // Sums of the target's own width (floatv): see vec.h for what float16v costs on AVX2.
  floatv acc[C][R][M], group_acc[C][R][M];
  float rest[R][M];  // the scalar parts: inputs past the last full run, zero points
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      for (int c = 0; c < C; ++c) acc[c][r][m] = group_acc[c][r][m] = floatv{};
      rest[r][m] = 0.0f;
    }
  float s[R];                        // group g's scales
  typename Codec::Scale applied[R];  // the same as the codec applies them (!kGroupSums)
  const auto set_group = [&](int64_t g) {
    for (int r = 0; r < R; ++r) {
      s[r] = scales[r][g];
      if constexpr (!kGroupSums && !(kLanes == 16 && M == 1)) applied[r] = Codec::scale(s[r]);
    }
  };
  // One run of 32 inputs from k: its vector j (of kVecs) summed into chain (B + j) % C.
  const auto run = [&](int64_t k, auto first_chain) {
    constexpr int B = decltype(first_chain)::value;
    floatv wv[R][kVecs];
    for (int r = 0; r < R; ++r) {
      if constexpr (kGroupSums) {
        Codec::decode(rows[r], k, wv[r]);
      } else if constexpr (kLanes == 16 && M == 1) {
        // AVX-512, one row: scaled after decoding. A table scaled per group (Uint4's, Fp4's
        // decode_scaled) is faster where the codes are in cache, but with the codes from
        // memory it is slower (4096 x 4096 fp4, 2 threads: 0.66 ms against 0.50).
        Codec::decode(rows[r], k, wv[r]);
        for (int j = 0; j < kVecs; ++j) wv[r][j] *= s[r];
      } else {
        Codec::decode_scaled(rows[r], k, applied[r], wv[r]);
      }
    }
    auto& sums = kGroupSums ? group_acc : acc;
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kVecs; ++j) {
        floatv xv = loadv(x + m * K + k + j * kLanes);
        if constexpr (R > 1) in_register(xv);
        for (int r = 0; r < R; ++r) sums[(B + j) % C][r][m] += wv[r][j] * xv;
      }
  };
  // The end of a group: its sums scaled into the others (kGroupSums).
  const auto end_group = [&] {
    if constexpr (kGroupSums)
      for (int c = 0; c < C; ++c) {
        acc[c][0][0] += group_acc[c][0][0] * s[0];
        group_acc[c][0][0] = floatv{};
      }
  };
  int64_t g = 0;
  if (w.group_size == kRun && !kGroupSums) {
    // Groups of one run (32 inputs, MXFP4's), in a loop of their own. Where there are more
    // chains than a run's vectors (AVX-512, one row), groups go in pairs, the second into
    // the chains the first leaves idle (4096 x 4096 in groups of 32, one row, 2 threads:
    // fp4 0.51 ms against 0.67, uint4 0.50 against 0.73).
    if constexpr (C > kVecs) {
      for (; (g + 2) * kRun <= K; g += 2) {
        set_group(g);
        run(g * kRun, Index<0>{});
        set_group(g + 1);
        run((g + 1) * kRun, Index<kVecs>{});
      }
    } else {
      for (; (g + 1) * kRun <= K; ++g) {
        set_group(g);
        run(g * kRun, Index<0>{});
      }
    }
  }
  for (; g < groups; ++g) {
    int64_t k, end;
    group_span(w, g, 0, K, k, end);
    set_group(g);
    if constexpr (C > kVecs) {  // runs in pairs, as groups above
      for (; k + 2 * kRun <= end; k += 2 * kRun) {
        run(k, Index<0>{});
        run(k + kRun, Index<kVecs>{});
      }
    }
    for (; k + kRun <= end; k += kRun) run(k, Index<0>{});
    for (; k < end; ++k) {  // the inputs past the last full run (the last group's)
      for (int r = 0; r < R; ++r) {
        const float wk = Codec::code(rows[r], k) * s[r];
        for (int m = 0; m < M; ++m) rest[r][m] += wk * x[m * K + k];
      }
    }
    end_group();
  }
  if (w.zeros != nullptr)  // the zero points out of the sums (the identity above)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        rest[r][m] -= zero_point_sum(zeros[r], scales[r], x_sums + m * groups, groups);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      floatv total = acc[0][r][m];
      for (int c = 1; c < C; ++c) total += acc[c][r][m];
      const float sum = horizontal_sum(total) + rest[r][m];
      write(y + m * N + n0 + r, sum + (bias != nullptr ? bias[n0 + r] : 0.0f));
    }
}

// Outputs per block of stream_block (R) and chains of sums (C) for M rows of x: as many
// as keep the C x R x M sums, R x kVecs decoded vectors and a run of x in registers
// (AVX-512: 32 of them, AVX2: 16). One row streams one output at a time: blocks of four
// outputs read four streams of codes at once, which the prefetchers serve worse
// (4096 x 4096 uint4 on 2 threads: 0.75 ms against 0.53). With AVX-512, from two rows the
// FMAs bound the pass, and four outputs share each run of x. With AVX2 a block of two
// outputs does not fit (2 x 4 decoded vectors and their sums), so one output meets all
// rows, with at least 8 chains of sums among them.
template <int M>
constexpr int block_outputs() {
#ifdef __AVX512F__
  return M == 1 ? 1 : 4;
#else
  return 1;
#endif
}

template <int M>
constexpr int block_chains() {
#ifdef __AVX512F__
  return M == 1 ? 4 : (block_outputs<M>() * M >= 4 ? 1 : 2);
#else
  return M <= 2 ? 4 : 2;
#endif
}

template <typename Codec, int M, typename out_t>
void stream_rows(const Packed& w, const float* x, const float* x_sums, const float* bias,
                 out_t* y, int64_t n_begin, int64_t n_end) {
  constexpr int R = block_outputs<M>(), C = block_chains<M>();
  int64_t n = n_begin;
  if constexpr (M == 1 && R == 1) {
    if (w.group_size > kRun) {
      for (; n < n_end; ++n) stream_block<Codec, 1, 1, C, true>(w, x, x_sums, bias, y, n);
      return;
    }
  }
#ifndef __AVX512F__
  // AVX2, four rows of x that outgrow L1 (64 KB at 4096 inputs): each output's pass reads
  // them from L2, which bounds it. Pairs of outputs halve the reads, though their sums and
  // codes spill a little (256 x 4096 uint4, one thread, weight in L2: 145 us against 172;
  // at 1024 inputs, x in L1, 143 against 125).
  if constexpr (M == 4) {
    if (M * w.K * static_cast<int64_t>(sizeof(float)) > kL1Bytes) {
      for (; n + 2 <= n_end; n += 2) stream_block<Codec, 2, M, 1, false>(w, x, x_sums, bias, y, n);
      for (; n < n_end; ++n) stream_block<Codec, 1, M, C, false>(w, x, x_sums, bias, y, n);
      return;
    }
  }
#endif
  for (; n + R <= n_end; n += R) stream_block<Codec, R, M, C, false>(w, x, x_sums, bias, y, n);
  for (; n < n_end; ++n) stream_block<Codec, 1, M, C, false>(w, x, x_sums, bias, y, n);
}

// The same for weights whose inputs look their groups up: each output's row dequantized
// into `scratch` (K floats, in L1/L2), then its products with the rows of x (in order).
template <typename Codec, int M, typename out_t>
void stream_rows_each(const Packed& w, const float* x, const float* bias, out_t* y,
                      int64_t n_begin, int64_t n_end, float* scratch) {
  const int64_t K = w.K, N = w.N;
  for (int64_t n = n_begin; n < n_end; ++n) {
    dequantize_each<Codec>(w, n, 0, K, scratch);
    floatv acc[M];
    for (int m = 0; m < M; ++m) acc[m] = floatv{};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      const floatv wk = loadv(scratch + k);
      for (int m = 0; m < M; ++m) acc[m] += wk * loadv(x + m * K + k);
    }
    for (int m = 0; m < M; ++m) {
      float sum = horizontal_sum(acc[m]);
      for (int64_t t = k; t < K; ++t) sum += scratch[t] * x[m * K + t];
      write(y + m * N + n, sum + (bias != nullptr ? bias[n] : 0.0f));
    }
  }
}

template <typename Codec, int M, typename out_t>
void stream_pass(const Packed& w, const float* x, const float* x_sums, const float* bias,
                 out_t* y) {
  // Chunks of at least ~64 KB of codes: fewer scheduling points, and a small layer stays
  // on one thread rather than paying to wake another.
  const int64_t grain = std::max<int64_t>(4, 65536 / std::max<int64_t>(w.row_bytes, 1));
  at::parallel_for(0, w.N, grain, [&](int64_t begin, int64_t end) {
    if (w.groups == nullptr) {
      stream_rows<Codec, M>(w, x, x_sums, bias, y, begin, end);
    } else {
      std::vector<float> scratch(w.K);
      stream_rows_each<Codec, M>(w, x, bias, y, begin, end, scratch.data());
    }
  });
}

template <typename Codec, typename out_t>
void stream(const Packed& w, const float* x, const float* bias, out_t* y, int64_t M) {
  const int64_t K = w.K;
  std::vector<float> x_sums;
  if (w.groups == nullptr) {
    const int64_t groups = (K + w.group_size - 1) / w.group_size;
    x_sums.assign(M * groups, 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        int64_t k, end;
        group_span(w, g, 0, K, k, end);
        float sum = 0.0f;
        for (; k < end; ++k) sum += x[m * K + k];
        x_sums[m * groups + g] = sum;
      }
  }
  const float* sums = x_sums.empty() ? nullptr : x_sums.data();
  switch (M) {
    case 1: stream_pass<Codec, 1>(w, x, sums, bias, y); break;
    case 2: stream_pass<Codec, 2>(w, x, sums, bias, y); break;
    case 3: stream_pass<Codec, 3>(w, x, sums, bias, y); break;
    default: stream_pass<Codec, 4>(w, x, sums, bias, y); break;
  }
}

// Rows of x and outputs per register tile of the tile products: MR x NR sums of kLanes
// lanes, with MR runs of x and NR of weights, in registers (AVX-512: 4 x 4 and 8 loads,
// 24 of its 32; AVX2: 2 x 4 and 6 loads, 14 of its 16: 256 x 4096 uint4, 64 rows, one
// thread, 69 GFLOP/s against 65 for 4 x 2, 66 for 3 x 3, 47 for 4 x 3, which spills).
#ifdef __AVX512F__
constexpr int kMR = 4, kNR = 4;
#elif defined(__AVX2__)
constexpr int kMR = 2, kNR = 4;
#else
constexpr int kMR = 2, kNR = 2;
#endif

// c[m][n] += sum_k x[m][k] w[n][k] over kk inputs, for MR rows of x and NR rows of w (both
// in order along k): MR x NR dot products at once, each run of x and w loaded once for
// NR or MR of them; the lanes summed at the end.
template <int MR, int NR>
void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kk, float* c,
              int64_t ldc) {
  floatv acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = floatv{};
  int64_t k = 0;
  for (; k + kLanes <= kk; k += kLanes) {
    floatv xv[MR], wv[NR];
    for (int m = 0; m < MR; ++m) {
      xv[m] = loadv(x + m * ldx + k);
      in_register(xv[m]);
    }
    for (int n = 0; n < NR; ++n) {
      wv[n] = loadv(w + n * ldw + k);
      in_register(wv[n]);
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m * NR + n] += xv[m] * wv[n];
  }
  float sums[MR * NR];
#ifdef __AVX512F__
  if constexpr (MR * NR == 16) {
    store16(sums, transpose_sum16(acc));
  } else
#endif
  {
    for (int i = 0; i < MR * NR; ++i) sums[i] = horizontal_sum(acc[i]);
  }
  for (; k < kk; ++k)
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) sums[m * NR + n] += x[m * ldx + k] * w[n * ldw + k];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) c[m * ldc + n] += sums[m * NR + n];
}

template <int MR>
void dot_tile_rows(int nr, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kk,
                   float* c, int64_t ldc) {
  switch (nr) {
    case 1: dot_tile<MR, 1>(x, ldx, w, ldw, kk, c, ldc); break;
    case 2: if constexpr (kNR >= 2) dot_tile<MR, 2>(x, ldx, w, ldw, kk, c, ldc); break;
    case 3: if constexpr (kNR >= 3) dot_tile<MR, 3>(x, ldx, w, ldw, kk, c, ldc); break;
    case 4: if constexpr (kNR >= 4) dot_tile<MR, 4>(x, ldx, w, ldw, kk, c, ldc); break;
  }
}

// The products of rows [0, M) of x (ldx apart) with rows [0, N) of w over kk inputs, added
// to c [M, N]: register tiles of kMR x kNR, smaller ones at the edges.
void dot_block(const float* x, int64_t ldx, int64_t M, const float* w, int64_t N, int64_t kk,
               float* c) {
  for (int64_t m = 0; m < M; m += kMR) {
    const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m));
    for (int64_t n = 0; n < N; n += kNR) {
      const int nr = static_cast<int>(std::min<int64_t>(kNR, N - n));
      const float* xs = x + m * ldx;
      const float* ws = w + n * kk;
      float* cs = c + m * N + n;
      switch (mr) {
        case 1: dot_tile_rows<1>(nr, xs, ldx, ws, kk, kk, cs, N); break;
        case 2: if constexpr (kMR >= 2) dot_tile_rows<2>(nr, xs, ldx, ws, kk, kk, cs, N); break;
        case 3: if constexpr (kMR >= 3) dot_tile_rows<3>(nr, xs, ldx, ws, kk, kk, cs, N); break;
        case 4: if constexpr (kMR >= 4) dot_tile_rows<4>(nr, xs, ldx, ws, kk, kk, cs, N); break;
      }
    }
  }
}

// Outputs per tile: about kTileOutputs, but the number of tiles a multiple of the threads'
// so none waits on another's last tile (576 outputs on 2 threads: 10 tiles of 60, not 9
// of 64), and a multiple of the register tiles' kNR.
int64_t tile_outputs(int64_t N) {
  const int64_t threads = at::get_num_threads();
  int64_t tiles = (N + kTileOutputs - 1) / kTileOutputs;
  tiles = (tiles + threads - 1) / threads * threads;
  const int64_t outputs = (N + tiles - 1) / tiles;
  return (outputs + kNR - 1) / kNR * kNR;
}

// All rows of x (float32, in order) against tiles of the dequantized weight: each thread
// dequantizes a tile of outputs x a block of inputs into its scratch, then takes the
// products of the tile with every row of x, four rows of x at a time (their 32 KB in L1)
// against all of the tile's (in L2).
template <typename Codec, typename out_t>
void tiles(const Packed& w, const float* x, const float* bias, out_t* y, int64_t M) {
  const int64_t K = w.K, N = w.N;
  const int64_t tile_n = tile_outputs(N);
  const int64_t tile_k = std::min<int64_t>(K, kTileInputs);
  const int64_t num_tiles = (N + tile_n - 1) / tile_n;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(tile_n * tile_k), acc(M * tile_n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_n, nn = std::min(tile_n, N - n0);
      std::fill(acc.begin(), acc.begin() + M * nn, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += tile_k) {
        const int64_t kk = std::min(tile_k, K - k0);
        for (int64_t j = 0; j < nn; ++j) dequantize<Codec>(w, n0 + j, k0, k0 + kk, &tile[j * kk]);
        dot_block(x + k0, K, M, tile.data(), nn, kk, acc.data());
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nn; ++j)
          write(y + m * N + n0 + j, acc[m * nn + j] + (bias != nullptr ? bias[n0 + j] : 0.0f));
    }
  });
}

#ifdef __AVX512BF16__
// bfloat16 x where the CPU has AVX512_BF16: the tiles are dequantized to bfloat16 (as the
// reference rounds its weights for bfloat16 x) and the products taken by the dot-product
// instruction, two products per float32 lane summed in float32, twice the float32 FMA's
// rate (4096 x 4096, 64 rows, 2 threads: 7.0 ms, where float32 math took 12.4 and oneDNN
// takes 5.3 on bfloat16 weights).
template <int MR, int NR>
void dot_tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t kk,
                   float* c, int64_t ldc) {
  float16v acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = float16v{};
  int64_t k = 0;
  for (; k + 32 <= kk; k += 32) {
    __m512bh xv[MR], wv[NR];
    for (int m = 0; m < MR; ++m) {
      xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
      in_register(xv[m]);
    }
    for (int n = 0; n < NR; ++n) {
      wv[n] = (__m512bh)_mm512_loadu_si512(w + n * ldw + k);
      in_register(wv[n]);
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n)
        acc[m * NR + n] = (float16v)_mm512_dpbf16_ps((__m512)acc[m * NR + n], xv[m], wv[n]);
  }
  float sums[MR * NR];
  if constexpr (MR * NR == 16) {
    store16(sums, transpose_sum16(acc));
  } else {
    for (int i = 0; i < MR * NR; ++i) sums[i] = horizontal_sum(acc[i]);
  }
  const auto widen = [](uint16_t bits) {
    const uint32_t word = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &word, sizeof(value));
    return value;
  };
  for (; k < kk; ++k)
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n)
        sums[m * NR + n] += widen(x[m * ldx + k]) * widen(w[n * ldw + k]);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) c[m * ldc + n] += sums[m * NR + n];
}

template <int MR>
void dot_tile_bf16_rows(int nr, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kk,
                        float* c, int64_t ldc) {
  switch (nr) {
    case 1: dot_tile_bf16<MR, 1>(x, ldx, w, kk, kk, c, ldc); break;
    case 2: dot_tile_bf16<MR, 2>(x, ldx, w, kk, kk, c, ldc); break;
    case 3: dot_tile_bf16<MR, 3>(x, ldx, w, kk, kk, c, ldc); break;
    case 4: dot_tile_bf16<MR, 4>(x, ldx, w, kk, kk, c, ldc); break;
  }
}

// Row n's weights [k0, k1) as bfloat16 bits, rounded to nearest even from the float32
// dequantized ones (`row`: k1 - k0 floats of scratch).
template <typename Codec>
void dequantize_bf16(const Packed& w, int64_t n, int64_t k0, int64_t k1, float* row,
                     uint16_t* dst) {
  dequantize<Codec>(w, n, k0, k1, row);
  const int64_t kk = k1 - k0;
  int64_t k = 0;
  for (; k + 32 <= kk; k += 32) {
    const __m512 low = _mm512_loadu_ps(row + k), high = _mm512_loadu_ps(row + k + 16);
    _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
  for (; k < kk; ++k) dst[k] = c10::BFloat16(row[k]).x;
}

// tiles() for bfloat16 x, read as it is.
template <typename Codec>
void tiles_bf16(const Packed& w, const at::BFloat16* x_bf16, const float* bias, at::BFloat16* y,
                int64_t M) {
  const int64_t K = w.K, N = w.N;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_bf16);
  const int64_t tile_n = tile_outputs(N);
  const int64_t tile_k = std::min<int64_t>(K, kTileInputs);
  const int64_t num_tiles = (N + tile_n - 1) / tile_n;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> tile(tile_n * tile_k);
    std::vector<float> row(tile_k), acc(M * tile_n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_n, nn = std::min(tile_n, N - n0);
      std::fill(acc.begin(), acc.begin() + M * nn, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += tile_k) {
        const int64_t kk = std::min(tile_k, K - k0);
        for (int64_t j = 0; j < nn; ++j)
          dequantize_bf16<Codec>(w, n0 + j, k0, k0 + kk, row.data(), &tile[j * kk]);
        for (int64_t m = 0; m < M; m += kMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m));
          for (int64_t n = 0; n < nn; n += kNR) {
            const int nr = static_cast<int>(std::min<int64_t>(kNR, nn - n));
            const uint16_t* xs = x + m * K + k0;
            const uint16_t* ws = tile.data() + n * kk;
            float* cs = acc.data() + m * nn + n;
            switch (mr) {
              case 1: dot_tile_bf16_rows<1>(nr, xs, K, ws, kk, cs, nn); break;
              case 2: dot_tile_bf16_rows<2>(nr, xs, K, ws, kk, cs, nn); break;
              case 3: dot_tile_bf16_rows<3>(nr, xs, K, ws, kk, cs, nn); break;
              case 4: dot_tile_bf16_rows<4>(nr, xs, K, ws, kk, cs, nn); break;
            }
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nn; ++j)
          write(y + m * N + n0 + j, acc[m * nn + j] + (bias != nullptr ? bias[n0 + j] : 0.0f));
    }
  });
}
#endif

template <typename Codec, typename x_t>
void run(const Packed& w, const at::Tensor& x, const std::optional<at::Tensor>& bias,
         at::Tensor& out) {
  const int64_t M = x.size(0), K = w.K;
  const x_t* xp = x.data_ptr<x_t>();
  std::vector<float> bias32;
  if (bias.has_value()) {
    const x_t* bp = bias->data_ptr<x_t>();
    bias32.assign(bp, bp + w.N);
  }
  const float* b = bias.has_value() ? bias32.data() : nullptr;
  x_t* y = out.data_ptr<x_t>();
  const bool few = M <= kFewRowsMax;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<x_t, at::BFloat16>) {
    if (!few) {
      tiles_bf16<Codec>(w, xp, b, y, M);
      return;
    }
  }
#endif
  // The streaming kernel takes x in the codec's decode order; the tiles in order.
  const bool permute = few && Codec::kPermuted && w.groups == nullptr;
  std::vector<float> x32;
  const float* xf = nullptr;
  if constexpr (std::is_same_v<x_t, float>) {
    if (!permute) xf = xp;
  }
  if (xf == nullptr) {
    x32.resize(M * K);
    x_as_float(xp, x32.data(), M, K, permute);
    xf = x32.data();
  }
  if (few)
    stream<Codec>(w, xf, b, y, M);
  else
    tiles<Codec>(w, xf, b, y, M);
}

void quantized_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes,
                      const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                      const std::optional<at::Tensor>& g_idx, std::string_view kind,
                      int64_t group_size, const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [M, K], contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "codes: [N, *], contiguous");
  const int64_t N = codes.size(0);
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N,
              "out: [M, N], contiguous, x's dtype");
  int64_t expected_cols;
  if (kind == "uint4" || kind == "fp4") {
    TORCH_CHECK(codes.scalar_type() == at::kByte, kind, " codes: uint8");
    expected_cols = Uint4::row_bytes(K);
  } else if (kind == "uint8") {
    TORCH_CHECK(codes.scalar_type() == at::kByte, "uint8 codes: uint8");
    expected_cols = K;
  } else if (kind == "fp8") {
    TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn, "fp8 codes: float8_e4m3fn");
    expected_cols = K;
  } else {
    TORCH_CHECK(false, "kind: uint4, uint8, fp8 or fp4, not ", kind);
  }
  TORCH_CHECK(codes.size(1) == expected_cols, kind, " codes of ", K, " inputs: [N, ",
              expected_cols, "], not [N, ", codes.size(1), "]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == N &&
                  scales.is_contiguous(),
              "scales: float32 [N, G], contiguous");
  const int64_t G = scales.size(1);
  if (zeros.has_value())
    TORCH_CHECK(zeros->scalar_type() == at::kFloat && zeros->sizes() == scales.sizes() &&
                    zeros->is_contiguous(),
                "zeros: float32, scales' shape, contiguous");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(),
                "bias: [N], x's dtype, contiguous");
  TORCH_CHECK(group_size >= 1, "group_size >= 1");

  Packed w{static_cast<const uint8_t*>(codes.data_ptr()),
           expected_cols,
           scales.data_ptr<float>(),
           zeros.has_value() ? zeros->data_ptr<float>() : nullptr,
           G,
           group_size,
           nullptr,
           N,
           K};
  // Each input's group where runs of 32 cannot share one (see the top of this file).
  std::vector<int32_t> groups;
  if (g_idx.has_value()) {
    TORCH_CHECK(g_idx->scalar_type() == at::kLong && g_idx->numel() == K && g_idx->is_contiguous(),
                "g_idx: int64 [K], contiguous");
    const int64_t* gp = g_idx->data_ptr<int64_t>();
    groups.resize(K);
    for (int64_t k = 0; k < K; ++k) {
      TORCH_CHECK(gp[k] >= 0 && gp[k] < G, "g_idx[", k, "] = ", gp[k], " outside [0, ", G, ")");
      groups[k] = static_cast<int32_t>(gp[k]);
    }
  } else {
    TORCH_CHECK(G * group_size >= K, G, " groups of ", group_size, " cannot cover ", K,
                " inputs");
    if (group_size % kRun != 0) {
      groups.resize(K);
      for (int64_t k = 0; k < K; ++k) groups[k] = static_cast<int32_t>(k / group_size);
    }
  }
  if (!groups.empty()) w.groups = groups.data();
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    if (bias.has_value()) out.add_(*bias);
    return;
  }

  const auto dispatch = [&](auto codec) {
    using Codec = decltype(codec);
    if (dtype == at::kFloat)
      run<Codec, float>(w, x, bias, out);
    else
      run<Codec, at::BFloat16>(w, x, bias, out);
  };
  if (kind == "uint4")
    dispatch(Uint4{});
  else if (kind == "uint8")
    dispatch(Uint8{});
  else if (kind == "fp8")
    dispatch(Fp8{});
  else
    dispatch(Fp4{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def("quantized_linear(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor? zeros, "
        "Tensor? g_idx, str kind, int group_size, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) { m.impl("quantized_linear", &quantized_linear); }

namespace ops {

void quantized_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes,
                      const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                      const std::optional<at::Tensor>& g_idx, std::string_view kind,
                      int64_t group_size, const std::optional<at::Tensor>& bias) {
  serve_cpu::quantized_linear(out, x, codes, scales, zeros, g_idx, kind, group_size, bias);
}

}  // namespace ops

}  // namespace serve_cpu
