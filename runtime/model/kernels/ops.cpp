// The kernels as torch ops (ops.h): every tensor argument is checked before a core reads it.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "cores.h"
#include "half.h"

AGENTCACHE_BEGIN
namespace ops {
namespace {

// A float16 tensor's data as IEEE binary16 bits (at::Half is binary16, 2 bytes: what half.h reads).
uint16_t* half_bits(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::Half>());
}

// Bytes read as elements of T.
template <class T>
const T* as(const char* p) {
  return reinterpret_cast<const T*>(p);
}

// A row of D fp32 values into a KV slot: as they are, or rounded to fp16 (half.h).
void store_row(const float* x, int64_t D, bool is_half, char* slot) {
  if (is_half) narrow_floats(x, D, reinterpret_cast<uint16_t*>(slot));
  else std::copy(x, x + D, reinterpret_cast<float*>(slot));
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v,
                            std::optional<at::Tensor> mask, double scale,
                            std::optional<at::Tensor> src, std::optional<at::Tensor> shared) {
  const bool is_half = k.scalar_type() == at::kHalf;
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type() &&
                  (is_half || k.scalar_type() == at::kFloat),
              "decode_attention: q must be fp32 and k, v both fp32 or both float16, not q ",
              q.scalar_type(), ", k ", k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
                  (!mask.has_value() || mask->device().is_cpu()),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4,
              "decode_attention: q [B, H, D], k and v [B, H_kv, T, D]");
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), T = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == T &&
                  k.size(3) == D && v.size(3) == D, "decode_attention: k/v shapes do not match q");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: H must be a multiple of H_kv");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k/v last dim not contiguous");
  at::Tensor m;
  const float* mp = nullptr;
  if (mask.has_value()) {
    m = mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.dim() == 2 && m.size(0) == B &&
                    m.size(1) == T,
                "decode_attention: mask must be additive fp32 [B, T]");
    mp = m.data_ptr<float>();
  }
  TORCH_CHECK(src.has_value() == shared.has_value(),
              "decode_attention: pass src and shared together");
  at::Tensor src64, shared64;
  const int64_t *srcp = nullptr, *sharedp = nullptr;
  if (src.has_value()) {
    TORCH_CHECK(src->device().is_cpu() && shared->device().is_cpu(),
                "decode_attention: CPU tensors only");
    TORCH_CHECK(src->dim() == 1 && src->size(0) == B && shared->dim() == 1 &&
                    shared->size(0) == B, "decode_attention: src and shared must be [B]");
    src64 = src->to(at::kLong).contiguous();
    shared64 = shared->to(at::kLong).contiguous();
    srcp = src64.data_ptr<int64_t>();
    sharedp = shared64.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(srcp[b] >= 0 && srcp[b] < B && sharedp[b] >= 0 && sharedp[b] <= T,
                  "decode_attention: src must name a row and shared lie within [0, T]");
  }
  auto out = at::empty({B, H, D}, q.options());
  DecodeAttentionArgs args{q.data_ptr<float>(), nullptr, nullptr, k.stride(0), k.stride(1),
                           k.stride(2), v.stride(0), v.stride(1), v.stride(2), mp, srcp,
                           sharedp, B, H, Hkv, T, D, static_cast<float>(scale),
                           out.data_ptr<float>()};
  if (is_half) {
    args.k_half = half_bits(k);
    args.v_half = half_bits(v);
  } else {
    args.k = k.data_ptr<float>();
    args.v = v.data_ptr<float>();
  }
  agentcache::decode_attention(args);
  return out;
}

std::vector<at::Tensor> prefix_attention(at::Tensor q, const at::Tensor& k, const at::Tensor& v,
                                         double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "prefix_attention: CPU tensors only");
  const bool is_half = k.scalar_type() == at::kHalf;
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type() &&
                  (is_half || k.scalar_type() == at::kFloat),
              "prefix_attention: q must be fp32 and k, v both fp32 or both float16, not q ",
              q.scalar_type(), ", k ", k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2),
              "prefix_attention: q [H_kv, M, D], k and v [H_kv, S, D]");
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), S = k.size(1);
  // NOTE: the same limits on every ISA (16 is a whole number of vectors on each)
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 128,
              "prefix_attention: head dim must be a multiple of 16 up to 128, not ", D);
  TORCH_CHECK(S >= 1, "prefix_attention: no keys");
  TORCH_CHECK(v.stride(2) == 1, "prefix_attention: v rows must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 || S == 1, "prefix_attention: k rows must be contiguous");
  q = q.contiguous();
  auto ks = k.stride(2) == 1 ? k : k.contiguous();
  auto out = at::empty({H, M, D}, q.options());
  auto lse = at::empty({H, M}, q.options());
  if (is_half)
    agentcache::prefix_attention(q.data_ptr<float>(), half_bits(ks), ks.stride(0), ks.stride(1),
                                 half_bits(v), v.stride(0), v.stride(1), H, M, S, D,
                                 static_cast<float>(scale), out.data_ptr<float>(),
                                 lse.data_ptr<float>());
  else
    agentcache::prefix_attention(q.data_ptr<float>(), ks.data_ptr<float>(), ks.stride(0),
                                 ks.stride(1), v.data_ptr<float>(), v.stride(0), v.stride(1), H,
                                 M, S, D, static_cast<float>(scale), out.data_ptr<float>(),
                                 lse.data_ptr<float>());
  return {out, lse};
}

at::Tensor segment_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                             const std::vector<at::Tensor>& buffers, int64_t layer,
                             const std::vector<int64_t>& past, const std::vector<int64_t>& lengths,
                             double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_new.device().is_cpu() && v_new.device().is_cpu(),
              "segment_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_new.scalar_type() == at::kFloat &&
                  v_new.scalar_type() == at::kFloat, "segment_attention: fp32 tensors only");
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.sizes() == k_new.sizes() &&
                  k_new.size(1) == q.size(1) && k_new.size(2) == q.size(2),
              "segment_attention: q [H, N, D], k_new and v_new [H_kv, N, D]");
  const int64_t H = q.size(0), N = q.size(1), D = q.size(2), Hkv = k_new.size(0);
  const int64_t num = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "segment_attention: H must be a multiple of H_kv");
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 128,
              "segment_attention: head dim must be a multiple of 16 up to 128, not ", D);
  TORCH_CHECK(num >= 1 && static_cast<int64_t>(past.size()) == num &&
                  static_cast<int64_t>(lengths.size()) == num,
              "segment_attention: one buffer, past and length per segment");
  // NOTE: every buffer of one dtype, fp32 or float16 (the new K/V stored rounded: half.h)
  const at::ScalarType dtype = buffers[0].scalar_type();
  const bool is_half = dtype == at::kHalf;
  std::vector<int64_t> starts(num), kh(num), ks(num), vh(num), vs(num);
  std::vector<char*> kp(num), vp(num);
  int64_t start = 0;
  for (int64_t s = 0; s < num; ++s) {
    const auto& b = buffers[s];
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == dtype &&
                    (is_half || dtype == at::kFloat) && b.dim() == 5 && b.size(1) == 2 &&
                    b.size(2) == Hkv && b.size(4) == D && b.stride(4) == 1,
                "segment_attention: buffer ", s, " must be [L, 2, H_kv, capacity, D] with "
                "contiguous rows, fp32 or float16 as every buffer (buffer 0: ", dtype, "), not ",
                b.scalar_type(), " ", b.sizes());
    TORCH_CHECK(layer >= 0 && layer < b.size(0), "segment_attention: layer ", layer,
                " outside buffer ", s);
    TORCH_CHECK(lengths[s] >= 1 && past[s] >= 0 && past[s] + lengths[s] <= b.size(3),
                "segment_attention: segment ", s, " (past ", past[s], ", length ", lengths[s],
                ") does not fit its buffer of ", b.size(3), " positions");
    starts[s] = start;
    start += lengths[s];
    const int64_t elem = is_half ? 2 : 4;
    char* base = static_cast<char*>(b.data_ptr()) + layer * b.stride(0) * elem;
    kp[s] = base;
    vp[s] = base + b.stride(1) * elem;
    kh[s] = vh[s] = b.stride(2);
    ks[s] = vs[s] = b.stride(3);
  }
  TORCH_CHECK(start == N, "segment_attention: lengths sum to ", start, ", q has ", N, " tokens");
  q = q.contiguous();
  auto kn = k_new.contiguous(), vn = v_new.contiguous();
  const float *knp = kn.data_ptr<float>(), *vnp = vn.data_ptr<float>();
  // the new keys and values into each segment's buffer (fp16: rounded to nearest even, as
  // torch's `x.half()`; the attention below reads them back from there, rounded)
  const int64_t elem = is_half ? 2 : 4;
  for (int64_t s = 0; s < num; ++s)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t j = 0; j < lengths[s]; ++j) {
        const int64_t from = (h * N + starts[s] + j) * D, to = h * kh[s] + (past[s] + j) * ks[s];
        store_row(knp + from, D, is_half, kp[s] + to * elem);
        store_row(vnp + from, D, is_half, vp[s] + to * elem);
      }
  auto out = at::empty({H, N, D}, q.options());
  SegmentAttentionArgs args{q.data_ptr<float>(), H, Hkv, N, D, num, starts.data(),
                            lengths.data(), past.data(), nullptr, nullptr, kh.data(),
                            ks.data(), vh.data(), vs.data(), static_cast<float>(scale),
                            out.data_ptr<float>()};
  // the buffers' K / V as the core's element type (one pair set)
  std::vector<const float*> k32(num), v32(num);
  std::vector<const uint16_t*> k16(num), v16(num);
  for (int64_t s = 0; s < num; ++s) {
    if (is_half) k16[s] = as<uint16_t>(kp[s]), v16[s] = as<uint16_t>(vp[s]);
    else k32[s] = as<float>(kp[s]), v32[s] = as<float>(vp[s]);
  }
  if (is_half) args.k_half = k16.data(), args.v_half = v16.data();
  else args.k = k32.data(), args.v = v32.data();
  agentcache::segment_attention(args);
  return out;
}

namespace {

// The layout of a quantized weight: uint8 [N, K / 32, 34] (GGUF's Q8_0), [N, K / 32, 20]
// (GGUF's Q4_1) or [N, K / 32 * 20] (Q4_1 in the kernel layout: repack_q4_1), contiguous.
enum class QuantLayout { kQ8_0, kQ4_1, kQ4_1R };
struct QuantShape {
  int64_t N, K;
  QuantLayout format;
};

QuantShape quant_layout(const at::Tensor& blocks, const char* op) {
  const bool is_blocks = blocks.dim() == 3 && (blocks.size(2) == kQ8_0Bytes ||
                                                blocks.size(2) == kQ4_1Bytes);
  const bool is_rows = blocks.dim() == 2 && blocks.size(1) % kQ4_1Bytes == 0;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && (is_blocks || is_rows) &&
                  blocks.is_contiguous(),
              op, ": blocks must be contiguous uint8 [N, K / 32, 34] (Q8_0), [N, K / 32, 20] "
              "(Q4_1; quantize_weight) or [N, K / 32 * 20] (Q4_1, repack_q4_1)");
  if (is_rows) return {blocks.size(0), blocks.size(1) / kQ4_1Bytes * kQuantBlock,
                       QuantLayout::kQ4_1R};
  return {blocks.size(0), blocks.size(1) * kQuantBlock,
          blocks.size(2) == kQ8_0Bytes ? QuantLayout::kQ8_0 : QuantLayout::kQ4_1};
}

}  // namespace

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_packed: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_packed: x must be fp32");
  TORCH_CHECK(x.dim() >= 1, "linear_packed: x must be [..., K], not a 0-dim tensor");
  const auto type = packed.scalar_type();
  if (type == at::kByte) {
    TORCH_CHECK((packed.dim() == 3 || packed.dim() == 2) && packed.size(0) == n,
                "linear_packed: n = ", n, " does not match the quantized weight's ",
                packed.dim() >= 2 ? packed.size(0) : 0, " rows");
    return linear_quantized(x, packed, bias);
  }
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && packed.dim() == 3 &&
                  packed.size(2) == kPackedCols && packed.is_contiguous(),
              "linear_packed: packed must be contiguous bf16 or fp32 [blocks, K, 32] "
              "(pack_weight)");
  const int64_t K = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(K >= 1, "linear_packed: the packed weight has K = 0 inputs");
  TORCH_CHECK(x.size(-1) == K, "linear_packed: x has ", x.size(-1), " inputs, the weight ", K);
  TORCH_CHECK(n > 0 && n <= blocks * kPackedCols && n > (blocks - 1) * kPackedCols,
              "linear_packed: n = ", n, " does not match ", blocks, " packed blocks");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                                    bias->numel() == n && bias->device().is_cpu()),
              "linear_packed: bias must be fp32 [n]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto xs = x.reshape({-1, K}).contiguous();
  const int64_t m = xs.size(0);
  auto out = at::empty({m, n}, xs.options());
  if (m == 0) return out.view(shape);
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  if (type == at::kFloat)
    linear_packed_f32(xs.data_ptr<float>(), m, K, packed.data_ptr<float>(), blocks,
                      out.data_ptr<float>(), n, bp);
  else
    linear_packed_bf16(xs.data_ptr<float>(), m, K,
                       reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                       blocks, out.data_ptr<float>(), n, bp);
  return out.view(shape);
}

at::Tensor linear_quantized(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(),
              "linear_quantized: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_quantized: x must be fp32");
  TORCH_CHECK(x.dim() >= 1, "linear_quantized: x must be [..., K], not a 0-dim tensor");
  const QuantShape layout = quant_layout(blocks, "linear_quantized");
  const int64_t N = layout.N, K = layout.K;
  const QuantLayout format = layout.format;
  TORCH_CHECK(N >= 1 && K >= 1, "linear_quantized: the quantized weight is empty");
  TORCH_CHECK(x.size(-1) == K, "linear_quantized: x has ", x.size(-1), " inputs, the weight ", K);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                                    bias->numel() == N && bias->device().is_cpu()),
              "linear_quantized: bias must be fp32 [N]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto xs = x.reshape({-1, K}).contiguous();
  const int64_t m = xs.size(0);
  auto out = at::empty({m, N}, xs.options());
  if (m == 0) return out.view(shape);
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  const auto product = format == QuantLayout::kQ8_0   ? linear_q8_0
                       : format == QuantLayout::kQ4_1 ? linear_q4_1
                                                      : linear_q4_1r;
  product(xs.data_ptr<float>(), m, K, blocks.data_ptr<uint8_t>(), N,
          b.has_value() ? b->data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out.view(shape);
}

at::Tensor dequantize_blocks(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.device().is_cpu(), "dequantize_blocks: CPU tensors only");
  const QuantShape layout = quant_layout(blocks, "dequantize_blocks");
  const int64_t N = layout.N, K = layout.K;
  const QuantLayout format = layout.format;
  const int64_t bytes = format == QuantLayout::kQ8_0 ? kQ8_0Bytes : kQ4_1Bytes;
  auto out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  if (N == 0 || K == 0) return out;
  const auto rows = format == QuantLayout::kQ8_0   ? dequantize_q8_0
                    : format == QuantLayout::kQ4_1 ? dequantize_q4_1
                                                   : dequantize_q4_1r;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  constexpr int64_t kChunk = 16;  // rows per task
  parallel_for((N + kChunk - 1) / kChunk, [&](int64_t first, int64_t last) {
    const int64_t r0 = first * kChunk, r1 = std::min(N, last * kChunk);
    rows(w + r0 * (K / kQuantBlock) * bytes, r1 - r0, K, o + r0 * K);
  });
  return out;
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_rows: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "linear_rows: fp32 tensors only");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2, "linear_rows: x must be [..., K] and w [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N >= 1 && K >= 1 && w.stride(0) == 1 && w.stride(1) == N,
              "linear_rows: w must be an input-major [N, K] view (strides (1, N)) of a "
              "contiguous [K, N] tensor");
  TORCH_CHECK(x.size(-1) == K, "linear_rows: x has ", x.size(-1), " inputs, the weight ", K);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                                    bias->numel() == N && bias->device().is_cpu()),
              "linear_rows: bias must be fp32 [N]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto xs = x.reshape({-1, K}).contiguous();
  const int64_t m = xs.size(0);
  auto out = at::empty({m, N}, xs.options());
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  agentcache::linear_rows(xs.data_ptr<float>(), m, K, w.data_ptr<float>(), N,
              b.has_value() ? b->data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out.view(shape);
}

// Looked up once; called boxed, so a change of the op's C++ signature in another torch cannot
// miscall it (the Python side checks that the op exists before asking for it). Float32 products
// like at::linear's MKL ones, faster where MKL does not run its AVX-512 kernels (AMD).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace ops
AGENTCACHE_END
