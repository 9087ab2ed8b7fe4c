// A thin C layer over the CUDA driver API, which it opens with dlopen at
// run time: nothing here needs the CUDA toolkit or links a CUDA library.
// Every function returns a CUresult (0 is success); kv_error names it.
#ifndef KVTIER_CUDA_SHIM_H
#define KVTIER_CUDA_SHIM_H

#include <stddef.h>
#include <stdint.h>

typedef struct kv_ctx kv_ctx;

enum {
	KV_ERR_DLOPEN = -1,  // libcuda.so.1 could not be opened
	KV_ERR_DLSYM = -2,   // a driver function is missing
	KV_ERR_NOUVA = -3,   // the device lacks unified addressing or mapped host memory
	KV_CUDA_NOT_READY = 600,
	KV_CUDA_NO_DEVICE = 100,
};

// kv_init opens the driver and calls cuInit once; msg receives dlerror's
// text on KV_ERR_DLOPEN / KV_ERR_DLSYM.
int kv_init(char *msg, size_t msglen);
int kv_device_count(int *n);
int kv_open(int device, const void *fatbin, kv_ctx **out);
void kv_close(kv_ctx *c);
const char *kv_name(kv_ctx *c);
int kv_sms(kv_ctx *c);
void kv_error(int status, const char **name, const char **msg);

int kv_host_register(kv_ctx *c, void *p, size_t n);
int kv_host_unregister(kv_ctx *c, void *p);
int kv_malloc(kv_ctx *c, size_t n, uint64_t *out);
int kv_free(kv_ctx *c, uint64_t p);
int kv_pinned(kv_ctx *c, size_t n, void **out);
int kv_pinned_free(kv_ctx *c, void *p);
int kv_htod(kv_ctx *c, uint64_t dst, const void *src, size_t n);
int kv_dtoh(kv_ctx *c, void *dst, uint64_t src, size_t n);

// Events: timing events can measure elapsed time, the others only order.
int kv_event_new(kv_ctx *c, int timing, void **ev);
void kv_event_free(kv_ctx *c, void *ev);
int kv_event_record(kv_ctx *c, int to_host, void *ev);
int kv_event_query(kv_ctx *c, void *ev);  // 0 done, KV_CUDA_NOT_READY pending
int kv_event_sync(kv_ctx *c, void *ev);
int kv_event_ms(kv_ctx *c, void *start, void *end, float *ms);
int kv_stream_sync(kv_ctx *c, int to_host);

// kv_copy copies the pairs' pinned host array to dev_pairs and launches
// kv_store (to_host) or kv_load on that direction's stream, then records
// done (may be NULL). With sums (a device address of npairs × nseg words)
// it launches kv_store_sum or kv_load_sum, which write each segment's raw
// CRC32C.
int kv_copy(kv_ctx *c, int to_host, uint64_t bases, const void *host_pairs, uint64_t dev_pairs, int npairs,
            int nseg, uint64_t seg, uint64_t block_stride, uint64_t host_base, uint64_t slot_stride, int ctas,
            int threads, uint64_t sums, void *done);

// kv_memcpy_async is one copy-engine transfer on a direction's stream
// (benchmark baselines).
int kv_memcpy_async(kv_ctx *c, int to_host, void *host, uint64_t dev, size_t n);

// kv_memcpy_batch is the driver's batched copy (cuMemcpyBatchAsync) of count
// copies on a direction's stream; KV_ERR_DLSYM when the driver lacks it.
int kv_memcpy_batch(kv_ctx *c, int to_host, uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count);

#endif
