// Gather/scatter of paged KV blocks between GPU memory and pinned host
// slots. One launch copies a batch of (GPU block, CPU slot) pairs across
// all layers: the work items are (pair, segment) with segment = layer × K/V,
// pair-major so that consecutive items touch consecutive host bytes (a CPU
// slot is block-major: [layer][K, V][segment]).
//
// The grid is persistent and small (the caller caps it, 8–16 CTAs, so
// model compute keeps its SMs). Each warp strides over the items and copies
// one segment at a time with 16-byte accesses, holding UNROLL independent
// loads in flight per thread before it stores: with a warp per item even
// 4 KiB segments keep every warp busy. Reads from host memory pay a PCIe
// round trip each, so kv_load keeps more bytes in flight (8 loads a thread,
// 128 B) than kv_store (4). Segments whose addresses or size are not
// 16-byte aligned fall back to 4-byte or byte copies.
//
// The host memory is registered with the driver (portable | devicemap);
// with unified addressing its host addresses are valid device addresses.

#include <stdint.h>

#define WARP 32

template <int UNROLL>
__device__ __forceinline__ void copy_vec16(int4* __restrict__ dst, const int4* __restrict__ src, uint64_t n) {
  const uint64_t stride = WARP;
  uint64_t i = threadIdx.x % WARP;
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    int4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

template <int UNROLL>
__device__ __forceinline__ void copy_segment(char* dst, const char* src, uint64_t n) {
  const uintptr_t a = (uintptr_t)dst | (uintptr_t)src;
  if (((a | n) & 15) == 0) {
    copy_vec16<UNROLL>((int4*)dst, (const int4*)src, n / 16);
  } else if (((a | n) & 3) == 0) {
    uint32_t* d = (uint32_t*)dst;
    const uint32_t* s = (const uint32_t*)src;
    for (uint64_t i = threadIdx.x % WARP; i < n / 4; i += WARP) d[i] = s[i];
  } else {
    for (uint64_t i = threadIdx.x % WARP; i < n; i += WARP) dst[i] = src[i];
  }
}

// bases[s] is the device address of segment region s (layer × K/V) of the
// GPU cache; a block's segment s lives at bases[s] + block × block_stride.
// pairs[2p] is the GPU block and pairs[2p+1] the CPU slot of pair p; slot c
// starts at host_base + c × slot_stride and holds segment s at s × seg.
template <bool TO_HOST, int UNROLL>
__device__ __forceinline__ void kv_copy(const uint64_t* __restrict__ bases, const int32_t* __restrict__ pairs,
                                        int npairs, int nseg, uint64_t seg, uint64_t block_stride,
                                        uint64_t host_base, uint64_t slot_stride) {
  const int64_t items = (int64_t)npairs * nseg;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / WARP);
  const int64_t warp = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  for (int64_t it = warp; it < items; it += warps) {
    const int p = (int)(it / nseg);
    const int s = (int)(it % nseg);
    char* gpu = (char*)(bases[s] + (uint64_t)pairs[2 * p] * block_stride);
    char* host = (char*)(host_base + (uint64_t)pairs[2 * p + 1] * slot_stride + (uint64_t)s * seg);
    if (TO_HOST) {
      copy_segment<UNROLL>(host, gpu, seg);
    } else {
      copy_segment<UNROLL>(gpu, host, seg);
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024)
kv_store(const uint64_t* bases, const int32_t* pairs, int npairs, int nseg, uint64_t seg,
         uint64_t block_stride, uint64_t host_base, uint64_t slot_stride) {
  kv_copy<true, 4>(bases, pairs, npairs, nseg, seg, block_stride, host_base, slot_stride);
}

extern "C" __global__ void __launch_bounds__(1024)
kv_load(const uint64_t* bases, const int32_t* pairs, int npairs, int nseg, uint64_t seg,
        uint64_t block_stride, uint64_t host_base, uint64_t slot_stride) {
  kv_copy<false, 8>(bases, pairs, npairs, nseg, seg, block_stride, host_base, slot_stride);
}
