// The self-test's product checks (kernel_selftest.h): linear_packed in fp32 and bf16,
// linear_rows, and the products over GGUF's Q8_0 and Q4_1 blocks (direct tiles, the widened path,
// dequantized panels, Q4_1's kernel layout) with their dequantization, against float64 loops.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cores.h"
#include "kernel_selftest.h"

namespace selftest {

namespace {

// x [m, K] . W^T with W [N, K]; pack as pack_weight does (fp32: columns in order; bf16: word i
// of a line holds column i low, column 16 + i high; values rounded to nearest even).
uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// y = x W^T + bias in float64: x [m, K], the weights as held [N, K], bias [N] -> [m, N].
template <typename H>
std::vector<double> reference_product(const std::vector<float>& x, const std::vector<H>& held,
                                      const std::vector<float>& bias, int64_t m, int64_t N,
                                      int64_t K) {
  std::vector<double> want(m * N);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t n = 0; n < N; ++n) {
      double acc = bias[n];
      for (int64_t kk = 0; kk < K; ++kk) acc += double(x[r * K + kk]) * held[n * K + kk];
      want[r * N + n] = acc;
    }
  return want;
}

// A random fp16 value's bits and its value: |v| in [2^-14, 2^-1), or a subnormal (exponent 0,
// so the scalar path's bit rebuild is exercised), either sign.
uint16_t random_half(double& value, bool negative_ok) {
  std::uniform_int_distribution<int> exp_dist(1, 14), mant_dist(0, 1023), sign_dist(0, 1);
  const int e = mant_dist(rng) < 64 ? 0 : exp_dist(rng), mant = mant_dist(rng);
  const int sign = negative_ok ? sign_dist(rng) : 0;
  value = e == 0 ? std::ldexp(mant / 1024.0, -14) : std::ldexp(1.0 + mant / 1024.0, e - 15);
  if (sign) value = -value;
  return uint16_t((sign << 15) | (e << 10) | mant);
}

// GGUF Q4_1 blocks [N, nb, 20] in the kernel layout (runtime.model.kernels.repack_q4_1, written
// again here from its docstring): per row the nb scales, the nb minimums, then the nibbles in
// groups of 4 blocks (byte 4 i + j: block 4 g + j's byte i), the last nb % 4 blocks as stored.
std::vector<uint8_t> repack_q4_1(const std::vector<uint8_t>& w, int64_t N, int64_t nb) {
  std::vector<uint8_t> out(w.size());
  const int64_t bytes = ac::kQ4_1Bytes, groups = nb / 4;
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* in = &w[n * nb * bytes];
    uint8_t* row = &out[n * nb * bytes];
    for (int64_t b = 0; b < nb; ++b) {
      std::memcpy(row + 2 * b, in + b * bytes, 2);
      std::memcpy(row + 2 * (nb + b), in + b * bytes + 2, 2);
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t at = b < 4 * groups ? (b / 4) * 64 + 4 * i + b % 4
                                          : groups * 64 + (b - 4 * groups) * 16 + i;
        row[4 * nb + at] = in[b * bytes + 4 + i];
      }
    }
  }
  return out;
}

}  // namespace

void check_linear_packed(int64_t m, int64_t N, int64_t K, bool bf16) {
  const int64_t C = ac::kPackedCols, blocks = (N + C - 1) / C;
  auto w = randn(N * K), x = randn(m * K), bias = randn(N);
  std::vector<float> held(w);
  if (bf16)
    for (auto& value : held) value = from_bf16(to_bf16(value));
  std::vector<float> pf(blocks * K * C, 0.f);
  std::vector<uint16_t> pb(blocks * K * C, 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t kk = 0; kk < K; ++kk) {
      const int64_t b = n / C, c = n % C, line = (b * K + kk) * C;
      pf[line + c] = w[n * K + kk];
      pb[line + (c < 16 ? 2 * c : 2 * (c - 16) + 1)] = to_bf16(w[n * K + kk]);
    }
  std::vector<float> out(m * N);
  if (bf16)
    ac::linear_packed_bf16(x.data(), m, K, pb.data(), blocks, out.data(), N, bias.data());
  else
    ac::linear_packed_f32(x.data(), m, K, pf.data(), blocks, out.data(), N, bias.data());
  const auto want = reference_product(x, held, bias, m, N, K);
  char what[96];
  std::snprintf(what, sizeof what, "linear_packed_%s m=%ld N=%ld K=%ld", bf16 ? "bf16" : "f32",
                long(m), long(N), long(K));
  expect_close(what, out.data(), want, 1e-5 * std::sqrt(double(K)), 1e-5);
}

void check_linear_rows(int64_t m, int64_t N, int64_t K) {
  auto wt = randn(K * N), x = randn(m * K), bias = randn(N);
  std::vector<float> out(m * N);
  ac::linear_rows(x.data(), m, K, wt.data(), N, bias.data(), out.data());
  std::vector<float> held(N * K);  // the input-major [K, N] weight as [N, K]
  for (int64_t kk = 0; kk < K; ++kk)
    for (int64_t n = 0; n < N; ++n) held[n * K + kk] = wt[kk * N + n];
  const auto want = reference_product(x, held, bias, m, N, K);
  char what[64];
  std::snprintf(what, sizeof what, "linear_rows m=%ld N=%ld K=%ld", long(m), long(N), long(K));
  expect_close(what, out.data(), want, 1e-5 * std::sqrt(double(K)), 1e-5);
}

// x [m, K] . W^T + bias for W in GGUF's Q8_0 (q41 false) or Q4_1 blocks, random integers and
// scales, against float64 on the blocks' values.
void check_linear_quant(int64_t m, int64_t N, int64_t K, bool q41) {
  const int64_t nb = K / ac::kQuantBlock, bytes = q41 ? ac::kQ4_1Bytes : ac::kQ8_0Bytes;
  std::vector<uint8_t> w(N * nb * bytes);
  std::vector<double> held(N * K);
  std::uniform_int_distribution<int> q8(-128, 127), q4(0, 15);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = &w[(n * nb + b) * bytes];
      double d, mn = 0;
      const uint16_t dh = random_half(d, !q41);
      std::memcpy(blk, &dh, 2);
      if (q41) {
        const uint16_t mh = random_half(mn, true);
        std::memcpy(blk + 2, &mh, 2);
      }
      for (int64_t i = 0; i < ac::kQuantBlock; ++i) {
        int q;
        if (q41) {
          q = q4(rng);
          uint8_t& byte = blk[4 + i % 16];
          byte = i < 16 ? uint8_t((byte & 0xF0) | q) : uint8_t((byte & 0x0F) | (q << 4));
        } else {
          q = q8(rng);
          blk[2 + i] = uint8_t(int8_t(q));
        }
        held[n * K + b * ac::kQuantBlock + i] = d * q + mn;
      }
    }
  auto x = randn(m * K), bias = randn(N);
  const auto want = reference_product(x, held, bias, m, N, K);
  // Q4_1 also in the kernel layout (repack_q4_1): the same values
  const std::vector<uint8_t> rows = q41 ? repack_q4_1(w, N, nb) : std::vector<uint8_t>{};
  for (int layout = 0; layout < (q41 ? 2 : 1); ++layout) {
    const char* name = !q41 ? "q8_0" : layout == 0 ? "q4_1" : "q4_1r";
    const uint8_t* weight = layout == 0 ? w.data() : rows.data();
    std::vector<float> out(m * N), values(N * K);
    (!q41 ? ac::linear_q8_0 : layout == 0 ? ac::linear_q4_1 : ac::linear_q4_1r)(
        x.data(), m, K, weight, N, bias.data(), out.data());
    (!q41 ? ac::dequantize_q8_0 : layout == 0 ? ac::dequantize_q4_1 : ac::dequantize_q4_1r)(
        weight, N, K, values.data());
    char what[96];
    std::snprintf(what, sizeof what, "linear_%s m=%ld N=%ld K=%ld", name, long(m), long(N),
                  long(K));
    // NOTE: weights up to 128 * 0.5 (Q8_0): the tolerance scales with them
    expect_close(what, out.data(), want, 1e-5 * std::sqrt(double(K)) * (q41 ? 8 : 64), 1e-5);
    std::snprintf(what, sizeof what, "dequantize_%s N=%ld K=%ld", name, long(N), long(K));
    expect_close(what, values.data(), held, 0.0, 1e-7);
  }
}

}  // namespace selftest
