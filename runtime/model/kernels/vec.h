// The portable vector layer of agentcache's native kernels: one source for every instruction set.
//
// The build (runtime/model/kernels/_build.py) defines exactly one AGENTCACHE_ISA_* macro and passes the
// matching compiler flags; this header turns it into the native vector width (kW floats), the
// number of vector registers (kRegs) that the kernels size their register tiles by, and `vf`, a
// GCC/Clang vector-extension type of that width (plain `float` for the scalar path), so that one
// source compiles to AVX-512, AVX2+FMA, ARM NEON or scalar code:
//
//   ISA      flags (x86-64 / aarch64)                      kW   kRegs
//   avx512   -mavx512f -mavx512bw -mavx512vl -mavx512dq     16   32
//            -mavx2 -mfma -mf16c
//   avx2     -mavx2 -mfma -mf16c                            8    16
//   neon     -march=armv8-a (Advanced SIMD is baseline)     4    32
//   scalar   no vector extension; auto-vectorization off    1    16
//
// A kernel's tile is a count of `vf` accumulators chosen so that accumulators plus the operands
// in flight fit kRegs (a tile that spills runs from the stack: correct, slower). Nothing here
// knows about torch: the cores (attention.cpp, products.cpp) build and run without it, which is
// how tests/runtime/kernel_selftest.cpp runs the NEON path under qemu on an x86 machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#if defined(AGENTCACHE_ISA_AVX512)
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__))
#error "AGENTCACHE_ISA_AVX512 needs -mavx512f -mavx512bw -mfma"
#endif
#define AGENTCACHE_ISA_NAME "avx512"
#define AGENTCACHE_ISA_NS isa_avx512
#define AGENTCACHE_VEC_FLOATS 16
#define AGENTCACHE_VEC_REGS 32
#elif defined(AGENTCACHE_ISA_AVX2)
#if !(defined(__AVX2__) && defined(__FMA__))
#error "AGENTCACHE_ISA_AVX2 needs -mavx2 -mfma"
#endif
#define AGENTCACHE_ISA_NAME "avx2"
#define AGENTCACHE_ISA_NS isa_avx2
#define AGENTCACHE_VEC_FLOATS 8
#define AGENTCACHE_VEC_REGS 16
#elif defined(AGENTCACHE_ISA_NEON)
#if !(defined(__ARM_NEON) && defined(__aarch64__))
#error "AGENTCACHE_ISA_NEON needs an aarch64 target with Advanced SIMD"
#endif
#define AGENTCACHE_ISA_NAME "neon"
#define AGENTCACHE_ISA_NS isa_neon
#define AGENTCACHE_VEC_FLOATS 4
#define AGENTCACHE_VEC_REGS 32
#elif defined(AGENTCACHE_ISA_LAYOUT_CHECK)
// Tests only (tests/runtime/test_kernel_cores.py): another ISA's vector width and register count
// (-DAGENTCACHE_ISA_LAYOUT_CHECK=16 -DAGENTCACHE_LAYOUT_REGS=32: AVX-512's) compiled for any
// CPU, the compiler splitting the wide vectors, so that ISA's tile and index arithmetic runs on
// a machine without it.
#define AGENTCACHE_ISA_NAME "layout-check"
#define AGENTCACHE_ISA_NS isa_layout_check
#define AGENTCACHE_VEC_FLOATS AGENTCACHE_ISA_LAYOUT_CHECK
#define AGENTCACHE_VEC_REGS AGENTCACHE_LAYOUT_REGS
#elif defined(AGENTCACHE_ISA_SCALAR)
#define AGENTCACHE_ISA_NAME "scalar"
#define AGENTCACHE_ISA_NS isa_scalar
#define AGENTCACHE_VEC_FLOATS 1
#define AGENTCACHE_VEC_REGS 16
#else
#error "build with one of -DAGENTCACHE_ISA_{AVX512,AVX2,NEON,SCALAR} (runtime/model/kernels/_build.py)"
#endif

// Loop hints: `omp simd` (honoured with -fopenmp) on vector paths, nothing on the scalar one.
#define AGENTCACHE_PRAGMA(x) _Pragma(#x)
#if AGENTCACHE_VEC_FLOATS > 1
#define AGENTCACHE_SIMD AGENTCACHE_PRAGMA(omp simd)
#define AGENTCACHE_SIMD_SUM(v) AGENTCACHE_PRAGMA(omp simd reduction(+ : v))
#else
#define AGENTCACHE_SIMD
#define AGENTCACHE_SIMD_SUM(v)
#endif

// Every ISA's code lives in its own inline namespace, so two builds loaded in one process (the
// tests load each ISA this CPU runs) never share a symbol or a type name.
#define AGENTCACHE_BEGIN namespace agentcache { inline namespace AGENTCACHE_ISA_NS {
#define AGENTCACHE_END }}

AGENTCACHE_BEGIN

constexpr int64_t kW = AGENTCACHE_VEC_FLOATS;  // floats per native vector
constexpr int kRegs = AGENTCACHE_VEC_REGS;     // vector registers a tile may fill
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if AGENTCACHE_VEC_FLOATS > 1
typedef float vf __attribute__((vector_size(4 * AGENTCACHE_VEC_FLOATS)));
typedef uint32_t vu __attribute__((vector_size(4 * AGENTCACHE_VEC_FLOATS)));
#else
using vf = float;  // NOTE: the scalar path: the same arithmetic on plain floats
using vu = uint32_t;
#endif

// Unaligned loads and stores (memcpy compiles to one vector move).
inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vzero() { return vf{}; }
inline vf vsplat(float x) { return vzero() + x; }
inline vu vload_bits(const void* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// The bits of `u` read as floats (not a value conversion: for the scalar path a plain cast would
// convert the integer's value).
inline vf vbits(vu u) {
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// The sum of a vector's lanes, lane by lane.
inline float hsum(vf v) {
#if AGENTCACHE_VEC_FLOATS > 1
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += v[i];
  return s;
#else
  return v;
#endif
}

// sums[o] = the sum of acc[o]'s lanes, o < 4. NOTE: on x86 and NEON one transposed reduction for
// the four (pairwise adds; AVX-512: each vector's halves added first) instead of 4 chains of kW
// dependent scalar adds; the order of the adds differs from hsum's (float32 rounding).
inline void hsum4(const vf* acc, float* sums) {
#if (defined(__AVX512F__) && AGENTCACHE_VEC_FLOATS == 16) || \
    (defined(__AVX2__) && AGENTCACHE_VEC_FLOATS == 8)
  __m256 a[4];
#if AGENTCACHE_VEC_FLOATS == 16
  for (int o = 0; o < 4; ++o) {
    __m512 z;
    std::memcpy(&z, &acc[o], sizeof z);
    a[o] = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));
  }
#else
  std::memcpy(a, acc, sizeof a);
#endif
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#elif defined(__ARM_NEON) && defined(__aarch64__) && AGENTCACHE_VEC_FLOATS == 4
  float32x4_t a[4];
  std::memcpy(a, acc, sizeof a);
  vst1q_f32(sums, vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])));
#else
  for (int o = 0; o < 4; ++o) sums[o] = hsum(acc[o]);
#endif
}

// bfloat16 pairs to float32: a 32-bit word holding bf16 values a (low half) and b (high half)
// gives a = word << 16 and b = word & 0xFFFF0000, read as floats. pack_weight (Python) lays a
// packed line out so that the low halves hold columns [0, 16) and the high halves [16, 32).
inline vf bf16_low(vu words) { return vbits(words << 16); }
inline vf bf16_high(vu words) { return vbits(words & 0xFFFF0000u); }

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

// Threads: the cores split their work with parallel_for and size it by thread_count(); the torch
// module (module.cpp) points both at torch's intra-op pool (at::parallel_for), the self-test
// leaves them serial. One instance per library (an inline function's static).
struct Threads {
  using Body = void (*)(const void* ctx, int64_t begin, int64_t end);
  int64_t (*count)() = [] { return int64_t{1}; };
  void (*parallel)(int64_t n, const void* ctx, Body body) = [](int64_t n, const void* ctx,
                                                               Body body) {
    if (n > 0) body(ctx, 0, n);
  };
};

inline Threads& threads() {
  static Threads instance;
  return instance;
}

inline int64_t thread_count() { return threads().count(); }

// f(begin, end) over chunks of [0, n) on the configured threads (each index exactly once).
template <class F>
void parallel_for(int64_t n, const F& f) {
  threads().parallel(n, &f, [](const void* ctx, int64_t begin, int64_t end) {
    (*static_cast<const F*>(ctx))(begin, end);
  });
}

AGENTCACHE_END
