// Attention kernels of agentcache's compact forward, fp32, one source for every ISA (vec.h).
// fp16 K/V (the 16-bit KV cache, IEEE bits as uint16_t) run the same code, templated on the
// element type E: a vector of values is widened as it is loaded (half.h's vload_kv), a key row
// that is read element by element is widened once into a row of fp32 scratch first. The values
// and the order of every operation are the fp32 path's, so the results equal, bit for bit, those
// over fp32 K/V holding the same values; the fp32 instantiation is the code as it was.
//
// decode_attention: one query per row over grouped KV heads (a decode step), flash-decoding
// layout. Every (row, KV head, block of kBlock keys) is one work item on the configured threads;
// each item computes the scores of the H / H_kv queries that share the KV head (4 keys at a
// time: an accumulator vector per query and key, one transposed reduction per 4), a block-local
// softmax (max, sum) and the weighted sum of V; a serial merge rescales the blocks by
// exp(block max - global max). K and V are read once per KV head and never expanded. A block
// whose additive mask is -inf everywhere is skipped (rows of a batched step shorter than the
// longest row read nothing past their end). With a shared prefix (src, shared), a row's keys are
// cut at its split point p (Chunks: blocks over [0, p), then fresh blocks over [p, T), so a
// prefix of any length ends in a chunk of its own); rows that read one chunk of keys from the
// same source row are one work item: their queries together against the chunk, as two small
// register-tiled matrix products (run_group: grouped_attention.cpp, declared with the block
// constants both files use in grouped_attention.h). Rows that share nothing keep the plain blocks.
//
// prefix_attention and segment_attention (many queries per KV head): prefill_attention.cpp.
//
// Register tiles are counted in native vectors (kW floats) and sized by kRegs, so each ISA gets
// tiles that fit its register file; the arithmetic (and so the results, within float32 rounding)
// is the same on every path.
#include <algorithm>
#include <atomic>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cores.h"
#include "grouped_attention.h"
#include "half.h"
#include "vec.h"

AGENTCACHE_BEGIN

const char* isa_name() { return AGENTCACHE_ISA_NAME; }

namespace {

// Rows of V prefetched ahead in pv_tile. NOTE: measured over 2,000 keys (one row, 9 queries over 3
// KV heads, D = 64, 30 layers of distinct buffers, main's build and this one loaded in one process
// and alternated, 40 passes each, AMD EPYC, 2 threads): with AVX2's narrower tiles a pass reads
// part of each V row, and 64 rows ahead was 1.08x faster than 8 by medians (32: 1.08x as well);
// AVX-512 reads a row in one pass, where farther than 8 measured 0.96-1.00x.
constexpr int64_t kPvAhead = kW >= 16 ? kAhead : 64;

// Key row p (D elements) as fp32: fp32 rows in place, fp16 rows widened into `row`.
template <class E>
inline const float* row_f32(const E* p, int64_t D, float* row) {
  if constexpr (std::is_same_v<E, float>) {
    return p;
  } else {
    widen_halves(p, D, row);
    return row;
  }
}

template <class E>
struct Item {
  const float* q;     // [G, D] queries of this KV head
  const E* k;         // first key of the block; rows `ks` elements apart
  const E* v;
  const float* mask;  // [n] additive, or nullptr
  int64_t ks, vs, n, G, D;
  float scale;
  float* block_max;   // [G]
  float* block_sum;   // [G]
  float* block_acc;   // [G, D] unnormalized sum of p * V
  float* row;         // [4, D] scratch: key rows widened (fp16 K)
};

// P.V of one item: queries per pass and head-dim vectors per pass, accumulators in registers.
constexpr int kPvVecs = 4;
// NOTE: 3 on 16 registers (12 accumulators, 4 of V, the weight a broadcast from memory): G = 3
// (SmolLM2) in one pass per kPvVecs * kW dims of V, where tiles of 2 + 1 read each twice; AVX2,
// 2,000 keys as above: 1.04x. (NEON also gets kPvAhead's 64, by analogy: not measured.)
constexpr int kPvQueries = kRegs >= 32 ? 4 : 3;

// Queries [g0, g0 + GT) over head dims [d0, d0 + kPvVecs * kW).
template <int GT, class E>
void pv_tile(const Item<E>& it, const float* __restrict scores, int64_t g0, int64_t d0) {
  vf acc[GT][kPvVecs];
  for (int gi = 0; gi < GT; ++gi)
    for (int c = 0; c < kPvVecs; ++c) acc[gi][c] = vzero();
  for (int64_t t = 0; t < it.n; ++t) {
    const E* __restrict vt = it.v + t * it.vs + d0;
    if (t + kPvAhead < it.n) prefetch_row(vt + kPvAhead * it.vs, kPvVecs * kW);
    vf vv[kPvVecs];
    for (int c = 0; c < kPvVecs; ++c) vv[c] = vload_kv(vt + c * kW);
    for (int gi = 0; gi < GT; ++gi) {
      const float p = scores[(g0 + gi) * kBlock + t];
      for (int c = 0; c < kPvVecs; ++c) acc[gi][c] += vv[c] * p;
    }
  }
  for (int gi = 0; gi < GT; ++gi)
    for (int c = 0; c < kPvVecs; ++c) vstore(it.block_acc + (g0 + gi) * it.D + d0 + c * kW, acc[gi][c]);
}

// P.V for a head dim that is not a whole number of tiles: plain loops the compiler vectorizes.
template <class E>
void pv_loops(const Item<E>& it, const float* __restrict scores) {
  const int64_t D = it.D;
  std::fill(it.block_acc, it.block_acc + it.G * D, 0.f);
  for (int64_t t = 0; t < it.n; ++t) {
    const float* __restrict vt = row_f32(it.v + t * it.vs, D, it.row);
    for (int64_t g = 0; g < it.G; ++g) {
      const float p = scores[g * kBlock + t];
      float* __restrict ag = it.block_acc + g * D;
AGENTCACHE_SIMD
      for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
    }
  }
}

// Scores of GT queries (q: [GT, DC] contiguous) against the KT keys from kt (fp32 rows kts floats
// apart): scores[g * kBlock + kk] = scale * q_g . k_kk + mask[kk] (mask: nullptr for 0). One
// accumulator vector per (query, key) over the head dim, then for KT = 4 one transposed
// reduction of a query's 4 (hsum4), where a dot product per (query, key) paid a whole
// horizontal sum. NOTE: opaque to the optimizer and independent of the K/V element type, so
// fp16 K/V (widened into fp32 rows first) run the very instructions fp32 K/V run: inlined into
// each instantiation, -fassociative-math let the compiler order the sums differently (AVX2:
// fp16 results off the fp32 ones in the last bit).
#if defined(__clang__)
#define AGENTCACHE_OPAQUE __attribute__((noinline))
#else
#define AGENTCACHE_OPAQUE __attribute__((noipa))  // NOTE: no inlining, no constant-argument clone
#endif
template <int64_t DC, int GT, int KT>
AGENTCACHE_OPAQUE void key_tile(const float* __restrict q, const float* kt, int64_t kts,
                                const float* mask, float scale, float* __restrict scores) {
  vf acc[GT][KT];
  for (int gi = 0; gi < GT; ++gi)
    for (int kk = 0; kk < KT; ++kk) acc[gi][kk] = vzero();
  for (int64_t d = 0; d < DC; d += kW) {
    vf kv[KT];
    for (int kk = 0; kk < KT; ++kk) kv[kk] = vload(kt + kk * kts + d);
    for (int gi = 0; gi < GT; ++gi) {
      const vf qv = vload(q + gi * DC + d);
      for (int kk = 0; kk < KT; ++kk) acc[gi][kk] += qv * kv[kk];
    }
  }
  for (int gi = 0; gi < GT; ++gi) {
    float sums[KT];
    if constexpr (KT == 4) hsum4(acc[gi], sums);
    else for (int kk = 0; kk < KT; ++kk) sums[kk] = hsum(acc[gi][kk]);
    for (int kk = 0; kk < KT; ++kk)
      scores[gi * kBlock + kk] = sums[kk] * scale + (mask != nullptr ? mask[kk] : 0.f);
  }
}

// Queries per score tile: GT x 4 accumulators plus 4 key vectors within the register file (on 16
// registers 3 x 4 + 4, the query an operand from memory: AVX2, 2,000 keys as kPvAhead's, 1.02x
// over 2 queries a tile, the three queries of a KV head in one pass).
constexpr int kScoreQueries = kRegs >= 32 ? 4 : 3;

// Every query's scores against the KT keys from t. fp16 keys are widened into it.row ([KT, DC])
// first, so both element types run the same fp32 code (key_tile).
template <int64_t DC, int KT, class E>
inline void key_scores(const Item<E>& it, int64_t t, float* __restrict scores) {
  const float* kt;
  int64_t kts;
  if constexpr (std::is_same_v<E, float>) {
    kt = it.k + t * it.ks, kts = it.ks;
  } else {
    for (int kk = 0; kk < KT; ++kk) widen_halves(it.k + (t + kk) * it.ks, DC, it.row + kk * DC);
    kt = it.row, kts = DC;
  }
  const float* mask = it.mask != nullptr ? it.mask + t : nullptr;
  for (int64_t g0 = 0; g0 < it.G; g0 += kScoreQueries) {
    const float* q = it.q + g0 * DC;
    float* out = scores + g0 * kBlock + t;
    switch (std::min<int64_t>(kScoreQueries, it.G - g0)) {  // NOTE: exactly the queries left
      case 4: if constexpr (kScoreQueries >= 4) key_tile<DC, 4, KT>(q, kt, kts, mask, it.scale, out); break;
      case 3: if constexpr (kScoreQueries >= 3) key_tile<DC, 3, KT>(q, kt, kts, mask, it.scale, out); break;
      case 2: key_tile<DC, 2, KT>(q, kt, kts, mask, it.scale, out); break;
      default: key_tile<DC, 1, KT>(q, kt, kts, mask, it.scale, out); break;
    }
  }
}

// The scores of every query of an item over its n keys: tiles of 4 keys (the last keys one at a
// time), K prefetched kScoreAhead rows ahead (a tile of 4 keys goes faster than kAhead's rows).
constexpr int64_t kScoreAhead = 16;
template <int64_t DC, class E>
void block_scores(const Item<E>& it, float* __restrict scores) {
  int64_t t = 0;
  for (; t + 4 <= it.n; t += 4) {
    for (int64_t kk = 0; kk < 4 && t + kScoreAhead + kk < it.n; ++kk)
      prefetch_row(it.k + (t + kScoreAhead + kk) * it.ks, DC);
    key_scores<DC, 4>(it, t, scores);
  }
  for (; t < it.n; ++t) key_scores<DC, 1>(it, t, scores);
}

// DC: the head dim known at compile time (0: read it from `it.D`), so the score loop unrolls.
template <int64_t DC, class E>
void run_block(const Item<E>& it, float* __restrict scores) {
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
  if constexpr (DC > 0 && DC % kW == 0) {
    block_scores<DC>(it, scores);
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const E* kr = it.k + t * it.ks;
      if (t + kAhead < n) prefetch_row(kr + kAhead * it.ks, D);
      const float* __restrict kt = row_f32(kr, D, it.row);
      const float add = it.mask != nullptr ? it.mask[t] : 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = it.q + g * D;
        float dot = 0.f;
AGENTCACHE_SIMD_SUM(dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
        scores[g * kBlock + t] = dot * it.scale + add;
      }
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
AGENTCACHE_SIMD_SUM(sum)
      for (int64_t t = 0; t < n; ++t) {
        const float e = exp_nonpositive(sg[t] - mx);
        sg[t] = e;
        sum += e;
      }
    }
    it.block_max[g] = mx;
    it.block_sum[g] = sum;
  }
  if constexpr (DC > 0 && DC % (kPvVecs * kW) == 0) {
    for (int64_t g0 = 0; g0 < G; g0 += kPvQueries)
      for (int64_t d0 = 0; d0 < DC; d0 += kPvVecs * kW) {
        switch (std::min<int64_t>(kPvQueries, G - g0)) {  // NOTE: exactly the queries left
          case 4: if constexpr (kPvQueries >= 4) pv_tile<4>(it, scores, g0, d0); break;
          case 3: if constexpr (kPvQueries >= 3) pv_tile<3>(it, scores, g0, d0); break;
          case 2: if constexpr (kPvQueries >= 2) pv_tile<2>(it, scores, g0, d0); break;
          default: pv_tile<1>(it, scores, g0, d0); break;
        }
      }
  } else {
    pv_loops(it, scores);
  }
}

// A row's keys in chunks (its partials' slots): [0, p) in chunks of kBlock from 0, then [p, T)
// in chunks of kBlock from p, so there are at most S + 1 (S = ceil(T / kBlock)).
//   keys  0 ........ kBlock ...... p | p ....... p + kBlock ...... T
//   slot  0           1 (partial)    | 2         3 (partial)
// p = 0 (a row that shares nothing): the blocks [s * kBlock, (s + 1) * kBlock), the one chunking
// (and arithmetic) of a step without src. p > 0: the shared prefix's last chunk may be partial,
// and the row's own keys start a fresh chunk at p, so rows sharing p keys of one source row read
// the same chunks of it, whatever p is.
struct Chunks {
  int64_t p, head, count;  // head: chunks in [0, p)
  Chunks(int64_t p_, int64_t T)
      : p(p_), head((p_ + kBlock - 1) / kBlock), count(head + (T - p_ + kBlock - 1) / kBlock) {}
  int64_t t0(int64_t j) const { return j < head ? j * kBlock : p + (j - head) * kBlock; }
  int64_t n(int64_t j, int64_t T) const {
    return std::min(kBlock, (j < head ? p : T) - t0(j));
  }
};

// The split point p of every row: 0 without src; a row that reads shared[b] > 0 keys from
// another row splits there; any other row (a source row: it shares nothing itself) splits where most of its
// readers do (ties: the longest), so its partial chunk of the prefix joins theirs. Rows whose
// shared length is another still group over the whole chunks they have in common.
std::vector<int64_t> split_points(const DecodeAttentionArgs& a, bool groups) {
  const int64_t B = a.B;
  std::vector<int64_t> p(B, 0);
  if (a.src == nullptr) return p;
  for (int64_t b = 0; b < B; ++b) p[b] = a.src[b] != b ? a.shared[b] : 0;  // readers
  if (!groups) return p;
  for (int64_t r = 0; r < B; ++r) {
    if (p[r] != 0) continue;
    int64_t best = 0, best_count = 0;
    for (int64_t b = 0; b < B; ++b) {
      if (a.src[b] != r || p[b] == 0) continue;
      int64_t count = 0;
      for (int64_t c = 0; c < B; ++c) count += a.src[c] == r && p[c] == p[b];
      if (count > best_count || (count == best_count && p[b] > best)) best = p[b], best_count = count;
    }
    p[r] = best;
  }
  return p;
}

// A unit of work: chunk `slot` (keys [t0, t0 + n)) of row b and KV head h read from row kv_row
// (count == 0), or the group of rows members[first, first + count) reading those keys of kv_row.
struct Work {
  int64_t b, h, slot, kv_row, t0, n, first, count;
};
struct Member {
  int64_t b, slot;
};

// The work items of a step, groups first (the heaviest). A chunk of row b inside [0, p) is read
// from src[b]; rows reading the same keys [t0, t0 + n) of one row, with no key of them masked,
// form a group (with D % kW == 0; the rest, and every row's own keys, run alone).
std::vector<Work> plan_work(const DecodeAttentionArgs& a, const std::vector<int64_t>& p,
                            bool groups, std::vector<Member>& members) {
  const int64_t B = a.B, T = a.T, Hkv = a.Hkv;
  struct Key {
    int64_t kv_row, t0, n, b, slot;
    bool clear;
  };
  std::vector<Key> keys;
  for (int64_t b = 0; b < B; ++b) {
    const Chunks c(p[b], T);
    for (int64_t j = 0; j < c.count; ++j) {
      const int64_t t0 = c.t0(j), n = c.n(j, T);
      const bool reads = a.src[b] != b && a.shared[b] > 0;  // else p[b] is a source row's
      const int64_t kv_row = j < c.head && reads ? a.src[b] : b;
      bool clear = groups;
      for (int64_t t = 0; a.mask != nullptr && clear && t < n; ++t)
        clear = a.mask[b * T + t0 + t] == 0.f;
      keys.push_back({kv_row, t0, n, b, j, clear});
    }
  }
  // NOTE: a stable sort keeps rows in order within a group (each lane's arithmetic is its own)
  std::stable_sort(keys.begin(), keys.end(), [](const Key& x, const Key& y) {
    return std::make_tuple(!x.clear, x.kv_row, x.t0, x.n) < std::make_tuple(!y.clear, y.kv_row, y.t0, y.n);
  });
  std::vector<Work> work, singles;
  for (size_t i = 0; i < keys.size();) {
    size_t e = i + 1;
    while (e < keys.size() && keys[i].clear && keys[e].clear && keys[e].kv_row == keys[i].kv_row &&
           keys[e].t0 == keys[i].t0 && keys[e].n == keys[i].n)
      ++e;
    const Key& k = keys[i];
    if (e - i >= 2) {
      const int64_t first = static_cast<int64_t>(members.size());
      for (size_t m = i; m < e; ++m) members.push_back({keys[m].b, keys[m].slot});
      for (int64_t h = 0; h < Hkv; ++h)
        work.push_back({-1, h, -1, k.kv_row, k.t0, k.n, first, static_cast<int64_t>(e - i)});
    } else {
      for (int64_t h = 0; h < Hkv; ++h) singles.push_back({k.b, h, k.slot, k.kv_row, k.t0, k.n, 0, 0});
    }
    i = e;
  }
  work.insert(work.end(), singles.begin(), singles.end());
  return work;
}

// The work items of a step without src: every (row, KV head, block), each alone.
std::vector<Work> plain_work(const DecodeAttentionArgs& a) {
  std::vector<Work> work;
  const Chunks c(0, a.T);
  work.reserve(a.B * a.Hkv * c.count);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hkv; ++h)
      for (int64_t j = 0; j < c.count; ++j) work.push_back({b, h, j, b, c.t0(j), c.n(j, a.T), 0, 0});
  return work;
}

// Every work item's chunk partials (pm: max, pl: sum, pa: accumulator; `slots` per (row, KV
// head)) over K/V of element type E (k, v: the first element of a.k / a.k_half's layout).
template <class E>
void run_work(const DecodeAttentionArgs& a, const E* k, const E* v, const std::vector<Work>& work,
              const std::vector<Member>& members, int64_t slots, float* pm, float* pl, float* pa) {
  const int64_t H = a.H, D = a.D, Hkv = a.Hkv, T = a.T, G = H / Hkv;
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(work.size());
  // NOTE: items are handed out one at a time (their costs differ up to B-fold)
  parallel_for(std::min<int64_t>(total, thread_count()), [&](int64_t, int64_t) {
    std::vector<float> scores(G * kBlock), row(4 * D);  // NOTE: block_scores widens 4 keys
    GroupScratch scratch;
    std::vector<GroupQuery> queries;
    for (int64_t j = next++; j < total; j = next++) {
      const Work& w = work[j];
      const E* kb = k + w.kv_row * a.ks0 + w.h * a.ks1 + w.t0 * a.ks2;
      const E* vb = v + w.kv_row * a.vs0 + w.h * a.vs1 + w.t0 * a.vs2;
      if (w.count > 0) {
        queries.clear();
        for (int64_t i = 0; i < w.count; ++i) {
          const Member& m = members[w.first + i];
          const int64_t idx = (m.b * Hkv + w.h) * slots + m.slot;
          for (int64_t g = 0; g < G; ++g)
            queries.push_back({a.q + (m.b * H + w.h * G + g) * D, pm + idx * G + g,
                               pl + idx * G + g, pa + (idx * G + g) * D});
        }
        run_group(kb, vb, a.ks2, a.vs2, w.n, D, a.scale, queries.data(),
                  static_cast<int64_t>(queries.size()), scratch);
        continue;
      }
      const int64_t b = w.b, idx = (b * Hkv + w.h) * slots + w.slot;
      const Item<E> it{a.q + (b * H + w.h * G) * D, kb, vb, a.mask ? a.mask + b * T + w.t0 : nullptr,
                       a.ks2, a.vs2, w.n, G, D, a.scale,
                       pm + idx * G, pl + idx * G, pa + idx * G * D, row.data()};
      if (D == 64) run_block<64>(it, scores.data());
      else if (D == 128) run_block<128>(it, scores.data());
      else run_block<0>(it, scores.data());
    }
  });
}

}  // namespace

void decode_attention(const DecodeAttentionArgs& a) {
  const int64_t B = a.B, H = a.H, D = a.D, Hkv = a.Hkv, T = a.T;
  const int64_t G = H / Hkv, S = (T + kBlock - 1) / kBlock;
  std::fill(a.out, a.out + B * H * D, 0.f);
  if (S == 0 || B == 0) return;
  const bool groups = a.src != nullptr && D % kW == 0;
  const int64_t slots = a.src != nullptr ? S + 1 : S;  // chunks per (row, KV head), at most
  const std::vector<int64_t> p = split_points(a, groups);
  std::vector<float> part_max(B * Hkv * slots * G), part_sum(B * Hkv * slots * G);
  std::vector<float> part_acc(B * Hkv * slots * G * D);
  float *pm = part_max.data(), *pl = part_sum.data(), *pa = part_acc.data();
  std::vector<Member> members;
  const std::vector<Work> work = a.src != nullptr ? plan_work(a, p, groups, members) : plain_work(a);
  if (a.k_half != nullptr) run_work(a, a.k_half, a.v_half, work, members, slots, pm, pl, pa);
  else run_work(a, a.k, a.v, work, members, slots, pm, pl, pa);
  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t used = Chunks(p[bh / Hkv], T).count;  // NOTE: p = 0: the S blocks, as ever
    for (int64_t g = 0; g < G; ++g) {
      float mx = kNegInf;
      for (int64_t s = 0; s < used; ++s) mx = std::max(mx, pm[(bh * slots + s) * G + g]);
      if (mx == kNegInf) continue;  // every key masked: zeros
      float* o = a.out + (bh * G + g) * D;
      float denom = 0.f;
      for (int64_t s = 0; s < used; ++s) {
        const int64_t at = (bh * slots + s) * G + g;
        const float w = std::exp(pm[at] - mx);
        denom += w * pl[at];
        const float* acc = pa + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= denom;
    }
  }
}

AGENTCACHE_END
