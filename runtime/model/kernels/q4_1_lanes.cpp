// One-row (decode) products over Q4_1 in the kernel layout (quant_blocks.h's top;
// repack_q4_1 in Python): register tiles as quantized.cpp's direct path, a block's weights a
// shift and a mask per vector of 32-bit lanes instead of a byte -> 32-bit widening (a shuffle),
// the tile's scales converted to fp32 once and each block's d a broadcast from memory.
//
// NOTE: measured on SmolLM2-135M's 30 layers of Q4_1 products (qkv 960 x 576, o 576 x 576,
// gate_up 3,072 x 576, down 576 x 1,536) at one row, 2 threads, AVX-512 (an AMD EPYC host),
// 7 alternating rounds of 20 passes, medians: GGUF's layout 2.54 / 2.58 / 2.65 ms, this one
// 2.27 / 2.30 / 2.37 (1.10 / 1.12 / 1.14x per round). With the per-block unpack gone the
// tile is bound by its multiply-adds (3 a block a row: 2 for x . q, 1 for d).
#include "quant_blocks.h"

AGENTCACHE_BEGIN
namespace {

// acc[r][held + h] += d_h * (x_r . q_h) over block b (x row stride K; d_h at ds[2 (held + h)
// nbp]: direct_tile_r's scratch from block b on).
template <int MR, int NO, int kHeld>
inline void block_step(const vf (*q)[kBlockVecs], const float* __restrict x, int64_t K, int64_t b,
                       const float* ds, int64_t nbp, int held, vf (&acc)[MR][NO]) {
  for (int r = 0; r < MR; ++r) {
    const float* xb = x + r * K + b * kQuantBlock;
    for (int h = 0; h < kHeld; ++h) {
      vf t = vload(xb) * q[h][0];
      for (int64_t v = 1; v < kBlockVecs; ++v) t += vload(xb + v * kW) * q[h][v];
      acc[r][held + h] += t * ds[2 * (held + h) * nbp];
    }
  }
}

// block_step for block J of a group whose lanes are held (b: that block).
template <int J, int MR, int NO, int kHeld>
inline void group_step(const vu (*lanes)[kLaneVecs], const float* __restrict x, int64_t K,
                       int64_t b, const float* ds, int64_t nbp, int held, vf (&acc)[MR][NO]) {
  vf q[kHeld][kBlockVecs];
  for (int h = 0; h < kHeld; ++h) group_block<J>(lanes[h], q[h]);
  block_step<MR, NO, kHeld>(q, x, K, b, ds, nbp, held, acc);
}

// direct_tile for a Q4_1 weight in the kernel layout (the same arguments), and: xsum [MR, nbp]
// (nbp: nb rounded up to whole vectors, zeros past nb); sc a scratch of [NO, 2, nbp] floats
// whose entries past nb are zero. The tile's d and m become fp32 in sc once, the m terms are one
// lane-wise product over blocks, each block's d a broadcast from sc. Each (row, output) sums
// x . q per block in the same order as direct_tile; the m terms in another order (float32
// rounding).
template <int MR, int NO>
inline void direct_tile_r(const float* __restrict x, int64_t K, const float* __restrict xsum,
                          int64_t nbp, const uint8_t* __restrict w, int64_t row_bytes, int64_t o0,
                          int64_t nout, float* __restrict out, int64_t ldo, const float* bias,
                          float* __restrict sc) {
  const int64_t nb = K / kQuantBlock, groups = nb / kGroupBlocks;
  const uint8_t* rows[NO];
  for (int o = 0; o < NO; ++o) {
    rows[o] = w + (o0 + std::min<int64_t>(o, nout - 1)) * row_bytes;
    halves_to_floats(rows[o], nb, sc + 2 * o * nbp);                // d
    halves_to_floats(rows[o] + 2 * nb, nb, sc + (2 * o + 1) * nbp);  // m
  }
  vf acc[MR][NO];
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = vzero();
  for (int64_t v = 0; v < nbp; v += kW)
    for (int o = 0; o < NO; ++o) {
      const vf mv = vload(sc + (2 * o + 1) * nbp + v);
      for (int r = 0; r < MR; ++r) acc[r][o] += mv * vload(xsum + r * nbp + v);
    }
  // NOTE: one prefetch stream past the tile's contiguous NO * row_bytes bytes, as direct_tile's,
  // spread over the groups.
  const uint8_t* ahead = w + o0 * row_bytes + kAheadBytes;
  const int64_t step = groups > 0 ? (NO * row_bytes + groups - 1) / groups : 0;
  constexpr int kHeld = kRegs >= 32 ? NO : 1;  // outputs' groups held at once (direct_tile)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(ahead + g * step + off);
    for (int held = 0; held < NO; held += kHeld) {
      vu lanes[kHeld][kLaneVecs];
      for (int h = 0; h < kHeld; ++h)
        for (int64_t l = 0; l < kLaneVecs; ++l)
          lanes[h][l] = vload_bits(rows[held + h] + 4 * nb + g * kGroupBytes + l * 4 * kW);
      // NOTE: the four blocks spelled out: through each_group_block's generic lambda the tile ran
      // 1.08-1.10x slower (SmolLM2's 30 layers at one row, 2 threads, 3 alternating rounds).
      const int64_t b = g * kGroupBlocks;
      group_step<0, MR, NO, kHeld>(lanes, x, K, b, sc + b, nbp, held, acc);
      group_step<1, MR, NO, kHeld>(lanes, x, K, b + 1, sc + b + 1, nbp, held, acc);
      group_step<2, MR, NO, kHeld>(lanes, x, K, b + 2, sc + b + 2, nbp, held, acc);
      group_step<3, MR, NO, kHeld>(lanes, x, K, b + 3, sc + b + 3, nbp, held, acc);
    }
  }
  for (int64_t b = groups * kGroupBlocks; b < nb; ++b)  // the last nb % 4 blocks: GGUF's bytes
    for (int held = 0; held < NO; held += kHeld) {
      vf q[kHeld][kBlockVecs];
      for (int h = 0; h < kHeld; ++h)
        gguf_nibbles(rows[held + h] + 4 * nb + groups * kGroupBytes +
                         (b - groups * kGroupBlocks) * (kQuantBlock / 2),
                     q[h]);
      block_step<MR, NO, kHeld>(q, x, K, b, sc + b, nbp, held, acc);
    }
  for (int r = 0; r < MR; ++r) {
    float sums[NO];
    // NOTE: vec.h's transposed reduction for a tile's 4 outputs: with K = 576 a tile's rows are
    // 18 blocks, and 4 chains of kW dependent adds were a sizeable share of the tile
    if constexpr (NO == 4)
      hsum4(acc[r], sums);
    else
      for (int o = 0; o < NO; ++o) sums[o] = hsum(acc[r][o]);
    for (int o = 0; o < nout; ++o)
      out[r * ldo + o0 + o] = sums[o] + (bias != nullptr ? bias[o0 + o] : 0.f);
  }
}

}  // namespace

// direct for a Q4_1 weight in the kernel layout: xsum [m, nbp] (direct_tile_r).
void direct_r(const float* x, int64_t m, int64_t K, const float* xsum, int64_t nbp,
              const uint8_t* w, int64_t N, const float* bias, float* out) {
  const int64_t chunks = (N + kQuantChunk - 1) / kQuantChunk;
  const int64_t row_bytes = (K / kQuantBlock) * kQ4_1Bytes;
  parallel_for(chunks, [&](int64_t first, int64_t last) {
    std::vector<float> sc(2 * 4 * nbp, 0.f);  // [NO <= 4, 2, nbp]: d, m per output
    const int64_t o0 = first * kQuantChunk, o1 = std::min(N, last * kQuantChunk);
    for (int64_t r = 0; r < m; r += kQuantRows) {
      const auto rows = [&](auto MR) {
        constexpr int NO = direct_outs<MR>();
        for (int64_t o = o0; o < o1; o += NO)
          direct_tile_r<MR, NO>(x + r * K, K, xsum + r * nbp, nbp, w, row_bytes, o,
                                std::min<int64_t>(NO, o1 - o), out + r * N, N, bias, sc.data());
      };
      switch (std::min<int64_t>(kQuantRows, m - r)) {
        case 4: if constexpr (kQuantRows >= 4) rows(std::integral_constant<int, 4>{}); break;
        case 3: if constexpr (kQuantRows >= 3) rows(std::integral_constant<int, 3>{}); break;
        case 2: rows(std::integral_constant<int, 2>{}); break;
        default: rows(std::integral_constant<int, 1>{}); break;
      }
    }
  });
}

AGENTCACHE_END
