// Runs the torch-free kernel cores (runtime/model/kernels/attention.cpp, grouped_attention.cpp,
// prefill_attention.cpp, products.cpp, quantized.cpp, q4_1_lanes.cpp) and half.h's fp16
// conversions of one ISA's build against float64 loops written here, serially (vec.h's default
// threads). Built by tests/runtime/test_kernel_cores.py for each ISA this machine runs, and for
// NEON with an aarch64 cross compiler, run under qemu: so the NEON path is executed, not only
// compiled, on x86. The checks live by concept in kernel_selftest_attention.cpp, _products.cpp
// and _half.cpp (kernel_selftest.h); this file holds what they share and main(), which runs them
// in a fixed order (they draw from one generator).
// Prints one line per failed check and a summary; exit status 0 when every check passed.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cores.h"
#include "kernel_selftest.h"

namespace selftest {

int checks = 0, failures = 0;
std::mt19937 rng(1234);

std::vector<float> randn(size_t n, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

void expect_close(const char* what, const float* got, const std::vector<double>& want,
                  double atol, double rtol) {
  ++checks;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) - rtol * std::fabs(want[i]);
    if (!(err <= worst)) {  // NOTE: NaN counts as a failure
      worst = std::isnan(err) ? INFINITY : err;
      at = i;
    }
  }
  if (worst > atol) {
    ++failures;
    std::printf("FAIL %s: element %zu got %.9g want %.9g\n", what, at, got[at], want[at]);
  }
}

}  // namespace selftest

int main() {
  using namespace selftest;
  check_half_conversion();
  for (bool masked : {false, true}) {
    check_decode_attention_half(3, 3, 2, 601, 64, masked, false);
    check_decode_attention_half(2, 7, 2, 300, 40, masked, false);
    check_decode_attention_half(4, 3, 2, 700, 64, masked, true);
    check_decode_attention_half(5, 2, 2, 800, 80, masked, true);
    check_decode_attention_half(16, 3, 3, 320, 64, masked, true);  // a partial chunk of 240
  }
  for (bool masked : {false, true}) {
    check_decode_attention(3, 3, 2, 601, 64, masked, false);
    check_decode_attention(2, 4, 1, 257, 128, masked, false);
    check_decode_attention(3, 7, 2, 300, 40, masked, false);
    check_decode_attention(2, 1, 1, 1, 8, masked, false);
    check_decode_attention(4, 3, 2, 700, 64, masked, true);
    check_decode_attention(5, 2, 2, 800, 80, masked, true);
    check_decode_attention(16, 3, 3, 320, 64, masked, true);  // a partial chunk of 240
    check_decode_attention(9, 4, 2, 271, 128, masked, true);  // 203 shared, one chunk
  }
  check_prefix_attention(3, 37, 200, 64);
  check_prefix_attention(2, 61, 130, 16);
  check_prefix_attention(1, 7, 65, 128);
  check_prefix_attention(2, 13, 64, 48);
  check_segment_attention(9, 3, 64, {{256, 17}, {256, 17}, {0, 5}, {40, 1}});
  check_segment_attention(4, 2, 16, {{0, 1}, {3, 33}, {100, 70}});
  check_segment_attention(2, 2, 128, {{300, 2}});
  check_segment_attention(6, 2, 48, {{7, 25}, {0, 130}});
  check_prefill_half(3, 3, 37, 200, 64);
  check_prefill_half(4, 2, 13, 70, 16);
  check_prefill_half(2, 1, 61, 130, 128);
  for (bool bf16 : {false, true}) {
    check_linear_packed(16, 96, 57, bf16);
    check_linear_packed(3, 100, 70, bf16);
    check_linear_packed(13, 33, 5, bf16);
    check_linear_packed(1, 1, 1, bf16);
  }
  check_linear_rows(1, 200, 130);
  check_linear_rows(5, 2088, 70);
  check_linear_rows(8, 17, 9);
  check_linear_rows(2, 200, 130);
  check_linear_rows(13, 100, 40);
  check_linear_rows(32, 96, 64);
  for (bool q41 : {false, true}) {
    check_linear_quant(1, 37, 64, q41);
    check_linear_quant(4, 48, 576, q41);
    check_linear_quant(3, 17, 96, q41);
    check_linear_quant(16, 70, 160, q41);
    check_linear_quant(64, 33, 32, q41);
    check_linear_quant(130, 70, 160, q41);  // dequantized panels (from 128 rows)
    check_linear_quant(128, 33, 576, q41);
    check_linear_quant(2, 9, 224, q41);   // Q4_1's kernel layout: 7 blocks, a group and 3 more
    check_linear_quant(1, 5, 1536, q41);  // 48 blocks, 12 whole groups
  }
  std::printf("%s: %d checks, %d failed\n", ac::isa_name(), checks, failures);
  return failures == 0 ? 0 : 1;
}
