// The self-test's fp16 conversion check (kernel_selftest.h): half.h's widening on all 65,536
// halves and its three narrowing paths on every rounding boundary, bit for bit.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "half.h"
#include "kernel_selftest.h"

namespace selftest {

namespace {

// Bits equal everywhere (one check).
void expect_bits(const char* what, const uint16_t* got, const std::vector<uint16_t>& want,
                 const std::vector<float>& from) {
  ++checks;
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i]) {
      ++failures;
      std::printf("FAIL %s: [%zu] %.9g (bits %08x) gave %04x want %04x\n", what, i, from[i],
                  [&] { uint32_t b; std::memcpy(&b, &from[i], 4); return b; }(), got[i], want[i]);
      return;
    }
}

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The value of fp16 bits h from its fields (IEEE 754 binary16), float64; NaN for NaN.
double half_value(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1F) return m ? NAN : sign * INFINITY;
  return sign * (e ? std::ldexp(1024 + m, e - 25) : std::ldexp(m, -24));
}

}  // namespace

// half.h: every fp16 value widens to its exact value; narrowing rounds to nearest, ties to even,
// on every path (the vector loop, the build's per-element conversion, the integer one): each
// finite half itself, each midpoint between neighbours (to the even one; 65520 to inf), a float
// either side of it, huge and tiny values, inf and NaN.
void check_half_conversion() {
  std::vector<uint16_t> all(65536);
  for (uint32_t h = 0; h < 65536; ++h) all[h] = uint16_t(h);
  std::vector<float> wide(65536);
  ac::widen_halves(all.data(), 65536, wide.data());
  ++checks;
  for (uint32_t h = 0; h < 65536; ++h) {
    const double want = half_value(uint16_t(h));
    uint32_t bits;  // NOTE: the sign read from the bits (-fno-signed-zeros folds signbit)
    std::memcpy(&bits, &wide[h], 4);
    const bool ok = std::isnan(want) ? std::isnan(wide[h])
                                     : double(wide[h]) == want && (bits >> 31) == (h >> 15);
    const float one = ac::half_bits_to_float(uint16_t(h));
    if (!ok || std::memcmp(&one, &wide[h], 4) != 0) {
      ++failures;
      std::printf("FAIL widen_halves: %04x gave %.9g want %.9g\n", h, wide[h], want);
      break;
    }
  }
  std::vector<float> in;
  std::vector<uint16_t> want;
  for (uint16_t sign : {0, 0x8000})
    for (uint32_t h = 0; h < 0x7C00; ++h) {
      const double lo = half_value(uint16_t(h));
      const double hi = h < 0x7BFF ? half_value(uint16_t(h + 1)) : 65536;  // 0x7C00: inf
      const float mid = float((lo + hi) / 2), s = sign ? -1.f : 1.f;
      const uint16_t even = uint16_t((h & 1) ? h + 1 : h) | sign;
      in.insert(in.end(),
                {s * mid, s * std::nextafter(mid, 0.f), s * std::nextafter(mid, INFINITY)});
      want.insert(want.end(), {even, uint16_t(h | sign), uint16_t((h + 1) | sign)});
      if (h == 0 && sign) continue;  // NOTE: -0: -fno-signed-zeros may store it as +0 (NEON)
      in.push_back(s * float(lo));
      want.push_back(uint16_t(h | sign));
    }
  for (float big : {1e10f, 65519.996f, 65520.f, INFINITY, 1e-30f, 2.9802322e-08f}) {
    for (float s : {1.f, -1.f}) {
      in.push_back(s * big);
      const uint16_t sign = s < 0 ? 0x8000 : 0;
      want.push_back(big >= 65520.f   ? uint16_t(0x7C00 | sign)
                     : big > 65000.f ? uint16_t(0x7BFF | sign)
                                     : sign);  // 2^-25: a tie, to 0
    }
  }
  std::vector<uint16_t> got(in.size()), one(in.size()), ints(in.size());
  ac::narrow_floats(in.data(), int64_t(in.size()), got.data());
  for (size_t i = 0; i < in.size(); ++i) {
    one[i] = ac::float_to_half_bits(in[i]);
    ints[i] = ac::float_to_half_bits_scalar(in[i]);
  }
  expect_bits("narrow_floats", got.data(), want, in);
  expect_bits("float_to_half_bits", one.data(), want, in);
  expect_bits("float_to_half_bits_scalar", ints.data(), want, in);
  ++checks;
  const float nan = from_bits(0x7FC00000u);
  for (uint16_t h : {ac::float_to_half_bits(nan), ac::float_to_half_bits_scalar(nan)})
    if ((h & 0x7C00) != 0x7C00 || (h & 0x3FF) == 0) {
      ++failures;
      std::printf("FAIL NaN narrowed to %04x\n", h);
    }
}

}  // namespace selftest
