// Matrix products of few rows (a decode step's) for agentcache's compact forward, fp32 inputs,
// accumulation and outputs, one source for every ISA (vec.h).
//
// linear_packed: y = x . W^T + bias with W packed by runtime.model.kernels.pack_weight into blocks of
// kPackedCols (32) output columns, [ceil(N / 32), K, 32], zero padded past N, so a block is one
// contiguous stream of K lines of 32 values, read once per row tile of x (again from cache for
// the next tile). Two element types:
// - bfloat16 (weights="bfloat16"): half the bytes of fp32. Inside a line, 32-bit word i holds
//   column i (low half) and column 16 + i (high half), so widening is a shift and a mask per
//   vector on every ISA (vec.h's bf16_low / bf16_high); the result equals fp32 arithmetic on the
//   bf16-rounded weights within float32 rounding.
// - float32 (weights="float32-packed"): the model's values in their natural column order; the
//   result equals at::linear's within float32 rounding (sums in another order).
//
// linear_rows: x . w^T + bias for a few rows over the compact forward's own input-major weights
// (a contiguous [K, N] tensor), no copy: for one or two rows each thread streams a contiguous
// range of K; from three, register tiles over strips of columns (linear_rows_tiled).
#include <vector>

#include "cores.h"
#include "vec.h"

AGENTCACHE_BEGIN
namespace {

constexpr int64_t kColVecs = kPackedCols / kW;  // vectors per packed line (fp32)
constexpr int64_t kPrefetchBytes = 96 * 64;     // measured best of 8-160 lines on W1's shapes (bf16)
// Rows of x per pass over a block: accumulators (rows x kColVecs) plus a line of weights within
// the register file (AVX-512: 12 x 2 + 2; AVX2: 3 x 4 with the weights read as FMA operands;
// NEON: 2 x 8 + 8).
constexpr int kPackedRows = kW == 16 ? 12 : kW == 8 ? 3 : 2;

// How a packed element type is read: one k's line of kPackedCols values as kColVecs fp32 vectors
// in column order.
template <typename T>
struct Line;

template <>
struct Line<float> {
  static inline void load(const float* w, vf* out) {
    for (int64_t c = 0; c < kColVecs; ++c) out[c] = vload(w + c * kW);
  }
};

template <>
struct Line<uint16_t> {  // bfloat16 bits, pairs (column i, column 16 + i) per 32-bit word
  static inline void load(const uint16_t* w, vf* out) {
    for (int64_t c = 0; c < kColVecs / 2; ++c) {
      const vu words = vload_bits(w + 2 * c * kW);
      out[c] = bf16_low(words);
      out[kColVecs / 2 + c] = bf16_high(words);
    }
  }
};

// KU independent partial sums per output vector hide the multiply-add latency when MR is small
// (AVX-512's tuned rule; elsewhere as many as the registers left hold, at most 4).
template <int MR>
constexpr int packed_unroll() {
  if constexpr (kW == 16) {
    return MR <= 2 ? 4 : (MR <= 4 ? 2 : 1);
  } else {
    constexpr int64_t left = (kRegs - kColVecs - 1) / (MR * kColVecs);
    return left >= 4 ? 4 : left >= 2 ? 2 : 1;
  }
}

// MR rows of x (row stride ldx) against one packed block; stores ncols (<= 32) columns per row.
template <typename T, int MR>
inline void packed_tile(const float* __restrict x, int64_t ldx, const T* __restrict w, int64_t K,
                        float* __restrict out, int64_t ldo, int64_t ncols, const float* bias) {
  constexpr int KU = packed_unroll<MR>();
  constexpr int64_t line = kPackedCols * static_cast<int64_t>(sizeof(T));  // bytes per k
  vf acc[KU][MR][kColVecs];
  for (int u = 0; u < KU; ++u)
    for (int r = 0; r < MR; ++r)
      for (int64_t c = 0; c < kColVecs; ++c) acc[u][r][c] = vzero();
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
    for (int u = 0; u < KU; ++u) {
      // NOTE: past the block's end this prefetches the next block (or nothing useful); a
      // prefetch never faults.
      for (int64_t b = 0; b < line; b += 64) __builtin_prefetch(ahead + (k + u) * line + b);
      vf wv[kColVecs];
      Line<T>::load(w + (k + u) * kPackedCols, wv);
      for (int r = 0; r < MR; ++r) {
        const float xb = x[r * ldx + k + u];
        for (int64_t c = 0; c < kColVecs; ++c) acc[u][r][c] += wv[c] * xb;
      }
    }
  }
  for (; k < K; ++k) {
    vf wv[kColVecs];
    Line<T>::load(w + k * kPackedCols, wv);
    for (int r = 0; r < MR; ++r) {
      const float xb = x[r * ldx + k];
      for (int64_t c = 0; c < kColVecs; ++c) acc[0][r][c] += wv[c] * xb;
    }
  }
  alignas(64) float row[kPackedCols];
  for (int r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < kColVecs; ++c) {
      vf s = acc[0][r][c];
      for (int u = 1; u < KU; ++u) s += acc[u][r][c];
      vstore(row + c * kW, s);
    }
    float* o = out + r * ldo;
    for (int64_t c = 0; c < ncols; ++c) o[c] = row[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

// One block of columns for rows [0, m) of x (fp32 [m, K] contiguous) into out (row stride ldo).
template <typename T>
void packed_block(const float* x, int64_t m, int64_t K, const T* w, float* out, int64_t ldo,
                  int64_t ncols, const float* bias) {
  for (int64_t r = 0; r < m; r += kPackedRows) {
    const float* xr = x + r * K;
    float* o = out + r * ldo;
    switch (std::min<int64_t>(kPackedRows, m - r)) {
#define AGENTCACHE_PACKED_CASE(n) \
  case n:                         \
    if constexpr (n <= kPackedRows) packed_tile<T, n>(xr, K, w, K, o, ldo, ncols, bias); \
    break;
      AGENTCACHE_PACKED_CASE(12)
      AGENTCACHE_PACKED_CASE(11)
      AGENTCACHE_PACKED_CASE(10)
      AGENTCACHE_PACKED_CASE(9)
      AGENTCACHE_PACKED_CASE(8)
      AGENTCACHE_PACKED_CASE(7)
      AGENTCACHE_PACKED_CASE(6)
      AGENTCACHE_PACKED_CASE(5)
      AGENTCACHE_PACKED_CASE(4)
      AGENTCACHE_PACKED_CASE(3)
      AGENTCACHE_PACKED_CASE(2)
#undef AGENTCACHE_PACKED_CASE
      default: packed_tile<T, 1>(xr, K, w, K, o, ldo, ncols, bias); break;
    }
  }
}

template <typename T>
void packed_columns(const float* xp, int64_t m, int64_t K, const T* wp, int64_t blocks, float* op,
                    int64_t n, const float* bp) {
  parallel_for(blocks, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t c0 = blk * kPackedCols;
      packed_block<T>(xp, m, K, wp + blk * K * kPackedCols, op + c0, n,
                      std::min(kPackedCols, n - c0), bp != nullptr ? bp + c0 : nullptr);
    }
  });
}

// linear_rows: columns go in tiles of kRowsCols so that the tile's rows of the weight stay in L2
// while every row of x reuses them; each pass reads kRowsK inputs' weight vectors once for a group
// of up to kRowsGroup rows (2 accumulators per row). The sums run in another order than MKL's or
// oneDNN's: float32 within rounding.
// NOTE: measured on W1's 30 layers of products (AMD EPYC host, 2 threads, same run), ms for this
// kernel / oneDNN / MKL / linear_packed over a packed copy: see fp32_products' docstring.
constexpr int64_t kRowsK = 8;          // inputs per pass over a row of y
constexpr int64_t kRowsCols = 2048;    // columns per tile
constexpr int kRowsGroup = kRegs >= 32 ? 4 : 2;  // rows sharing each load of kRowsK vectors

// Rows [0, RT) of x (row stride K) against inputs [kb, kb + kRowsK) and columns [c0, c1).
template <int RT>
inline void rows_pass(const float* __restrict x, int64_t K, const float* __restrict w, int64_t N,
                      int64_t c0, int64_t c1, float* __restrict y) {
  float xs[RT][kRowsK];
  for (int r = 0; r < RT; ++r)
    for (int64_t j = 0; j < kRowsK; ++j) xs[r][j] = x[r * K + j];
  int64_t c = c0;
  for (; c + kW <= c1; c += kW) {
    vf wv[kRowsK];
    for (int64_t j = 0; j < kRowsK; ++j) wv[j] = vload(w + j * N + c);
    for (int r = 0; r < RT; ++r) {
      vf a = vload(y + r * N + c) + wv[0] * xs[r][0], b = wv[1] * xs[r][1];
      for (int64_t j = 2; j < kRowsK; j += 2) {
        a += wv[j] * xs[r][j];
        b += wv[j + 1] * xs[r][j + 1];
      }
      vstore(y + r * N + c, a + b);
    }
  }
  for (; c < c1; ++c)  // the last columns of a row
    for (int r = 0; r < RT; ++r) {
      float acc = y[r * N + c];
      for (int64_t j = 0; j < kRowsK; ++j) acc += w[j * N + c] * xs[r][j];
      y[r * N + c] = acc;
    }
}

void rows_partial(const float* __restrict x, int64_t m, int64_t K, const float* __restrict wt,
                  int64_t N, int64_t k0, int64_t k1, float* __restrict y) {
  for (int64_t c0 = 0; c0 < N; c0 += kRowsCols) {
    const int64_t c1 = std::min(N, c0 + kRowsCols);
    for (int64_t kb = k0; kb < k1; kb += kRowsK) {
      const float* w = wt + kb * N;
      if (kb + kRowsK > k1) {  // the K remainder, one input at a time
        for (int64_t r = 0; r < m; ++r)
          for (int64_t k = kb; k < k1; ++k) {
            const float xv = x[r * K + k];
            const float* wk = wt + k * N;
            float* yr = y + r * N;
            for (int64_t c = c0; c < c1; ++c) yr[c] += wk[c] * xv;
          }
        continue;
      }
      int64_t r = 0;
      for (; r + kRowsGroup <= m; r += kRowsGroup)
        rows_pass<kRowsGroup>(x + r * K + kb, K, w, N, c0, c1, y + r * N);
      switch (m - r) {
        case 3: if constexpr (kRowsGroup > 3) rows_pass<3>(x + r * K + kb, K, w, N, c0, c1, y + r * N); break;
        case 2: if constexpr (kRowsGroup > 2) rows_pass<2>(x + r * K + kb, K, w, N, c0, c1, y + r * N); break;
        case 1: rows_pass<1>(x + r * K + kb, K, w, N, c0, c1, y + r * N); break;
        default: break;
      }
    }
  }
}

// linear_rows from kTiledMin rows (a batched decode step): register tiles of up to kTileRows rows
// by kTileVecs vectors of columns (a strip of kTileCols columns). Threads take whole strips, so
// there are no partial sums across threads. A thread walks its strips in panels of kTilePanel,
// and a panel in turns of kTileTurn inputs: in each turn every strip of the panel runs all its row
// tiles over the turn's K lines, the first tile reading them from L2 (prefetched a turn ahead)
// and the others from L1, with the tiles' running sums kept in a small [strips][rows][cols]
// buffer between turns. Every output is still one chain of multiply-adds in input order, so the
// result is bit for bit the one of a single pass over K.
// NOTE: measured on SmolLM2-135M's 30 layers of products (qkv, o, gate_up, down; AMD EPYC with
// AVX-512, 1 thread, CPU time, per-product minimum of 5 alternating runs, same run), ms for the
// single-pass tiles / the few-row path above / oneDNN: 2 rows 18.0 / 17.2 / 20.8; 4 rows 16.3 /
// 21.4 / 20.1; 8 rows 16.9 / 27.6 / 23.0; 16 rows 24.9 / - / 28.5; 32 rows 39.3 / - / 45.2; 64
// rows 69.8 / - / 72.1 (hence fp32_products.ROWS_MAX = 32). The single pass read a strip from
// memory for its first row tile and from L2 for the others, leaving memory idle meanwhile; the
// turns (2 threads, 30 layers with distinct weights, median of 12 alternating runs, issue 34):
// 16 rows 15.1 against 17.2 ms, 8 rows 13.9 / 14.8, 32 rows 22.3 / 23.5, 3 rows equal; the LM head
// (49,152 x 576) at 16 rows 4.1 against 5.0 ms. Turns of 64 inputs or whole-thread panels (the
// head's sums then outgrow L2) gained less, prefetching into L1 (locality 3) a turn ahead
// thrashed it (16 rows 15.7).
// NOTE: with 16 registers (kNarrow: AVX2, scalar) two changes, measured on a Zen 3 EPYC with AVX2
// (2 threads, SmolLM2's shapes, the same process alternating with the build before, 9-15 runs,
// min / median / max of the ratios; outputs bit-equal): the rows go in tiles of equal size (16
// rows: 5 + 5 + 6, not 5 + 5 + 5 + 1, whose one-row tile waits on its two accumulators' latency,
// 4 cycles a k for 2 multiply-adds), and the next turn's weight lines are prefetched as whole
// rows of the panel (each k's lines of the panel in one contiguous 1 KB run, spread over the
// turn's strips; the last turn prefetches the next panel's first) instead of one strip's line a k
// in its first tile. The LM head (49,152 x 576) at 16 rows 1.36 / 1.41 / 1.69x (19.0 -> 13.0
// ms), 3 rows 1.65x, 32 rows 1.26x; the 30 layers at 16 rows 1.04 / 1.11 / 1.56x (with the
// weights in L3, 37 -> 31.6 ms), at 3 to 32 rows 0.98-1.10x by medians (within the run's noise).
// NOTE: and turns of 16 inputs there (a panel's turn 16 KB of weights, not 32 KB, all of L1; the
// likely reason, not measured: x's rows and the running sums no longer push a strip's turn out
// of L1 before its later row tiles read it), the same host and method (21-25 runs): the 30
// layers at 4 / 8 / 16 / 32 rows 1.12 / 1.16 / 1.07 / 1.01x by medians (8 rows 1.03 / 1.16 /
// 1.25x), the head 1.10 / 1.04 / 1.00 / 0.96x; in the engine, 16 clients' decode steps (bench
// load's turn shape) spent 44.7 and 41.5 ms in the layers against 52.2 and 46.2 (alternating
// processes).
// Turns of 8 inputs: the layers at 16 rows 0.98x; panels of 8 or 32 strips: no clear change;
// turns of 32 over panels of 8 0.89x, of 16 over panels of 4 0.98x.
constexpr int64_t kTiledMin = 3;
constexpr bool kNarrow = kRegs < 32;
constexpr int kTileVecs = kNarrow ? 2 : 3;
constexpr int kTileRows = kNarrow ? 6 : 8;  // accumulators + kTileVecs weights + 1 in kRegs
constexpr int64_t kTileCols = kTileVecs * kW;
constexpr int64_t kTileTurn = kNarrow ? 16 : 32;  // inputs per turn (AVX-512: a strip's 6 KB)
constexpr int64_t kTilePanel = 16;  // strips per panel: its sums and a turn of it fit L2
constexpr int64_t kTileAhead = kTileTurn;  // K lines prefetched ahead: the next turn's

// Rows [0, RT) of x (row stride K) over inputs [k0, k1) for kTileCols columns: the tile's
// running sums come from `acc_in` and go back to it ([RT][kTileCols], row-major), so a strip's
// row tiles can take turns over short ranges of K. `ahead`: prefetch the weight lines kTileAhead
// ahead (the strip's first row tile).
template <int RT>
inline void tile_rows(const float* __restrict x, int64_t K, const float* __restrict w,
                      int64_t ws, int64_t k0, int64_t k1, float* __restrict acc_in, bool ahead) {
  vf acc[RT][kTileVecs];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vload(acc_in + r * kTileCols + v * kW);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * ws;
    if (ahead && k + kTileAhead < K)  // into L2 (locality 2): a turn of a panel fits there
      for (int64_t c = 0; c < kTileCols; c += 16)
        __builtin_prefetch(wk + kTileAhead * ws + c, 0, 2);
    vf wv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) wv[v] = vload(wk + v * kW);
    for (int r = 0; r < RT; ++r) {
      const vf xv = vsplat(x[r * K + k]);
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] += wv[v] * xv;
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kTileVecs; ++v) vstore(acc_in + r * kTileCols + v * kW, acc[r][v]);
}

template <int RT = kTileRows>
void tile_some_rows(int64_t rt, const float* x, int64_t K, const float* w, int64_t ws,
                    int64_t k0, int64_t k1, float* acc, bool ahead) {
  if constexpr (RT > 1) {
    if (rt < RT) return tile_some_rows<RT - 1>(rt, x, K, w, ws, k0, k1, acc, ahead);
  }
  tile_rows<RT>(x, K, w, ws, k0, k1, acc, ahead);
}

// The sizes of the row tiles of m rows, in order: kNarrow, tiles of equal size (the larger ones
// last), else kTileRows each and the rest last.
inline std::vector<int64_t> row_tiles(int64_t m) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  std::vector<int64_t> sizes(static_cast<size_t>(tiles));
  for (int64_t t = 0, r = 0; t < tiles; r += sizes[t++])
    sizes[t] = kNarrow ? (m - r) / (tiles - t) : std::min<int64_t>(kTileRows, m - r);
  return sizes;
}

// Prefetch into L2 the lines of weight rows [k0, k1) (input-major, row stride N) over columns
// [c0, c1).
inline void prefetch_lines(const float* wt, int64_t N, int64_t k0, int64_t k1, int64_t c0,
                           int64_t c1) {
  for (int64_t k = k0; k < k1; ++k)
    for (int64_t c = c0; c < c1; c += 16) __builtin_prefetch(wt + k * N + c, 0, 2);
}

void linear_rows_tiled(const float* x, int64_t m, int64_t K, const float* wt, int64_t N,
                       const float* bias, float* out) {
  const int64_t strips = (N + kTileCols - 1) / kTileCols;
  const std::vector<int64_t> tiles = row_tiles(m);  // a strip's row tiles
  parallel_for(strips, [&](int64_t first, int64_t last) {
    const int64_t tile = m * kTileCols;  // one strip's running sums, [m][kTileCols]
    std::vector<float> acc(static_cast<size_t>(std::min(last - first, kTilePanel) * tile));
    std::vector<float> pad;  // the last strip's columns, zero padded to kTileCols
    if (last == strips && N % kTileCols != 0) {
      const int64_t c0 = (strips - 1) * kTileCols;
      pad.assign(K * kTileCols, 0.f);
      for (int64_t k = 0; k < K; ++k)
        std::copy(wt + k * N + c0, wt + k * N + N, pad.data() + k * kTileCols);
    }
    for (int64_t p0 = first; p0 < last; p0 += kTilePanel) {
      const int64_t p1 = std::min(last, p0 + kTilePanel);
      std::fill(acc.begin(), acc.end(), 0.f);
      // kNarrow: the lines of the next turn (after the last: the next panel's first) over the
      // columns of its panel, rows_ahead K lines of them before each strip of this turn
      const int64_t rows_ahead = (kTileTurn + (p1 - p0) - 1) / (p1 - p0);
      for (int64_t k0 = 0; k0 < K; k0 += kTileTurn) {
        const int64_t k1 = std::min(K, k0 + kTileTurn);
        const bool last_turn = k1 == K;
        const int64_t next_k = last_turn ? 0 : k1;
        const int64_t next_p0 = last_turn ? p1 : p0;
        const int64_t next_p1 = last_turn ? std::min(last, p1 + kTilePanel) : p1;
        for (int64_t s = p0; s < p1; ++s) {
          if constexpr (kNarrow) {
            const int64_t a0 = next_k + (s - p0) * rows_ahead;
            const int64_t a1 = std::min({K, a0 + rows_ahead, next_k + kTileTurn});
            prefetch_lines(wt, N, a0, a1, next_p0 * kTileCols, std::min(N, next_p1 * kTileCols));
          }
          const bool padded = !pad.empty() && s == strips - 1;
          const float* w = padded ? pad.data() : wt + s * kTileCols;
          const int64_t ws = padded ? kTileCols : N;
          int64_t r = 0;
          for (const int64_t rt : tiles) {
            tile_some_rows(rt, x + r * K, K, w, ws, k0, k1,
                           acc.data() + (s - p0) * tile + r * kTileCols, !kNarrow && r == 0);
            r += rt;
          }
        }
      }
      for (int64_t s = p0; s < p1; ++s) {
        const int64_t c0 = s * kTileCols, cols = std::min(kTileCols, N - c0);
        const float* a = acc.data() + (s - p0) * tile;
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < cols; ++c)
            out[r * N + c0 + c] = a[r * kTileCols + c] + (bias != nullptr ? bias[c0 + c] : 0.f);
      }
    }
  });
}

}  // namespace

void linear_packed_f32(const float* x, int64_t m, int64_t K, const float* packed, int64_t blocks,
                       float* out, int64_t n, const float* bias) {
  packed_columns<float>(x, m, K, packed, blocks, out, n, bias);
}

void linear_packed_bf16(const float* x, int64_t m, int64_t K, const uint16_t* packed,
                        int64_t blocks, float* out, int64_t n, const float* bias) {
  packed_columns<uint16_t>(x, m, K, packed, blocks, out, n, bias);
}

void packed_panel_f32(const float* x, int64_t m, int64_t K, const float* panel, float* out,
                      int64_t ldo, int64_t ncols, const float* bias) {
  packed_block<float>(x, m, K, panel, out, ldo, ncols, bias);
}

void linear_rows(const float* x, int64_t m, int64_t K, const float* wt, int64_t N,
                 const float* bias, float* out) {
  if (m >= kTiledMin) return linear_rows_tiled(x, m, K, wt, N, bias, out);
  std::fill(out, out + m * N, 0.f);
  if (m == 0) return;
  // NOTE: at least 64 inputs per thread, so a thread's stream is worth its partial buffer
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(thread_count(), K / 64));
  std::vector<float> partial(parts > 1 ? (parts - 1) * m * N : 0, 0.f);
  float* pp = partial.data();
  const int64_t per = (K + parts - 1) / parts, total = m * N;
  parallel_for(parts, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t k0 = t * per, k1 = std::min(K, k0 + per);
      if (k0 < k1) rows_partial(x, m, K, wt, N, k0, k1, t == 0 ? out : pp + (t - 1) * total);
    }
  });
  for (int64_t t = 0; t + 1 < parts; ++t) {
    const float* p = pp + t * total;
AGENTCACHE_SIMD
    for (int64_t i = 0; i < total; ++i) out[i] += p[i];
  }
  if (bias != nullptr)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < N; ++c) out[r * N + c] += bias[c];
}

AGENTCACHE_END
