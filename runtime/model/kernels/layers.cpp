// DecodeLayers (layers.h): the layer loop of a compact decode step, its products through the ops
// (ops.h) or ATen, RMSNorm and RoPE as plain loops the compiler vectorizes for the build's ISA.
#include "layers.h"

#include <cmath>
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
  // linear_rows reads the weights input-major: [N, K] views with strides (1, N)
  const auto input_major = [](const at::Tensor& w) {
    return w.dim() == 2 && w.stride(0) == 1 && w.stride(1) == w.size(0);
  };
  for (size_t i = 0; rows_max_ > 0 && i < L; ++i)
    TORCH_CHECK(input_major(qkv_[i]) && input_major(o_[i]) && input_major(gate_up_[i]) &&
                    input_major(down_[i]),
                "DecodeLayers: rows_max needs input-major weights (layer ", i, ")");
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
      continue;
    }
    TORCH_CHECK(packed_[i].scalar_type() == packed_[0].scalar_type() &&
                    (packed_[i].scalar_type() == at::kBFloat16 ||
                     packed_[i].scalar_type() == at::kFloat) &&
                    packed_[i].is_contiguous() && packed_[i].dim() == 3 &&
                    packed_[i].size(1) == w.size(1) && packed_[i].size(2) == kPackedCols &&
                    packed_[i].size(0) == (w.size(0) + kPackedCols - 1) / kPackedCols,
                "DecodeLayers: packed weight ", i, " does not match its fp32 weight");
  }
}

at::Tensor DecodeLayers::run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor buffer,
                             at::Tensor rows, at::Tensor pos, int64_t kv_len,
                             std::optional<at::Tensor> mask, std::optional<at::Tensor> src,
                             std::optional<at::Tensor> shared) const {
  using at::indexing::Slice;
  for (const auto* t : {&h, &cos, &sin, &buffer, &rows, &pos})
    TORCH_CHECK(t->device().is_cpu(), "DecodeLayers.run: CPU tensors only");
  TORCH_CHECK(!mask.has_value() || mask->device().is_cpu(), "DecodeLayers.run: CPU tensors only");
  TORCH_CHECK(h.dim() == 3 && h.size(1) == 1 && h.scalar_type() == at::kFloat,
              "DecodeLayers.run: h must be fp32 [B, 1, hidden]");
  const int64_t b = h.size(0), hidden = h.size(2), n = rows.size(0);
  TORCH_CHECK(hidden == hidden_, "DecodeLayers.run: h has hidden size ", hidden,
              ", the weights ", hidden_);
  TORCH_CHECK(n == b && pos.size(0) == b, "DecodeLayers.run: one row and position per h row");
  TORCH_CHECK(buffer.dim() == 6 && buffer.size(0) == static_cast<int64_t>(ln1_.size()) &&
                  buffer.size(1) == 2 && buffer.size(3) == nkv_ && buffer.size(5) == d_ &&
                  buffer.stride(5) == 1 &&
                  (buffer.scalar_type() == at::kFloat || buffer.scalar_type() == at::kHalf),
              "DecodeLayers.run: buffer must be fp32 or float16 [L, 2, R, H_kv, capacity, D], "
              "not ", buffer.scalar_type(), " ", buffer.sizes());
  TORCH_CHECK(kv_len >= 1 && kv_len <= buffer.size(4), "DecodeLayers.run: kv_len");
  auto rows64 = rows.to(at::kLong).contiguous(), pos64 = pos.to(at::kLong).contiguous();
  const int64_t *rp = rows64.data_ptr<int64_t>(), *pp = pos64.data_ptr<int64_t>();
  for (int64_t j = 0; j < b; ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < buffer.size(2) && pp[j] >= 0 && pp[j] < buffer.size(4),
                "DecodeLayers.run: row or position outside the buffer");
  std::optional<at::Tensor> flat;
  if (mask.has_value()) flat = mask->reshape({mask->size(0), -1});
  auto cs = cos.reshape({b, d_}).contiguous(), sn = sin.reshape({b, d_}).contiguous();
  // the residual stream, updated in place; row-major, as rms_norm reads it
  auto hs = h.reshape({b, hidden}).clone(at::MemoryFormat::Contiguous);
  auto x = at::empty({b, hidden}, hs.options());
  auto q = at::empty({b, nh_, d_}, hs.options());
  for (size_t i = 0; i < ln1_.size(); ++i) {
    rms_norm(hs, ln1_[i], x);
    const bool use_packed = !packed_.empty() && b <= packed_max_rows_;
    const bool use_rows = !use_packed && b <= rows_max_;
    const bool use_onednn = !use_packed && !use_rows && onednn_lo_ <= b && b <= onednn_hi_;
    const auto proj = [&](const at::Tensor& in, size_t which, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias) {
      return use_packed   ? ops::linear_packed(in, packed_[4 * i + which], bias, w.size(0))
             : use_rows   ? ops::linear_rows(in, w, bias)
             : use_onednn ? ops::onednn_linear(in, w, bias)
                          : at::linear(in, w, bias);
    };
    auto qkv = proj(x, 0, qkv_[i], qkv_bias_[i]).contiguous();  // [B, (H + 2 H_kv) D]
    rope_and_store(qkv, cs, sn, q, buffer.select(0, i), rp, pp);
    auto layer = buffer.select(0, i);
    auto keys = layer.select(0, 0).index({Slice(0, n), Slice(), Slice(0, kv_len)});
    auto values = layer.select(0, 1).index({Slice(0, n), Slice(), Slice(0, kv_len)});
    auto attn = ops::decode_attention(q, keys, values, flat, scale_, src, shared);  // [B, H, D]
    hs.add_(proj(attn.view({b, nh_ * d_}), 1, o_[i], o_bias_[i]));
    rms_norm(hs, ln2_[i], x);
    auto parts = proj(x, 2, gate_up_[i], std::nullopt).chunk(2, -1);
    hs.add_(proj(at::silu(parts[0]).mul_(parts[1]), 3, down_[i], std::nullopt));
  }
  return hs.view({b, 1, hidden});
}

bool DecodeLayers::is_norm_weight(const at::Tensor& w) const {
  return w.dim() == 1 && w.numel() == hidden_ && w.scalar_type() == at::kFloat &&
         w.is_contiguous() && w.device().is_cpu();
}

void DecodeLayers::rms_norm(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) const {
  const int64_t rows = x.size(0), cols = x.size(1);
  const float* __restrict xp = x.data_ptr<float>();
  const float* __restrict wp = w.data_ptr<float>();
  float* __restrict yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * cols;
    float ss = 0.f;
AGENTCACHE_SIMD_SUM(ss)
    for (int64_t c = 0; c < cols; ++c) ss += xr[c] * xr[c];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(cols) + static_cast<float>(eps_));
    float* yr = yp + r * cols;
AGENTCACHE_SIMD
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * inv * wp[c];
  }
}

void DecodeLayers::rope_and_store(const at::Tensor& qkv, const at::Tensor& cos,
                                  const at::Tensor& sin, at::Tensor& q, const at::Tensor& layer,
                                  const int64_t* rows, const int64_t* pos) const {
  const int64_t b = qkv.size(0), width = qkv.size(1), half = d_ / 2;
  const float* __restrict src = qkv.data_ptr<float>();
  const float* __restrict cp = cos.data_ptr<float>();
  const float* __restrict sp = sin.data_ptr<float>();
  float* __restrict qp = q.data_ptr<float>();
  const bool is_half = layer.scalar_type() == at::kHalf;
  // NOTE: element offsets; a float16 buffer's slots get the rounded values (half.h)
  auto* base = static_cast<char*>(layer.data_ptr());
  const int64_t elem = is_half ? 2 : 4;
  const int64_t s0 = layer.stride(0), s1 = layer.stride(1), s2 = layer.stride(2);
  const int64_t s3 = layer.stride(3);
  std::vector<float> key(d_);
  const auto store = [&](const float* x, int64_t offset) {
    char* slot = base + offset * elem;
    if (is_half) narrow_floats(x, d_, reinterpret_cast<uint16_t*>(slot));
    else std::copy(x, x + d_, reinterpret_cast<float*>(slot));
  };
  for (int64_t j = 0; j < b; ++j) {
    const float* row = src + j * width;
    const float *c = cp + j * d_, *s = sp + j * d_;
    const int64_t kslot = rows[j] * s1 + pos[j] * s3, vslot = s0 + kslot;
    for (int64_t hd = 0; hd < nh_ + nkv_; ++hd) {
      const float* x = row + hd * d_;
      float* out = hd < nh_ ? qp + (j * nh_ + hd) * d_ : key.data();
      for (int64_t d = 0; d < d_; ++d) {
        const float rolled = x[d < half ? d + half : d - half];
        out[d] = x[d] * c[d] + rolled * s[d];
      }
      if (hd >= nh_) store(key.data(), kslot + (hd - nh_) * s2);
    }
    const float* v = row + (nh_ + nkv_) * d_;
    for (int64_t hd = 0; hd < nkv_; ++hd) store(v + hd * d_, vslot + hd * s2);
  }
}

AGENTCACHE_END
