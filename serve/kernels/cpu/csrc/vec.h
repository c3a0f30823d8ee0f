// Vector helpers shared by the CPU kernels: GCC vector extensions, so one source compiles
// to AVX-512 (one register per 16 floats), AVX2 (two) or plain code, as -march allows.
#pragma once

#include <algorithm>
#include <cstdint>

namespace serve_cpu {

// 16 floats as one value: one AVX-512 register, two AVX2 ones, plain code elsewhere.
typedef float float16v __attribute__((vector_size(64)));
typedef float float8v __attribute__((vector_size(32)));
typedef float float4v __attribute__((vector_size(16)));

typedef int32_t int16v __attribute__((vector_size(64)));
typedef uint16_t uint16x16 __attribute__((vector_size(32)));

// The target's own register of floats, for kernels written once for any width: 16 lanes
// with AVX-512, 8 with AVX2, 4 elsewhere. A float16v without AVX-512 has no machine mode:
// GCC keeps such values in memory and copies them through general registers, so a loop
// that carries float16v sums (an accumulator array, a lambda's captures) spills on AVX2.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float floatv __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t intv __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline floatv loadv(const float* p) {
  floatv v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, floatv v) { __builtin_memcpy(p, &v, sizeof(v)); }

// exp(x) lane by lane for x <= 0 (scores minus their row's max), in vector arithmetic:
// libm's expf does not vectorise here. Range reduction x = n ln2 + r with |r| <= ln2 / 2
// (n rounded to nearest as trunc(x log2e - 1/2), right for x <= 0), a degree-6 polynomial
// for exp(r) (relative error ~1e-7, float32's own), and 2^n built in the exponent bits.
// Lanes below -87 (past float's smallest normal), -inf among them, give 0.
// For any float vector type (float16v, or floatv at the target's width).
template <typename V>
inline V exp_nonpositive(V x) {
  using I = decltype(x < x);  // int32 lanes, as many
  const I underflow = x < -87.0f;
  x = x < -87.0f ? -87.0f : x;
  const I n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);
  const V nf = __builtin_convertvector(n, V);
  V r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  V p = 1.9875691500e-4f + r * 0.0f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const V two_n = (V)((n + 127) << 23);
  return (V)((I)(p * two_n) & ~underflow);
}

// 1 / (1 + exp(-x)) lane by lane, from exp of the non-positive -|x| alone.
template <typename V>
inline V sigmoid(V x) {
  const V e = exp_nonpositive(x < 0.0f ? x : -x);
  return (x < 0.0f ? e : 1.0f) / (1.0f + e);
}

inline float16v load16(const float* p) {
  float16v v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, float16v v) { __builtin_memcpy(p, &v, sizeof(v)); }

// 16 bfloat16 values (their bits, as torch stores them) widened to float: the upper half
// of a float's bits.
inline float16v load16_bf16(const uint16_t* p) {
  uint16x16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  return (float16v)(__builtin_convertvector(h, int16v) << 16);
}

// kLanes bfloat16 values widened to floatv.
typedef uint16_t uint16v __attribute__((vector_size(kLanes * sizeof(uint16_t))));
inline floatv loadv_bf16(const uint16_t* p) {
  uint16v h;
  __builtin_memcpy(&h, p, sizeof(h));
  return (floatv)(__builtin_convertvector(h, intv) << 16);
}

typedef uint8_t uint8x16 __attribute__((vector_size(16)));

// A narrow float format (kExp exponent bits of bias kBias, kMant mantissa bits) widened to
// float32 in integer lanes, for any -march. A normal value is its exponent and mantissa
// shifted into float32's places with the exponent rebiased by an integer add; a subnormal
// one (exponent 0) is its mantissa converted and scaled, so no float32 subnormal is ever an
// input (CPUs take microcode assists on those). An all-ones exponent is infinity (mantissa
// 0) or NaN where the format has infinities (kHasInf); e4m3fn has none, and only its
// all-ones exponent and mantissa is NaN.
template <int kExp, int kMant, int kBias, bool kHasInf>
inline float16v widen_narrow_float(int16v bits) {
  constexpr int kEmMask = (1 << (kExp + kMant)) - 1;
  constexpr int kExpAllOnes = (1 << kExp) - 1;
  const int16v em = bits & kEmMask;
  const int16v exponent = em >> kMant;
  const int16v mantissa = em & ((1 << kMant) - 1);
  const float16v normal = (float16v)((em << (23 - kMant)) + ((127 - kBias) << 23));
  const float16v subnormal =
      __builtin_convertvector(mantissa, float16v) * __builtin_ldexpf(1.0f, 1 - kBias - kMant);
  float16v x = exponent == 0 ? subnormal : normal;
  const float16v inf = (float16v)(int16v{} + 0x7F800000);
  const float16v nan = (float16v)(int16v{} + 0x7FC00000);
  if constexpr (kHasInf) {
    x = exponent == kExpAllOnes ? (mantissa == 0 ? inf : nan) : x;
  } else {
    x = em == kEmMask ? nan : x;
  }
  return (float16v)((int16v)x | ((bits >> (kExp + kMant)) << 31));
}

// 16 float16 values (their bits) to float.
inline float16v load16_f16(const uint16_t* p) {
  uint16x16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  return widen_narrow_float<5, 10, 15, true>(__builtin_convertvector(h, int16v));
}

// Bytes zero-extended to int32 lanes through 16-bit ones: GCC turns the direct conversion
// into a scalar loop, these two steps into vector zero-extensions.
inline int16v bytes_to_lanes(uint8x16 b) {
  return __builtin_convertvector(__builtin_convertvector(b, uint16x16), int16v);
}

// 16 fp8 e5m2 values: float16's layout cut to its top byte.
inline float16v load16_e5m2(const uint8_t* p) {
  uint8x16 b;
  __builtin_memcpy(&b, p, sizeof(b));
  return widen_narrow_float<5, 2, 15, true>(bytes_to_lanes(b));
}

// 16 fp8 e4m3fn values.
inline float16v load16_e4m3fn(const uint8_t* p) {
  uint8x16 b;
  __builtin_memcpy(&b, p, sizeof(b));
  return widen_narrow_float<4, 3, 7, false>(bytes_to_lanes(b));
}

// The lanes' sum as a tree of halves: a reduction loop ends in 15 dependent scalar adds.
inline float horizontal_sum(float16v v) {
  const float8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const float4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The same for 8 and 4 lanes (floatv's other widths).
inline float horizontal_sum(float8v v) {
  const float4v b =
      __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float horizontal_sum(float4v v) { return (v[0] + v[2]) + (v[1] + v[3]); }

// The lanes' maximum, as a tree of halves.
inline float horizontal_max(float16v v) {
  const float8v lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const float8v hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const float8v a = lo > hi ? lo : hi;
  const float4v b0 = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  const float4v b1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const float4v b = b0 > b1 ? b0 : b1;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// The same for 8 and 4 lanes (floatv's other widths).
inline float horizontal_max(float8v v) {
  const float4v b0 = __builtin_shufflevector(v, v, 0, 1, 2, 3);
  const float4v b1 = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const float4v b = b0 > b1 ? b0 : b1;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

inline float horizontal_max(float4v b) {
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// Lane i of the result is the sum of v[i]'s lanes, for 16 vectors at once: a transposing
// tree of shuffles and adds (30 shuffles, 15 adds), where 16 separate horizontal sums
// take ~100 instructions. Each level halves the lanes per vector and pairs the vectors up;
// the last leaves the sums in bit-reversed order, which one permutation puts right.
inline float16v transpose_sum16(const float16v* v) {
  float16v a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) {  // a[j]: 8 partial sums of v[2j], then 8 of v[2j + 1]
    a[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  }
  for (int j = 0; j < 4; ++j) {  // b[j]: 4 partials each of v[4j], v[4j + 2], v[4j + 1], v[4j + 3]
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                   10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  }
  for (int j = 0; j < 2; ++j) {  // c[j]: pairs of partials, v[8j + (0 4 2 6 1 5 3 7)]
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                   24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  }
  // d: whole sums, lane l holding v[bit_reverse(l)]
  const float16v d =
      __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                              14, 30) +
      __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                              15, 31);
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// transpose_sum16's tree for 8 vectors of 8 lanes (lane i: the sum of v[i]'s lanes): two
// levels of pairing, the sums left in bit-reversed order, then one permutation.
inline float8v transpose_sum8(const float8v* v) {
  float8v a[4], b[2];
  for (int j = 0; j < 4; ++j)  // a[j]: 4 partial sums of v[2j], then 4 of v[2j + 1]
    a[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 2; ++j)  // b[j]: pairs of partials, v[4j + (0 2 1 3)]
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // c: whole sums, lane l holding v[bit_reverse(l)]
  const float8v c = __builtin_shufflevector(b[0], b[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(b[0], b[1], 1, 9, 3, 11, 5, 13, 7, 15);
  return __builtin_shufflevector(c, c, 0, 4, 2, 6, 1, 5, 3, 7);
}

// And for 4 vectors of 4 lanes.
inline float4v transpose_sum4(const float4v* v) {
  const float4v a0 = __builtin_shufflevector(v[0], v[1], 0, 1, 4, 5) +
                     __builtin_shufflevector(v[0], v[1], 2, 3, 6, 7);
  const float4v a1 = __builtin_shufflevector(v[2], v[3], 0, 1, 4, 5) +
                     __builtin_shufflevector(v[2], v[3], 2, 3, 6, 7);
  const float4v c = __builtin_shufflevector(a0, a1, 0, 4, 2, 6) +
                    __builtin_shufflevector(a0, a1, 1, 5, 3, 7);
  return __builtin_shufflevector(c, c, 0, 2, 1, 3);
}

// kLanes vectors' sums in one floatv, at the target's width.
inline floatv transpose_sumv(const floatv* v) {
#if defined(__AVX512F__)
  return transpose_sum16(v);
#elif defined(__AVX2__)
  return transpose_sum8(v);
#else
  return transpose_sum4(v);
#endif
}

}  // namespace serve_cpu
