// The kernels' cores: raw pointers in, raw pointers out, no torch (see vec.h). module.cpp checks
// tensors and calls these; tests/runtime/kernel_selftest.cpp calls them directly.
#pragma once

#include <cstdint>

#include "vec.h"

AGENTCACHE_BEGIN

// One query per row over grouped KV heads (a decode step), computed in fp32 (attention.cpp).
// K/V are fp32 (k, v) or IEEE fp16 bits (k_half, v_half; then k, v are nullptr): fp16 K/V are
// widened exactly to fp32 as they are read, so the output equals, bit for bit, this kernel's
// on fp32 K/V holding the same values.
struct DecodeAttentionArgs {
  const float* q;                  // [B, H, D] contiguous
  const float* k;                  // [B, H_kv, T, D], element strides below, last dim contiguous
  const float* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const float* mask;               // additive [B, T] contiguous, or nullptr
  const int64_t* src;              // [B] or nullptr (with shared): shared-prefix source row
  const int64_t* shared;           // [B]: keys [0, shared[b]) equal row src[b]'s
  int64_t B, H, Hkv, T, D;
  float scale;
  float* out;                      // [B, H, D]: written (a fully masked row gets zeros)
  const uint16_t* k_half = nullptr;  // fp16 K / V instead of k / v: the same shapes and strides
  const uint16_t* v_half = nullptr;
};
void decode_attention(const DecodeAttentionArgs& a);

// Unmasked attention of M queries per KV head to one run of S keys, with the log-sum-exp of the
// scaled scores (prefill_attention.cpp). q [H, M, D] contiguous; k [H, S, D] with element strides
// (kh, ks), last dim contiguous; v likewise (vh, vs); out [H, M, D]; lse [H, M]. D a multiple of
// 16 up to 128 (checked by the caller).
void prefix_attention(const float* q, const float* k, int64_t kh, int64_t ks, const float* v,
                      int64_t vh, int64_t vs, int64_t H, int64_t M, int64_t S, int64_t D,
                      float scale, float* out, float* lse);
// The same over fp16 K/V (IEEE bits), widened exactly as read: bit for bit the fp32 overload's
// result on fp32 K/V holding the same values.
void prefix_attention(const float* q, const uint16_t* k, int64_t kh, int64_t ks,
                      const uint16_t* v, int64_t vh, int64_t vs, int64_t H, int64_t M, int64_t S,
                      int64_t D, float scale, float* out, float* lse);

// Several sequences' new tokens packed in one row (forward_packed), attended in one call
// (prefill_attention.cpp): segment s has queries for tokens [starts[s], starts[s] + lengths[s])
// of q at positions [past[s], past[s] + lengths[s]) of its own keys, and token j of it attends
// to keys [0, past[s] + j] (causal). Keys of segment s: k[s], element strides kh[s] per KV head
// and ks[s] per position, last dim contiguous (values likewise). q [H, N, D] contiguous; out
// [H, N, D]. D a multiple of 16 up to 128, lengths >= 1 (checked by the caller). K/V fp32 (k, v)
// or fp16 bits (k_half, v_half; k, v then nullptr), attended as their exact fp32 values.
struct SegmentAttentionArgs {
  const float* q;
  int64_t H, Hkv, N, D, num_segments;
  const int64_t* starts;
  const int64_t* lengths;
  const int64_t* past;
  const float* const* k;
  const float* const* v;
  const int64_t* kh;
  const int64_t* ks;
  const int64_t* vh;
  const int64_t* vs;
  float scale;
  float* out;
  const uint16_t* const* k_half = nullptr;  // fp16 K / V per segment instead of k / v
  const uint16_t* const* v_half = nullptr;
};
void segment_attention(const SegmentAttentionArgs& a);

// Output columns per packed block of pack_weight (products.cpp).
constexpr int64_t kPackedCols = 32;

// out [m, n] = x [m, K] . W^T + bias, W packed by pack_weight as fp32 or bf16 (the bits, as
// uint16) in `blocks` blocks of kPackedCols columns ([blocks, K, 32]); bias [n] or nullptr.
void linear_packed_f32(const float* x, int64_t m, int64_t K, const float* packed, int64_t blocks,
                       float* out, int64_t n, const float* bias);
// One fp32 block of linear_packed_f32, serially: out [m, ncols] (row stride ldo) = x [m, K] .
// panel ([K, 32], columns past ncols ignored) + bias [ncols] or nullptr.
void packed_panel_f32(const float* x, int64_t m, int64_t K, const float* panel, float* out,
                      int64_t ldo, int64_t ncols, const float* bias);
void linear_packed_bf16(const float* x, int64_t m, int64_t K, const uint16_t* packed,
                        int64_t blocks, float* out, int64_t n, const float* bias);

// out [m, N] = x [m, K] . wt + bias for wt a contiguous [K, N] (input-major) weight; bias [N] or
// nullptr. Few rows (a decode step's): each thread streams a contiguous range of K, or from 3
// rows register tiles over strips of columns (products.cpp).
void linear_rows(const float* x, int64_t m, int64_t K, const float* wt, int64_t N,
                 const float* bias, float* out);

// GGUF's quantized blocks (quantized.cpp): weights [N, K] as N rows of K / kQuantBlock blocks,
// K a multiple of 32. Q8_0: fp16 scale, 32 int8 (34 bytes); Q4_1: fp16 scale, fp16 minimum, 16
// bytes of nibbles, weight j low and 16 + j high in byte j (20 bytes).
constexpr int64_t kQuantBlock = 32;
constexpr int64_t kQ8_0Bytes = 34;
constexpr int64_t kQ4_1Bytes = 20;

// out [m, N] = x [m, K] . W^T + bias, W in blocks as above; bias [N] or nullptr.
void linear_q8_0(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
                 const float* bias, float* out);
void linear_q4_1(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
                 const float* bias, float* out);
// Q4_1 in the kernel layout (quant_blocks.h's top; repack_q4_1 in Python): the same 20 bytes a
// block, a row's fp16 scales, then its fp16 minimums, then its nibbles in groups of 4 blocks.
void linear_q4_1r(const float* x, int64_t m, int64_t K, const uint8_t* w, int64_t N,
                  const float* bias, float* out);
// out [N, K] fp32 = the blocks' values (d * q, + m for Q4_1), serially.
void dequantize_q8_0(const uint8_t* w, int64_t N, int64_t K, float* out);
void dequantize_q4_1(const uint8_t* w, int64_t N, int64_t K, float* out);
void dequantize_q4_1r(const uint8_t* w, int64_t N, int64_t K, float* out);

// The ISA this library was built for: "avx512", "avx2", "neon" or "scalar".
const char* isa_name();

AGENTCACHE_END
