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
//
// kv_store_sum is kv_store that also computes each segment's raw CRC32C
// (Castagnoli, reflected, initial value 0, no final xor) from the values
// it already holds in registers, and writes it to sums[item];
// kv_load_sum is kv_load that does the same for the values it writes to
// the GPU (a kv_digest read off the load, not off the cache); the host
// combines a block's segments into its checksum (crcmath.go). A lane's
// chunks are 16 bytes, 512 bytes apart: it folds them Horner-style
// (multiply by x^(8·512), add the chunk's CRC), shifts its sum by the bytes
// after its last chunk, and the warp xors the lanes' sums. The multiply by
// a constant and the 16-byte step are table lookups in shared memory.

#include <stdint.h>

#define WARP 32
#define CRC_POLY 0x82F63B78u

struct crc_tables {
  uint32_t slice[16][256];  // slice[k][b]: the CRC of byte b followed by k zero bytes
  uint32_t skip[4][256];    // skip[k][b]: (b << 8k) · x^(8·496) mod P
  uint32_t pow8[32];        // x^(8·2^j) mod P
};

// mulmodp is a·b mod P in the reflected representation (x^0 is bit 31).
__device__ __forceinline__ uint32_t mulmodp(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) p ^= b;
    b = (b & 1) ? (b >> 1) ^ CRC_POLY : b >> 1;
  }
  return p;
}

// shift_bytes is c · x^(8n) mod P: c followed by n zero bytes.
__device__ __forceinline__ uint32_t shift_bytes(const crc_tables* T, uint32_t c, uint64_t n) {
  for (int j = 0; n != 0; j++, n >>= 1) {
    if (n & 1) c = mulmodp(T->pow8[j], c);
  }
  return c;
}

__device__ void crc_tables_init(crc_tables* T) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC_POLY : c >> 1;
    T->slice[0][i] = c;
  }
  if (threadIdx.x == 0) {
    T->pow8[0] = 1u << 23;  // x^8
    for (int j = 1; j < 32; j++) T->pow8[j] = mulmodp(T->pow8[j - 1], T->pow8[j - 1]);
  }
  __syncthreads();
  for (int k = 1; k < 16; k++) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      uint32_t c = T->slice[k - 1][i];
      T->slice[k][i] = T->slice[0][c & 255] ^ (c >> 8);
    }
    __syncthreads();
  }
  const uint32_t x496 = shift_bytes(T, 1u << 31, 496);
  for (int i = threadIdx.x; i < 4 * 256; i += blockDim.x) {
    T->skip[i / 256][i % 256] = mulmodp(x496, (uint32_t)(i % 256) << (8 * (i / 256)));
  }
  __syncthreads();
}

// crc_step is acc · x^(8·512) ⊕ crc(v): the lane's sum so far moved past
// the 512 bytes up to and including its next chunk v, plus v's CRC.
__device__ __forceinline__ uint32_t crc_step(const crc_tables* T, uint32_t acc, int4 v) {
  uint32_t c = T->skip[0][acc & 255] ^ T->skip[1][(acc >> 8) & 255] ^ T->skip[2][(acc >> 16) & 255] ^
               T->skip[3][acc >> 24];
  c ^= (uint32_t)v.x;
  const uint32_t y = (uint32_t)v.y, z = (uint32_t)v.z, w = (uint32_t)v.w;
  return T->slice[15][c & 255] ^ T->slice[14][(c >> 8) & 255] ^ T->slice[13][(c >> 16) & 255] ^
         T->slice[12][c >> 24] ^ T->slice[11][y & 255] ^ T->slice[10][(y >> 8) & 255] ^
         T->slice[9][(y >> 16) & 255] ^ T->slice[8][y >> 24] ^ T->slice[7][z & 255] ^
         T->slice[6][(z >> 8) & 255] ^ T->slice[5][(z >> 16) & 255] ^ T->slice[4][z >> 24] ^
         T->slice[3][w & 255] ^ T->slice[2][(w >> 8) & 255] ^ T->slice[1][(w >> 16) & 255] ^
         T->slice[0][w >> 24];
}

// copy_vec16 copies n 16-byte chunks; with SUM it returns the lane's part
// of their CRC (the warp xors the parts).
template <int UNROLL, bool SUM>
__device__ __forceinline__ uint32_t copy_vec16(int4* __restrict__ dst, const int4* __restrict__ src, uint64_t n,
                                               const crc_tables* T) {
  const uint64_t stride = WARP;
  const uint64_t lane = threadIdx.x % WARP;
  uint64_t i = lane;
  uint32_t acc = 0;
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    int4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) dst[i + u * stride] = v[u];
    if (SUM) {
#pragma unroll
      for (int u = 0; u < UNROLL; u++) acc = crc_step(T, acc, v[u]);
    }
  }
  for (; i < n; i += stride) {
    const int4 v = src[i];
    dst[i] = v;
    if (SUM) acc = crc_step(T, acc, v);
  }
  if (!SUM || lane >= n) return 0;
  const uint64_t last = lane + (n - 1 - lane) / stride * stride;  // the lane's last chunk
  return shift_bytes(T, acc, (n - 1 - last) * 16);
}

// copy_segment copies n bytes; with SUM it returns the lane's part of the
// CRC of the bytes. Unaligned segments take 4-byte or byte copies, and
// their CRC is computed apart from the copy: each lane over a contiguous
// range of the GPU's side (src for a store, dst for a load once the
// warp's writes are done), shifted by the bytes after it — never over
// host memory, where each byte read is a bus round trip.
template <int UNROLL, bool SUM, bool TO_HOST>
__device__ __forceinline__ uint32_t copy_segment(char* dst, const char* src, uint64_t n, const crc_tables* T) {
  const uintptr_t a = (uintptr_t)dst | (uintptr_t)src;
  const uint64_t lane = threadIdx.x % WARP;
  if (((a | n) & 15) == 0) {
    return copy_vec16<UNROLL, SUM>((int4*)dst, (const int4*)src, n / 16, T);
  } else if (((a | n) & 3) == 0) {
    uint32_t* d = (uint32_t*)dst;
    const uint32_t* s = (const uint32_t*)src;
    for (uint64_t i = lane; i < n / 4; i += WARP) d[i] = s[i];
  } else {
    for (uint64_t i = lane; i < n; i += WARP) dst[i] = src[i];
  }
  if (!SUM) return 0;
  const char* gpu = src;
  if (!TO_HOST) {
    __syncwarp();  // the other lanes' bytes of dst are written and visible
    gpu = dst;
  }
  const uint64_t per = (n + WARP - 1) / WARP;
  const uint64_t lo = min(n, lane * per), hi = min(n, lo + per);
  uint32_t c = 0;
  for (uint64_t i = lo; i < hi; i++) c = T->slice[0][(c ^ (uint8_t)gpu[i]) & 255] ^ (c >> 8);
  return shift_bytes(T, c, n - hi);
}

// bases[s] is the device address of segment region s (layer × K/V) of the
// GPU cache; a block's segment s lives at bases[s] + block × block_stride.
// pairs[2p] is the GPU block and pairs[2p+1] the CPU slot of pair p; slot c
// starts at host_base + c × slot_stride and holds segment s at s × seg.
// With SUM, item it's raw CRC goes to sums[it].
template <bool TO_HOST, int UNROLL, bool SUM>
__device__ __forceinline__ void kv_copy(const uint64_t* __restrict__ bases, const int32_t* __restrict__ pairs,
                                        int npairs, int nseg, uint64_t seg, uint64_t block_stride,
                                        uint64_t host_base, uint64_t slot_stride, const crc_tables* T,
                                        uint32_t* sums) {
  const int64_t items = (int64_t)npairs * nseg;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / WARP);
  const int64_t warp = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  for (int64_t it = warp; it < items; it += warps) {
    const int p = (int)(it / nseg);
    const int s = (int)(it % nseg);
    char* gpu = (char*)(bases[s] + (uint64_t)pairs[2 * p] * block_stride);
    char* host = (char*)(host_base + (uint64_t)pairs[2 * p + 1] * slot_stride + (uint64_t)s * seg);
    uint32_t c = TO_HOST ? copy_segment<UNROLL, SUM, true>(host, gpu, seg, T)
                         : copy_segment<UNROLL, SUM, false>(gpu, host, seg, T);
    if (SUM) {
      for (int off = WARP / 2; off > 0; off /= 2) c ^= __shfl_xor_sync(0xffffffffu, c, off);
      if (threadIdx.x % WARP == 0) sums[it] = c;
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024)
kv_store(const uint64_t* bases, const int32_t* pairs, int npairs, int nseg, uint64_t seg,
         uint64_t block_stride, uint64_t host_base, uint64_t slot_stride) {
  kv_copy<true, 4, false>(bases, pairs, npairs, nseg, seg, block_stride, host_base, slot_stride, nullptr, nullptr);
}

// kv_store_sum is kv_store writing each item's raw CRC32C to sums (mapped
// host memory, npairs × nseg words, pair-major).
extern "C" __global__ void __launch_bounds__(1024)
kv_store_sum(const uint64_t* bases, const int32_t* pairs, int npairs, int nseg, uint64_t seg,
             uint64_t block_stride, uint64_t host_base, uint64_t slot_stride, uint32_t* sums) {
  __shared__ crc_tables T;
  crc_tables_init(&T);
  kv_copy<true, 4, true>(bases, pairs, npairs, nseg, seg, block_stride, host_base, slot_stride, &T, sums);
}

extern "C" __global__ void __launch_bounds__(1024)
kv_load(const uint64_t* bases, const int32_t* pairs, int npairs, int nseg, uint64_t seg,
        uint64_t block_stride, uint64_t host_base, uint64_t slot_stride) {
  kv_copy<false, 8, false>(bases, pairs, npairs, nseg, seg, block_stride, host_base, slot_stride, nullptr, nullptr);
}

// kv_load_sum is kv_load writing each item's raw CRC32C to sums, as
// kv_store_sum does.
extern "C" __global__ void __launch_bounds__(1024)
kv_load_sum(const uint64_t* bases, const int32_t* pairs, int npairs, int nseg, uint64_t seg,
            uint64_t block_stride, uint64_t host_base, uint64_t slot_stride, uint32_t* sums) {
  __shared__ crc_tables T;
  crc_tables_init(&T);
  kv_copy<false, 8, true>(bases, pairs, npairs, nseg, seg, block_stride, host_base, slot_stride, &T, sums);
}
