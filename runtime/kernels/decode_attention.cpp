// One-query attention over grouped KV heads (a decode step), fp32, for agentcache's compact forward.
//
// Flash-decoding layout: every (row, KV head, block of kBlock keys) is one work item on torch's
// intra-op thread pool (at::parallel_for); each item computes the scores of the H / H_kv queries
// that share the KV head, a block-local softmax (max, sum) and the weighted sum of V; a serial
// merge rescales the blocks by exp(block max - global max). K and V are read once per KV head
// and never expanded. A block whose additive mask is -inf everywhere is skipped (rows of a
// batched step shorter than the longest row read nothing past their end). Rows that read one
// block of keys from the same source row (a shared prefix) are one work item: their queries
// together against the block, as two small matrix products (run_group).
//
// Built by runtime/kernels/__init__.py with torch.utils.cpp_extension; see its docstring for
// the flags and why reassociation is allowed.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;  // keys per work item (64 KiB of K at D = 64)
constexpr int64_t kAhead = 8;    // rows of K / V prefetched ahead of the one in use
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0: Cephes expf (range reduction by ln 2, degree-5 polynomial, about 1 ulp),
// written so that the compiler vectorizes the loop calling it. x < -87.3 (and -inf) gives 0.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.3f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return x < -87.3f ? 0.0f : p * two_n;
}

struct Item {
  const float* q;     // [G, D] queries of this KV head
  const float* k;     // first key of the block; rows `ks` floats apart
  const float* v;
  const float* mask;  // [n] additive, or nullptr
  int64_t ks, vs, n, G, D;
  float scale;
  float* block_max;   // [G]
  float* block_sum;   // [G]
  float* block_acc;   // [G, D] unnormalized sum of p * V
};

// P.V of queries [g0, g0 + GT) over the block, their accumulators held in registers.
template <int64_t DC, int64_t GT>
void pv_tile(const Item& it, const float* __restrict scores, int64_t g0) {
  float acc[GT][DC] = {};
  for (int64_t t = 0; t < it.n; ++t) {
    const float* __restrict vt = it.v + t * it.vs;
    if (t + kAhead < it.n)
      for (int64_t d = 0; d < DC; d += 16) __builtin_prefetch(vt + kAhead * it.vs + d);
    for (int64_t gi = 0; gi < GT; ++gi) {
      const float p = scores[(g0 + gi) * kBlock + t];
#pragma omp simd
      for (int64_t d = 0; d < DC; ++d) acc[gi][d] += p * vt[d];
    }
  }
  for (int64_t gi = 0; gi < GT; ++gi)
    std::copy(acc[gi], acc[gi] + DC, it.block_acc + (g0 + gi) * DC);
}

// DC: the head dim known at compile time (0: read it from `it.D`), so the inner loops unroll.
template <int64_t DC>
void run_block(const Item& it, float* __restrict scores) {
  const int64_t D = DC > 0 ? DC : it.D, G = it.G, n = it.n;
  if (it.mask != nullptr) {
    bool any = false;
    for (int64_t t = 0; t < n && !any; ++t) any = it.mask[t] != kNegInf;
    if (!any) {
      std::fill(it.block_max, it.block_max + G, kNegInf);
      std::fill(it.block_sum, it.block_sum + G, 0.f);
      std::fill(it.block_acc, it.block_acc + G * D, 0.f);
      return;
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* __restrict kt = it.k + t * it.ks;
    if (t + kAhead < n)
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(kt + kAhead * it.ks + d);
    const float add = it.mask != nullptr ? it.mask[t] : 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const float* __restrict qg = it.q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
      scores[g * kBlock + t] = dot * it.scale + add;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict sg = scores + g * kBlock;
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
    float sum = 0.f;
    if (mx == kNegInf) {
      std::fill(sg, sg + n, 0.f);
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        const float e = exp_nonpositive(sg[t] - mx);
        sg[t] = e;
        sum += e;
      }
    }
    it.block_max[g] = mx;
    it.block_sum[g] = sum;
  }
  // P.V, four queries at a time with their accumulators held in registers across the block.
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    if constexpr (DC > 0) {
      switch (gn) {  // NOTE: a tile of exactly gn queries: no multiply-add by a zero weight
        case 4: pv_tile<DC, 4>(it, scores, g0); break;
        case 3: pv_tile<DC, 3>(it, scores, g0); break;
        case 2: pv_tile<DC, 2>(it, scores, g0); break;
        default: pv_tile<DC, 1>(it, scores, g0); break;
      }
    } else {
      std::fill(it.block_acc + g0 * D, it.block_acc + (g0 + gn) * D, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const float* __restrict vt = it.v + t * it.vs;
        for (int64_t gi = 0; gi < gn; ++gi) {
          const float p = scores[(g0 + gi) * kBlock + t];
          float* __restrict ag = it.block_acc + (g0 + gi) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
        }
      }
    }
  }
}


// Rows that read one whole block of keys from the same row (a shared prefix), computed together:
// their m * G queries become the lanes of vectors, so scores are Q.K^T and the weighted sum P.V
// as register-tiled products over the block (every key and value loaded once per 4 keys x 64
// queries, not once per query), where run_block pays a horizontal sum per query and key. The
// numbers equal run_block's within float32 rounding (each score is a sum over the head dim in
// another order), not to the bit.
typedef float v16 __attribute__((vector_size(64)));  // GCC/Clang: the target's widest vectors
constexpr int64_t kLanes = 16;
constexpr int64_t kGroupLanes = 64;  // queries per pass over the block (4 vectors)

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

struct GroupQuery {
  const float* q;  // [D]
  float* block_max;
  float* block_sum;
  float* block_acc;  // [D]
};

struct GroupScratch {
  std::vector<float> qt;      // [D][kGroupLanes] the queries, transposed
  std::vector<float> scores;  // [kBlock][kGroupLanes], then the weights exp(s - max)
};

// scores[t][lane] = scale * q_lane . k_t over tiles of KT keys and NV vectors of queries (KT * NV
// accumulators held in registers across the head dim; 8 keys measured no faster than 4).
template <int NV, int KT = 4>
void group_scores(const float* qt, const float* k, int64_t ks, int64_t D, int64_t n, float scale,
                  float* scores) {
  static_assert(kBlock % KT == 0, "whole tiles of keys");
  for (int64_t t = 0; t < n; t += KT) {
    v16 acc[KT][NV] = {};
    for (int64_t d = 0; d < D; ++d) {
      v16 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = load16(qt + d * kGroupLanes + v * kLanes);
      for (int kk = 0; kk < KT; ++kk) {
        const float kv = k[(t + kk) * ks + d];
        for (int v = 0; v < NV; ++v) acc[kk][v] += qv[v] * kv;
      }
    }
    for (int kk = 0; kk < KT; ++kk)
      for (int v = 0; v < NV; ++v)
        store16(scores + (t + kk) * kGroupLanes + v * kLanes, acc[kk][v] * scale);
  }
}

// acc of queries [q0, q0 + QT) over one chunk of DV vectors of the head dim: sum_t w[t][q] v_t.
template <int QT, int DV>
void group_pv(const float* w, const float* vb, int64_t vs, int64_t n, int64_t q0, int64_t d0,
              const GroupQuery* queries) {
  v16 acc[QT][DV] = {};
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = vb + t * vs + d0;
    if (t + kAhead < n) __builtin_prefetch(vt + kAhead * vs);
    v16 vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = load16(vt + j * kLanes);
    for (int qi = 0; qi < QT; ++qi) {
      const float p = w[t * kGroupLanes + q0 + qi];
      for (int j = 0; j < DV; ++j) acc[qi][j] += vv[j] * p;
    }
  }
  for (int qi = 0; qi < QT; ++qi)
    for (int j = 0; j < DV; ++j) store16(queries[q0 + qi].block_acc + d0 + j * kLanes, acc[qi][j]);
}

template <int QT>
void group_pv_dims(const float* w, const float* vb, int64_t vs, int64_t n, int64_t q0, int64_t D,
                   const GroupQuery* queries) {
  for (int64_t d0 = 0; d0 < D; d0 += 4 * kLanes) {
    switch ((std::min<int64_t>(4 * kLanes, D - d0)) / kLanes) {
      case 4: group_pv<QT, 4>(w, vb, vs, n, q0, d0, queries); break;
      case 3: group_pv<QT, 3>(w, vb, vs, n, q0, d0, queries); break;
      case 2: group_pv<QT, 2>(w, vb, vs, n, q0, d0, queries); break;
      default: group_pv<QT, 1>(w, vb, vs, n, q0, d0, queries); break;
    }
  }
}

// The block's keys k / values v (rows ks / vs floats apart, n == kBlock, D % kLanes == 0)
// for queries nq queries, no key masked; writes each query's block max, sum and accumulator as
// run_block does.
void run_group(const float* k, const float* v, int64_t ks, int64_t vs, int64_t n, int64_t D,
               float scale, const GroupQuery* queries, int64_t nq, GroupScratch& scratch) {
  scratch.qt.resize(D * kGroupLanes);
  scratch.scores.resize(kBlock * kGroupLanes);
  float* qt = scratch.qt.data();
  float* sc = scratch.scores.data();
  for (int64_t c0 = 0; c0 < nq; c0 += kGroupLanes) {
    const int64_t m = std::min(kGroupLanes, nq - c0), nv = (m + kLanes - 1) / kLanes;
    const GroupQuery* qs = queries + c0;
    std::fill(qt, qt + D * kGroupLanes, 0.f);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t d = 0; d < D; ++d) qt[d * kGroupLanes + i] = qs[i].q[d];
    switch (nv) {
      case 4: group_scores<4>(qt, k, ks, D, n, scale, sc); break;
      case 3: group_scores<3>(qt, k, ks, D, n, scale, sc); break;
      case 2: group_scores<2>(qt, k, ks, D, n, scale, sc); break;
      default: group_scores<1>(qt, k, ks, D, n, scale, sc); break;
    }
    // softmax over the block, lane by lane (every key is unmasked: the max is finite)
    float mx[kGroupLanes], sum[kGroupLanes];
    std::fill(mx, mx + kGroupLanes, kNegInf);
    std::fill(sum, sum + kGroupLanes, 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const float* st = sc + t * kGroupLanes;
#pragma omp simd
      for (int64_t i = 0; i < kGroupLanes; ++i) mx[i] = std::max(mx[i], st[i]);
    }
    for (int64_t t = 0; t < n; ++t) {
      float* st = sc + t * kGroupLanes;
#pragma omp simd
      for (int64_t i = 0; i < kGroupLanes; ++i) {
        const float e = exp_nonpositive(st[i] - mx[i]);
        st[i] = e;
        sum[i] += e;
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      *qs[i].block_max = mx[i];
      *qs[i].block_sum = sum[i];
    }
    int64_t q0 = 0;
    for (; q0 + 4 <= m; q0 += 4) group_pv_dims<4>(sc, v, vs, n, q0, D, qs);
    for (; q0 < m; ++q0) group_pv_dims<1>(sc, v, vs, n, q0, D, qs);
  }
}

// q: [B, H, D]; k, v: [B, H_kv, T, D] (any strides, last dim contiguous); mask: additive
// [B, T] or None. Returns [B, H, D]. A row whose every key is masked gets zeros.
//
// Shared prefix (src, shared: [B] int64, both or neither): row b's keys [0, shared[b]) hold the
// same bytes as row src[b]'s (the caller guarantees it: both were copied from the same pinned
// prefix-cache blocks). A block of keys that lies wholly inside [0, shared[b]) is then read
// from row src[b]. The rows that read a block from the same row, with no key of it masked, are
// one work item (run_group): the block is read once for all of them and their queries run as
// register-tiled products. Results equal those without sharing within float32 rounding.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               std::optional<torch::Tensor> mask, double scale,
                               std::optional<torch::Tensor> src,
                               std::optional<torch::Tensor> shared) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "decode_attention: fp32 tensors only");
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
  torch::Tensor m;
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
  torch::Tensor src64, shared64;
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
  const int64_t G = H / Hkv, S = (T + kBlock - 1) / kBlock;
  auto out = torch::zeros({B, H, D}, q.options());
  if (S == 0 || B == 0) return out;
  auto part_max = torch::empty({B, Hkv, S, G}, q.options());
  auto part_sum = torch::empty({B, Hkv, S, G}, q.options());
  auto part_acc = torch::empty({B, Hkv, S, G, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *pm = part_max.data_ptr<float>(), *pl = part_sum.data_ptr<float>();
  float* pa = part_acc.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float sc = static_cast<float>(scale);
  // Work: (row, KV head, block) items for run_block, and with a shared prefix, group items for
  // the rows reading one whole block from the same row (run_group); groups first (the heaviest),
  // handed out one at a time to torch's threads (their costs differ up to B-fold).
  struct Work {
    int64_t b, h, s, kv_row, first, count;  // count > 0: members [first, first + count)
  };
  std::vector<Work> work;
  std::vector<int64_t> members;
  std::vector<Work> singles;
  work.reserve(B * Hkv * S);
  // the row whose keys row b reads in block s: its source for a block wholly inside its prefix
  const auto reads_from = [&](int64_t b, int64_t s) {
    return srcp != nullptr && (s + 1) * kBlock <= sharedp[b] ? srcp[b] : b;
  };
  if (srcp == nullptr || D % kLanes != 0) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t s = 0; s < S; ++s) work.push_back({b, h, s, reads_from(b, s), 0, 0});
  } else {
    std::vector<int64_t> reader(B);
    std::vector<char> unmasked(B);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t t0 = s * kBlock, n = std::min(kBlock, T - t0);
      for (int64_t b = 0; b < B; ++b) {
        reader[b] = reads_from(b, s);
        bool clear = n == kBlock;
        for (int64_t t = 0; mp != nullptr && clear && t < n; ++t) clear = mp[b * T + t0 + t] == 0.f;
        unmasked[b] = clear;
      }
      for (int64_t r = 0; r < B; ++r) {
        const int64_t first = static_cast<int64_t>(members.size());
        for (int64_t b = 0; b < B; ++b)
          if (reader[b] == r && unmasked[b]) members.push_back(b);
        const int64_t count = static_cast<int64_t>(members.size()) - first;
        if (count < 2) members.resize(first);
        for (int64_t h = 0; h < Hkv; ++h) {
          if (count >= 2) work.push_back({-1, h, s, r, first, count});
          for (int64_t b = 0; b < B; ++b)
            if (reader[b] == r && (count < 2 || !unmasked[b])) singles.push_back({b, h, s, r, 0, 0});
        }
      }
    }
    work.insert(work.end(), singles.begin(), singles.end());
  }
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(work.size());
  at::parallel_for(0, std::min<int64_t>(total, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(G * kBlock);
    GroupScratch scratch;
    std::vector<GroupQuery> queries;
    for (int64_t j = next++; j < total; j = next++) {
      const Work& w = work[j];
      const int64_t t0 = w.s * kBlock;
      const float* kb = kp + w.kv_row * ks0 + w.h * ks1 + t0 * ks2;
      const float* vb = vp + w.kv_row * vs0 + w.h * vs1 + t0 * vs2;
      if (w.count > 0) {
        queries.clear();
        for (int64_t i = 0; i < w.count; ++i) {
          const int64_t b = members[w.first + i], idx = (b * Hkv + w.h) * S + w.s;
          for (int64_t g = 0; g < G; ++g)
            queries.push_back({qp + (b * H + w.h * G + g) * D, pm + idx * G + g, pl + idx * G + g,
                               pa + (idx * G + g) * D});
        }
        run_group(kb, vb, ks2, vs2, kBlock, D, sc, queries.data(),
                  static_cast<int64_t>(queries.size()), scratch);
        continue;
      }
      const int64_t b = w.b, idx = (b * Hkv + w.h) * S + w.s;
      const Item it{qp + (b * H + w.h * G) * D, kb, vb, mp ? mp + b * T + t0 : nullptr,
                    ks2, vs2, std::min(kBlock, T - t0), G, D, sc,
                    pm + idx * G, pl + idx * G, pa + idx * G * D};
      if (D == 64) run_block<64>(it, scores.data());
      else if (D == 128) run_block<128>(it, scores.data());
      else run_block<0>(it, scores.data());
    }
  });
  float* op = out.data_ptr<float>();
  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    for (int64_t g = 0; g < G; ++g) {
      float mx = kNegInf;
      for (int64_t s = 0; s < S; ++s) mx = std::max(mx, pm[(bh * S + s) * G + g]);
      if (mx == kNegInf) continue;  // every key masked: zeros
      float* o = op + (bh * G + g) * D;
      float denom = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t at = (bh * S + s) * G + g;
        const float w = std::exp(pm[at] - mx);
        denom += w * pl[at];
        const float* a = pa + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= denom;
    }
  }
  return out;
}


// y = x . W^T + bias with W packed for small products (a decode step's): packed by
// runtime.kernels.pack_weight into blocks of kCols output columns, [ceil(N / kCols), K, kCols],
// zero padded past N, so a block is one contiguous stream of K lines of kCols values, read once
// per kRowsPerTile rows of x (again from cache for the next rows). Two element types:
// - bfloat16 (weights="bfloat16"): half the bytes of fp32; inside a line the columns come in the
//   order that AVX-512's unpack instructions widen them to fp32 (two shuffles per line, no
//   shift); the result equals fp32 arithmetic on the bf16-rounded weights within float32
//   rounding.
// - float32 (weights="float32-packed"): the same values as the model's weights in their natural
//   column order; the result equals at::linear's within float32 rounding (sums in another order).
// x, the accumulation and y are fp32.
constexpr int64_t kCols = 32;
constexpr int64_t kRowsPerTile = 12;  // rows of x per pass over a block (24 accumulators)
constexpr int64_t kPrefetchBytes = 96 * 64;  // measured best of 8-160 lines on W1's shapes (bf16)

// How a packed element type is read: one k's kCols values as two fp32 vectors (AVX-512), or one
// value, and which column packed position p holds.
template <typename T>
struct PackedType;

template <>
struct PackedType<uint16_t> {  // bfloat16 bits
  static inline float value(uint16_t bits16) {
    const uint32_t bits = static_cast<uint32_t>(bits16) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof(float));
    return v;
  }
  // What unpacklo / unpackhi of 16-bit lanes put in fp32 lane p of the low / high half;
  // pack_weight (Python) applies the same order.
  static inline int64_t column(int64_t p) {
    const int64_t lane = p / 8, j = p % 8;
    return j < 4 ? lane * 4 + j : 16 + lane * 4 + (j - 4);
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  static inline void load(const uint16_t* w, __m512& w0, __m512& w1) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i raw = _mm512_loadu_si512(w);
    w0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw));
    w1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw));
  }
#endif
};

template <>
struct PackedType<float> {
  static inline float value(float v) { return v; }
  static inline int64_t column(int64_t p) { return p; }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  static inline void load(const float* w, __m512& w0, __m512& w1) {
    w0 = _mm512_loadu_ps(w);
    w1 = _mm512_loadu_ps(w + 16);
  }
#endif
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// MR rows of x against one packed block; KU independent partial sums per output vector hide the
// fused multiply-add latency when MR is small. Stores ncols (<= kCols) columns per row.
template <typename T, int MR, int KU>
inline void packed_tile(const float* __restrict x, int64_t ldx, const T* __restrict w,
                        int64_t K, float* __restrict out, int64_t ldo, int64_t ncols,
                        const float* bias) {
  constexpr int64_t line = kCols * static_cast<int64_t>(sizeof(T));  // bytes per k
  __m512 acc[KU][MR][2];
  for (int u = 0; u < KU; ++u)
    for (int r = 0; r < MR; ++r) acc[u][r][0] = acc[u][r][1] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
    for (int u = 0; u < KU; ++u) {
      // NOTE: past the block's end this prefetches the next block (or nothing useful); a
      // prefetch never faults.
      for (int64_t b = 0; b < line; b += 64) _mm_prefetch(ahead + (k + u) * line + b, _MM_HINT_T0);
      __m512 w0, w1;
      PackedType<T>::load(w + (k + u) * kCols, w0, w1);
      for (int r = 0; r < MR; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * ldx + k + u]);
        acc[u][r][0] = _mm512_fmadd_ps(w0, xb, acc[u][r][0]);
        acc[u][r][1] = _mm512_fmadd_ps(w1, xb, acc[u][r][1]);
      }
    }
  }
  for (; k < K; ++k) {
    __m512 w0, w1;
    PackedType<T>::load(w + k * kCols, w0, w1);
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[0][r][0] = _mm512_fmadd_ps(w0, xb, acc[0][r][0]);
      acc[0][r][1] = _mm512_fmadd_ps(w1, xb, acc[0][r][1]);
    }
  }
  const auto lanes = [](int64_t n) -> __mmask16 {
    return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                   : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
  };
  const __mmask16 m0 = lanes(ncols), m1 = lanes(ncols - 16);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
  }
  for (int r = 0; r < MR; ++r) {
    __m512 s0 = acc[0][r][0], s1 = acc[0][r][1];
    for (int u = 1; u < KU; ++u) {
      s0 = _mm512_add_ps(s0, acc[u][r][0]);
      s1 = _mm512_add_ps(s1, acc[u][r][1]);
    }
    _mm512_mask_storeu_ps(out + r * ldo, m0, _mm512_add_ps(s0, b0));
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, _mm512_add_ps(s1, b1));
  }
}

template <typename T, int MR>
inline void packed_rows(const float* x, int64_t K, const T* w, float* out, int64_t ldo,
                        int64_t ncols, const float* bias) {
  constexpr int KU = MR <= 2 ? 4 : (MR <= 4 ? 2 : 1);
  packed_tile<T, MR, KU>(x, K, w, K, out, ldo, ncols, bias);
}
#endif

// One block of columns for rows [0, m) of x (fp32 [m, K] contiguous) into out (row stride ldo).
template <typename T>
void packed_block(const float* x, int64_t m, int64_t K, const T* w, float* out, int64_t ldo,
                  int64_t ncols, const float* bias) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  int64_t r = 0;
  for (; r < m; r += kRowsPerTile) {
    const float* xr = x + r * K;
    float* o = out + r * ldo;
    switch (std::min(kRowsPerTile, m - r)) {
      case 1: packed_rows<T, 1>(xr, K, w, o, ldo, ncols, bias); break;
      case 2: packed_rows<T, 2>(xr, K, w, o, ldo, ncols, bias); break;
      case 3: packed_rows<T, 3>(xr, K, w, o, ldo, ncols, bias); break;
      case 4: packed_rows<T, 4>(xr, K, w, o, ldo, ncols, bias); break;
      case 5: packed_rows<T, 5>(xr, K, w, o, ldo, ncols, bias); break;
      case 6: packed_rows<T, 6>(xr, K, w, o, ldo, ncols, bias); break;
      case 7: packed_rows<T, 7>(xr, K, w, o, ldo, ncols, bias); break;
      case 8: packed_rows<T, 8>(xr, K, w, o, ldo, ncols, bias); break;
      case 9: packed_rows<T, 9>(xr, K, w, o, ldo, ncols, bias); break;
      case 10: packed_rows<T, 10>(xr, K, w, o, ldo, ncols, bias); break;
      case 11: packed_rows<T, 11>(xr, K, w, o, ldo, ncols, bias); break;
      default: packed_rows<T, 12>(xr, K, w, o, ldo, ncols, bias); break;
    }
  }
#else
  // Portable path (no AVX-512): the same arithmetic, one column at a time.
  for (int64_t r = 0; r < m; ++r)
    for (int64_t p = 0; p < kCols; ++p) {
      const int64_t c = PackedType<T>::column(p);
      if (c >= ncols) continue;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * PackedType<T>::value(w[k * kCols + p]);
      out[r * ldo + c] = acc + (bias != nullptr ? bias[c] : 0.f);
    }
#endif
}

template <typename T>
void packed_columns(const float* xp, int64_t m, int64_t K, const T* wp, int64_t blocks,
                    float* op, int64_t n, const float* bp) {
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t c0 = blk * kCols;
      packed_block<T>(xp, m, K, wp + blk * K * kCols, op + c0, n, std::min(kCols, n - c0),
                      bp != nullptr ? bp + c0 : nullptr);
    }
  });
}

// x: fp32 [..., K] (any leading shape); packed: bf16 or fp32 [ceil(n / kCols), K, kCols] from
// pack_weight with that element type (the layouts differ: a bf16 packing converted to fp32, or
// the reverse, has the same shape but permuted columns, which nothing here can detect); n: the
// weight's N (only its block count is checkable: padding columns read as zeros); bias: fp32 [n]
// or None. Returns fp32 [..., n]. Blocks of columns run on torch's threads. Each output is one
// running sum over K per row tile (from 5 rows on), so its rounding error against float64 grows
// with K as a plain sum's does: measured 3-8x MKL's.
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& packed,
                            const std::optional<torch::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_packed: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_packed: x must be fp32");
  TORCH_CHECK(x.dim() >= 1, "linear_packed: x must be [..., K], not a 0-dim tensor");
  const auto type = packed.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && packed.dim() == 3 &&
                  packed.size(2) == kCols && packed.is_contiguous(),
              "linear_packed: packed must be contiguous bf16 or fp32 [blocks, K, 32] "
              "(pack_weight)");
  const int64_t K = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(K >= 1, "linear_packed: the packed weight has K = 0 inputs");
  TORCH_CHECK(x.size(-1) == K, "linear_packed: x has ", x.size(-1), " inputs, the weight ", K);
  TORCH_CHECK(n > 0 && n <= blocks * kCols && n > (blocks - 1) * kCols,
              "linear_packed: n = ", n, " does not match ", blocks, " packed blocks");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                                    bias->numel() == n && bias->device().is_cpu()),
              "linear_packed: bias must be fp32 [n]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto xs = x.reshape({-1, K}).contiguous();
  const int64_t m = xs.size(0);
  auto out = torch::empty({m, n}, xs.options());
  if (m == 0) return out.view(shape);
  std::optional<torch::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  const float* xp = xs.data_ptr<float>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  if (type == at::kFloat)
    packed_columns<float>(xp, m, K, packed.data_ptr<float>(), blocks, op, n, bp);
  else
    packed_columns<uint16_t>(xp, m, K,
                             reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                             blocks, op, n, bp);
  return out.view(shape);
}


// Attention of many queries to one shared run of keys, no mask (forward_packed's cascade: every
// packed token attends to the prefix the segments share): q [H_kv, M, D] (a KV head's query heads
// folded into M), k and v [H_kv, S, D]; returns out [H_kv, M, D] and the log-sum-exp of the
// scaled scores [H_kv, M], as torch's CPU flash kernel does, so the caller merges it with the
// rest of each segment's keys. Flash-style: per item of kItemRows queries of one head, blocks of
// kKeyBlock keys from K transposed once per head ([D, S] padded to whole blocks; padded keys
// score -inf), tiles of kTileRows queries whose scores (kTileRows x 4 vectors) and whose P.V
// accumulators stay in registers; an online softmax rescales each query's sums per block.
// Results equal the flash kernel's within float32 rounding (sums in another order; exp by
// exp_nonpositive). NOTE: measured on an AMD EPYC host (2 threads, same run), D = 64, 1,360 keys:
// 1,920 queries per head x 3 heads 9.2 vs 13.3 ms, 2,700 x 3 13.2 vs 19.5 ms (1.44-1.48x);
// D = 128: 1.25x; 4-query tiles were 1.10-1.17x.
constexpr int64_t kKeyBlock = 64;  // keys per block (4 vectors of scores per query)
constexpr int64_t kItemRows = 60;  // queries per work item (whole tiles of 6)

template <int RT, int DC>
inline void prefix_tile(const float* __restrict q, int64_t D, const float* __restrict kt,
                        int64_t Sp, int64_t j0, int64_t nb, const float* __restrict v, int64_t vs,
                        float scale, float* __restrict acc, float* __restrict mx,
                        float* __restrict sm) {
  v16 s[RT][4] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kt + d * Sp + j0;
    const v16 k0 = load16(kd), k1 = load16(kd + 16), k2 = load16(kd + 32), k3 = load16(kd + 48);
    for (int r = 0; r < RT; ++r) {
      const float qv = q[r * D + d];
      s[r][0] += k0 * qv;
      s[r][1] += k1 * qv;
      s[r][2] += k2 * qv;
      s[r][3] += k3 * qv;
    }
  }
  alignas(64) float p[RT][kKeyBlock];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < 4; ++c) store16(p[r] + 16 * c, s[r][c] * scale);
    for (int64_t j = nb; j < kKeyBlock; ++j) p[r][j] = kNegInf;
    float top = kNegInf;
    for (int64_t j = 0; j < kKeyBlock; ++j) top = std::max(top, p[r][j]);
    const float next = std::max(mx[r], top);  // finite: the block has a key (nb >= 1)
    const float alpha = exp_nonpositive(mx[r] - next);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const float e = exp_nonpositive(p[r][j] - next);
      p[r][j] = e;
      total += e;
    }
    sm[r] = sm[r] * alpha + total;
    mx[r] = next;
    float* ar = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
  }
  v16 a[RT][DC];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < DC; ++c) a[r][c] = load16(acc + r * D + 16 * c);
  for (int64_t j = 0; j < nb; ++j) {
    const float* vj = v + (j0 + j) * vs;
    v16 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = load16(vj + 16 * c);
    for (int r = 0; r < RT; ++r) {
      const float pr = p[r][j];
      for (int c = 0; c < DC; ++c) a[r][c] += vv[c] * pr;
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < DC; ++c) store16(acc + r * D + 16 * c, a[r][c]);
}

// One work item: rows queries (q, out: [rows, D]; lse: [rows]) of one head over all S keys.
template <int DC>
void prefix_item(const float* q, int64_t rows, int64_t D, const float* kt, int64_t S, int64_t Sp,
                 const float* v, int64_t vs, float scale, float* out, float* lse) {
  constexpr int RT = DC <= 4 ? 6 : 2;  // score and P.V accumulators within 32 registers
  float mx[kItemRows], sm[kItemRows];
  std::fill(mx, mx + rows, kNegInf);
  std::fill(sm, sm + rows, 0.f);
  std::fill(out, out + rows * D, 0.f);
  for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, S - j0);
    int64_t r0 = 0;
    for (; r0 + RT <= rows; r0 += RT)
      prefix_tile<RT, DC>(q + r0 * D, D, kt, Sp, j0, nb, v, vs, scale, out + r0 * D, mx + r0,
                          sm + r0);
    for (; r0 < rows; ++r0)
      prefix_tile<1, DC>(q + r0 * D, D, kt, Sp, j0, nb, v, vs, scale, out + r0 * D, mx + r0,
                         sm + r0);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / sm[r];
    for (int64_t d = 0; d < D; ++d) out[r * D + d] *= inv;
    lse[r] = mx[r] + std::log(sm[r]);
  }
}

std::vector<torch::Tensor> prefix_attention(torch::Tensor q, const torch::Tensor& k,
                                            const torch::Tensor& v, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "prefix_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "prefix_attention: fp32 tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2),
              "prefix_attention: q [H_kv, M, D], k and v [H_kv, S, D]");
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), S = k.size(1);
  TORCH_CHECK(D % kLanes == 0 && D >= kLanes && D <= 8 * kLanes,
              "prefix_attention: head dim must be a multiple of 16 up to 128, not ", D);
  TORCH_CHECK(S >= 1, "prefix_attention: no keys");
  TORCH_CHECK(v.stride(2) == 1, "prefix_attention: v rows must be contiguous");
  q = q.contiguous();
  const int64_t Sp = (S + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  auto kt = torch::zeros({H, D, Sp}, q.options());
  kt.narrow(2, 0, S).copy_(k.transpose(1, 2));
  auto out = torch::empty({H, M, D}, q.options());
  auto lse = torch::empty({H, M}, q.options());
  const int64_t per = (M + kItemRows - 1) / kItemRows;
  const float* qp = q.data_ptr<float>();
  const float* ktp = kt.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t vh = v.stride(0), vs = v.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, H * per, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / per, m0 = (it % per) * kItemRows;
      const int64_t rows = std::min(kItemRows, M - m0);
      const float* qh = qp + (h * M + m0) * D;
      const float* kth = ktp + h * D * Sp;
      const float* vhp = vp + h * vh;
      float* oh = op + (h * M + m0) * D;
      float* lh = lp + h * M + m0;
      switch (D / kLanes) {
        case 1: prefix_item<1>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
        case 2: prefix_item<2>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
        case 3: prefix_item<3>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
        case 4: prefix_item<4>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
        case 5: prefix_item<5>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
        case 6: prefix_item<6>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
        case 7: prefix_item<7>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
        default: prefix_item<8>(qh, rows, D, kth, S, Sp, vhp, vs, sc, oh, lh); break;
      }
    }
  });
  return {out, lse};
}


// x . w^T + bias for a few rows of x over the compact forward's own input-major weights (w is the
// [N, K] view of a contiguous [K, N] tensor: wt[k * N + n]), no copy. Each of torch's threads
// takes a contiguous range of K, so it reads its share of the weight as one forward stream per
// tile of columns (one stream where N <= kRowsCols; the best case for the hardware prefetchers),
// and accumulates its partial products y[r, :] +=
// x[r, k] * wt[k, :] over kRowsK inputs at a time into its own [m, N] buffer; the buffers are
// summed at the end (m * N * threads adds, small next to K * N weight reads). Columns go in tiles
// of kRowsCols so that the tile's rows of the weight stay in L2 while every row of x reuses them.
// The sums run in another order than MKL's or oneDNN's: float32 within rounding.
// NOTE: measured on W1's 30 layers of products (AMD EPYC host, 2 threads, same run), ms for this
// kernel / oneDNN / MKL / linear_packed over a packed copy: see fp32_products' docstring.
constexpr int64_t kRowsK = 8;         // inputs per pass over a row of y (8 weight vectors live)
constexpr int64_t kRowsCols = 2048;   // columns per tile (8 x 8 KiB of weight rows per pass)

// Rows [0, RT) of x (row stride K) against inputs [kb, kb + kRowsK) and columns [c0, c1): each
// group of weight vectors is loaded once for the RT rows (RT * 2 accumulators, 8 weight vectors).
template <int RT>
inline void rows_pass(const float* __restrict x, int64_t K, const float* __restrict w, int64_t N,
                      int64_t c0, int64_t c1, float* __restrict y) {
  float xs[RT][kRowsK];
  for (int r = 0; r < RT; ++r)
    for (int64_t j = 0; j < kRowsK; ++j) xs[r][j] = x[r * K + j];
  int64_t c = c0;
  for (; c + kLanes <= c1; c += kLanes) {
    v16 wv[kRowsK];
    for (int64_t j = 0; j < kRowsK; ++j) wv[j] = load16(w + j * N + c);
    for (int r = 0; r < RT; ++r) {
      v16 a = load16(y + r * N + c) + wv[0] * xs[r][0], b = wv[1] * xs[r][1];
      for (int64_t j = 2; j < kRowsK; j += 2) {
        a += wv[j] * xs[r][j];
        b += wv[j + 1] * xs[r][j + 1];
      }
      store16(y + r * N + c, a + b);
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
      for (; r + 4 <= m; r += 4) rows_pass<4>(x + r * K + kb, K, w, N, c0, c1, y + r * N);
      switch (m - r) {
        case 3: rows_pass<3>(x + r * K + kb, K, w, N, c0, c1, y + r * N); break;
        case 2: rows_pass<2>(x + r * K + kb, K, w, N, c0, c1, y + r * N); break;
        case 1: rows_pass<1>(x + r * K + kb, K, w, N, c0, c1, y + r * N); break;
        default: break;
      }
    }
  }
}

// x: fp32 [..., K]; w: fp32 [N, K] with strides (1, N) (a transposed view of a contiguous [K, N]
// tensor, as compact_llama._fuse stores the weights); bias: fp32 [N] or None. Returns [..., N].
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& w,
                          const std::optional<torch::Tensor>& bias) {
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
  auto out = torch::zeros({m, N}, xs.options());
  if (m == 0) return out.view(shape);
  // NOTE: at least 64 inputs per thread, so a thread's stream is worth its partial buffer
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), K / 64));
  auto partial = parts > 1 ? torch::zeros({parts - 1, m, N}, xs.options()) : torch::Tensor();
  const float* xp = xs.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* pp = parts > 1 ? partial.data_ptr<float>() : nullptr;
  const int64_t per = (K + parts - 1) / parts;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t k0 = t * per, k1 = std::min(K, k0 + per);
      if (k0 < k1) rows_partial(xp, m, K, wp, N, k0, k1, t == 0 ? op : pp + (t - 1) * m * N);
    }
  });
  const int64_t total = m * N;
  for (int64_t t = 0; t + 1 < parts; ++t) {
    const float* p = pp + t * total;
#pragma omp simd
    for (int64_t i = 0; i < total; ++i) op[i] += p[i];
  }
  if (bias.has_value()) out.add_(*bias);
  return out.view(shape);
}


// x . w^T + bias on oneDNN (torch's mkldnn::_linear_pointwise, the op fp32_products.onednn_linear
// calls): float32 products like at::linear's MKL ones, faster where MKL does not run its AVX-512
// kernels (AMD). Looked up once; called boxed, so a change of the op's C++ signature in another
// torch cannot miscall it (the Python side checks that the op exists before asking for it).
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w,
                            const std::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}


// The layer loop of a compact decode step (one new token per row): the math of CompactLlama.qkv
// / BatchKV.write_step / CompactLlama.finish with the products in ATen (at::linear, MKL) and the
// small ops in plain loops (RMSNorm, RoPE written straight into the KV slots), which saves the
// Python and dispatch overhead of about 25 small ops per layer. Results equal the Python loop's
// within float32 rounding (the tests' 1e-5), not to the bit: sums are reassociated and
// multiply-adds fused. Weights are the compact forward's (input-major views). With packed copies
// of them (pack_weight: bf16 for weights="bfloat16", the fp32 weights then holding the same
// rounded values; fp32 for weights="float32-packed"), a step of at most packed_max_rows rows runs
// its products in linear_packed instead of at::linear; otherwise a step of at most rows_max rows
// (fp32_products.ProductChoice.rows; 0: none) runs them in linear_rows over the weights
// themselves, and a step of onednn_lo to onednn_hi rows (ProductChoice.onednn_rows) in
// onednn_linear.
class DecodeLayers {
 public:
  DecodeLayers(std::vector<torch::Tensor> ln1, std::vector<torch::Tensor> qkv,
               std::vector<std::optional<torch::Tensor>> qkv_bias, std::vector<torch::Tensor> o,
               std::vector<std::optional<torch::Tensor>> o_bias, std::vector<torch::Tensor> ln2,
               std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale, std::vector<torch::Tensor> packed, int64_t packed_max_rows,
               int64_t onednn_lo, int64_t onednn_hi, int64_t rows_max)
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
    const auto input_major = [](const torch::Tensor& w) {
      return w.dim() == 2 && w.stride(0) == 1 && w.stride(1) == w.size(0);
    };
    for (size_t i = 0; rows_max_ > 0 && i < L; ++i)
      TORCH_CHECK(input_major(qkv_[i]) && input_major(o_[i]) && input_major(gate_up_[i]) &&
                      input_major(down_[i]),
                  "DecodeLayers: rows_max needs input-major weights (layer ", i, ")");
    // packed: empty, or per layer the blocks of qkv, o, gate_up and down (pack_weight), of one
    // element type (bf16 or fp32)
    TORCH_CHECK(packed_.empty() || packed_.size() == 4 * L,
                "DecodeLayers: packed holds 4 weights per layer, or none");
    for (size_t i = 0; i < packed_.size(); ++i) {
      const auto& w = i % 4 == 0 ? qkv_[i / 4] : i % 4 == 1 ? o_[i / 4]
                    : i % 4 == 2 ? gate_up_[i / 4] : down_[i / 4];
      TORCH_CHECK(packed_[i].scalar_type() == packed_[0].scalar_type() &&
                      (packed_[i].scalar_type() == at::kBFloat16 ||
                       packed_[i].scalar_type() == at::kFloat) &&
                      packed_[i].is_contiguous() && packed_[i].dim() == 3 &&
                      packed_[i].size(1) == w.size(1) && packed_[i].size(2) == kCols &&
                      packed_[i].size(0) == (w.size(0) + kCols - 1) / kCols,
                  "DecodeLayers: packed weight ", i, " does not match its fp32 weight");
    }
  }

  // h: [B, 1, hidden]; cos, sin: [B, 1, 1, D] (CompactLlama.rope); buffer: [L, 2, R, H_kv, cap,
  // D]; rows, pos: [B] int64 (row i writes at pos[i]); kv_len: keys read; mask: additive
  // [B, 1, 1, kv_len] or None; src, shared: a shared prefix, as decode_attention reads it (row
  // j of the step is rows[j]; src names step rows). Returns the hidden states after the last
  // layer, [B, 1, hidden].
  torch::Tensor run(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor buffer,
                    torch::Tensor rows, torch::Tensor pos, int64_t kv_len,
                    std::optional<torch::Tensor> mask, std::optional<torch::Tensor> src,
                    std::optional<torch::Tensor> shared) const {
    using torch::indexing::Slice;
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
                    buffer.stride(5) == 1 && buffer.scalar_type() == at::kFloat,
                "DecodeLayers.run: buffer must be fp32 [L, 2, R, H_kv, capacity, D]");
    TORCH_CHECK(kv_len >= 1 && kv_len <= buffer.size(4), "DecodeLayers.run: kv_len");
    auto rows64 = rows.to(at::kLong).contiguous(), pos64 = pos.to(at::kLong).contiguous();
    const int64_t *rp = rows64.data_ptr<int64_t>(), *pp = pos64.data_ptr<int64_t>();
    for (int64_t j = 0; j < b; ++j)
      TORCH_CHECK(rp[j] >= 0 && rp[j] < buffer.size(2) && pp[j] >= 0 && pp[j] < buffer.size(4),
                  "DecodeLayers.run: row or position outside the buffer");
    std::optional<torch::Tensor> flat;
    if (mask.has_value()) flat = mask->reshape({mask->size(0), -1});
    auto cs = cos.reshape({b, d_}).contiguous(), sn = sin.reshape({b, d_}).contiguous();
    // the residual stream, updated in place; row-major, as rms_norm reads it
    auto hs = h.reshape({b, hidden}).clone(at::MemoryFormat::Contiguous);
    auto x = torch::empty({b, hidden}, hs.options());
    auto q = torch::empty({b, nh_, d_}, hs.options());
    for (size_t i = 0; i < ln1_.size(); ++i) {
      rms_norm(hs, ln1_[i], x);
      const bool use_packed = !packed_.empty() && b <= packed_max_rows_;
      const bool use_rows = !use_packed && b <= rows_max_;
      const bool use_onednn = !use_packed && !use_rows && onednn_lo_ <= b && b <= onednn_hi_;
      const auto proj = [&](const torch::Tensor& in, size_t which, const torch::Tensor& w,
                            const std::optional<torch::Tensor>& bias) {
        return use_packed   ? linear_packed(in, packed_[4 * i + which], bias, w.size(0))
               : use_rows   ? linear_rows(in, w, bias)
               : use_onednn ? onednn_linear(in, w, bias)
                            : at::linear(in, w, bias);
      };
      auto qkv = proj(x, 0, qkv_[i], qkv_bias_[i]).contiguous();  // [B, (H + 2 H_kv) D]
      rope_and_store(qkv, cs, sn, q, buffer.select(0, i), rp, pp);
      auto layer = buffer.select(0, i);
      auto keys = layer.select(0, 0).index({Slice(0, n), Slice(), Slice(0, kv_len)});
      auto values = layer.select(0, 1).index({Slice(0, n), Slice(), Slice(0, kv_len)});
      auto attn = decode_attention(q, keys, values, flat, scale_, src, shared);  // [B, H, D]
      hs.add_(proj(attn.view({b, nh_ * d_}), 1, o_[i], o_bias_[i]));
      rms_norm(hs, ln2_[i], x);
      auto parts = proj(x, 2, gate_up_[i], std::nullopt).chunk(2, -1);
      hs.add_(proj(at::silu(parts[0]).mul_(parts[1]), 3, down_[i], std::nullopt));
    }
    return hs.view({b, 1, hidden});
  }

 private:
  bool is_norm_weight(const torch::Tensor& w) const {
    return w.dim() == 1 && w.numel() == hidden_ && w.scalar_type() == at::kFloat &&
           w.is_contiguous() && w.device().is_cpu();
  }

  // y = x * rsqrt(mean(x^2) + eps) * w, row by row ([B, N] contiguous fp32).
  void rms_norm(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y) const {
    const int64_t rows = x.size(0), cols = x.size(1);
    const float* __restrict xp = x.data_ptr<float>();
    const float* __restrict wp = w.data_ptr<float>();
    float* __restrict yp = y.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = xp + r * cols;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < cols; ++c) ss += xr[c] * xr[c];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(cols) + static_cast<float>(eps_));
      float* yr = yp + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * inv * wp[c];
    }
  }

  // Rotate-half RoPE (as CompactLlama.qkv: x * cos + roll(x, D / 2) * signed_sin) of the query
  // and key heads of qkv ([B, (H + 2 H_kv) D]); queries go to q ([B, H, D]), keys and the
  // values straight into the layer's KV slots (layer: [2, R, H_kv, capacity, D]).
  void rope_and_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                      torch::Tensor& q, const torch::Tensor& layer, const int64_t* rows,
                      const int64_t* pos) const {
    const int64_t b = qkv.size(0), width = qkv.size(1), half = d_ / 2;
    const float* __restrict src = qkv.data_ptr<float>();
    const float* __restrict cp = cos.data_ptr<float>();
    const float* __restrict sp = sin.data_ptr<float>();
    float* __restrict qp = q.data_ptr<float>();
    float* base = layer.data_ptr<float>();
    const int64_t s0 = layer.stride(0), s1 = layer.stride(1), s2 = layer.stride(2);
    const int64_t s3 = layer.stride(3);
    for (int64_t j = 0; j < b; ++j) {
      const float* row = src + j * width;
      const float *c = cp + j * d_, *s = sp + j * d_;
      float* kslot = base + rows[j] * s1 + pos[j] * s3;
      float* vslot = base + s0 + rows[j] * s1 + pos[j] * s3;
      for (int64_t hd = 0; hd < nh_ + nkv_; ++hd) {
        const float* x = row + hd * d_;
        float* out = hd < nh_ ? qp + (j * nh_ + hd) * d_ : kslot + (hd - nh_) * s2;
        for (int64_t d = 0; d < d_; ++d) {
          const float rolled = x[d < half ? d + half : d - half];
          out[d] = x[d] * c[d] + rolled * s[d];
        }
      }
      const float* v = row + (nh_ + nkv_) * d_;
      for (int64_t hd = 0; hd < nkv_; ++hd)
        std::copy(v + hd * d_, v + (hd + 1) * d_, vslot + hd * s2);
    }
  }

  std::vector<torch::Tensor> ln1_, qkv_;
  std::vector<std::optional<torch::Tensor>> qkv_bias_;
  std::vector<torch::Tensor> o_;
  std::vector<std::optional<torch::Tensor>> o_bias_;
  std::vector<torch::Tensor> ln2_, gate_up_, down_, packed_;
  int64_t nh_, nkv_, d_, packed_max_rows_, onednn_lo_, onednn_hi_, rows_max_, hidden_ = 0;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  module.attr("packed_vectorized") = true;
#else
  module.attr("packed_vectorized") = false;  // linear_packed's portable path: scalar, ~12x slower
#endif
  module.def("decode_attention", &decode_attention,
             "one-query attention over grouped KV heads, fp32 (see the source's header)",
             pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"),
             pybind11::arg("scale"), pybind11::arg("src") = pybind11::none(),
             pybind11::arg("shared") = pybind11::none(),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("linear_packed", &linear_packed,
             "x . W^T + bias with W packed as bf16 or fp32 (pack_weight), fp32 in and out (see "
             "the source)",
             pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("n"),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("linear_rows", &linear_rows,
             "x . w^T + bias for few rows over an input-major fp32 weight, no copy (see the "
             "source)",
             pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("prefix_attention", &prefix_attention,
             "attention of q [H_kv, M, D] to k, v [H_kv, S, D], no mask: (out, log-sum-exp), fp32 "
             "(see the source)",
             pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("scale"),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<DecodeLayers>(module, "DecodeLayers")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t,
                          int64_t, int64_t, double, double, std::vector<torch::Tensor>,
                          int64_t, int64_t, int64_t, int64_t>())
      .def("run", &DecodeLayers::run, "the layer loop of one decode step (see the source)",
           pybind11::arg("h"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("buffer"), pybind11::arg("rows"), pybind11::arg("pos"),
           pybind11::arg("kv_len"), pybind11::arg("mask"),
           pybind11::arg("src") = pybind11::none(), pybind11::arg("shared") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
