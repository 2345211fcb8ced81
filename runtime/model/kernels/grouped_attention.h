// What decode attention's two translation units share: the block of keys a work item reads and
// the prefetch distance (attention.cpp's plain blocks, grouped_attention.cpp's groups), and the
// grouped-row path as attention.cpp's run_work calls it. Internal to the kernels (cores.h is their
// interface); it knows nothing of rows, masks, split points or work items: those stay in
// attention.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "vec.h"

AGENTCACHE_BEGIN

constexpr int64_t kBlock = 256;  // keys per work item (64 KiB of K at D = 64)
constexpr int64_t kAhead = 8;    // rows of K / V prefetched ahead of the one in use

// Prefetch the row of n elements at p (one hint per 64-byte line).
template <class E>
inline void prefetch_row(const E* p, int64_t n) {
  for (int64_t d = 0; d < n; d += 64 / sizeof(E)) __builtin_prefetch(p + d);
}

// One query of a group (grouped_attention.cpp's run_group) and where its chunk partials go.
struct GroupQuery {
  const float* q;  // [D]
  float* block_max;
  float* block_sum;
  float* block_acc;  // [D]
};

// run_group's buffers, kept across a thread's work items (kGroupLanes, kScoreKeys:
// grouped_attention.cpp).
struct GroupScratch {
  std::vector<float> qt;      // [D][kGroupLanes] the queries, transposed
  std::vector<float> scores;  // [kBlock][kGroupLanes], then the weights exp(s - max)
  std::vector<float> rows;    // [kScoreKeys][D] a tile of fp16 keys widened
};

// A chunk's n <= kBlock keys k / values v (rows ks / vs elements apart, D % kW == 0) for nq
// queries, no key masked; writes each query's block max, sum and accumulator as run_block does.
// NOTE: defined in grouped_attention.cpp and instantiated there for E = float and uint16_t
// (fp16 bits), the two element types decode_attention reads.
template <class E>
void run_group(const E* k, const E* v, int64_t ks, int64_t vs, int64_t n, int64_t D,
               float scale, const GroupQuery* queries, int64_t nq, GroupScratch& scratch);

AGENTCACHE_END
