// A stack of Llama-, Gemma- or GPT-2-style decoder layers in one call.
//
// The ~10 ops a layer cost more from Python than some of them take to run: their
// dispatch, wrappers and module calls were 3-5 ms of a 14-21 ms one-token step for the
// default model, and ~7% of a 64-row decode step. Here the same ops run in the same order
// on the same tensors, called as C++ functions, so the output is the Python loop's bit for
// bit (serve/models/native_layer_stack.py decides which models and steps qualify, and
// holds the contract). The linears run as `serve.kernels.cpu.linear` runs them: the
// few-row kernel on the weights, or, where the caller passes the packed copies (steps of
// more rows), the panel kernel on its panels (float32; bfloat16 on AVX512_BF16 builds) or
// oneDNN's `_linear_pointwise` on its own layout.
//
// A layer: h = norm(x [+ residual]); q, k, v = split(h W_qkv^T + b); q times the layer's
// query scale where it is not 1 (OPT scales q itself, then attends at scale 1); q, k each
// rms_norm'd per head where the model has q/k norms (Qwen3, Gemma 3); rotate q and k
// where the model has rotary tables (GPT-2's positions were added to the embeddings);
// write k, v into the layer's cache; attend (the scores soft-capped where the layer's cap
// is not 0: Gemma 2); x = o W_o^T + b; h = norm(x + residual);
// x = act_and_mul(h W_up^T + b) W_down^T + b, the gate's activation SiLU or GeLU (exact or
// tanh's approximation: Gemma's GeGLU), or without `gated_mlp` x = act(h W_up^T + b)
// W_down^T + b (GPT-2's MLP: GeLU's forms or ReLU); each block's x scaled by the residual
// multiplier where it is not 1 (Granite), or rms_norm'd alone before it joins the residual
// where the model has `block_norm_weights` (Gemma's sandwich). The norms are RMSNorm, or
// with `norm` "layer" torch's layer_norm of x + residual (weight and bias optional).
// With `parallel_residual` (GPT-NeoX) attention and the MLP each read their own norm of
// the layer's input x, and the layer gives (mlp + attention) + x; the residual returned is
// then the last layer's input.
// With `output_rows` (the rows the step reads after the model: its sampled tokens), the
// last layer's o_proj, norm and MLP run for those rows alone, and the stack returns them
// in that order: a prompt chunk's other rows need only their K/V, which every layer has
// written by then. `weights` holds kWeightsPerLayer entries a layer in that order, the
// biases None where the model has none (and a LayerNorm's weight where it has no affine
// part); `qk_norm_weights` the q and k norms' weights a layer, or nothing;
// `block_norm_weights` the norms of attention's and the MLP's outputs a layer, or nothing.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

namespace serve_cpu {
namespace {

// input norm W, input norm b, qkv W, qkv b, o W, o b, post-attention norm W, post-attention
// norm b, up W, up b, down W, down b (up: gate_up where the MLP is gated; the norms' b None
// for RMSNorm)
constexpr int64_t kWeightsPerLayer = 12;

// Per layer: qkv, o, up, down.
constexpr int64_t kLinearsPerLayer = 4;

// RMSNorm over each head's [head_dim] row, as the loop's `norm(t.reshape(-1, head_dim))`:
// a contiguous copy of the strided heads (`reshape` returns a strided view of one head a
// token: `serve.kernels.cpu.rms_norm` copies it too), normed into a new tensor of their
// shape.
at::Tensor head_norm(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  const at::Tensor rows = heads.reshape({-1, heads.size(2)}).contiguous();
  at::Tensor out = at::empty_like(rows);
  ops::rms_norm(out, out, rows, std::nullopt, weight, eps);
  return out.view(heads.sizes());
}

// oneDNN's linear on a weight `torch.ops.mkldnn._reorder_linear_weight` packed, as Python
// calls it (no post-op, no algorithm).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(""));
}

// rms_norm of x's rows with no residual (a sandwich's norm of a block's output), as the loop's
// `norm(x)`.
at::Tensor norm_alone(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  ops::rms_norm(out, out, x, std::nullopt, weight, eps);
  return out;
}

// The MLP's activation. Gated: act(gate) * up over [T, 2d] -> [T, d], as `ActAndMul`
// computes it: the native kernel for SiLU, torch's gelu and mul on the halves otherwise.
// Plain: act(x), as `Activation` computes it (serve/models/layers/activation.py).
enum class Activation { kSilu, kGelu, kGeluTanh, kGeluNew, kRelu };

Activation parse_activation(c10::string_view name, bool gated) {
  if (name == "silu") return Activation::kSilu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (!gated && name == "gelu_new") return Activation::kGeluNew;
  if (!gated && name == "relu") return Activation::kRelu;
  TORCH_CHECK(false, "decoder_layers: activation silu, gelu or gelu_tanh (gated), or those, "
              "gelu_new or relu (plain), not ", name, gated ? " (gated)" : " (plain)");
}

// act(x) by the same torch ops as the loop's function, so in the same rounding.
at::Tensor activate(const at::Tensor& x, Activation activation) {
  switch (activation) {
    case Activation::kSilu: return at::silu(x);
    case Activation::kGelu: return at::gelu(x, "none");
    case Activation::kGeluTanh: return at::gelu(x, "tanh");
    case Activation::kRelu: return at::relu(x);
    case Activation::kGeluNew: {  // GPT-2's tanh approximation, written out as its code has it
      const at::Tensor inner = at::add(x, at::mul(at::pow(x, 3.0), 0.044715));
      return at::mul(at::mul(x, 0.5), at::add(at::tanh(at::mul(inner, 0.7978845608028654)), 1.0));
    }
  }
  TORCH_CHECK(false, "decoder_layers: unknown activation");
}

at::Tensor act_and_mul(const at::Tensor& gate_up, Activation activation) {
  if (activation == Activation::kSilu) {
    at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    ops::silu_and_mul(out, gate_up);
    return out;
  }
  const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
  return at::gelu(halves[0], activation == Activation::kGeluTanh ? "tanh" : "none")
      .mul(halves[1]);
}

// (norm(x + residual), x + residual), or (norm(x), x) without a residual (the first
// layer's input), as the loop's norm(x, residual): the native rms_norm, or torch's
// layer_norm of torch's sum as `LayerNorm` takes them.
std::pair<at::Tensor, at::Tensor> norm_adding(bool layer_norm, const at::Tensor& x,
                                              const std::optional<at::Tensor>& residual,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& bias, double eps) {
  if (layer_norm) {
    const at::Tensor total = residual.has_value() ? at::add(x, *residual) : x;
    return {at::layer_norm(total, {total.size(1)}, weight, bias, eps), total};
  }
  TORCH_CHECK(weight.has_value(), "decoder_layers: an RMSNorm without its weight");
  at::Tensor h = at::empty_like(x);
  at::Tensor total = residual.has_value() ? at::empty_like(x) : x;
  ops::rms_norm(h, total, x, residual, *weight, eps);
  return {h, total};
}

at::Tensor linear(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& packed) {
  TORCH_CHECK(weight.has_value(), "a linear layer without its weight");
  if (packed.has_value() && packed->is_mkldnn()) return onednn_linear(x, *packed, bias);
  at::Tensor out = at::empty({x.size(0), weight->size(0)}, x.options());
  if (packed.has_value()) {
    ops::linear_panels(out, x, *packed, bias);
  } else {
    ops::linear_few_rows(out, x, *weight, bias);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x_in, const at::Tensor& positions,
    const c10::List<std::optional<at::Tensor>>& weights,
    const c10::List<std::optional<at::Tensor>>& packed_weights, at::TensorList qk_norm_weights,
    at::TensorList block_norm_weights, at::TensorList key_caches, at::TensorList value_caches,
    at::TensorList cos_sin_caches, bool is_neox_style,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, at::ArrayRef<double> scales,
    at::ArrayRef<double> query_scales, at::IntArrayRef sliding_windows,
    at::ArrayRef<double> logit_softcaps, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, double eps, double residual_multiplier,
    c10::string_view activation_name, c10::string_view norm_name, bool gated_mlp,
    bool parallel_residual, const std::optional<at::Tensor>& output_rows) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kWeightsPerLayer,
              "decoder_layers: ", kWeightsPerLayer, " weights a layer");
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == num_layers &&
                  (cos_sin_caches.empty() ||
                   static_cast<int64_t>(cos_sin_caches.size()) == num_layers) &&
                  static_cast<int64_t>(scales.size()) == num_layers &&
                  static_cast<int64_t>(query_scales.size()) == num_layers &&
                  static_cast<int64_t>(sliding_windows.size()) == num_layers &&
                  static_cast<int64_t>(logit_softcaps.size()) == num_layers,
              "decoder_layers: one cache pair, rotary table (or none), scale, query scale, window "
              "and soft-cap a layer");
  const bool rotary = !cos_sin_caches.empty();
  TORCH_CHECK(norm_name == "rms" || norm_name == "layer", "decoder_layers: norm rms or layer");
  const bool layer_norm = norm_name == "layer";
  const bool packed = !packed_weights.empty();
  TORCH_CHECK(
      !packed || static_cast<int64_t>(packed_weights.size()) == num_layers * kLinearsPerLayer,
      "decoder_layers: no packed weights, or ", kLinearsPerLayer, " a layer");
  const bool qk_norm = !qk_norm_weights.empty();
  TORCH_CHECK(!qk_norm || static_cast<int64_t>(qk_norm_weights.size()) == num_layers * 2,
              "decoder_layers: no q/k norms, or two a layer");
  const bool block_norms = !block_norm_weights.empty();
  TORCH_CHECK(!block_norms || static_cast<int64_t>(block_norm_weights.size()) == num_layers * 2,
              "decoder_layers: no block output norms, or two a layer");
  const Activation activation = parse_activation(activation_name, gated_mlp);
  TORCH_CHECK(!parallel_residual || (residual_multiplier == 1.0 && !block_norms),
              "decoder_layers: a parallel residual with neither a residual multiplier nor block "
              "output norms");
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "x: [T, hidden], contiguous");
  if (output_rows.has_value()) {
    TORCH_CHECK(output_rows->dim() == 1 && output_rows->scalar_type() == at::kLong,
                "decoder_layers: output_rows, int64 row indices");
    TORCH_CHECK(packed && output_rows->numel() > 2,
                "decoder_layers: output_rows only with packed weights and three rows or more "
                "(oneDNN's rows do not depend on the others' there)");
  }
  int64_t tokens = x_in.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in;
  std::optional<at::Tensor> residual;  // the first layer's input is the residual
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const auto w = [&](int64_t i) { return weights.get(layer * kWeightsPerLayer + i); };
    const auto p = [&](int64_t i) -> std::optional<at::Tensor> {
      if (!packed) return std::nullopt;
      return packed_weights.get(layer * kLinearsPerLayer + i);
    };
    // The input norm, adding the residual from the second layer on; in parallel, of the
    // layer's input, which the layer adds to its output itself.
    auto [h, total] = norm_adding(layer_norm, x, parallel_residual ? std::nullopt : residual,
                                  w(0), w(1), eps);
    residual = total;

    const at::Tensor qkv = linear(h, w(2), w(3), p(0));  // [T, q_size + 2 kv_size]
    at::Tensor q = qkv.narrow(1, 0, q_size);
    if (query_scales[layer] != 1.0) q = q.mul(query_scales[layer]);  // OPT
    q = q.view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    if (qk_norm) {
      q = head_norm(q, qk_norm_weights[layer * 2], eps);
      k = head_norm(k, qk_norm_weights[layer * 2 + 1], eps);
    }
    at::Tensor q_rot = q, k_rot = k;
    if (rotary) {
      q_rot = at::empty(q.sizes(), q.options());
      k_rot = at::empty(k.sizes(), k.options());
      ops::rotary_embedding(q_rot, k_rot, positions, q, k, cos_sin_caches[layer], is_neox_style);
    }

    at::Tensor key_cache = key_caches[layer], value_cache = value_caches[layer];
    ops::reshape_and_cache(k_rot, v, key_cache, value_cache, slot_mapping);
    at::Tensor attended = at::empty(q_rot.sizes(), q_rot.options());
    ops::paged_attention(attended, q_rot, key_cache, value_cache, block_tables, seq_lens,
                         query_start_loc, scales[layer], std::nullopt, sliding_windows[layer],
                         logit_softcaps[layer], std::nullopt);
    at::Tensor attended_rows = attended.view({tokens, q_size});
    if (output_rows.has_value() && layer == num_layers - 1) {
      // Past the last attention, only the rows read after the model are computed.
      attended_rows = attended_rows.index_select(0, *output_rows);
      residual = residual->index_select(0, *output_rows);
      tokens = output_rows->numel();
    }
    at::Tensor o = linear(attended_rows, w(4), w(5), p(1));
    if (residual_multiplier != 1.0) o = o.mul(residual_multiplier);  // Granite
    if (block_norms) o = norm_alone(o, block_norm_weights[layer * 2], eps);  // Gemma

    at::Tensor h2;
    if (parallel_residual) {
      h2 = norm_adding(layer_norm, *residual, std::nullopt, w(6), w(7), eps).first;
    } else {
      auto [normed, total2] = norm_adding(layer_norm, o, residual, w(6), w(7), eps);
      h2 = normed;
      residual = total2;
    }

    const at::Tensor up = linear(h2, w(8), w(9), p(2));
    x = linear(gated_mlp ? act_and_mul(up, activation) : activate(up, activation), w(10), w(11),
               p(3));
    if (parallel_residual) x = at::add(at::add(x, o), *residual);  // as the loop's mlp + attn + x
    if (residual_multiplier != 1.0) x = x.mul(residual_multiplier);
    if (block_norms) x = norm_alone(x, block_norm_weights[layer * 2 + 1], eps);
  }
  TORCH_CHECK(residual.has_value(), "decoder_layers: no layers");
  return {x, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def(
      "decoder_layers(Tensor x, Tensor positions, Tensor?[] weights, Tensor?[] packed_weights, "
      "Tensor[] qk_norm_weights, Tensor[] block_norm_weights, "
      "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor[] cos_sin_caches, "
      "bool is_neox_style, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float[] scales, float[] query_scales, int[] sliding_windows, float[] logit_softcaps, "
      "int num_heads, int num_kv_heads, int head_dim, float eps, float residual_multiplier, "
      "str activation, str norm, bool gated_mlp, bool parallel_residual, "
      "Tensor? output_rows=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
// oneDNN's packed weights are tensors of the MkldnnCPU backend: a call that carries them
// dispatches there.
TORCH_LIBRARY_IMPL(serve_cpu, MkldnnCPU, m) { m.impl("decoder_layers", &decoder_layers); }

}  // namespace serve_cpu
