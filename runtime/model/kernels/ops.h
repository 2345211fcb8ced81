// The kernels as torch ops: argument checks (a wrong tensor is a RuntimeError naming it, never a
// read out of bounds), then the cores (cores.h). Defined in ops.cpp; bound in module.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "vec.h"

AGENTCACHE_BEGIN
namespace ops {

// q [B, H, D] fp32; k, v [B, H_kv, T, D] (any strides, last dim contiguous), both fp32 or both
// float16 (attended as their exact fp32 values: cores.h); mask additive fp32
// [B, T] or None; src, shared [B] int64 (together): row b's keys [0, shared[b]) are row
// src[b]'s. Returns [B, H, D]; a row whose every key is masked gets zeros.
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v,
                            std::optional<at::Tensor> mask, double scale,
                            std::optional<at::Tensor> src, std::optional<at::Tensor> shared);

// Writes each segment's new keys / values (k_new, v_new [H_kv, N, D] fp32, tokens in segment
// order) into its buffer ([L, 2, H_kv, capacity, D], layer `layer`; every buffer fp32, or every
// one float16: then stored rounded to nearest even) at [past, past + length), then attends every
// segment's queries (q [H, N, D]) to its own keys as stored, causal (cores.h).
at::Tensor segment_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                             const std::vector<at::Tensor>& buffers, int64_t layer,
                             const std::vector<int64_t>& past, const std::vector<int64_t>& lengths,
                             double scale);

// q [H_kv, M, D] fp32, k and v [H_kv, S, D] both fp32 or both float16 (V rows contiguous), D a
// multiple of 16 up to 128.
// Returns {out [H_kv, M, D], lse [H_kv, M]}.
std::vector<at::Tensor> prefix_attention(at::Tensor q, const at::Tensor& k, const at::Tensor& v,
                                         double scale);

// x fp32 [..., K]; packed bf16 or fp32 [ceil(n / 32), K, 32] (pack_weight), or uint8 GGUF blocks
// [n, K / 32, 34 | 20] (linear_quantized); bias fp32 [n] or None. Returns fp32 [..., n].
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t n);

// x fp32 [..., K]; blocks uint8 [N, K / 32, 34] (Q8_0) or [N, K / 32, 20] (Q4_1), contiguous,
// GGUF's layout (quantize_weight); bias fp32 [N] or None. Returns fp32 [..., N].
at::Tensor linear_quantized(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);

// blocks uint8 [N, K / 32, 34 | 20] (as linear_quantized) -> fp32 [N, K], the blocks' values
// (rows split over threads).
at::Tensor dequantize_blocks(const at::Tensor& blocks);

// x fp32 [..., K]; w fp32 [N, K] with strides (1, N) (an input-major view of a contiguous [K, N]
// tensor); bias fp32 [N] or None. Returns [..., N].
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias);

// x . w^T + bias on oneDNN (torch's mkldnn::_linear_pointwise).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias);

}  // namespace ops
AGENTCACHE_END
