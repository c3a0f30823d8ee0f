// The codecs of quantized_linear.cpp: each kind's packed codes (serve/kernels/packed_weight.py:
// uint4 and fp4 e2m1 two per byte, uint8 and fp8 e4m3fn one) decoded to floats, a run of 32
// inputs at a time as vec.h's floatv (the target's own register) or one input at a time,
// with code per instruction set (AVX-512, AVX2, plain) where it pays; and a row of the
// weight dequantized with its scales and zero points, for the tiles and the inputs that
// look their group up. The loops that take the products are quantized_linear.cpp's.
//
// Included by quantized_linear.cpp alone: its contents keep that file's internal linkage
// (an unnamed namespace), so inlining and code are as they were in one file.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace serve_cpu {
namespace {

// Inputs per decoded run: 16 bytes of uint4 codes.
constexpr int64_t kRun = 32;

// A run of 32 inputs as kVecs vectors of kLanes floats: 2 with AVX-512, 4 with AVX2.
constexpr int kVecs = kRun / kLanes;

// The packed weight as raw pointers.
struct Packed {
  const uint8_t* codes;
  int64_t row_bytes;    // bytes of codes per output
  const float* scales;  // [N, G]
  const float* zeros;   // [N, G] or nullptr (zero points 0)
  int64_t num_groups;   // G
  int64_t group_size;
  const int32_t* groups;  // g(k) for each input, where it is looked up; or nullptr
  int64_t N, K;
};

// kLanes bytes zero-extended into int32 lanes: one instruction with AVX2 or AVX-512,
// where GCC builds the generic conversion (vec.h's bytes_to_lanes) out of narrower ones.
inline intv widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (intv)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (intv)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  intv v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}

inline int nibble(const uint8_t* row, int64_t k) { return (row[k >> 1] >> ((k & 1) * 4)) & 15; }

// A run's 16 bytes of nibbles (inputs k .. k + 31 at p = row + k / 2, the even input of
// each byte low) as int lanes, each lane's nibble in its low 4 bits, two ways:
//   nibble_lanes: the streaming order, 16 even inputs then 16 odd (x is permuted to
//     match, x_as_float): v[j] (j < kVecs / 2) the bytes themselves, their high nibbles
//     still above; v[kVecs / 2 + j] the same bytes shifted down by 4.
//   nibble_lanes_in_order: v[j]'s lane i the nibble of input j * kLanes + i, alone.
inline void nibble_lanes(const uint8_t* p, intv (&v)[kVecs]) {
  for (int j = 0; j < kVecs / 2; ++j) {
    v[j] = widen(p + j * kLanes);
    v[kVecs / 2 + j] = v[j] >> 4;
  }
}

inline void nibble_lanes_in_order(const uint8_t* p, intv (&v)[kVecs]) {
#if defined(__AVX2__)
  // The low and high nibbles as bytes, interleaved into the inputs' order, then widened.
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(bytes, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i first = _mm_unpacklo_epi8(low, high);  // inputs 0..15
  const __m128i second = _mm_unpackhi_epi8(low, high);  // inputs 16..31
#if defined(__AVX512F__)
  v[0] = (intv)_mm512_cvtepu8_epi32(first);
  v[1] = (intv)_mm512_cvtepu8_epi32(second);
#else
  v[0] = (intv)_mm256_cvtepu8_epi32(first);
  v[1] = (intv)_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8));
  v[2] = (intv)_mm256_cvtepu8_epi32(second);
  v[3] = (intv)_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8));
#endif
#else
  for (int j = 0; j < kVecs; ++j)
    for (int i = 0; i < kLanes; ++i) v[j][i] = nibble(p, j * kLanes + i);
#endif
}

// Each kind's codes, decoded to floats: a run of 32 at once (the inputs k .. k + 31, k a
// multiple of 32) as kVecs vectors, in the streaming order (kPermuted: see nibble_lanes)
// or the inputs' own (for the tiles and the groups looked up); and one at a time. The
// streaming kernel takes them times their group's scale, from decode_scaled with the
// scale as the codec applies it (`Scale`, from scale(s)): for most, a float to multiply
// the decoded codes by (MultipliedScale).
template <typename Codec>
struct MultipliedScale {
  using Scale = float;
  static Scale scale(float s) { return s; }
  static void decode_scaled(const uint8_t* row, int64_t k, Scale s, floatv (&v)[kVecs]) {
    Codec::decode(row, k, v);
    for (int j = 0; j < kVecs; ++j) v[j] *= s;
  }
};

struct Uint4 : MultipliedScale<Uint4> {
  static constexpr bool kPermuted = true;
  static int64_t row_bytes(int64_t K) { return (K + 1) / 2; }
  static void decode(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    intv lanes[kVecs];
    nibble_lanes(row + k / 2, lanes);
    for (int j = 0; j < kVecs; ++j)
      v[j] = __builtin_convertvector(j < kVecs / 2 ? lanes[j] & 15 : lanes[j], floatv);
  }
  static void decode_in_order(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    intv lanes[kVecs];
    nibble_lanes_in_order(row + k / 2, lanes);
    for (int j = 0; j < kVecs; ++j) v[j] = __builtin_convertvector(lanes[j], floatv);
  }
#if defined(__AVX512F__)
  // Scaled codes looked up as Fp4's values are, in the 16 codes times the scale: a permute
  // per 16 codes where converting and scaling take three instructions.
  using Scale = floatv;
  static Scale scale(float s) {
    return floatv{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * s;
  }
  static void decode_scaled(const uint8_t* row, int64_t k, Scale table, floatv (&v)[kVecs]) {
    intv lanes[kVecs];
    nibble_lanes(row + k / 2, lanes);
    for (int j = 0; j < kVecs; ++j)
      v[j] = (floatv)_mm512_permutexvar_ps((__m512i)lanes[j], (__m512)table);
  }
#endif
  static float code(const uint8_t* row, int64_t k) { return static_cast<float>(nibble(row, k)); }
};

// FP4 E2M1 (MXFP4's codes), packed as Uint4's: a nibble is sign (bit 3), exponent (bits
// 2..1) and mantissa (bit 0), looked up in a table of its 16 values rather than computed
// from its bits. AVX-512 holds the whole table in a register, and a permute, which reads
// only a lane's low 4 bits, looks 16 nibbles up at once; AVX2's permute takes 8 entries and
// 3 bits, so it looks the magnitude up and the sign bit is moved into place. The scale
// is applied to the table (Scale: the 16 values, or AVX2's 8 magnitudes, times it), once
// per group, not to each decoded vector.
struct Fp4 : MultipliedScale<Fp4> {
  static constexpr bool kPermuted = true;
  static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  static int64_t row_bytes(int64_t K) { return Uint4::row_bytes(K); }
#if defined(__AVX512F__) || defined(__AVX2__)
  // The values in `table` (kValues' first kLanes, maybe scaled) of the nibbles in the
  // lanes' low 4 bits (the bits above them ignored). AVX2's sign is flipped, not set, so
  // a negative scale stays right.
  static floatv lookup(floatv table, intv lanes) {
#if defined(__AVX512F__)
    return (floatv)_mm512_permutexvar_ps((__m512i)lanes, (__m512)table);
#else
    const __m256 magnitude = _mm256_permutevar8x32_ps((__m256)table, (__m256i)lanes);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32((__m256i)lanes, 28),
                                          _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    return (floatv)_mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
#endif
  }
  using Scale = floatv;
  static Scale scale(float s) { return loadv(kValues) * s; }
  static void decode_scaled(const uint8_t* row, int64_t k, Scale table, floatv (&v)[kVecs]) {
    intv lanes[kVecs];
    nibble_lanes(row + k / 2, lanes);
    for (int j = 0; j < kVecs; ++j) v[j] = lookup(table, lanes[j]);
  }
#else
  static floatv lookup(floatv, intv lanes) {
    floatv v;
    for (int i = 0; i < kLanes; ++i) v[i] = kValues[lanes[i] & 15];
    return v;
  }
#endif
  static void decode(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    intv lanes[kVecs];
    nibble_lanes(row + k / 2, lanes);
    for (int j = 0; j < kVecs; ++j) v[j] = lookup(loadv(kValues), lanes[j]);
  }
  static void decode_in_order(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    intv lanes[kVecs];
    nibble_lanes_in_order(row + k / 2, lanes);
    for (int j = 0; j < kVecs; ++j) v[j] = lookup(loadv(kValues), lanes[j]);
  }
  static float code(const uint8_t* row, int64_t k) { return kValues[nibble(row, k)]; }
};

struct Uint8 : MultipliedScale<Uint8> {
  static constexpr bool kPermuted = false;
  static int64_t row_bytes(int64_t K) { return K; }
  static void decode(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    for (int j = 0; j < kVecs; ++j)
      v[j] = __builtin_convertvector(widen(row + k + j * kLanes), floatv);
  }
  static void decode_in_order(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    decode(row, k, v);
  }
  static float code(const uint8_t* row, int64_t k) { return static_cast<float>(row[k]); }
};

struct Fp8 : MultipliedScale<Fp8> {
  static constexpr bool kPermuted = false;
  static int64_t row_bytes(int64_t K) { return K; }
  static float code(const uint8_t* row, int64_t k) {
    return static_cast<float>(c10::Float8_e4m3fn(row[k], c10::Float8_e4m3fn::from_bits()));
  }
  // kLanes e4m3fn bytes through float16: a byte's sign, exponent and mantissa bits moved
  // to float16's places (bits 15, 10..13, 7..9) make a float16 of 2^-8 times its value,
  // subnormals included (e4m3's bias is 7, float16's 15), which one instruction widens to
  // float32. The NaN bytes (0x7F, 0xFF) land on +-1.875 (480 / 256) and are put back. Half
  // the instructions of vec.h's bit-by-bit widening, which decoding bounds (one row).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  static floatv decode_lanes(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    // Sign-extended, the sign fills bits 7..15; shifted, bits 14 and 15; 14 is cleared.
    const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7);
    const __m256i half = _mm256_and_si256(shifted, _mm256_set1_epi16(-16512));  // 0xBF80
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(
        _mm256_and_si256(half, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F80));
    const __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    return (floatv)_mm512_mask_blend_ps(nan, value, _mm512_set1_ps(__builtin_nanf("")));
  }
#elif defined(__AVX512F__)
  static floatv decode_lanes(const uint8_t* p) {
    return widen_narrow_float<4, 3, 7, false>(widen(p));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  static floatv decode_lanes(const uint8_t* p) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7);
    const __m128i half = _mm_and_si128(shifted, _mm_set1_epi16(-16512));  // 0xBF80
    const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    // +-480 (no e4m3fn value: its largest is 448) were NaN; all ones is a NaN too.
    const __m256 magnitude =
        _mm256_and_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
    const __m256 nan = _mm256_cmp_ps(magnitude, _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
    return (floatv)_mm256_or_ps(value, nan);
  }
#else
  static floatv decode_lanes(const uint8_t* p) {
    floatv v;
    for (int i = 0; i < kLanes; ++i) v[i] = code(p, i);
    return v;
  }
#endif
  static void decode(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    for (int j = 0; j < kVecs; ++j) v[j] = decode_lanes(row + k + j * kLanes);
  }
  static void decode_in_order(const uint8_t* row, int64_t k, floatv (&v)[kVecs]) {
    decode(row, k, v);
  }
};

// The inputs of group g that lie in [k0, k1).
inline void group_span(const Packed& w, int64_t g, int64_t k0, int64_t k1, int64_t& begin,
                       int64_t& end) {
  begin = std::max(k0, g * w.group_size);
  end = std::min(k1, (g + 1) * w.group_size);
}

// Row n's weights [k0, k1) as floats into dst (k0 a multiple of 32, k1 one or K), each
// computed as (code - zero) * scale in float32, as the torch reference rounds them.
template <typename Codec>
void dequantize_runs(const Packed& w, int64_t n, int64_t k0, int64_t k1, float* dst) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  const float* scales = w.scales + n * w.num_groups;
  const float* zeros = w.zeros != nullptr ? w.zeros + n * w.num_groups : nullptr;
  for (int64_t g = k0 / w.group_size; g * w.group_size < k1; ++g) {
    int64_t k, end;
    group_span(w, g, k0, k1, k, end);
    const float s = scales[g], z = zeros != nullptr ? zeros[g] : 0.0f;
    for (; k + kRun <= end; k += kRun) {
      floatv v[kVecs];
      Codec::decode_in_order(row, k, v);
      for (int j = 0; j < kVecs; ++j) storev(dst + (k - k0) + j * kLanes, (v[j] - z) * s);
    }
    for (; k < end; ++k) dst[k - k0] = (Codec::code(row, k) - z) * s;
  }
}

// The same where each input looks its group up (g_idx, or a group size that is not a
// multiple of 32; k0 a multiple of 32). With AVX-512 the codes are decoded 32 at a time
// and each lane's scale and zero point fetched by its group: from the row's scales held
// in two registers (one permute per 16 lanes) where there are 32 groups or fewer (act
// order over 4096 inputs in groups of 128), by a gather otherwise; with AVX2, by a gather.
// 4096 x 4096 uint4 in act order, one row: 7.9 ms one input at a time.
template <typename Codec>
void dequantize_each(const Packed& w, int64_t n, int64_t k0, int64_t k1, float* dst) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  const float* scales = w.scales + n * w.num_groups;
  const float* zeros = w.zeros != nullptr ? w.zeros + n * w.num_groups : nullptr;
  int64_t k = k0;
#ifdef __AVX512F__
  const int64_t G = w.num_groups;
  const auto table_half = [&](const float* values, int64_t first) {
    const int64_t count = std::clamp<int64_t>(G - first, 0, 16);
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), values + first);
  };
  const __m512 s_lo = table_half(scales, 0), s_hi = table_half(scales, 16);
  const __m512 z_lo = zeros != nullptr ? table_half(zeros, 0) : _mm512_setzero_ps();
  const __m512 z_hi = zeros != nullptr ? table_half(zeros, 16) : _mm512_setzero_ps();
  const auto lanes = [&](floatv codes, int64_t at) {
    const __m512i group = _mm512_loadu_si512(w.groups + at);
    __m512 s, z = _mm512_setzero_ps();
    if (G <= 32) {
      s = _mm512_permutex2var_ps(s_lo, group, s_hi);
      if (zeros != nullptr) z = _mm512_permutex2var_ps(z_lo, group, z_hi);
    } else {
      s = _mm512_i32gather_ps(group, scales, 4);
      if (zeros != nullptr) z = _mm512_i32gather_ps(group, zeros, 4);
    }
    storev(dst + (at - k0), (codes - (floatv)z) * (floatv)s);
  };
  for (; k + kRun <= k1; k += kRun) {
    floatv v[kVecs];
    Codec::decode_in_order(row, k, v);
    for (int j = 0; j < kVecs; ++j) lanes(v[j], k + j * kLanes);
  }
#elif defined(__AVX2__)
  for (; k + kRun <= k1; k += kRun) {
    floatv v[kVecs];
    Codec::decode_in_order(row, k, v);
    for (int j = 0; j < kVecs; ++j) {
      const int64_t at = k + j * kLanes;
      const __m256i group = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.groups + at));
      const floatv s = (floatv)_mm256_i32gather_ps(scales, group, 4);
      const floatv z = zeros != nullptr ? (floatv)_mm256_i32gather_ps(zeros, group, 4) : floatv{};
      storev(dst + (at - k0), (v[j] - z) * s);
    }
  }
#endif
  for (; k < k1; ++k) {
    const int32_t g = w.groups[k];
    dst[k - k0] = (Codec::code(row, k) - (zeros != nullptr ? zeros[g] : 0.0f)) * scales[g];
  }
}

template <typename Codec>
void dequantize(const Packed& w, int64_t n, int64_t k0, int64_t k1, float* dst) {
  if (w.groups == nullptr)
    dequantize_runs<Codec>(w, n, k0, k1, dst);
  else
    dequantize_each<Codec>(w, n, k0, k1, dst);
}

}  // namespace
}  // namespace serve_cpu
