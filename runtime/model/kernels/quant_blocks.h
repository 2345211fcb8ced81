// GGUF's quantized block formats as the product kernels read them (quantized.cpp, q4_1_lanes.cpp):
// a block read as scale, minimum and fp32 vectors of its integers, a row dequantized, half to
// float; shared by both translation units (internal linkage in each). Knows no torch and no
// threads.
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
#pragma once

#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cores.h"
#include "half.h"
#include "vec.h"

AGENTCACHE_BEGIN
namespace {

constexpr int64_t kBlockVecs = kQuantBlock / kW;  // fp32 vectors per block of 32
// Rows of x per direct tile: accumulators (rows x 2 outputs) plus a block of x per row and two
// blocks of weights within the register file.
constexpr int kQuantRows = kRegs >= 32 ? 4 : 2;
constexpr int64_t kQuantChunk = 16;  // outputs per parallel task (direct path)

// IEEE half to float (half.h: F16C on x86, the hardware type on aarch64, else the bits rebuilt).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_bits_to_float(h);
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

// n fp16 values at p (2-byte aligned: a row's scales) as fp32 at out (half.h's widen_halves).
inline void halves_to_floats(const uint8_t* p, int64_t n, float* out) {
  widen_halves(reinterpret_cast<const uint16_t*>(p), n, out);
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

}  // namespace

// The direct path over Q4_1 in the kernel layout (q4_1_lanes.cpp): out [m, N] = x [m, K] . W^T +
// bias for m <= kQuantRows rows; xsum [m, nbp] the sums of x over each block, nbp = nb rounded
// up to whole vectors, zeros past nb.
void direct_r(const float* x, int64_t m, int64_t K, const float* xsum, int64_t nbp,
              const uint8_t* w, int64_t N, const float* bias, float* out);

AGENTCACHE_END
