// IEEE binary16 (fp16, "half") <-> float32 for the kernels, one source for every ISA (vec.h):
// the 16-bit KV cache holds K/V as fp16 bits (uint16_t) and every kernel widens them to fp32 and
// computes in fp32. Widening is exact; narrowing rounds to nearest, ties to even (IEEE 754's
// default, and what torch's `x.half()` gives: subnormals kept, |x| >= 65520 to inf).
//
//   ISA           widen (n halves -> floats)         narrow (floats -> halves)
//   avx512        vcvtph2ps, 16 a vector (F16C 8)    vcvtps2ph with _MM_FROUND_TO_NEAREST_INT
//   avx2          vcvtph2ps (F16C), 8 a vector        the same, 8 a vector
//   neon          vcvt_f32_f16, 4 a vector           vcvt_f16_f32 (FPCR's default: nearest even)
//   scalar and    the bits rebuilt, per element      integer rounding, per element
//   layout check
// Knows no torch and no threads.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(AGENTCACHE_ISA_NEON)
#include <arm_neon.h>
#endif

#include "vec.h"

AGENTCACHE_BEGIN

// The value of the fp16 bits h, exactly (inf and NaN kept; subnormals normalized).
inline float half_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// The fp16 bits nearest x, ties to even: |x| >= 65520 (half of the way past the largest half,
// 65504) gives inf, |x| <= 2^-25 gives zero, NaN a quiet NaN. Integer arithmetic only, so the
// build's fast-math flags cannot change it.
inline uint16_t float_to_half_bits_scalar(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u, a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // 65520 up: inf
  if (a >= 0x38800000u) {  // 2^-14 up: normal; drop 13 mantissa bits, rounding half to even
    const uint32_t r = a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u);  // rebias 127 -> 15
    return static_cast<uint16_t>(sign | (r >> 13));  // NOTE: a carry may round up to 0x7C00
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // up to 2^-25: zero (a tie: even)
  // subnormal: value = m * 2^(e - 150) with the implicit bit; in units of 2^-24, m >> (126 - e)
  const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - e;
  const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  const uint32_t up = rest > half || (rest == half && (q & 1u)) ? 1u : 0u;
  return static_cast<uint16_t>(sign | (q + up));  // NOTE: 0x3FF + 1 is the least normal, 0x400
}

inline uint16_t float_to_half_bits(float x) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__aarch64__)
  const __fp16 f = static_cast<__fp16>(x);
  uint16_t h;
  std::memcpy(&h, &f, 2);
  return h;
#else
  return float_to_half_bits_scalar(x);
#endif
}

// The kW fp16 values at p as one vector (vec.h's vf): one conversion on AVX-512, AVX2 and NEON.
inline vf vload_half(const uint16_t* p) {
#if defined(AGENTCACHE_ISA_AVX512)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(AGENTCACHE_ISA_AVX2)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(AGENTCACHE_ISA_NEON)
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
#else
  float lanes[kW];
  for (int64_t i = 0; i < kW; ++i) lanes[i] = half_bits_to_float(p[i]);
  return vload(lanes);
#endif
}

// K/V element types: fp32, or uint16_t holding fp16 bits. vload_kv reads kW of them as fp32.
inline vf vload_kv(const float* p) { return vload(p); }
inline vf vload_kv(const uint16_t* p) { return vload_half(p); }

// out[i] = the value of the fp16 bits p[i], i in [0, n).
inline void widen_halves(const uint16_t* p, int64_t n, float* out) {
  int64_t i = 0;
#if defined(AGENTCACHE_ISA_AVX512)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#elif defined(AGENTCACHE_ISA_NEON)
  for (const int64_t whole = n / 4 * 4; i < whole; i += 4)
    vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + i))));
#endif
  for (; i < n; ++i) out[i] = half_bits_to_float(p[i]);
}

// out[i] = float_to_half_bits(x[i]), i in [0, n).
inline void narrow_floats(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
#if defined(AGENTCACHE_ISA_AVX512)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(AGENTCACHE_ISA_NEON)
  for (const int64_t whole = n / 4 * 4; i < whole; i += 4)
    vst1_u16(out + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
#endif
  for (; i < n; ++i) out[i] = float_to_half_bits(x[i]);
}

AGENTCACHE_END
