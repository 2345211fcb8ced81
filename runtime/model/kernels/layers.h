// DecodeLayers: the layer loop of a compact decode step in C++ (defined in layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "vec.h"

AGENTCACHE_BEGIN

// The layer loop of a compact decode step (one new token per row): the math of CompactLlama.qkv
// / BatchKV.write_step / CompactLlama.finish with the products in ATen (at::linear, MKL) and the
// small ops in plain loops (RMSNorm, RoPE written straight into the KV slots), which saves the
// Python and dispatch overhead of about 25 small ops per layer. Results equal the Python loop's
// within float32 rounding (the tests' 1e-5), not to the bit: sums are reassociated and
// multiply-adds fused. Weights are the compact forward's (input-major views). With packed copies
// of them (pack_weight: bf16 for weights="bfloat16", the fp32 weights then holding the same
// rounded values; fp32 for weights="float32-packed"; GGUF's Q8_0 / Q4_1 blocks as uint8 for
// weights="q8_0" / "q4_1", the fp32 weights then holding the blocks' values), a step of at most packed_max_rows rows runs
// its products in linear_packed instead of at::linear; otherwise a step of at most rows_max rows
// (fp32_products.ProductChoice.rows; 0: none) runs them in linear_rows over the weights
// themselves, and a step of onednn_lo to onednn_hi rows (ProductChoice.onednn_rows) in
// onednn_linear.
class DecodeLayers {
 public:
  DecodeLayers(std::vector<at::Tensor> ln1, std::vector<at::Tensor> qkv,
               std::vector<std::optional<at::Tensor>> qkv_bias, std::vector<at::Tensor> o,
               std::vector<std::optional<at::Tensor>> o_bias, std::vector<at::Tensor> ln2,
               std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale, std::vector<at::Tensor> packed, int64_t packed_max_rows,
               int64_t onednn_lo, int64_t onednn_hi, int64_t rows_max);

  // h: [B, 1, hidden]; cos, sin: [B, 1, 1, D] (CompactLlama.rope); buffer: [L, 2, R, H_kv, cap,
  // D], fp32 or float16 (the new K/V stored rounded to nearest even, attended as stored); rows,
  // pos: [B] int64 (row i writes at pos[i]); kv_len: keys read; mask: additive
  // [B, 1, 1, kv_len] or None; src, shared: a shared prefix, as decode_attention reads it (row
  // j of the step is rows[j]; src names step rows). Returns the hidden states after the last
  // layer, [B, 1, hidden].
  at::Tensor run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor buffer,
                 at::Tensor rows, at::Tensor pos, int64_t kv_len, std::optional<at::Tensor> mask,
                 std::optional<at::Tensor> src, std::optional<at::Tensor> shared) const;

 private:
  bool is_norm_weight(const at::Tensor& w) const;
  // y = x * rsqrt(mean(x^2) + eps) * w, row by row ([B, N] contiguous fp32).
  void rms_norm(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) const;
  // Rotate-half RoPE (as CompactLlama.qkv: x * cos + roll(x, D / 2) * signed_sin) of the query
  // and key heads of qkv ([B, (H + 2 H_kv) D]); queries go to q ([B, H, D]), keys and the
  // values straight into the layer's KV slots (layer: [2, R, H_kv, capacity, D], fp32, or
  // float16 rounded to nearest even as torch's `x.half()`).
  void rope_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& q, const at::Tensor& layer, const int64_t* rows,
                      const int64_t* pos) const;

  std::vector<at::Tensor> ln1_, qkv_;
  std::vector<std::optional<at::Tensor>> qkv_bias_;
  std::vector<at::Tensor> o_;
  std::vector<std::optional<at::Tensor>> o_bias_;
  std::vector<at::Tensor> ln2_, gate_up_, down_, packed_;
  int64_t nh_, nkv_, d_, packed_max_rows_, onednn_lo_, onednn_hi_, rows_max_, hidden_ = 0;
  double eps_, scale_;
};

AGENTCACHE_END
