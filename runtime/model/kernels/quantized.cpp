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
// Q4_1 also comes in the kernel layout (repack_q4_1 in Python; the same 20 bytes a block, the
// same values), which a one-row product reads without byte shuffles. A row of nb blocks:
//   [0, 2 nb)      the blocks' fp16 scales d, in block order
//   [2 nb, 4 nb)   their fp16 minimums m
//   [4 nb, 20 nb)  the nibbles: groups of 4 blocks (64 bytes: byte 4 i + j is block 4 g + j's
//                  GGUF byte i, weight i low and 16 + i high), then the nb % 4 last blocks'
//                  16 bytes each as GGUF stores them.
// So 32-bit lane i of a group holds inputs i and 16 + i of its 4 blocks: block j's weights are
// (lane >> 8 j) & 15 and (lane >> (8 j + 4)) & 15, a shift and a mask per vector (ALU ports)
// where GGUF's bytes need a byte -> 32-bit widening (a shuffle) per vector; the scales of a
// tile's rows are converted to fp32 once per tile and read as broadcasts from memory.
//
// Few rows (a decode step's): register tiles of up to kQuantRows rows of x by 2-4 outputs read
// each weight block once per tile, straight from the packed bytes (prefetched ahead along each
// row); threads take chunks of 16 outputs.
// More rows (a batch, a short prefill): each thread dequantizes 4 outputs' rows at a time into an
// fp32 scratch and runs every row of x against them in register tiles, so the integer widening is
// paid once per output, not once per tile of rows. From kPanelMinRows rows (a prefill chunk):
// 32 outputs at a time into a [K, 32] panel run through linear_packed's fp32 register tiles.
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cores.h"
#include "vec.h"

AGENTCACHE_BEGIN
namespace {

constexpr int64_t kBlockVecs = kQuantBlock / kW;  // fp32 vectors per block of 32
// Rows of x per direct tile: accumulators (rows x 2 outputs) plus a block of x per row and two
// blocks of weights within the register file.
constexpr int kQuantRows = kRegs >= 32 ? 4 : 2;
constexpr int64_t kQuantChunk = 16;  // outputs per parallel task (direct path)

// IEEE half to float: F16C on x86, the hardware type on aarch64, else the bits rebuilt.
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

#if AGENTCACHE_VEC_FLOATS > 1
typedef int8_t vi8 __attribute__((vector_size(AGENTCACHE_VEC_FLOATS)));
typedef uint8_t vu8 __attribute__((vector_size(AGENTCACHE_VEC_FLOATS)));
typedef int32_t vi32 __attribute__((vector_size(4 * AGENTCACHE_VEC_FLOATS)));
// NOTE: through int32: GCC converts bytes straight to floats one lane at a time (an unsigned
// scalar conversion per lane), while byte -> int32 -> float is two vector instructions
// (vpmovzxbd / vpmovsxbd, vcvtdq2ps on x86).
inline vf widen(vi8 v) { return __builtin_convertvector(__builtin_convertvector(v, vi32), vf); }
inline vf widen(vu8 v) { return __builtin_convertvector(__builtin_convertvector(v, vi32), vf); }
#else
using vi8 = int8_t;
using vu8 = uint8_t;
inline vf widen(vi8 v) { return static_cast<float>(v); }
inline vf widen(vu8 v) { return static_cast<float>(v); }
#endif

template <typename V>
inline V load_bytes(const uint8_t* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kW signed bytes at p as floats. NOTE: on x86 with intrinsics: GCC loads an unaligned byte
// vector through general registers and sign-extends lane by lane (measured 5x slower for Q8_0).
inline vf load_s8(const uint8_t* p) {
#if defined(__AVX512F__) && AGENTCACHE_VEC_FLOATS == 16
  const __m512 f = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  vf v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__AVX2__) && AGENTCACHE_VEC_FLOATS == 8
  const __m256 f = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  vf v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  return widen(load_bytes<vi8>(p));
#endif
}

// A block format: its bytes, whether it has a minimum, and a block read as scale, minimum and
// kBlockVecs fp32 vectors of its integers in input order.
struct Q8_0 {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  static constexpr bool kHasMin = false;
  static constexpr bool kRepacked = false;
  static inline void load(const uint8_t* b, vf* q, float& d, float& m) {
    d = half_to_float(b);
    m = 0.f;
    for (int64_t v = 0; v < kBlockVecs; ++v) q[v] = load_s8(b + 2 + v * kW);
  }
};

// A GGUF Q4_1 block's 16 bytes of nibbles at p as kBlockVecs fp32 vectors in input order.
inline void gguf_nibbles(const uint8_t* p, vf* q) {
  // NOTE: byte j: weight j low, weight 16 + j high; the first half of the vectors holds the
  // low nibbles of bytes [0, 16), the second half the high ones.
#if defined(__AVX2__) && !defined(__AVX512F__) && AGENTCACHE_VEC_FLOATS == 8
  // NOTE: as load_s8: GCC moves an 8-byte vector through general registers lane by lane.
  // Bytes [0, 8) and [8, 16) zero-extended straight from memory to 32-bit lanes (vpmovzxbd's
  // load form): a lane's low 4 bits are the low nibble, the lane shifted right by 4 the high
  // one, the same integers with no byte shuffles (AVX2 decode was half AVX-512's with the
  // generic loop, and a 16-byte load split by shifts cost 6 shuffles a block).
  const auto eight = [](const uint8_t* at) {  // 8 bytes at `at`, zero-extended to 32 bits
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
  };
  const __m256i first = eight(p), second = eight(p + 8);
  const __m256i nib = _mm256_set1_epi32(0x0F);
  const __m256 parts[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(first, nib)),
                           _mm256_cvtepi32_ps(_mm256_and_si256(second, nib)),
                           _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)),
                           _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4))};
  std::memcpy(q, parts, sizeof parts);
#else
  for (int64_t v = 0; v < kBlockVecs / 2; ++v) {
    const vu8 bytes = load_bytes<vu8>(p + v * kW);
    q[v] = widen(static_cast<vu8>(bytes & 0x0F));
    q[kBlockVecs / 2 + v] = widen(static_cast<vu8>(bytes >> 4));
  }
#endif
}

struct Q4_1 {
  static constexpr int64_t kBytes = kQ4_1Bytes;
  static constexpr bool kHasMin = true;
  static constexpr bool kRepacked = false;
  static inline void load(const uint8_t* b, vf* q, float& d, float& m) {
#if defined(__F16C__)
    // NOTE: d and m are adjacent halves: one conversion for both.
    uint32_t dm;
    std::memcpy(&dm, b, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
    d = _mm_cvtss_f32(f);
    m = _mm_cvtss_f32(_mm_movehdup_ps(f));
#else
    d = half_to_float(b);
    m = half_to_float(b + 2);
#endif
    gguf_nibbles(b + 4, q);
  }
};

// Q4_1 in the kernel layout (the top of this file). NOTE: a group's 16 lanes are whole vectors
// on every ISA (kW 1, 4, 8 or 16).
constexpr int64_t kGroupBlocks = 4;                                // blocks per nibble group
constexpr int64_t kGroupBytes = kGroupBlocks * kQuantBlock / 2;    // 64
constexpr int64_t kLaneVecs = kQuantBlock / 2 / kW;                // vectors of a group's lanes
static_assert(kQuantBlock / 2 % kW == 0, "a group's 16 lanes are whole vectors");

struct Q4_1R {
  static constexpr int64_t kBytes = kQ4_1Bytes;
  static constexpr bool kHasMin = true;
  static constexpr bool kRepacked = true;
};

// Small integers in 32-bit lanes as floats (vcvtdq2ps on x86: as signed, one instruction).
inline vf lane_floats(vu v) {
#if AGENTCACHE_VEC_FLOATS > 1
  return __builtin_convertvector(reinterpret_cast<vi32>(v), vf);
#else
  return static_cast<float>(static_cast<int32_t>(v));
#endif
}

// Block J (0-3) of a group whose kLaneVecs lane vectors are held: kBlockVecs fp32 vectors in
// input order (lanes hold inputs i and 16 + i).
template <int J>
inline void group_block(const vu* lanes, vf* q) {
  for (int64_t h = 0; h < kLaneVecs; ++h) {
    q[h] = lane_floats((lanes[h] >> (8 * J)) & 0xFu);
    q[kLaneVecs + h] = lane_floats((lanes[h] >> (8 * J + 4)) & 0xFu);
  }
}

// body(J) for J = 0..3 as compile-time constants (the shift counts are immediates).
template <class Body>
inline void each_group_block(const Body& body) {
  body(std::integral_constant<int, 0>{});
  body(std::integral_constant<int, 1>{});
  body(std::integral_constant<int, 2>{});
  body(std::integral_constant<int, 3>{});
}

// n fp16 values at p as fp32 at out (F16C: 8 a conversion).
inline void halves_to_floats(const uint8_t* p, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(p + 2 * i);
}

// One row of a Q4_1 weight in the kernel layout (K inputs) as its K fp32 values d * q + m.
inline void dequantize_row_r(const uint8_t* row, int64_t K, float* out) {
  const int64_t nb = K / kQuantBlock, groups = nb / kGroupBlocks;
  const uint8_t* nib = row + 4 * nb;
  for (int64_t g = 0; g < groups; ++g) {
    vu lanes[kLaneVecs];
    for (int64_t l = 0; l < kLaneVecs; ++l) lanes[l] = vload_bits(nib + g * kGroupBytes + l * 4 * kW);
    each_group_block([&](auto J) {
      const int64_t b = g * kGroupBlocks + J;
      const float d = half_to_float(row + 2 * b), m = half_to_float(row + 2 * (nb + b));
      vf q[kBlockVecs];
      group_block<J>(lanes, q);
      for (int64_t v = 0; v < kBlockVecs; ++v) vstore(out + b * kQuantBlock + v * kW, q[v] * d + m);
    });
  }
  for (int64_t b = groups * kGroupBlocks; b < nb; ++b) {
    const float d = half_to_float(row + 2 * b), m = half_to_float(row + 2 * (nb + b));
    vf q[kBlockVecs];
    gguf_nibbles(nib + groups * kGroupBytes + (b - groups * kGroupBlocks) * 16, q);
    for (int64_t v = 0; v < kBlockVecs; ++v) vstore(out + b * kQuantBlock + v * kW, q[v] * d + m);
  }
}

// One row of weights (K inputs, F's layout) as its K fp32 values.
template <class F>
inline void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  if constexpr (F::kRepacked) {
    dequantize_row_r(row, K, out);
  } else {
    for (int64_t b = 0; b < K / kQuantBlock; ++b) {
      vf q[kBlockVecs];
      float d, m;
      F::load(row + b * F::kBytes, q, d, m);
      for (int64_t v = 0; v < kBlockVecs; ++v) vstore(out + b * kQuantBlock + v * kW, q[v] * d + m);
    }
  }
}

inline float hsum(vf v) {
#if AGENTCACHE_VEC_FLOATS > 1
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += v[i];
  return s;
#else
  return v;
#endif
}

// Outputs per direct tile: 4 for 1-2 rows (more independent streams and sums in flight), 2 for
// more rows (accumulators rows x outputs within the register file).
template <int MR>
constexpr int direct_outs() {
  return MR <= 2 ? 4 : 2;
}
// Software prefetch distance past a direct tile's rows. NOTE: measured at one row, one thread,
// AVX-512 (standalone loop over the cores, min / median / max of 9 passes, same run as fp32's
// linear_rows; the host shared with other jobs): SmolLM2's LM head (49,152 x 576) in Q8_0 0.80 /
// 0.86 / 17.0 ms against fp32 3.49 / 19.7 / 27.8 ms; with the earlier prefetch 1,024 bytes ahead
// along each row (inside the tile's next row for K = 576: useless) 2.97 / 15.0 / 29.7 ms.
// 2,048 / 4,096 bytes: 1.08 / 0.99 ms (min); AVX2: Q8_0 head 1.40 against 2.73-3.04 before.
constexpr int64_t kAheadBytes = 8192;

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
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < nout; ++o)
      out[r * ldo + o0 + o] = hsum(acc[r][o]) + (bias != nullptr ? bias[o0 + o] : 0.f);
}

// direct for a Q4_1 weight in the kernel layout: xsum [m, nbp] (direct_tile_r).
void direct_r(const float* x, int64_t m, int64_t K, const float* xsum, int64_t nbp,
              const uint8_t* w, int64_t N, const float* bias, float* out) {
  const int64_t chunks = (N + kQuantChunk - 1) / kQuantChunk, nbx = nbp;
  const int64_t row_bytes = (K / kQuantBlock) * kQ4_1Bytes;
  parallel_for(chunks, [&](int64_t first, int64_t last) {
    std::vector<float> sc(2 * 4 * nbx, 0.f);  // [NO <= 4, 2, nbp]: d, m per output
    const int64_t o0 = first * kQuantChunk, o1 = std::min(N, last * kQuantChunk);
    for (int64_t r = 0; r < m; r += kQuantRows) {
      const auto rows = [&](auto MR) {
        constexpr int NO = direct_outs<MR>();
        for (int64_t o = o0; o < o1; o += NO)
          direct_tile_r<MR, NO>(x + r * K, K, xsum + r * nbx, nbx, w, row_bytes, o,
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
