// The kernel self-test's shared pieces: the check counters, the one seeded generator every check
// draws from (so the checks see the same numbers as long as main() calls them in the same order),
// float64 comparisons, and each check main() runs, declared by the file that defines it:
// kernel_selftest_attention.cpp, kernel_selftest_products.cpp, kernel_selftest_half.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "cores.h"

namespace ac = agentcache;

namespace selftest {

extern int checks, failures;  // checks made; checks that failed (each prints one FAIL line)
extern std::mt19937 rng;

// n values drawn from N(0, scale^2).
std::vector<float> randn(size_t n, float scale = 1.f);

// |got - want| <= atol + rtol |want| everywhere (one check; NaN fails).
void expect_close(const char* what, const float* got, const std::vector<double>& want,
                  double atol, double rtol);

// kernel_selftest_attention.cpp
void check_decode_attention(int64_t B, int64_t G, int64_t Hkv, int64_t T, int64_t D, bool masked,
                            bool shared);
void check_decode_attention_half(int64_t B, int64_t G, int64_t Hkv, int64_t T, int64_t D,
                                 bool masked, bool shared);
void check_prefix_attention(int64_t H, int64_t M, int64_t S, int64_t D);
void check_segment_attention(int64_t H, int64_t Hkv, int64_t D,
                             std::vector<std::pair<int64_t, int64_t>> segs);
void check_prefill_half(int64_t H, int64_t Hkv, int64_t M, int64_t S, int64_t D);

// kernel_selftest_products.cpp
void check_linear_packed(int64_t m, int64_t N, int64_t K, bool bf16);
void check_linear_rows(int64_t m, int64_t N, int64_t K);
void check_linear_quant(int64_t m, int64_t N, int64_t K, bool q41);

// kernel_selftest_half.cpp
void check_half_conversion();

}  // namespace selftest
