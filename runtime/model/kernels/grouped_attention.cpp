// Decode attention's grouped rows (decode_attention in attention.cpp, which plans the work): rows
// that read one chunk of keys from the same row (a shared prefix), computed together: their
// m * G queries become the lanes of vectors, so scores are Q.K^T and the weighted sum P.V as
// register-tiled products over the chunk (every key and value loaded once per tile of keys x
// kGroupLanes queries, not once per query), where run_block pays a horizontal sum per query and
// key. The numbers equal run_block's within float32 rounding (each score is a sum over the head
// dim in another order), not to the bit.
//
// fp16 K/V run the same code, templated on the element type E: values widened as loaded
// (half.h's vload_kv), a tile of keys widened into a row of fp32 scratch first, so the results
// equal, bit for bit, those over fp32 K/V holding the same values. Register tiles are counted in
// native vectors (kW floats) and sized by kRegs (vec.h).
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "grouped_attention.h"
#include "half.h"
#include "vec.h"

AGENTCACHE_BEGIN

namespace {

constexpr int64_t kGroupVecs = 4;
constexpr int64_t kGroupLanes = kGroupVecs * kW;  // queries per pass over the block
constexpr int kScoreKeys = kRegs >= 32 ? 4 : 2;   // keys per score tile (KT)
constexpr int kGroupPvVecs = kRegs >= 32 ? 4 : 2;  // head-dim vectors per P.V pass
constexpr int kGroupPvQueries = 4;

// scores[t][lane] = scale * q_lane . k_t for the KT keys from k (scores: the first key's row),
// NV vectors of queries (KT * NV accumulators held in registers across the head dim).
// fp16 keys: the KT rows widened into `rows` ([KT, D]) first.
template <int NV, int KT, class E>
void score_tile(const float* qt, const E* k, int64_t ks, int64_t D, float scale, float* scores,
                float* rows) {
  const float* kt;  // the tile's first key, rows kts floats apart
  int64_t kts;
  if constexpr (std::is_same_v<E, float>) {
    kt = k, kts = ks;
  } else {
    for (int kk = 0; kk < KT; ++kk) widen_halves(k + kk * ks, D, rows + kk * D);
    kt = rows, kts = D;
  }
  vf acc[KT][NV];
  for (int kk = 0; kk < KT; ++kk)
    for (int v = 0; v < NV; ++v) acc[kk][v] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vf qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = vload(qt + d * kGroupLanes + v * kW);
    for (int kk = 0; kk < KT; ++kk) {
      const float kv = kt[kk * kts + d];
      for (int v = 0; v < NV; ++v) acc[kk][v] += qv[v] * kv;
    }
  }
  for (int kk = 0; kk < KT; ++kk)
    for (int v = 0; v < NV; ++v) vstore(scores + kk * kGroupLanes + v * kW, acc[kk][v] * scale);
}

// scores[t][lane] for the n keys of a chunk (n <= kBlock): tiles of kScoreKeys keys, then the
// keys left over one at a time (NOTE: never a key past n; each score's arithmetic is the same
// in either tile, so the split does not change a bit).
template <int NV, class E>
void group_scores(const float* qt, const E* k, int64_t ks, int64_t D, int64_t n, float scale,
                  float* scores, float* rows) {
  int64_t t = 0;
  for (; t + kScoreKeys <= n; t += kScoreKeys)
    score_tile<NV, kScoreKeys>(qt, k + t * ks, ks, D, scale, scores + t * kGroupLanes, rows);
  for (; t < n; ++t) score_tile<NV, 1>(qt, k + t * ks, ks, D, scale, scores + t * kGroupLanes, rows);
}

// acc of queries [q0, q0 + QT) over DV vectors of the head dim from d0: sum_t w[t][q] v_t.
template <int QT, int DV, class E>
void group_pv(const float* w, const E* vb, int64_t vs, int64_t n, int64_t q0, int64_t d0,
              const GroupQuery* queries) {
  vf acc[QT][DV];
  for (int qi = 0; qi < QT; ++qi)
    for (int j = 0; j < DV; ++j) acc[qi][j] = vzero();
  for (int64_t t = 0; t < n; ++t) {
    const E* vt = vb + t * vs + d0;
    if (t + kAhead < n) prefetch_row(vt + kAhead * vs, DV * kW);
    vf vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = vload_kv(vt + j * kW);
    for (int qi = 0; qi < QT; ++qi) {
      const float p = w[t * kGroupLanes + q0 + qi];
      for (int j = 0; j < DV; ++j) acc[qi][j] += vv[j] * p;
    }
  }
  for (int qi = 0; qi < QT; ++qi)
    for (int j = 0; j < DV; ++j) vstore(queries[q0 + qi].block_acc + d0 + j * kW, acc[qi][j]);
}

template <int QT, class E>
void group_pv_dims(const float* w, const E* vb, int64_t vs, int64_t n, int64_t q0, int64_t D,
                   const GroupQuery* queries) {
  for (int64_t d0 = 0; d0 < D; d0 += kGroupPvVecs * kW) {
    switch (std::min<int64_t>(kGroupPvVecs, (D - d0) / kW)) {
      case 4: if constexpr (kGroupPvVecs >= 4) group_pv<QT, 4>(w, vb, vs, n, q0, d0, queries); break;
      case 3: if constexpr (kGroupPvVecs >= 3) group_pv<QT, 3>(w, vb, vs, n, q0, d0, queries); break;
      case 2: group_pv<QT, 2>(w, vb, vs, n, q0, d0, queries); break;
      default: group_pv<QT, 1>(w, vb, vs, n, q0, d0, queries); break;
    }
  }
}

}  // namespace

// A chunk's n <= kBlock keys k / values v (rows ks / vs elements apart, D % kW == 0) for nq
// queries, no key masked; writes each query's block max, sum and accumulator as run_block does.
template <class E>
void run_group(const E* k, const E* v, int64_t ks, int64_t vs, int64_t n, int64_t D,
               float scale, const GroupQuery* queries, int64_t nq, GroupScratch& scratch) {
  scratch.qt.resize(D * kGroupLanes);
  scratch.scores.resize(kBlock * kGroupLanes);
  scratch.rows.resize(kScoreKeys * D);
  float* rows = scratch.rows.data();
  float* qt = scratch.qt.data();
  float* sc = scratch.scores.data();
  for (int64_t c0 = 0; c0 < nq; c0 += kGroupLanes) {
    const int64_t m = std::min(kGroupLanes, nq - c0), nv = (m + kW - 1) / kW;
    const GroupQuery* qs = queries + c0;
    std::fill(qt, qt + D * kGroupLanes, 0.f);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t d = 0; d < D; ++d) qt[d * kGroupLanes + i] = qs[i].q[d];
    switch (nv) {
      case 4: group_scores<4>(qt, k, ks, D, n, scale, sc, rows); break;
      case 3: group_scores<3>(qt, k, ks, D, n, scale, sc, rows); break;
      case 2: group_scores<2>(qt, k, ks, D, n, scale, sc, rows); break;
      default: group_scores<1>(qt, k, ks, D, n, scale, sc, rows); break;
    }
    // softmax over the block, lane by lane (every key is unmasked: the max is finite)
    float mx[kGroupLanes], sum[kGroupLanes];
    std::fill(mx, mx + kGroupLanes, kNegInf);
    std::fill(sum, sum + kGroupLanes, 0.f);
    const int64_t lanes = nv * kW;  // NOTE: lanes past nv * kW hold no score
    for (int64_t t = 0; t < n; ++t) {
      const float* st = sc + t * kGroupLanes;
AGENTCACHE_SIMD
      for (int64_t i = 0; i < lanes; ++i) mx[i] = std::max(mx[i], st[i]);
    }
    for (int64_t t = 0; t < n; ++t) {
      float* st = sc + t * kGroupLanes;
AGENTCACHE_SIMD
      for (int64_t i = 0; i < lanes; ++i) {
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
    for (; q0 + kGroupPvQueries <= m; q0 += kGroupPvQueries)
      group_pv_dims<kGroupPvQueries>(sc, v, vs, n, q0, D, qs);
    for (; q0 < m; ++q0) group_pv_dims<1>(sc, v, vs, n, q0, D, qs);
  }
}

template void run_group<float>(const float* k, const float* v, int64_t ks, int64_t vs, int64_t n,
                               int64_t D, float scale, const GroupQuery* queries, int64_t nq,
                               GroupScratch& scratch);
template void run_group<uint16_t>(const uint16_t* k, const uint16_t* v, int64_t ks, int64_t vs,
                                  int64_t n, int64_t D, float scale, const GroupQuery* queries,
                                  int64_t nq, GroupScratch& scratch);

AGENTCACHE_END
