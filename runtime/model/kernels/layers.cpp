// DecodeLayers (layers.h): the layer loop of a compact decode step, its products through the ops
// (ops.h) or ATen, RMSNorm and RoPE as plain loops the compiler vectorizes for the build's ISA.
#include "layers.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "cores.h"
#include "half.h"
#include "ops.h"
#include "vec.h"

AGENTCACHE_BEGIN

DecodeLayers::DecodeLayers(
    std::vector<at::Tensor> ln1, std::vector<at::Tensor> qkv,
    std::vector<std::optional<at::Tensor>> qkv_bias, std::vector<at::Tensor> o,
    std::vector<std::optional<at::Tensor>> o_bias, std::vector<at::Tensor> ln2,
    std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
    std::vector<at::Tensor> packed, int64_t packed_max_rows, int64_t onednn_lo,
    int64_t onednn_hi, int64_t rows_max)
      : ln1_(std::move(ln1)), qkv_(std::move(qkv)), qkv_bias_(std::move(qkv_bias)),
        o_(std::move(o)), o_bias_(std::move(o_bias)), ln2_(std::move(ln2)),
        gate_up_(std::move(gate_up)), down_(std::move(down)), packed_(std::move(packed)),
        nh_(num_heads), nkv_(num_kv_heads), d_(head_dim), packed_max_rows_(packed_max_rows),
        onednn_lo_(onednn_lo), onednn_hi_(onednn_hi), rows_max_(rows_max), eps_(eps),
        scale_(scale) {
  const size_t L = ln1_.size();
  TORCH_CHECK(qkv_.size() == L && qkv_bias_.size() == L && o_.size() == L &&
                  o_bias_.size() == L && ln2_.size() == L && gate_up_.size() == L &&
                  down_.size() == L, "DecodeLayers: one entry per layer in every list");
  TORCH_CHECK(L > 0 && nh_ > 0 && nkv_ > 0 && nh_ % nkv_ == 0 && d_ > 0 && d_ % 2 == 0,
              "DecodeLayers: at least one layer, heads a multiple of KV heads, even head dim");
  hidden_ = ln1_[0].numel();
  // NOTE: the plain loops read the norm weights and the qkv product's rows by these sizes.
  for (size_t i = 0; i < L; ++i)
    TORCH_CHECK(is_norm_weight(ln1_[i]) && is_norm_weight(ln2_[i]) &&
                    qkv_[i].dim() == 2 && qkv_[i].size(0) == (nh_ + 2 * nkv_) * d_ &&
                    qkv_[i].size(1) == hidden_,
                "DecodeLayers: layer ", i, " needs fp32 contiguous norm weights [hidden] and "
                "a qkv weight [(H + 2 H_kv) D, hidden]");
  // NOTE: the step's buffers are sized by these shapes, and the cores read the biases raw
  inter_ = gate_up_[0].size(0) / 2;
  for (size_t i = 0; i < L; ++i) {
    TORCH_CHECK(o_[i].dim() == 2 && o_[i].size(0) == hidden_ && o_[i].size(1) == nh_ * d_ &&
                    gate_up_[i].dim() == 2 && gate_up_[i].size(0) == 2 * inter_ &&
                    gate_up_[i].size(1) == hidden_ && down_[i].dim() == 2 &&
                    down_[i].size(0) == hidden_ && down_[i].size(1) == inter_,
                "DecodeLayers: layer ", i, " needs o [hidden, H D], gate_up [2 inter, hidden] "
                "and down [hidden, inter], inter as layer 0's");
    for (auto* bias : {&qkv_bias_[i], &o_bias_[i]}) {
      if (!bias->has_value()) continue;
      const int64_t n = bias == &qkv_bias_[i] ? qkv_[i].size(0) : hidden_;
      TORCH_CHECK((*bias)->scalar_type() == at::kFloat && (*bias)->dim() == 1 &&
                      (*bias)->numel() == n && (*bias)->device().is_cpu(),
                  "DecodeLayers: layer ", i, "'s biases must be fp32 [N] on the CPU");
      *bias = (*bias)->contiguous();
    }
  }
  // linear_rows reads the weights input-major: [N, K] views with strides (1, N)
  const auto input_major = [](const at::Tensor& w) {
    return w.dim() == 2 && w.stride(0) == 1 && w.stride(1) == w.size(0) &&
           w.scalar_type() == at::kFloat && w.device().is_cpu();
  };
  for (size_t i = 0; rows_max_ > 0 && i < L; ++i)
    TORCH_CHECK(input_major(qkv_[i]) && input_major(o_[i]) && input_major(gate_up_[i]) &&
                    input_major(down_[i]),
                "DecodeLayers: rows_max needs input-major fp32 weights (layer ", i, ")");
  // packed: empty, or per layer the blocks of qkv, o, gate_up and down (pack_weight), of one
  // element type (bf16 or fp32), or GGUF's quantized blocks (uint8 [N, K / 32, 34 | 20]), or
  // Q4_1 in the kernel layout (uint8 [N, K / 32 * 20], repack_q4_1)
  TORCH_CHECK(packed_.empty() || packed_.size() == 4 * L,
              "DecodeLayers: packed holds 4 weights per layer, or none");
  for (size_t i = 0; i < packed_.size(); ++i) {
    const auto& w = i % 4 == 0 ? qkv_[i / 4] : i % 4 == 1 ? o_[i / 4]
                  : i % 4 == 2 ? gate_up_[i / 4] : down_[i / 4];
    if (packed_[i].scalar_type() == at::kByte) {
      const auto& b = packed_[i];
      const bool is_blocks = b.dim() == 3 && b.size(1) * kQuantBlock == w.size(1) &&
                             (b.size(2) == kQ8_0Bytes || b.size(2) == kQ4_1Bytes);
      const bool is_rows = b.dim() == 2 && b.size(1) == w.size(1) / kQuantBlock * kQ4_1Bytes &&
                           w.size(1) % kQuantBlock == 0;
      TORCH_CHECK(b.is_contiguous() && b.size(0) == w.size(0) && (is_blocks || is_rows),
                  "DecodeLayers: quantized weight ", i, " does not match its fp32 weight");
      const auto kind = is_rows ? Copy::Kind::kQ4_1R
                        : b.size(2) == kQ8_0Bytes ? Copy::Kind::kQ8_0 : Copy::Kind::kQ4_1;
      copies_.push_back({kind, b.data_ptr(), 0});
      continue;
    }
    TORCH_CHECK(packed_[i].scalar_type() == packed_[0].scalar_type() &&
                    (packed_[i].scalar_type() == at::kBFloat16 ||
                     packed_[i].scalar_type() == at::kFloat) &&
                    packed_[i].is_contiguous() && packed_[i].dim() == 3 &&
                    packed_[i].size(1) == w.size(1) && packed_[i].size(2) == kPackedCols &&
                    packed_[i].size(0) == (w.size(0) + kPackedCols - 1) / kPackedCols,
                "DecodeLayers: packed weight ", i, " does not match its fp32 weight");
    copies_.push_back({packed_[i].scalar_type() == at::kFloat ? Copy::Kind::kF32
                                                              : Copy::Kind::kBF16,
                       packed_[i].data_ptr(), packed_[i].size(0)});
  }
}

// One step's arguments as the loop reads them (check_step), with the tensors that hold them.
struct DecodeLayers::Step {
  int64_t b, kv_len;
  at::Tensor rows64, pos64, cs, sn, mask, src64, shared64;
  const int64_t *rows, *pos, *src = nullptr, *shared = nullptr;
  const float *cos, *sin, *mask_p = nullptr;
  char* kv;            // the buffer's first byte
  int64_t elem;        // bytes per K/V element (4, or 2 for float16)
  int64_t stride[5];   // the buffer's element strides over L, K|V, R, H_kv, capacity
  bool is_half;
};

namespace {

// y [n] += x [n]
void add_to(float* __restrict y, const float* __restrict x, int64_t n) {
AGENTCACHE_SIMD
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// act [rows, inter] = silu(gate) * up for gu [rows, 2 inter] (gate, up: its halves, as
// `chunk(2, -1)`), silu(g) = g / (1 + exp(-g)) as torch's at::silu, exp(-g) from vec.h's
// exp_nonpositive (about 1 ulp) of -|g| (for g < 0 its reciprocal: inf past g < -87.3, where
// silu is -0).
void silu_mul(const float* gu, int64_t rows, int64_t inter, float* act) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict g = gu + r * 2 * inter;
    const float* __restrict u = g + inter;
    float* __restrict a = act + r * inter;
AGENTCACHE_SIMD
    for (int64_t c = 0; c < inter; ++c) {
      const float e = exp_nonpositive(-std::fabs(g[c]));
      a[c] = g[c] / (1.f + (g[c] >= 0.f ? e : 1.f / e)) * u[c];
    }
  }
}

}  // namespace

at::Tensor DecodeLayers::run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor buffer,
                             at::Tensor rows, at::Tensor pos, int64_t kv_len,
                             std::optional<at::Tensor> mask, std::optional<at::Tensor> src,
                             std::optional<at::Tensor> shared) const {
  const Step step = check_step(h, cos, sin, buffer, rows, pos, kv_len, mask, src, shared);
  const int64_t b = step.b, hidden = hidden_, width = (nh_ + 2 * nkv_) * d_, heads = nh_ * d_;
  const Path path = !packed_.empty() && b <= packed_max_rows_      ? Path::kPacked
                    : b <= rows_max_                               ? Path::kRows
                    : onednn_lo_ <= b && b <= onednn_hi_           ? Path::kOneDnn
                                                                   : Path::kATen;
  // the residual stream, updated in place; row-major, as rms_norm reads it
  auto hs = h.reshape({b, hidden}).clone(at::MemoryFormat::Contiguous);
  // NOTE: every per-step buffer in one allocation: x, y [B, hidden]; qkv [B, (H + 2 H_kv) D];
  // q, attn [B, H, D]; gu [B, 2 inter]; act [B, inter]
  auto scratch = at::empty({b * (2 * hidden + width + 2 * heads + 3 * inter_)}, hs.options());
  float* hp = hs.data_ptr<float>();
  float* x = scratch.data_ptr<float>();
  float *y = x + b * hidden, *qkv = y + b * hidden, *q = qkv + b * width, *attn = q + b * heads;
  float *gu = attn + b * heads, *act = gu + b * 2 * inter_;
  DecodeAttentionArgs args{q, nullptr, nullptr, step.stride[2], step.stride[3], step.stride[4],
                           step.stride[2], step.stride[3], step.stride[4], step.mask_p,
                           step.src, step.shared, b, nh_, nkv_, step.kv_len, d_,
                           static_cast<float>(scale_), attn};
  for (size_t i = 0; i < ln1_.size(); ++i) {
    rms_norm(hp, ln1_[i].data_ptr<float>(), b, x);
    product(i, 0, x, b, qkv, path);
    rope_and_store(step, i, qkv, q);
    // keys and values of rows [0, B) of layer i (K at the layer's first byte, V one stride on)
    char* k = step.kv + static_cast<int64_t>(i) * step.stride[0] * step.elem;
    char* v = k + step.stride[1] * step.elem;
    if (step.is_half) {
      args.k_half = reinterpret_cast<const uint16_t*>(k);
      args.v_half = reinterpret_cast<const uint16_t*>(v);
    } else {
      args.k = reinterpret_cast<const float*>(k);
      args.v = reinterpret_cast<const float*>(v);
    }
    decode_attention(args);  // attn [B, H, D]
    product(i, 1, attn, b, y, path);
    add_to(hp, y, b * hidden);
    rms_norm(hp, ln2_[i].data_ptr<float>(), b, x);
    product(i, 2, x, b, gu, path);
    silu_mul(gu, b, inter_, act);
    product(i, 3, act, b, y, path);
    add_to(hp, y, b * hidden);
  }
  return hs.view({b, 1, hidden});
}

DecodeLayers::Step DecodeLayers::check_step(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& buffer,
    const at::Tensor& rows, const at::Tensor& pos, int64_t kv_len,
    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& src,
    const std::optional<at::Tensor>& shared) const {
  for (const auto* t : {&h, &cos, &sin, &buffer, &rows, &pos})
    TORCH_CHECK(t->device().is_cpu(), "DecodeLayers.run: CPU tensors only");
  TORCH_CHECK(!mask.has_value() || mask->device().is_cpu(), "DecodeLayers.run: CPU tensors only");
  TORCH_CHECK(h.dim() == 3 && h.size(1) == 1 && h.scalar_type() == at::kFloat,
              "DecodeLayers.run: h must be fp32 [B, 1, hidden]");
  Step s{};
  const int64_t b = s.b = h.size(0), hidden = h.size(2);
  TORCH_CHECK(hidden == hidden_, "DecodeLayers.run: h has hidden size ", hidden,
              ", the weights ", hidden_);
  TORCH_CHECK(rows.size(0) == b && pos.size(0) == b,
              "DecodeLayers.run: one row and position per h row");
  TORCH_CHECK(buffer.dim() == 6 && buffer.size(0) == static_cast<int64_t>(ln1_.size()) &&
                  buffer.size(1) == 2 && buffer.size(3) == nkv_ && buffer.size(5) == d_ &&
                  buffer.stride(5) == 1 &&
                  (buffer.scalar_type() == at::kFloat || buffer.scalar_type() == at::kHalf),
              "DecodeLayers.run: buffer must be fp32 or float16 [L, 2, R, H_kv, capacity, D], "
              "not ", buffer.scalar_type(), " ", buffer.sizes());
  TORCH_CHECK(kv_len >= 1 && kv_len <= buffer.size(4), "DecodeLayers.run: kv_len");
  TORCH_CHECK(b <= buffer.size(2), "DecodeLayers.run: more step rows than buffer rows");
  s.kv_len = kv_len;
  s.rows64 = rows.to(at::kLong).contiguous(), s.pos64 = pos.to(at::kLong).contiguous();
  s.rows = s.rows64.data_ptr<int64_t>(), s.pos = s.pos64.data_ptr<int64_t>();
  for (int64_t j = 0; j < b; ++j) {
    TORCH_CHECK(s.rows[j] >= 0 && s.rows[j] < buffer.size(2) && s.pos[j] >= 0 &&
                    s.pos[j] < buffer.size(4),
                "DecodeLayers.run: row or position outside the buffer");
    // NOTE: the K/V are written at rows[j] and attended at buffer row j: one row, so a step
    // whose rows are not 0..B-1 is refused rather than attending to another row's keys
    TORCH_CHECK(s.rows[j] == j, "DecodeLayers.run: step row ", j, " must be buffer row ", j,
                " (attention reads buffer rows [0, B)), not ", s.rows[j]);
  }
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == b * d_ && sin.numel() == b * d_,
              "DecodeLayers.run: cos and sin must be fp32 [B, 1, 1, D]");
  s.cs = cos.reshape({b, d_}).contiguous(), s.sn = sin.reshape({b, d_}).contiguous();
  s.cos = s.cs.data_ptr<float>(), s.sin = s.sn.data_ptr<float>();
  if (mask.has_value()) {
    s.mask = mask->reshape({mask->size(0), -1}).contiguous();
    TORCH_CHECK(s.mask.scalar_type() == at::kFloat && s.mask.size(0) == b &&
                    s.mask.size(1) == kv_len,
                "DecodeLayers.run: mask must be additive fp32 [B, 1, 1, kv_len]");
    s.mask_p = s.mask.data_ptr<float>();
  }
  TORCH_CHECK(src.has_value() == shared.has_value(),
              "DecodeLayers.run: pass src and shared together");
  if (src.has_value()) {
    TORCH_CHECK(src->device().is_cpu() && shared->device().is_cpu() && src->dim() == 1 &&
                    src->size(0) == b && shared->dim() == 1 && shared->size(0) == b,
                "DecodeLayers.run: src and shared must be CPU [B]");
    s.src64 = src->to(at::kLong).contiguous(), s.shared64 = shared->to(at::kLong).contiguous();
    s.src = s.src64.data_ptr<int64_t>(), s.shared = s.shared64.data_ptr<int64_t>();
    for (int64_t j = 0; j < b; ++j)
      TORCH_CHECK(s.src[j] >= 0 && s.src[j] < b && s.shared[j] >= 0 && s.shared[j] <= kv_len,
                  "DecodeLayers.run: src must name a row and shared lie within [0, kv_len]");
  }
  s.is_half = buffer.scalar_type() == at::kHalf;
  s.elem = s.is_half ? 2 : 4;
  s.kv = static_cast<char*>(buffer.data_ptr());
  for (int dim = 0; dim < 5; ++dim) s.stride[dim] = buffer.stride(dim);
  return s;
}

void DecodeLayers::product(size_t layer, int which, const float* x, int64_t m, float* out,
                           Path path) const {
  const at::Tensor& w = which == 0   ? qkv_[layer]
                        : which == 1 ? o_[layer]
                        : which == 2 ? gate_up_[layer]
                                     : down_[layer];
  const std::optional<at::Tensor> none;
  const auto& bias = which == 0 ? qkv_bias_[layer] : which == 1 ? o_bias_[layer] : none;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t N = w.size(0), K = w.size(1);
  if (path == Path::kRows) return linear_rows(x, m, K, w.data_ptr<float>(), N, bp, out);
  if (path == Path::kPacked) {
    const Copy& c = copies_[4 * layer + which];
    const auto* blocks = static_cast<const uint8_t*>(c.data);
    switch (c.kind) {
      case Copy::Kind::kQ8_0: return linear_q8_0(x, m, K, blocks, N, bp, out);
      case Copy::Kind::kQ4_1: return linear_q4_1(x, m, K, blocks, N, bp, out);
      case Copy::Kind::kQ4_1R: return linear_q4_1r(x, m, K, blocks, N, bp, out);
      case Copy::Kind::kF32:
        return linear_packed_f32(x, m, K, static_cast<const float*>(c.data), c.blocks, out, N,
                                 bp);
      case Copy::Kind::kBF16:
        return linear_packed_bf16(x, m, K, static_cast<const uint16_t*>(c.data), c.blocks, out,
                                  N, bp);
    }
  }
  // the fp32 library products (a step of more rows than the cores serve)
  auto in = at::from_blob(const_cast<float*>(x), {m, K}, w.options());
  auto result = path == Path::kOneDnn ? ops::onednn_linear(in, w, bias) : at::linear(in, w, bias);
  at::from_blob(out, {m, N}, w.options()).copy_(result);
}

bool DecodeLayers::is_norm_weight(const at::Tensor& w) const {
  return w.dim() == 1 && w.numel() == hidden_ && w.scalar_type() == at::kFloat &&
         w.is_contiguous() && w.device().is_cpu();
}

void DecodeLayers::rms_norm(const float* x, const float* w, int64_t rows, float* y) const {
  const int64_t cols = hidden_;
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict xr = x + r * cols;
    const float* __restrict wp = w;
    float ss = 0.f;
AGENTCACHE_SIMD_SUM(ss)
    for (int64_t c = 0; c < cols; ++c) ss += xr[c] * xr[c];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(cols) + static_cast<float>(eps_));
    float* __restrict yr = y + r * cols;
AGENTCACHE_SIMD
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * inv * wp[c];
  }
}

void DecodeLayers::rope_and_store(const Step& step, size_t layer, const float* qkv,
                                  float* q) const {
  const int64_t width = (nh_ + 2 * nkv_) * d_, half = d_ / 2;
  // NOTE: element offsets; a float16 buffer's slots get the rounded values (half.h)
  const int64_t* st = step.stride;
  char* base = step.kv + static_cast<int64_t>(layer) * st[0] * step.elem;
  std::vector<float> key(d_);
  const auto store = [&](const float* x, int64_t offset) {
    char* slot = base + offset * step.elem;
    if (step.is_half) narrow_floats(x, d_, reinterpret_cast<uint16_t*>(slot));
    else std::copy(x, x + d_, reinterpret_cast<float*>(slot));
  };
  for (int64_t j = 0; j < step.b; ++j) {
    const float* row = qkv + j * width;
    const float *c = step.cos + j * d_, *s = step.sin + j * d_;
    const int64_t kslot = step.rows[j] * st[2] + step.pos[j] * st[4], vslot = st[1] + kslot;
    for (int64_t hd = 0; hd < nh_ + nkv_; ++hd) {
      const float* x = row + hd * d_;
      float* out = hd < nh_ ? q + (j * nh_ + hd) * d_ : key.data();
      for (int64_t d = 0; d < d_; ++d) {
        const float rolled = x[d < half ? d + half : d - half];
        out[d] = x[d] * c[d] + rolled * s[d];
      }
      if (hd >= nh_) store(key.data(), kslot + (hd - nh_) * st[3]);
    }
    const float* v = row + (nh_ + nkv_) * d_;
    for (int64_t hd = 0; hd < nkv_; ++hd) store(v + hd * d_, vslot + hd * st[3]);
  }
}

AGENTCACHE_END
