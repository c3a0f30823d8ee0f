// Vector helpers shared by the CPU kernels: GCC vector extensions, so one source compiles
// to AVX-512 (one register per 16 floats), AVX2 (two) or plain code, as -march allows.
#pragma once

#include <cstdint>

namespace serve_cpu {

// 16 floats as one value: one AVX-512 register, two AVX2 ones, plain code elsewhere.
typedef float float16v __attribute__((vector_size(64)));
typedef float float8v __attribute__((vector_size(32)));
typedef float float4v __attribute__((vector_size(16)));

inline float16v load16(const float* p) {
  float16v v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, float16v v) { __builtin_memcpy(p, &v, sizeof(v)); }

// The lanes' sum as a tree of halves: a reduction loop ends in 15 dependent scalar adds.
inline float horizontal_sum(float16v v) {
  const float8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const float4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float16v acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return horizontal_sum(acc) + tail;
}

}  // namespace serve_cpu
