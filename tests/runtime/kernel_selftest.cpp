// Runs the torch-free kernel cores (runtime/model/kernels/attention.cpp, products.cpp, quantized.cpp)
// and half.h's fp16 conversions of one ISA's build against float64 loops written here, serially
// (vec.h's default threads). Built by tests/runtime/test_kernel_cores.py for each ISA this
// machine runs, and for NEON with an aarch64 cross compiler, run under qemu: so the NEON path is
// executed, not only compiled, on x86.
// Prints one line per failed check and a summary; exit status 0 when every check passed.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "cores.h"
#include "half.h"

namespace ac = agentcache;

namespace {

int checks = 0, failures = 0;
std::mt19937 rng(1234);

std::vector<float> randn(size_t n, float scale = 1.f) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// |got - want| <= atol + rtol |want| everywhere.
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

// softmax(q . K^T * scale + mask) V per (row, head), float64, GQA.
std::vector<double> attention_ref(const std::vector<float>& q, const std::vector<float>& k,
                                  const std::vector<float>& v, const std::vector<float>* mask,
                                  int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t D,
                                  double scale) {
  std::vector<double> out(B * H * D, 0.0);
  const int64_t G = H / Hkv;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kh = h / G;
      std::vector<double> s(T);
      double mx = -INFINITY;
      for (int64_t t = 0; t < T; ++t) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += double(q[(b * H + h) * D + d]) * k[((b * Hkv + kh) * T + t) * D + d];
        s[t] = dot * scale + (mask ? (*mask)[b * T + t] : 0.f);
        mx = std::max(mx, s[t]);
      }
      if (mx == -INFINITY) continue;
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h) * D + d] += s[t] / sum * v[((b * Hkv + kh) * T + t) * D + d];
    }
  return out;
}

void check_decode_attention(int64_t B, int64_t G, int64_t Hkv, int64_t T, int64_t D, bool masked,
                            bool shared) {
  const int64_t H = G * Hkv;
  auto q = randn(B * H * D), k = randn(B * Hkv * T * D), v = randn(B * Hkv * T * D);
  std::vector<int64_t> src(B, 0), len(B, 0);
  if (shared) {  // rows 1.. copy row 0's first 3/4 of the keys
    const int64_t n = T * 3 / 4;
    for (int64_t b = 1; b < B; ++b) {
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(&k[((b * Hkv + h) * T) * D], &k[(h * T) * D], n * D * sizeof(float));
        std::memcpy(&v[((b * Hkv + h) * T) * D], &v[(h * T) * D], n * D * sizeof(float));
      }
      len[b] = n;
    }
  }
  std::vector<float> mask(B * T, 0.f);
  if (masked) {
    for (int64_t t = T / 2 + 1; t < T; ++t) mask[(B - 1) * T + t] = -INFINITY;  // a shorter row
    if (B > 1 && T > 300)
      for (int64_t t = 256; t < 300; ++t) mask[t] = -INFINITY;  // a hole in row 0
  }
  std::vector<float> out(B * H * D);
  ac::DecodeAttentionArgs a{q.data(), k.data(), v.data(), Hkv * T * D, T * D, D,
                            Hkv * T * D, T * D, D, masked ? mask.data() : nullptr,
                            shared ? src.data() : nullptr, shared ? len.data() : nullptr,
                            B, H, Hkv, T, D, 1.f / std::sqrt(float(D)), out.data()};
  ac::decode_attention(a);
  char what[128];
  std::snprintf(what, sizeof what, "decode_attention B=%ld G=%ld T=%ld D=%ld mask=%d shared=%d",
                long(B), long(G), long(T), long(D), masked, shared);
  expect_close(what, out.data(),
               attention_ref(q, k, v, masked ? &mask : nullptr, B, H, Hkv, T, D,
                             1.0 / std::sqrt(double(D))),
               2e-6, 1e-5);
}

void check_prefix_attention(int64_t H, int64_t M, int64_t S, int64_t D) {
  auto q = randn(H * M * D), k = randn(H * S * D), v = randn(H * S * D);
  std::vector<float> out(H * M * D), lse(H * M);
  const float scale = 1.f / std::sqrt(float(D));
  ac::prefix_attention(q.data(), k.data(), S * D, D, v.data(), S * D, D, H, M, S, D, scale,
                       out.data(), lse.data());
  // as decode attention of M rows of one query each, head by head
  std::vector<double> want(H * M * D), want_lse(H * M);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t m = 0; m < M; ++m) {
      std::vector<double> s(S);
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < S; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += double(q[(h * M + m) * D + d]) * k[(h * S + j) * D + d];
        mx = std::max(mx, s[j] = dot * scale);
      }
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j < S; ++j)
        for (int64_t d = 0; d < D; ++d)
          want[(h * M + m) * D + d] += s[j] / sum * v[(h * S + j) * D + d];
      want_lse[h * M + m] = mx + std::log(sum);
    }
  char what[96];
  std::snprintf(what, sizeof what, "prefix_attention H=%ld M=%ld S=%ld D=%ld", long(H), long(M),
                long(S), long(D));
  expect_close(what, out.data(), want, 1e-5, 1e-5);
  expect_close(what, lse.data(), want_lse, 1e-4, 1e-5);
}

// Segments (past, length) of one packed row; each segment's keys live in their own buffer of
// `extra` spare positions (its rows `D` floats apart, heads `(past + length + extra) * D`).
void check_segment_attention(int64_t H, int64_t Hkv, int64_t D,
                             std::vector<std::pair<int64_t, int64_t>> segs) {
  const int64_t num = int64_t(segs.size()), G = H / Hkv, extra = 3;
  int64_t N = 0;
  for (auto [p, n] : segs) N += n;
  auto q = randn(H * N * D);
  std::vector<std::vector<float>> ks, vs;
  std::vector<const float*> kp, vp;
  std::vector<int64_t> starts, lengths, past, kh, kst, vh, vst;
  for (auto [p, n] : segs) {
    const int64_t cap = p + n + extra;
    ks.push_back(randn(Hkv * cap * D));
    vs.push_back(randn(Hkv * cap * D));
    starts.push_back(starts.empty() ? 0 : starts.back() + lengths.back());
    lengths.push_back(n);
    past.push_back(p);
    kh.push_back(cap * D);
    kst.push_back(D);
    vh.push_back(cap * D);
    vst.push_back(D);
  }
  for (int64_t s = 0; s < num; ++s) {
    kp.push_back(ks[s].data());
    vp.push_back(vs[s].data());
  }
  std::vector<float> out(H * N * D);
  const float scale = 1.f / std::sqrt(float(D));
  ac::segment_attention({q.data(), H, Hkv, N, D, num, starts.data(), lengths.data(), past.data(),
                         kp.data(), vp.data(), kh.data(), kst.data(), vh.data(), vst.data(),
                         scale, out.data()});
  std::vector<double> want(H * N * D);
  for (int64_t s = 0; s < num; ++s)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < lengths[s]; ++j) {
        const int64_t seen = past[s] + j + 1, kv = h / G, row = (h * N + starts[s] + j) * D;
        std::vector<double> sc(seen);
        double mx = -INFINITY, sum = 0;
        for (int64_t t = 0; t < seen; ++t) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(q[row + d]) * ks[s][kv * kh[s] + t * D + d];
          mx = std::max(mx, sc[t] = dot * scale);
        }
        for (auto& x : sc) sum += (x = std::exp(x - mx));
        for (int64_t t = 0; t < seen; ++t)
          for (int64_t d = 0; d < D; ++d) want[row + d] += sc[t] / sum * vs[s][kv * vh[s] + t * D + d];
      }
  char what[96];
  std::snprintf(what, sizeof what, "segment_attention H=%ld Hkv=%ld D=%ld segments=%ld", long(H),
                long(Hkv), long(D), long(num));
  expect_close(what, out.data(), want, 1e-5, 1e-5);
}

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
  std::vector<double> want(m * N);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t n = 0; n < N; ++n) {
      double acc = bias[n];
      for (int64_t kk = 0; kk < K; ++kk) acc += double(x[r * K + kk]) * wt[kk * N + n];
      want[r * N + n] = acc;
    }
  char what[64];
  std::snprintf(what, sizeof what, "linear_rows m=%ld N=%ld K=%ld", long(m), long(N), long(K));
  expect_close(what, out.data(), want, 1e-5 * std::sqrt(double(K)), 1e-5);
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

}  // namespace

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

// decode_attention over fp16 K/V equals, bit for bit, decode_attention over fp32 K/V holding the
// same (rounded) values; the fp32 result's own accuracy is check_decode_attention's.
void check_decode_attention_half(int64_t B, int64_t G, int64_t Hkv, int64_t T, int64_t D,
                                 bool masked, bool shared) {
  const int64_t H = G * Hkv, n = B * Hkv * T * D;
  auto q = randn(B * H * D), k = randn(n), v = randn(n);
  std::vector<uint16_t> k16(n), v16(n);
  ac::narrow_floats(k.data(), n, k16.data());
  ac::narrow_floats(v.data(), n, v16.data());
  ac::widen_halves(k16.data(), n, k.data());
  ac::widen_halves(v16.data(), n, v.data());
  std::vector<int64_t> src(B, 0), len(B, 0);
  if (shared)  // rows 1.. copy row 0's first 3/4 of the keys
    for (int64_t b = 1; b < B; ++b) {
      for (int64_t i = 0; i < Hkv * T * D; ++i) {
        const int64_t t = (i / D) % T, at = b * Hkv * T * D + i;
        if (t >= T * 3 / 4) continue;
        k[at] = k[i], v[at] = v[i], k16[at] = k16[i], v16[at] = v16[i];
      }
      len[b] = T * 3 / 4;
    }
  std::vector<float> mask(B * T, 0.f);
  if (masked) {
    for (int64_t t = T / 2 + 1; t < T; ++t) mask[(B - 1) * T + t] = -INFINITY;
    if (B > 1 && T > 300)
      for (int64_t t = 256; t < 512 && t < T; ++t) mask[t] = -INFINITY;  // a masked block
  }
  std::vector<float> out(B * H * D), out16(B * H * D);
  ac::DecodeAttentionArgs a{q.data(), k.data(), v.data(), Hkv * T * D, T * D, D,
                            Hkv * T * D, T * D, D, masked ? mask.data() : nullptr,
                            shared ? src.data() : nullptr, shared ? len.data() : nullptr,
                            B, H, Hkv, T, D, 1.f / std::sqrt(float(D)), out.data()};
  ac::decode_attention(a);
  a.k = a.v = nullptr;
  a.k_half = k16.data();
  a.v_half = v16.data();
  a.out = out16.data();
  ac::decode_attention(a);
  ++checks;
  if (std::memcmp(out.data(), out16.data(), out.size() * sizeof(float)) != 0) {
    ++failures;
    std::printf("FAIL decode_attention fp16 B=%ld G=%ld T=%ld D=%ld mask=%d shared=%d: not the "
                "fp32 result over the rounded K/V\n", long(B), long(G), long(T), long(D), masked,
                shared);
  }
}

// fp32 values rounded to fp16: the bits into h, their values back into x.
void round_to_half(std::vector<float>& x, std::vector<uint16_t>& h) {
  h.resize(x.size());
  ac::narrow_floats(x.data(), int64_t(x.size()), h.data());
  ac::widen_halves(h.data(), int64_t(h.size()), x.data());
}

// Bits equal (one check).
void expect_same(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
  ++checks;
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
    ++failures;
    std::printf("FAIL %s: not the fp32 result over the rounded K/V\n", what);
  }
}

// prefix_attention and segment_attention over fp16 K/V equal, bit for bit, the fp32 kernels over
// fp32 K/V holding the same (rounded) values (segments: two of them, keys strided by `extra`).
void check_prefill_half(int64_t H, int64_t Hkv, int64_t M, int64_t S, int64_t D) {
  auto q = randn(H * M * D), k = randn(H * S * D), v = randn(H * S * D);
  std::vector<uint16_t> k16, v16;
  round_to_half(k, k16);
  round_to_half(v, v16);
  std::vector<float> out(H * M * D), lse(H * M), out16(H * M * D), lse16(H * M);
  const float scale = 1.f / std::sqrt(float(D));
  ac::prefix_attention(q.data(), k.data(), S * D, D, v.data(), S * D, D, H, M, S, D, scale,
                       out.data(), lse.data());
  ac::prefix_attention(q.data(), k16.data(), S * D, D, v16.data(), S * D, D, H, M, S, D, scale,
                       out16.data(), lse16.data());
  expect_same("prefix_attention fp16", out16, out);
  expect_same("prefix_attention fp16 lse", lse16, lse);
  // segments: (past, length) = (S - M, M) and (0, M / 2 + 1) of one packed row, Hkv heads
  const int64_t len[2] = {M, M / 2 + 1}, past[2] = {S - M, 0}, N = len[0] + len[1];
  const int64_t starts[2] = {0, M}, cap = S + 3, kh[2] = {cap * D, cap * D}, ks[2] = {D, D};
  auto qs = randn(H * N * D), k0 = randn(Hkv * cap * D), v0 = randn(Hkv * cap * D);
  auto k1 = randn(Hkv * cap * D), v1 = randn(Hkv * cap * D);
  std::vector<uint16_t> k016, v016, k116, v116;
  round_to_half(k0, k016), round_to_half(v0, v016);
  round_to_half(k1, k116), round_to_half(v1, v116);
  const float* kp[2] = {k0.data(), k1.data()};
  const float* vp[2] = {v0.data(), v1.data()};
  const uint16_t* kp16[2] = {k016.data(), k116.data()};
  const uint16_t* vp16[2] = {v016.data(), v116.data()};
  std::vector<float> so(H * N * D), so16(H * N * D);
  ac::SegmentAttentionArgs a{qs.data(), H, Hkv, N, D, 2, starts, len, past, kp, vp, kh, ks, kh,
                             ks, scale, so.data()};
  ac::segment_attention(a);
  a.k = a.v = nullptr;
  a.k_half = kp16;
  a.v_half = vp16;
  a.out = so16.data();
  ac::segment_attention(a);
  expect_same("segment_attention fp16", so16, so);
}

int main() {
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
