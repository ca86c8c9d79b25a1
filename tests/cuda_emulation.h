// CPU emulation of the CUDA features that TVM's row-norm and elementwise kernels use (see cuda_emulation.py): one block at a
// time, its threads as std::threads; warp shuffles through a per-warp buffer and barrier; __shared__ = statics.
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <barrier>
#include <vector>
#include <memory>
#include <algorithm>
typedef _Float16 half;
struct half2 { half x, y; };
struct alignas(8) half4 { half x, y, z, w; };
inline half4 make_half4(half x, half y, half z, half w) { return {x, y, z, w}; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(32) ulonglong4 { unsigned long long x, y, z, w; };
struct alignas(16) ulonglong2 { unsigned long long x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline half __float2half_rn(float x) { return (half)x; }
inline unsigned __pack_half2(half x, half y) {
  unsigned short lo, hi;
  std::memcpy(&lo, &x, 2);
  std::memcpy(&hi, &y, 2);
  return lo | (unsigned(hi) << 16);
}
struct dim3 { int x, y, z; };
typedef unsigned int uint;
thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim;
static std::unique_ptr<std::barrier<>> block_bar;
static std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
static uint64_t warp_buf[32][32];     // a lane's value, as raw bits (float, int32 or int64)
#define __global__
#define __launch_bounds__(n)
#define __restrict__ __restrict
#define __shared__ static
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline unsigned __activemask() { return 0xffffffffu; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;
inline int lin_id() { return threadIdx.y * blockDim.x + threadIdx.x; }
template <class T> inline T exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  int w = lin_id() / 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  warp_buf[w][lin_id() % 32] = bits;
  warp_bars[w]->arrive_and_wait();
  bits = warp_buf[w][src_lane];
  warp_bars[w]->arrive_and_wait();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}
template <class T> inline T __shfl_down_sync(unsigned, T v, int offset, int width) {
  int lane = lin_id() % 32, seg = lane % width;
  return exchange(v, seg + offset < width ? lane + offset : lane);
}
template <class T> inline T __shfl_sync(unsigned, T v, int src, int width) {
  int lane = lin_id() % 32;
  return exchange(v, (lane / width) * width + (src % width));
}
template <class K> void launch(K kernel, int grid, int bx, int by) {
  blockDim = {bx, by, 1};
  int threads = bx * by;
  block_bar = std::make_unique<std::barrier<>>(threads);
  warp_bars.clear();
  for (int w = 0; w < (threads + 31) / 32; ++w) warp_bars.push_back(std::make_unique<std::barrier<>>(std::min(32, threads - 32 * w)));
  for (int b = 0; b < grid; ++b) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, b, t] { blockIdx = {b, 0, 0}; threadIdx = {t % bx, t / bx, 0}; kernel(); });
    for (auto& th : pool) th.join();
  }
}
