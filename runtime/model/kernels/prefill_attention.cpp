// Attention of many queries per KV head (a prefill's), fp32, one source for every ISA (vec.h):
// prefix_attention, many queries to one shared run of keys with no mask (forward_packed's
// cascade), returning the log-sum-exp too; segment_attention, a packed prefill's segments each
// to its own keys, causal. Both flash-style: K transposed, register tiles, an online softmax.
//
// Register tiles are counted in native vectors (kW floats) and sized by kRegs, so each ISA gets
// tiles that fit its register file; the arithmetic (and so the results, within float32 rounding)
// is the same on every path.
//
// fp16 K/V (the 16-bit KV cache) run the same code, templated on the element type E: keys are
// widened as they are transposed (the transposed copy is fp32 either way), values as they are
// loaded (half.h's vload_kv); so the results equal, bit for bit, those over fp32 K/V holding the
// same values.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cores.h"
#include "half.h"
#include "vec.h"

AGENTCACHE_BEGIN

// prefix_attention: per item of kItemRows queries of one head, blocks of kKeyBlock keys from K
// transposed once per head ([D, Sp] padded past whole blocks; padded keys score -inf), tiles of
// kTileRows queries whose scores (kTileRows x kKeyVecs vectors) and whose P.V accumulators stay in
// registers; an online softmax rescales each query's sums per block. Results equal torch's CPU
// flash kernel within float32 rounding (sums in another order; exp by exp_nonpositive).
// NOTE: measured on an AMD EPYC host with AVX-512 (2 threads, same run), D = 64, 1,360 keys:
// 1,920 queries per head x 3 heads 9.2 vs 13.3 ms for torch's kernel, 2,700 x 3 13.2 vs 19.5 ms
// (1.44-1.48x); D = 128: 1.25x; 4-query tiles were 1.10-1.17x.
namespace {

constexpr int64_t kKeyVecs = kRegs >= 32 ? 4 : 3;      // key vectors per block
constexpr int64_t kKeyBlock = kKeyVecs * kW;     // keys per block
constexpr int kTileRows = kRegs >= 32 ? 6 : 3;   // queries per register tile
constexpr int kPrefixPvVecs = 4;                 // head-dim vectors per P.V pass
constexpr int64_t kItemRows = 60;                // queries per work item (whole tiles of 6 and 2)

// acc[r] (rows of D floats, head dims [d0, d0 + CV * kW)) += sum_j p[r][j] v_j over nb keys.
template <int RT, int CV, class E>
inline void prefix_pv(const float (*p)[kKeyBlock], const E* __restrict v, int64_t vs,
                      int64_t j0, int64_t nb, float* __restrict acc, int64_t D, int64_t d0) {
  vf a[RT][CV];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CV; ++c) a[r][c] = vload(acc + r * D + d0 + c * kW);
  for (int64_t j = 0; j < nb; ++j) {
    const E* vj = v + (j0 + j) * vs + d0;
    vf vv[CV];
    for (int c = 0; c < CV; ++c) vv[c] = vload_kv(vj + c * kW);
    for (int r = 0; r < RT; ++r) {
      const float pr = p[r][j];
      for (int c = 0; c < CV; ++c) a[r][c] += vv[c] * pr;
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CV; ++c) vstore(acc + r * D + d0 + c * kW, a[r][c]);
}

// lim: each row's last visible key (keys past it score -inf), or nullptr (every key visible).
template <int RT, class E>
inline void prefix_tile(const float* __restrict q, int64_t D, const float* __restrict kt,
                        int64_t Sp, int64_t j0, int64_t nb, const E* __restrict v, int64_t vs,
                        float scale, float* __restrict acc, float* __restrict mx,
                        float* __restrict sm, const int64_t* lim) {
  vf s[RT][kKeyVecs];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < kKeyVecs; ++c) s[r][c] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kt + d * Sp + j0;
    vf kv[kKeyVecs];
    for (int c = 0; c < kKeyVecs; ++c) kv[c] = vload(kd + c * kW);
    for (int r = 0; r < RT; ++r) {
      const float qv = q[r * D + d];
      for (int c = 0; c < kKeyVecs; ++c) s[r][c] += kv[c] * qv;
    }
  }
  alignas(64) float p[RT][kKeyBlock];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < kKeyVecs; ++c) vstore(p[r] + c * kW, s[r][c] * scale);
    const int64_t seen = lim == nullptr ? nb : std::clamp<int64_t>(lim[r] - j0 + 1, 0, nb);
    for (int64_t j = seen; j < kKeyBlock; ++j) p[r][j] = kNegInf;
    float top = kNegInf;
    for (int64_t j = 0; j < kKeyBlock; ++j) top = std::max(top, p[r][j]);
    // NOTE: finite: key 0 is visible to every row and lies in the first block, so after it mx is
    // finite; a later block with no visible key leaves top -inf, alpha 1 and adds zeros
    const float next = std::max(mx[r], top);
    const float alpha = exp_nonpositive(mx[r] - next);
    float total = 0.f;
AGENTCACHE_SIMD_SUM(total)
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const float e = exp_nonpositive(p[r][j] - next);
      p[r][j] = e;
      total += e;
    }
    sm[r] = sm[r] * alpha + total;
    mx[r] = next;
    float* ar = acc + r * D;
AGENTCACHE_SIMD
    for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
  }
  for (int64_t d0 = 0; d0 < D; d0 += kPrefixPvVecs * kW) {
    switch (std::min<int64_t>(kPrefixPvVecs, (D - d0) / kW)) {
      case 4: prefix_pv<RT, 4>(p, v, vs, j0, nb, acc, D, d0); break;
      case 3: prefix_pv<RT, 3>(p, v, vs, j0, nb, acc, D, d0); break;
      case 2: prefix_pv<RT, 2>(p, v, vs, j0, nb, acc, D, d0); break;
      default: prefix_pv<RT, 1>(p, v, vs, j0, nb, acc, D, d0); break;
    }
  }
}

// Whether a tile of rows [r0, r0 + rt) sees any key of the block from j0 (lim as prefix_tile's).
inline bool tile_sees(const int64_t* lim, int64_t r0, int64_t rt, int64_t j0) {
  if (lim == nullptr) return true;
  for (int64_t r = r0; r < r0 + rt; ++r)
    if (lim[r] >= j0) return true;
  return false;
}

// One work item: rows queries (q, out: [rows, D]; lse: [rows] or nullptr) of one head over S
// keys, row r seeing keys [0, lim[r]] (lim nullptr: all S; every lim[r] < S).
template <class E>
void prefix_item(const float* q, int64_t rows, int64_t D, const float* kt, int64_t S, int64_t Sp,
                 const E* v, int64_t vs, float scale, float* out, float* lse,
                 const int64_t* lim) {
  float mx[kItemRows], sm[kItemRows];
  std::fill(mx, mx + rows, kNegInf);
  std::fill(sm, sm + rows, 0.f);
  std::fill(out, out + rows * D, 0.f);
  for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, S - j0);
    int64_t r0 = 0;
    for (; r0 + kTileRows <= rows; r0 += kTileRows)
      if (tile_sees(lim, r0, kTileRows, j0))
        prefix_tile<kTileRows>(q + r0 * D, D, kt, Sp, j0, nb, v, vs, scale, out + r0 * D,
                               mx + r0, sm + r0, lim == nullptr ? nullptr : lim + r0);
    for (; r0 < rows; ++r0)
      if (tile_sees(lim, r0, 1, j0))
        prefix_tile<1>(q + r0 * D, D, kt, Sp, j0, nb, v, vs, scale, out + r0 * D, mx + r0,
                       sm + r0, lim == nullptr ? nullptr : lim + r0);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / sm[r];
    for (int64_t d = 0; d < D; ++d) out[r * D + d] *= inv;
    if (lse != nullptr) lse[r] = mx[r] + std::log(sm[r]);
  }
}

// The row stride of K transposed for S keys: whole blocks, and an odd number of 64-byte lines,
// so the D rows a tile reads (one line each) spread over every L1 set. NOTE: a stride of a
// multiple of 1 KiB (S = 1,275: 1,280 floats) put them in 4 sets of 12 ways and made
// segment_attention 2x slower (16 segments x 25 tokens, measured on this host's 48 KiB L1).
inline int64_t kt_stride(int64_t S) {
  const int64_t Sp = (S + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  return (Sp / 16) % 2 == 0 ? Sp + 16 : Sp;
}

// K [S, D] (row stride ks; fp16 rows widened first, D <= 128) transposed into kt [D, Sp] fp32,
// zero past S.
template <class E>
void transpose_keys(const E* k, int64_t ks, int64_t S, int64_t Sp, int64_t D, float* kt) {
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * Sp + S, kt + (d + 1) * Sp, 0.f);
  float wide[128];
  for (int64_t j = 0; j < S; ++j) {
    const float* kj;
    if constexpr (std::is_same_v<E, float>) {
      kj = k + j * ks;
    } else {
      widen_halves(k + j * ks, D, wide);
      kj = wide;
    }
    for (int64_t d = 0; d < D; ++d) kt[d * Sp + j] = kj[d];
  }
}

template <class E>
void prefix_attention_impl(const float* q, const E* k, int64_t kh, int64_t ks, const E* v,
                           int64_t vh, int64_t vs, int64_t H, int64_t M, int64_t S, int64_t D,
                           float scale, float* out, float* lse) {
  static_assert(kItemRows % kTileRows == 0, "whole tiles per item");
  const int64_t Sp = kt_stride(S);
  std::vector<float> kt(H * D * Sp);  // [H, D, Sp]: K transposed, zero past S
  for (int64_t h = 0; h < H; ++h) transpose_keys(k + h * kh, ks, S, Sp, D, kt.data() + h * D * Sp);
  const int64_t per = (M + kItemRows - 1) / kItemRows;
  const float* ktp = kt.data();
  parallel_for(H * per, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / per, m0 = (it % per) * kItemRows;
      const int64_t rows = std::min(kItemRows, M - m0);
      prefix_item(q + (h * M + m0) * D, rows, D, ktp + h * D * Sp, S, Sp, v + h * vh, vs, scale,
                  out + (h * M + m0) * D, lse + h * M + m0, nullptr);
    }
  });
}

// segment_attention: forward_packed's attention in one call. Segment s's queries are folded per
// KV head as prefix_attention's (rows g * len + j for query head h * G + g and token j), and
// each row r gets lim[r] = past[s] + j (causal over the segment's own new keys); items of up to
// kItemRows rows run prefix_item over the segment's K, transposed once per (segment, KV head).
template <class E>
void segment_attention_impl(const SegmentAttentionArgs& a, const E* const* k, const E* const* v) {
  const int64_t G = a.H / a.Hkv, D = a.D, Hkv = a.Hkv;
  struct Piece {
    int64_t s, h, r0, rows;
  };
  std::vector<Piece> pieces;
  std::vector<int64_t> kt_at(a.num_segments * Hkv + 1, 0);  // offset of each (s, h)'s K^T
  for (int64_t s = 0; s < a.num_segments; ++s) {
    const int64_t S = a.past[s] + a.lengths[s], Sp = kt_stride(S);
    for (int64_t h = 0; h < Hkv; ++h) {
      kt_at[s * Hkv + h + 1] = kt_at[s * Hkv + h] + D * Sp;
      for (int64_t r0 = 0; r0 < G * a.lengths[s]; r0 += kItemRows)
        pieces.push_back({s, h, r0, std::min(kItemRows, G * a.lengths[s] - r0)});
    }
  }
  std::vector<float> kt(kt_at.back());  // per (s, h): [D, Sp] K transposed
  parallel_for(a.num_segments * Hkv, [&](int64_t begin, int64_t end) {
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / Hkv, h = sh % Hkv, S = a.past[s] + a.lengths[s];
      const int64_t Sp = (kt_at[sh + 1] - kt_at[sh]) / D;
      transpose_keys(k[s] + h * a.kh[s], a.ks[s], S, Sp, D, kt.data() + kt_at[sh]);
    }
  });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(pieces.size());
  // NOTE: pieces are handed out one at a time (segments differ in length and keys)
  parallel_for(std::min<int64_t>(total, thread_count()), [&](int64_t, int64_t) {
    std::vector<float> qs(kItemRows * D), os(kItemRows * D);
    int64_t lim[kItemRows];
    for (int64_t i = next++; i < total; i = next++) {
      const Piece& p = pieces[i];
      const int64_t len = a.lengths[p.s], S = a.past[p.s] + len;
      const auto row = [&](int64_t r) {  // the query / output row of folded row r0 + r
        const int64_t f = p.r0 + r, g = f / len, j = f % len;
        return ((p.h * G + g) * a.N + a.starts[p.s] + j) * D;
      };
      for (int64_t r = 0; r < p.rows; ++r) {
        std::copy(a.q + row(r), a.q + row(r) + D, qs.data() + r * D);
        lim[r] = a.past[p.s] + (p.r0 + r) % len;
      }
      prefix_item(qs.data(), p.rows, D, kt.data() + kt_at[p.s * Hkv + p.h], S,
                  (kt_at[p.s * Hkv + p.h + 1] - kt_at[p.s * Hkv + p.h]) / D,
                  v[p.s] + p.h * a.vh[p.s], a.vs[p.s], a.scale, os.data(), nullptr, lim);
      for (int64_t r = 0; r < p.rows; ++r)
        std::copy(os.data() + r * D, os.data() + (r + 1) * D, a.out + row(r));
    }
  });
}

}  // namespace

void prefix_attention(const float* q, const float* k, int64_t kh, int64_t ks, const float* v,
                      int64_t vh, int64_t vs, int64_t H, int64_t M, int64_t S, int64_t D,
                      float scale, float* out, float* lse) {
  prefix_attention_impl(q, k, kh, ks, v, vh, vs, H, M, S, D, scale, out, lse);
}

void prefix_attention(const float* q, const uint16_t* k, int64_t kh, int64_t ks,
                      const uint16_t* v, int64_t vh, int64_t vs, int64_t H, int64_t M, int64_t S,
                      int64_t D, float scale, float* out, float* lse) {
  prefix_attention_impl(q, k, kh, ks, v, vh, vs, H, M, S, D, scale, out, lse);
}

void segment_attention(const SegmentAttentionArgs& a) {
  if (a.k_half != nullptr) segment_attention_impl(a, a.k_half, a.v_half);
  else segment_attention_impl(a, a.k, a.v);
}

AGENTCACHE_END
