// Products over GGUF's quantized blocks (Q8_0, Q4_1), fp32 inputs, accumulation and outputs, one
// source for every ISA (vec.h).
//
// A weight [N, K] is N rows of K / 32 blocks, each block 32 consecutive inputs of one output,
// exactly as GGUF stores it (ggml's block_q8_0 / block_q4_1; runtime.model.kernels.quantize_weight):
// - Q8_0, 34 bytes: fp16 scale d, then 32 int8 q; weight i = d * q[i].
// - Q4_1, 20 bytes: fp16 scale d, fp16 minimum m, then 16 bytes of nibbles: byte j holds weight
//   j in its low nibble and weight 16 + j in its high one; weight i = d * q[i] + m.
// So a block's contribution to x . w is d * (x . q) (+ m * sum(x) for Q4_1): the integers are
// widened to fp32 vectors and multiplied by x, the scale applied once per block, and the sums of
// x over each block computed once per call. The result equals fp32 arithmetic on the
// dequantized weights within float32 rounding.
//
// Q4_1 also comes in the kernel layout (quant_blocks.h, q4_1_lanes.cpp; repack_q4_1 in Python).
//
// Few rows (a decode step's): register tiles of up to kQuantRows rows of x by 2-4 outputs read
// each weight block once per tile, straight from the packed bytes (prefetched ahead along each
// row); threads take chunks of 16 outputs.
// More rows (a batch, a short prefill): each thread dequantizes 4 outputs' rows at a time into an
// fp32 scratch and runs every row of x against them in register tiles, so the integer widening is
// paid once per output, not once per tile of rows. From kPanelMinRows rows (a prefill chunk):
// 32 outputs at a time into a [K, 32] panel run through linear_packed's fp32 register tiles.
#include "quant_blocks.h"

AGENTCACHE_BEGIN
namespace {

// Rows [0, MR) of x (row stride K) against outputs [o0, o0 + nout) (nout <= NO; a tile's missing
// outputs read the last one's blocks again and are not stored). w: the weight's first row,
// row_bytes apart; xsum: [MR, nb] sums of x over each block (Q4_1); out row stride ldo.
template <class F, int MR, int NO>
inline void direct_tile(const float* __restrict x, int64_t K, const float* __restrict xsum,
                        const uint8_t* __restrict w, int64_t row_bytes, int64_t o0, int64_t nout,
                        float* __restrict out, int64_t ldo, const float* bias) {
  const int64_t nb = K / kQuantBlock;
  const uint8_t* rows[NO];
  for (int o = 0; o < NO; ++o) rows[o] = w + (o0 + std::min<int64_t>(o, nout - 1)) * row_bytes;
  vf acc[MR][NO];
  float macc[MR][NO];
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < NO; ++o) {
      acc[r][o] = vzero();
      macc[r][o] = 0.f;
    }
  // NOTE: the tile's rows are one contiguous run of NO * row_bytes bytes (the last tile's
  // missing outputs aside), read at NO blocks a step: one prefetch stream kAheadBytes past the
  // tile's start, NO blocks' bytes a step, reaches the tiles after this one in time (past the
  // weight's end it prefetches nothing useful; a prefetch never faults).
  const uint8_t* ahead = w + o0 * row_bytes + kAheadBytes;
  // NOTE: with 32 registers every output's block is widened first (NO x kBlockVecs vectors),
  // then used by every row; with 16 (AVX2) that overflowed and the accumulators went through
  // the stack, so there one output's block at a time is widened and used (x re-read from L1).
  // Each (row, output) sums the same terms in the same order either way.
  constexpr int kHeld = kRegs >= 32 ? NO : 1;  // blocks widened at once
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t off = 0; off < NO * F::kBytes; off += 64)
      __builtin_prefetch(ahead + b * NO * F::kBytes + off);
    for (int held = 0; held < NO; held += kHeld) {
      vf q[kHeld][kBlockVecs];
      float d[kHeld], m[kHeld];
      for (int h = 0; h < kHeld; ++h) F::load(rows[held + h] + b * F::kBytes, q[h], d[h], m[h]);
      for (int r = 0; r < MR; ++r) {
        const float* xb = x + r * K + b * kQuantBlock;
        for (int h = 0; h < kHeld; ++h) {
          vf t = vload(xb) * q[h][0];
          for (int64_t v = 1; v < kBlockVecs; ++v) t += vload(xb + v * kW) * q[h][v];
          acc[r][held + h] += t * d[h];
          if constexpr (F::kHasMin) macc[r][held + h] += m[h] * xsum[r * nb + b];
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < nout; ++o)
      out[r * ldo + o0 + o] =
          hsum(acc[r][o]) + macc[r][o] + (bias != nullptr ? bias[o0 + o] : 0.f);
}

template <class F, int MR>
void direct_rows(const float* x, int64_t K, const float* xsum, const uint8_t* w, int64_t o_begin,
                 int64_t o_end, float* out, int64_t ldo, const float* bias) {
  constexpr int NO = direct_outs<MR>();
  const int64_t row_bytes = (K / kQuantBlock) * F::kBytes;
  for (int64_t o = o_begin; o < o_end; o += NO)
    direct_tile<F, MR, NO>(x, K, xsum, w, row_bytes, o, std::min<int64_t>(NO, o_end - o), out,
                           ldo, bias);
}

template <class F>
void direct(const float* x, int64_t m, int64_t K, const float* xsum, const uint8_t* w,
            int64_t N, const float* bias, float* out) {
  const int64_t nb = K / kQuantBlock, chunks = (N + kQuantChunk - 1) / kQuantChunk;
  parallel_for(chunks, [&](int64_t first, int64_t last) {
    const int64_t o0 = first * kQuantChunk, o1 = std::min(N, last * kQuantChunk);
    for (int64_t r = 0; r < m; r += kQuantRows) {
      const float* xr = x + r * K;
      const float* sr = xsum + r * nb;
      float* yr = out + r * N;
      switch (std::min<int64_t>(kQuantRows, m - r)) {
        case 4: if constexpr (kQuantRows >= 4) direct_rows<F, 4>(xr, K, sr, w, o0, o1, yr, N, bias); break;
        case 3: if constexpr (kQuantRows >= 3) direct_rows<F, 3>(xr, K, sr, w, o0, o1, yr, N, bias); break;
        case 2: direct_rows<F, 2>(xr, K, sr, w, o0, o1, yr, N, bias); break;
        default: direct_rows<F, 1>(xr, K, sr, w, o0, o1, yr, N, bias); break;
      }
    }
  });
}
// The widened path: kWideOuts outputs' rows dequantized once into an fp32 scratch ([kWideOuts,
// K] row-major, in L1 for K up to a few thousand), then every row of x against them in register
// tiles of kWideRows rows by kWideOuts outputs (dot products along K, one horizontal sum per
// output). NOTE: with 16 registers (AVX2) 3 rows: 12 accumulators and the 4 weight vectors, x
// read as the multiply-add's memory operand. Measured on SmolLM2's 30 layers at 30 rows (a hit's
// suffix), one thread, CPU time, 3 alternating rounds: 85.0-87.9 ms against 110.9-113.5 with 2
// rows (8 accumulators) and 97-105 with 4-6 rows by 2 outputs.
constexpr int kWideOuts = 4;
constexpr int kWideRows = kRegs >= 32 ? kQuantRows : 3;

// The horizontal sums of one row's kWideOuts accumulators. NOTE: on AVX2 one transposed
// reduction (two rounds of pairwise adds, then the halves) for the four: the lane-by-lane loop
// of hsum had cost 14% of the widened path (SmolLM2's 30 layers at 30 rows, serial CPU time, 3
// alternating rounds: 73.2-74.2 -> 62.7-63.7 ms). The order of the adds differs, within float32
// rounding.
inline void hsum_outs(const vf* acc, float* sums) {
#if defined(__AVX2__) && !defined(__AVX512F__) && AGENTCACHE_VEC_FLOATS == 8
  static_assert(kWideOuts == 4, "four sums per transposed reduction");
  __m256 a[4];
  std::memcpy(a, acc, sizeof a);
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  for (int c = 0; c < kWideOuts; ++c) sums[c] = hsum(acc[c]);
#endif
}

template <int MR>
inline void dot_tile(const float* __restrict x, int64_t K, const float* __restrict w,
                     float* __restrict out, int64_t ldo, int64_t ncols, const float* bias) {
  vf acc[MR][kWideOuts];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kWideOuts; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < K; k += kW) {
    vf wv[kWideOuts];
    for (int c = 0; c < kWideOuts; ++c) wv[c] = vload(w + c * K + k);
    for (int r = 0; r < MR; ++r) {
      const vf xv = vload(x + r * K + k);
      for (int c = 0; c < kWideOuts; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < MR; ++r) {
    float sums[kWideOuts];
    hsum_outs(acc[r], sums);
    for (int64_t c = 0; c < ncols; ++c)
      out[r * ldo + c] = sums[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

template <class F>
void dequantize_rows(const uint8_t* w, int64_t N, int64_t K, float* out) {
  const int64_t row_bytes = (K / kQuantBlock) * F::kBytes;
  for (int64_t n = 0; n < N; ++n) dequantize_row<F>(w + n * row_bytes, K, out + n * K);
}

template <class F>
void widened(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
             const float* bias, float* out) {
  const int64_t row_bytes = (K / kQuantBlock) * F::kBytes;
  const int64_t chunks = (N + kQuantChunk - 1) / kQuantChunk;
  parallel_for(chunks, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(kWideOuts * K, 0.f);  // [kWideOuts, K]
    const int64_t o_end = std::min(N, last * kQuantChunk);
    for (int64_t o = first * kQuantChunk; o < o_end; o += kWideOuts) {
      const int64_t nc = std::min<int64_t>(kWideOuts, o_end - o);
      dequantize_rows<F>(w + o * row_bytes, nc, K, scratch.data());
      const float* bo = bias != nullptr ? bias + o : nullptr;
      int64_t r = 0;
      for (; r + kWideRows <= m; r += kWideRows)
        dot_tile<kWideRows>(x + r * K, K, scratch.data(), out + r * N + o, N, nc, bo);
      for (; r < m; ++r) dot_tile<1>(x + r * K, K, scratch.data(), out + r * N + o, N, nc, bo);
    }
  });
}

// Outputs [0, nc) (nc <= kPackedCols) of the weight rows at w dequantized into panel, [K, 32]
// (input k's 32 outputs in one line, as pack_weight lays out fp32), columns past nc left as they
// are (never stored by packed_panel_f32); vals: a scratch of K floats.
template <class F>
void dequantize_panel(const uint8_t* w, int64_t nc, int64_t K, float* __restrict panel,
                      float* __restrict vals) {
  const int64_t row_bytes = (K / kQuantBlock) * F::kBytes;
  for (int64_t o = 0; o < nc; ++o) {
    dequantize_row<F>(w + o * row_bytes, K, vals);
    for (int64_t i = 0; i < K; ++i) panel[i * kPackedCols + o] = vals[i];
  }
}

// Many rows (a prefill chunk): each task dequantizes 32 outputs at a time into an fp32 panel laid
// out as pack_weight's ([K, 32], L2-resident) and runs every row of x against it in
// linear_packed's register tiles (products.cpp): the multiply-adds in the fp32 packed kernel's
// outer-product schedule, the widening paid once per weight. NOTE: measured on SmolLM2's four
// layer products (576 x 960, 576, 3072; 1536 x 576), one thread, min / median / max of 5
// alternating rounds, ms: Q4_1 512 rows 92.7 / 93.2 / 117 against 135 / 142 / 166 for the
// widened tiles and 86 / 93 / 113 for oneDNN's fp32 product over the dequantized weights
// (MKL: 199 / 213 / 225); 128 rows 17.7 / 25.5 / 29.3 against 24.6 / 24.6 / 24.8; 64 rows
// 3.4 / 19.6 / 27.5 against 2.3 / 15.4 / 26.4 (the panel's scattered stores cost more than
// the widened path's reuse saves below about 128 rows).
constexpr int64_t kPanelMinRows = 128;
template <class F>
void paneled(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
             const float* bias, float* out) {
  const int64_t row_bytes = (K / kQuantBlock) * F::kBytes;
  const int64_t panels = (N + kPackedCols - 1) / kPackedCols;
  parallel_for(panels, [&](int64_t first, int64_t last) {
    std::vector<float> panel(K * kPackedCols, 0.f), vals(K);  // [K, 32], [K]
    for (int64_t p = first; p < last; ++p) {
      const int64_t o = p * kPackedCols, nc = std::min<int64_t>(kPackedCols, N - o);
      dequantize_panel<F>(w + o * row_bytes, nc, K, panel.data(), vals.data());
      packed_panel_f32(x, m, K, panel.data(), out + o, N, nc, bias != nullptr ? bias + o : nullptr);
    }
  });
}

template <class F>
void linear_quant(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
                  const float* bias, float* out) {
  if (m <= 0 || N <= 0) return;
  if (m >= kPanelMinRows) {
    paneled<F>(x, m, K, w, N, bias, out);
    return;
  }
  if (m > kQuantRows) {
    widened<F>(x, m, K, w, N, bias, out);
    return;
  }
  const int64_t nb = K / kQuantBlock;
  // xsum [m, nbs]: sums of x over each block (Q4_1's m terms); the kernel layout's rows are
  // whole vectors, zero past nb (direct_tile_r)
  const int64_t nbs = F::kRepacked ? (nb + kW - 1) / kW * kW : nb;
  std::vector<float> xsum(F::kHasMin ? m * nbs : 0, 0.f);
  if constexpr (F::kHasMin)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * kQuantBlock;
        float s = 0.f;
        for (int64_t i = 0; i < kQuantBlock; ++i) s += xb[i];
        xsum[r * nbs + b] = s;
      }
  if constexpr (F::kRepacked)
    direct_r(x, m, K, xsum.data(), nbs, w, N, bias, out);
  else
    direct<F>(x, m, K, xsum.data(), w, N, bias, out);
}

}  // namespace

void linear_q8_0(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
                 const float* bias, float* out) {
  linear_quant<Q8_0>(x, m, K, w, N, bias, out);
}

void linear_q4_1(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
                 const float* bias, float* out) {
  linear_quant<Q4_1>(x, m, K, w, N, bias, out);
}

void linear_q4_1r(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
                  const float* bias, float* out) {
  linear_quant<Q4_1R>(x, m, K, w, N, bias, out);
}

void dequantize_q8_0(const uint8_t* w, int64_t N, int64_t K, float* out) {
  dequantize_rows<Q8_0>(w, N, K, out);
}

void dequantize_q4_1(const uint8_t* w, int64_t N, int64_t K, float* out) {
  dequantize_rows<Q4_1>(w, N, K, out);
}

void dequantize_q4_1r(const uint8_t* w, int64_t N, int64_t K, float* out) {
  dequantize_rows<Q4_1R>(w, N, K, out);
}

AGENTCACHE_END
