// The self-test's attention checks (kernel_selftest.h): decode_attention (masks, a shared prefix,
// head dims on and off the unrolled paths), prefix_attention with its log-sum-exp and
// segment_attention against float64 loops written here, and each over fp16 K/V bit-equal to the
// fp32 kernel over the rounded values.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "cores.h"
#include "half.h"
#include "kernel_selftest.h"

namespace selftest {

namespace {

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

}  // namespace

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

}  // namespace selftest
