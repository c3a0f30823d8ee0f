// The small per-token ops of a decoder layer, each one pass over its rows: RMSNorm with the
// residual add before it, the gated MLP's silu(gate) * up, and the rotary embedding.
//
// In torch each is several ops (RMSNorm: add, pow, mean, add, rsqrt, mul, mul), each a
// dispatch and a pass over memory; at decode sizes the dispatches cost more than the math.
// Float32 and bfloat16, with every intermediate rounded where torch's sequence of ops
// (serve/kernels/reference.py) rounds it, so the results match it up to the order of the
// sum of squares and the exp's last bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops.h"
#include "vec.h"

namespace serve_cpu {
namespace {

// Rows per thread chunk: enough work per chunk that a few rows stay on one thread.
inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1));
}

// Loads and stores of 16 values of the tensor's dtype, as floats; bfloat16 rounds to
// nearest even on the way out, as torch's conversion does (NaN stays a quiet NaN).
template <typename scalar_t>
struct Lanes;

template <>
struct Lanes<float> {
  static float16v load(const float* p) { return load16(p); }
  static void store(float* p, float16v v) { store16(p, v); }
  static float16v round(float16v v) { return v; }
};

template <>
struct Lanes<at::BFloat16> {
  static float16v load(const at::BFloat16* p) {
    return load16_bf16(reinterpret_cast<const uint16_t*>(p));
  }
  static int16v rounded_bits(float16v v) {
    const int16v bits = (int16v)v;
    const int16v rounded = bits + (((bits >> 16) & 1) + 0x7FFF);
    return v != v ? (int16v){} + (0x7FC0 << 16) : rounded & ~0xFFFF;
  }
  static void store(at::BFloat16* p, float16v v) {
    const int16v bits = rounded_bits(v) >> 16;
    const uint16x16 h = __builtin_convertvector(bits, uint16x16);
    __builtin_memcpy(p, &h, sizeof(h));
  }
  static float16v round(float16v v) { return (float16v)rounded_bits(v); }
};

// out = weight * rms_norm(x) (torch: normed rounded to the dtype, then the product); with
// residual: sum = x + residual (rounded) first, and the norm is of the sum.
template <typename scalar_t>
void rms_norm_rows(scalar_t* out, scalar_t* sum, const scalar_t* x, const scalar_t* residual,
                   const scalar_t* weight, float eps, int64_t hidden, int64_t begin,
                   int64_t end) {
  using L = Lanes<scalar_t>;
  const int64_t vec_end = hidden / 16 * 16;
  for (int64_t t = begin; t < end; ++t) {
    const scalar_t* xr = x + t * hidden;
    const scalar_t* src = xr;
    if (residual != nullptr) {
      const scalar_t* rr = residual + t * hidden;
      scalar_t* sr = sum + t * hidden;
      int64_t d = 0;
      for (; d < vec_end; d += 16) L::store(sr + d, L::load(xr + d) + L::load(rr + d));
      for (; d < hidden; ++d) sr[d] = static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
      src = sr;
    }
    float16v squares = {};
    float tail = 0.0f;
    int64_t d = 0;
    for (; d < vec_end; d += 16) {
      const float16v v = L::load(src + d);
      squares += v * v;
    }
    for (; d < hidden; ++d) tail += static_cast<float>(src[d]) * static_cast<float>(src[d]);
    const float inv_rms = 1.0f / std::sqrt((horizontal_sum(squares) + tail) / hidden + eps);
    scalar_t* o = out + t * hidden;
    for (d = 0; d < vec_end; d += 16) {
      const float16v normed = L::round(L::load(src + d) * inv_rms);
      L::store(o + d, L::load(weight + d) * normed);
    }
    for (; d < hidden; ++d) {
      const float normed = static_cast<float>(static_cast<scalar_t>(static_cast<float>(src[d]) * inv_rms));
      o[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) * normed);
    }
  }
}

void rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x,
              const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "x, out: [T, hidden], contiguous");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden, "weight: [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "x, weight and out share one dtype");
  TORCH_CHECK(out.sizes() == x.sizes(), "out: x's shape");
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(), "residual: x's shape and dtype");
    TORCH_CHECK(sum.is_contiguous() && sum.sizes() == x.sizes() && sum.scalar_type() == x.scalar_type(),
                "sum: x's shape and dtype");
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, rows, row_grain(hidden), [&](int64_t b, int64_t e) {
        rms_norm_rows<float>(out.data_ptr<float>(), residual ? sum.data_ptr<float>() : nullptr,
                             x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                             weight.data_ptr<float>(), static_cast<float>(eps), hidden, b, e);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = at::BFloat16;
      at::parallel_for(0, rows, row_grain(hidden), [&](int64_t b, int64_t e) {
        rms_norm_rows<T>(out.data_ptr<T>(), residual ? sum.data_ptr<T>() : nullptr, x.data_ptr<T>(),
                         residual ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                         static_cast<float>(eps), hidden, b, e);
      });
    }));
}

// out[t] = silu(x[t, :d]) * x[t, d:] (torch: silu rounded to the dtype, then the product).
template <typename scalar_t>
void silu_and_mul_rows(scalar_t* out, const scalar_t* x, int64_t d, int64_t begin, int64_t end) {
  using L = Lanes<scalar_t>;
  const int64_t vec_end = d / 16 * 16;
  for (int64_t t = begin; t < end; ++t) {
    const scalar_t* gate = x + t * 2 * d;
    const scalar_t* up = gate + d;
    scalar_t* o = out + t * d;
    int64_t i = 0;
    for (; i < vec_end; i += 16) {
      const float16v g = L::load(gate + i);
      L::store(o + i, L::round(g * sigmoid(g)) * L::load(up + i));
    }
    for (; i < d; ++i) {
      const float g = static_cast<float>(gate[i]);
      const float s = static_cast<float>(static_cast<scalar_t>(g / (1.0f + std::exp(-g))));
      o[i] = static_cast<scalar_t>(s * static_cast<float>(up[i]));
    }
  }
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x: [T, 2d], contiguous");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.size(0) == rows && out.size(1) == d &&
                  out.scalar_type() == x.scalar_type(), "out: [T, d], x's dtype");
  AT_DISPATCH_SWITCH(x.scalar_type(), "silu_and_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, rows, row_grain(2 * d), [&](int64_t b, int64_t e) {
        silu_and_mul_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), d, b, e);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = at::BFloat16;
      at::parallel_for(0, rows, row_grain(2 * d), [&](int64_t b, int64_t e) {
        silu_and_mul_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), d, b, e);
      });
    }));
}


// The rotary embedding of one token's heads: x [heads] rows of head_dim at stride_head,
// out the same rows packed. Products are rounded before their sum, as torch's separate
// mul and sub/add ops round them: contracting them into FMAs here would change the last
// bit (and greedy tokens with it), so contraction is off for this function only.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename scalar_t>
void rotate_heads(scalar_t* out, const scalar_t* x, int64_t heads, int64_t stride_head,
                  int64_t head_dim, const float* cos, const float* sin, int64_t rotary_dim,
                  bool neox) {
  const auto round = [](float v) { return static_cast<float>(static_cast<scalar_t>(v)); };
  const int64_t half = rotary_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* xh = x + h * stride_head;
    scalar_t* oh = out + h * head_dim;
    if (neox) {  // pairs (i, i + half)
      for (int64_t i = 0; i < half; ++i) {
        const float c = round(cos[i]), s = round(sin[i]);
        const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
        oh[i] = static_cast<scalar_t>(round(x1 * c) - round(x2 * s));
        oh[i + half] = static_cast<scalar_t>(round(x2 * c) + round(x1 * s));
      }
    } else {  // gpt-j: pairs (2i, 2i + 1)
      for (int64_t i = 0; i < half; ++i) {
        const float c = round(cos[i]), s = round(sin[i]);
        const float x1 = static_cast<float>(xh[2 * i]), x2 = static_cast<float>(xh[2 * i + 1]);
        oh[2 * i] = static_cast<scalar_t>(round(x1 * c) - round(x2 * s));
        oh[2 * i + 1] = static_cast<scalar_t>(round(x2 * c) + round(x1 * s));
      }
    }
    for (int64_t d = rotary_dim; d < head_dim; ++d) oh[d] = xh[d];
  }
}
#pragma GCC pop_options

// query_out / key_out = query / key with their first rotary_dim channels rotated by each
// token's position: cos_sin_cache [max_position, rotary_dim] float32 holds the cos half,
// then the sin half. query [T, H, D] and key [T, Hkv, D] may be strided views (of the fused
// QKV output) with unit stride along D; the outputs are contiguous.
void rotary_embedding(at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& positions,
                      const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache, bool is_neox_style) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) &&
                  query.size(2) == key.size(2), "query [T, H, D], key [T, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "unit stride along head_dim");
  TORCH_CHECK(query_out.is_contiguous() && query_out.sizes() == query.sizes() &&
                  key_out.is_contiguous() && key_out.sizes() == key.sizes(),
              "outputs: contiguous, the inputs' shapes");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() &&
                  query_out.scalar_type() == query.scalar_type() &&
                  key_out.scalar_type() == query.scalar_type(), "one dtype for q, k and outputs");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.scalar_type() == at::kFloat, "cos_sin_cache: [P, R] float32");
  const int64_t tokens = query.size(0), head_dim = query.size(2);
  const int64_t rotary_dim = cos_sin_cache.size(1), max_position = cos_sin_cache.size(0);
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rotary_dim: even, <= head_dim");
  const auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == tokens, "one position per token");
  const int64_t* pos_p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos_p[t] >= 0 && pos_p[t] < max_position, "position ", pos_p[t], " out of range");
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t heads = query.size(1), kv_heads = key.size(1);
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "rotary_embedding: float32 or bfloat16");
  const auto run = [&](auto* q_out, const auto* q, auto* k_out, const auto* k) {
    at::parallel_for(0, tokens, row_grain((heads + kv_heads) * head_dim), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* cos = cache + pos_p[t] * rotary_dim;
        const float* sin = cos + rotary_dim / 2;
        rotate_heads(q_out + t * heads * head_dim, q + t * query.stride(0), heads, query.stride(1),
                     head_dim, cos, sin, rotary_dim, is_neox_style);
        rotate_heads(k_out + t * kv_heads * head_dim, k + t * key.stride(0), kv_heads,
                     key.stride(1), head_dim, cos, sin, rotary_dim, is_neox_style);
      }
    });
  };
  if (query.scalar_type() == at::kFloat) {
    run(query_out.data_ptr<float>(), query.data_ptr<float>(), key_out.data_ptr<float>(),
        key.data_ptr<float>());
  } else {
    using T = at::BFloat16;
    run(query_out.data_ptr<T>(), query.data_ptr<T>(), key_out.data_ptr<T>(), key.data_ptr<T>());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor? residual, Tensor weight, "
        "float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) query_out, Tensor(b!) key_out, Tensor positions, "
        "Tensor query, Tensor key, Tensor cos_sin_cache, bool is_neox_style) -> ()");
}

TORCH_LIBRARY_IMPL(serve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}

namespace ops {

void rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x,
              const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  serve_cpu::rms_norm(out, sum, x, residual, weight, eps);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) { serve_cpu::silu_and_mul(out, x); }

void rotary_embedding(at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& positions,
                      const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache, bool is_neox_style) {
  serve_cpu::rotary_embedding(query_out, key_out, positions, query, key, cos_sin_cache,
                              is_neox_style);
}

}  // namespace ops

}  // namespace serve_cpu
