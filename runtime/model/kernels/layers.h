// DecodeLayers: the layer loop of a compact decode step in C++ (defined in layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "vec.h"

AGENTCACHE_BEGIN

// The layer loop of a compact decode step (one new token per row): the math of CompactLlama.qkv
// / BatchKV.write_step / CompactLlama.attend / CompactLlama.finish with every small op as a plain
// loop (RMSNorm, RoPE written straight into the KV slots, SiLU(gate) * up, the residual adds)
// and the products and the attention through their cores (cores.h: raw pointers in and out),
// over per-step buffers taken in one allocation: no ATen op runs per layer on the cores' paths
// (the Python loop runs about 25 a layer; a loop over the torch ops, about 15), so a step costs
// its products, its attention and about 5 thread fork/joins a layer. Results equal the Python
// loop's within float32 rounding (the tests' 1e-5), not to the bit: sums are reassociated,
// multiply-adds fused and exp is vec.h's. Weights are the compact forward's (input-major
// views). With packed copies of them (pack_weight: bf16 for weights="bfloat16", the fp32
// weights then holding the same rounded values; fp32 for weights="float32-packed"; GGUF's Q8_0 /
// Q4_1 blocks as uint8 for weights="q8_0" / "q4_1", the fp32 weights then holding the blocks'
// values), a step of at most packed_max_rows rows runs its products in linear_packed_f32 /
// _bf16 or linear_q8_0 / _q4_1 / _q4_1r; otherwise a step of at most rows_max rows
// (fp32_products.ProductChoice.rows; 0: none) runs them in linear_rows over the weights
// themselves, a step of onednn_lo to onednn_hi rows (ProductChoice.onednn_rows) in
// onednn_linear, and a larger one in at::linear (MKL).
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
  // pos: [B] int64 (row i writes at pos[i]; rows must be 0..B-1, as attention reads buffer rows
  // [0, B): anything else is a RuntimeError); kv_len: keys read; mask: additive
  // [B, 1, 1, kv_len] or None; src, shared: a shared prefix, as decode_attention reads it (row
  // j of the step is rows[j]; src names step rows). Returns the hidden states after the last
  // layer, [B, 1, hidden].
  at::Tensor run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor buffer,
                 at::Tensor rows, at::Tensor pos, int64_t kv_len, std::optional<at::Tensor> mask,
                 std::optional<at::Tensor> src, std::optional<at::Tensor> shared) const;

 private:
  // How a step runs its products (one choice per call, by its row count; see the class comment).
  enum class Path { kPacked, kRows, kOneDnn, kATen };
  // One packed copy as the cores read it (from packed_, checked by the constructor).
  struct Copy {
    enum class Kind { kQ8_0, kQ4_1, kQ4_1R, kF32, kBF16 } kind;
    const void* data;
    int64_t blocks;  // kF32 / kBF16: blocks of kPackedCols columns
  };
  struct Step;

  bool is_norm_weight(const at::Tensor& w) const;
  // The step's arguments checked (a wrong one is a RuntimeError naming it) and read as pointers.
  Step check_step(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& buffer, const at::Tensor& rows, const at::Tensor& pos,
                  int64_t kv_len, const std::optional<at::Tensor>& mask,
                  const std::optional<at::Tensor>& src,
                  const std::optional<at::Tensor>& shared) const;
  // out [m, N] = x [m, K] . W^T + bias for weight `which` (0 qkv, 1 o, 2 gate_up, 3 down) of
  // `layer`, through its core on `path` (the fp32 library paths through ATen); out is written,
  // not accumulated.
  void product(size_t layer, int which, const float* x, int64_t m, float* out, Path path) const;
  // y = x * rsqrt(mean(x^2) + eps) * w over `rows` rows of hidden_ floats (all contiguous).
  void rms_norm(const float* x, const float* w, int64_t rows, float* y) const;
  // Rotate-half RoPE (as CompactLlama.qkv: x * cos + roll(x, D / 2) * signed_sin) of the query
  // and key heads of qkv ([B, (H + 2 H_kv) D]); queries go to q ([B, H, D]), keys and the
  // values straight into the layer's KV slots (fp32, or float16 rounded to nearest even as
  // torch's `x.half()`).
  void rope_and_store(const Step& step, size_t layer, const float* qkv, float* q) const;

  std::vector<at::Tensor> ln1_, qkv_;
  std::vector<std::optional<at::Tensor>> qkv_bias_;
  std::vector<at::Tensor> o_;
  std::vector<std::optional<at::Tensor>> o_bias_;
  std::vector<at::Tensor> ln2_, gate_up_, down_, packed_;
  std::vector<Copy> copies_;  // packed_ as the cores read it, 4 a layer
  int64_t nh_, nkv_, d_, packed_max_rows_, onednn_lo_, onednn_hi_, rows_max_, hidden_ = 0;
  int64_t inter_ = 0;  // the MLP's width (gate_up: [2 inter, hidden])
  double eps_, scale_;
};

AGENTCACHE_END
