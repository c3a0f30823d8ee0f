// The ops of this library as plain C++ functions, for kernels that chain them (decoder.cpp)
// without a trip through the dispatcher or Python for each. Each forwards to the function
// its file registers; the contracts are the registered ops' (see each file).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>

namespace serve_cpu::ops {

void rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x,
              const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps);

void silu_and_mul(at::Tensor& out, const at::Tensor& x);

void rotary_embedding(at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& positions,
                      const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache, bool is_neox_style);

void linear_few_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias);

// panels: float32 [P, K, panel width] as `serve_cpu::pack_panels` gives them.
void linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                   const std::optional<at::Tensor>& bias);

// codes: uint8 (kind "uint4": [N, ceil(K / 2)], "uint8": [N, K]) or float8_e4m3fn ("fp8":
// [N, K]); scales and zeros float32 [N, G]; g_idx int64 [K] (serve/kernels/packed_weight.py).
void quantized_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes,
                      const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                      const std::optional<at::Tensor>& g_idx, std::string_view kind,
                      int64_t group_size, const std::optional<at::Tensor>& bias);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                     double logit_softcap, const std::optional<at::Tensor>& sinks);

}  // namespace serve_cpu::ops
