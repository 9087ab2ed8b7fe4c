//go:build cgo && linux

#include "cuda_shim.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The few driver types and constants used, declared here so that no CUDA
// header is needed.
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef uint64_t CUdeviceptr;

// cuMemcpyBatchAsync's attributes (CUDA 12.8+).
typedef struct {
	int type;  // CUmemLocationType: 1 device, 2 host
	int id;
} CUmemLocation;
typedef struct {
	int srcAccessOrder;  // CUmemcpySrcAccessOrder: 1 stream order
	CUmemLocation srcLocHint, dstLocHint;
	unsigned flags;
} CUmemcpyAttributes;

#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY 19
#define CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING 41
#define CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM 91
#define CU_MEMHOST_PORTABLE_DEVICEMAP 0x03
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGetCount)(int *);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DeviceGetName)(char *, int, CUdevice);
	CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
	CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*DevicePrimaryCtxRelease)(CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*CtxGetStreamPriorityRange)(int *, int *);
	CUresult (*ModuleLoadData)(CUmodule *, const void *);
	CUresult (*ModuleUnload)(CUmodule);
	CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemFree)(CUdeviceptr);
	CUresult (*MemHostAlloc)(void **, size_t, unsigned);
	CUresult (*MemFreeHost)(void *);
	CUresult (*MemHostRegister)(void *, size_t, unsigned);
	CUresult (*MemHostUnregister)(void *);
	CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*StreamCreateWithPriority)(CUstream *, unsigned, int);
	CUresult (*StreamDestroy)(CUstream);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*EventCreate)(CUevent *, unsigned);
	CUresult (*EventDestroy)(CUevent);
	CUresult (*EventRecord)(CUevent, CUstream);
	CUresult (*EventQuery)(CUevent);
	CUresult (*EventSynchronize)(CUevent);
	CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
	CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
	                         CUstream, void **, void **);
	// The batched copy is optional (drivers of CUDA 12.8 and later), in
	// two ABIs: CUDA 13 dropped the failIdx argument and named that one _v2.
	CUresult (*MemcpyBatchAsync)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
	                             size_t, size_t *, CUstream);
	CUresult (*MemcpyBatchAsync_v2)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
	                                size_t, CUstream);
	CUresult (*GetErrorName)(CUresult, const char **);
	CUresult (*GetErrorString)(CUresult, const char **);
} cu;

struct kv_ctx {
	CUdevice dev;
	CUcontext ctx;
	CUmodule mod;
	CUfunction store, store_sum, load, load_sum;
	CUstream stream[2];  // [0] loads (higher priority), [1] stores
	int sms;
	char name[256];
};

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int init_status;
static char init_msg[512];

// sym resolves name, preferring its _v2 ABI where the driver has one.
static void *sym(void *lib, const char *name) {
	char v2[128];
	snprintf(v2, sizeof v2, "%s_v2", name);
	void *p = dlsym(lib, v2);
	return p ? p : dlsym(lib, name);
}

#define LOAD(field, name)                                                          \
	do {                                                                           \
		*(void **)&cu.field = sym(lib, name);                                      \
		if (!cu.field) {                                                           \
			snprintf(init_msg, sizeof init_msg, "libcuda.so.1 lacks %s", name);     \
			init_status = KV_ERR_DLSYM;                                            \
			return;                                                                \
		}                                                                          \
	} while (0)

static void do_init(void) {
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		const char *e = dlerror();
		snprintf(init_msg, sizeof init_msg, "%s", e ? e : "dlopen libcuda.so.1 failed");
		init_status = KV_ERR_DLOPEN;
		return;
	}
	LOAD(Init, "cuInit");
	LOAD(DeviceGetCount, "cuDeviceGetCount");
	LOAD(DeviceGet, "cuDeviceGet");
	LOAD(DeviceGetName, "cuDeviceGetName");
	LOAD(DeviceGetAttribute, "cuDeviceGetAttribute");
	LOAD(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	LOAD(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease");
	LOAD(CtxSetCurrent, "cuCtxSetCurrent");
	LOAD(CtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange");
	LOAD(ModuleLoadData, "cuModuleLoadData");
	LOAD(ModuleUnload, "cuModuleUnload");
	LOAD(ModuleGetFunction, "cuModuleGetFunction");
	LOAD(MemAlloc, "cuMemAlloc");
	LOAD(MemFree, "cuMemFree");
	LOAD(MemHostAlloc, "cuMemHostAlloc");
	LOAD(MemFreeHost, "cuMemFreeHost");
	LOAD(MemHostRegister, "cuMemHostRegister");
	LOAD(MemHostUnregister, "cuMemHostUnregister");
	LOAD(MemcpyHtoD, "cuMemcpyHtoD");
	LOAD(MemcpyDtoH, "cuMemcpyDtoH");
	LOAD(MemcpyHtoDAsync, "cuMemcpyHtoDAsync");
	LOAD(MemcpyDtoHAsync, "cuMemcpyDtoHAsync");
	LOAD(StreamCreateWithPriority, "cuStreamCreateWithPriority");
	LOAD(StreamDestroy, "cuStreamDestroy");
	LOAD(StreamSynchronize, "cuStreamSynchronize");
	LOAD(EventCreate, "cuEventCreate");
	LOAD(EventDestroy, "cuEventDestroy");
	LOAD(EventRecord, "cuEventRecord");
	LOAD(EventQuery, "cuEventQuery");
	LOAD(EventSynchronize, "cuEventSynchronize");
	LOAD(EventElapsedTime, "cuEventElapsedTime");
	LOAD(LaunchKernel, "cuLaunchKernel");
	*(void **)&cu.MemcpyBatchAsync_v2 = dlsym(lib, "cuMemcpyBatchAsync_v2");
	if (!cu.MemcpyBatchAsync_v2) *(void **)&cu.MemcpyBatchAsync = dlsym(lib, "cuMemcpyBatchAsync");
	LOAD(GetErrorName, "cuGetErrorName");
	LOAD(GetErrorString, "cuGetErrorString");
	init_status = cu.Init(0);
}

int kv_init(char *msg, size_t msglen) {
	pthread_once(&init_once, do_init);
	if (msg && msglen) snprintf(msg, msglen, "%s", init_msg);
	return init_status;
}

int kv_device_count(int *n) { return cu.DeviceGetCount(n); }

void kv_error(int status, const char **name, const char **msg) {
	*name = "CUDA_ERROR_UNKNOWN";
	*msg = "unknown error";
	switch (status) {
	case KV_ERR_DLOPEN: *name = "dlopen"; *msg = "libcuda.so.1 could not be opened"; return;
	case KV_ERR_DLSYM: *name = "dlsym"; *msg = "a driver function is missing"; return;
	case KV_ERR_NOUVA:
		*name = "unsupported";
		*msg = "the device cannot use registered host addresses (unified addressing, mapped host memory)";
		return;
	}
	if (cu.GetErrorName) cu.GetErrorName(status, name);
	if (cu.GetErrorString) cu.GetErrorString(status, msg);
}

#define CHECK(call)                       \
	do {                                  \
		CUresult r_ = (call);             \
		if (r_ != 0) return r_;           \
	} while (0)

static int cur(kv_ctx *c) { return cu.CtxSetCurrent(c->ctx); }

int kv_open(int device, const void *fatbin, kv_ctx **out) {
	kv_ctx *c = calloc(1, sizeof *c);
	if (!c) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
	CUresult r = cu.DeviceGet(&c->dev, device);
	if (r == 0) r = cu.DeviceGetName(c->name, sizeof c->name - 1, c->dev);
	// The kernels use registered host addresses as device addresses.
	int uva = 0, map = 0, hostptr = 0;
	if (r == 0) r = cu.DeviceGetAttribute(&uva, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, c->dev);
	if (r == 0) r = cu.DeviceGetAttribute(&map, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, c->dev);
	if (r == 0)
		r = cu.DeviceGetAttribute(&hostptr, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, c->dev);
	if (r == 0 && (!uva || !map || !hostptr)) r = KV_ERR_NOUVA;
	if (r == 0) r = cu.DeviceGetAttribute(&c->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, c->dev);
	if (r != 0) {
		free(c);
		return r;
	}
	r = cu.DevicePrimaryCtxRetain(&c->ctx, c->dev);
	if (r != 0) {
		free(c);
		return r;
	}
	int least = 0, greatest = 0;
	r = cu.CtxSetCurrent(c->ctx);
	if (r == 0) r = cu.ModuleLoadData(&c->mod, fatbin);
	if (r == 0) r = cu.ModuleGetFunction(&c->store, c->mod, "kv_store");
	if (r == 0) r = cu.ModuleGetFunction(&c->store_sum, c->mod, "kv_store_sum");
	if (r == 0) r = cu.ModuleGetFunction(&c->load, c->mod, "kv_load");
	if (r == 0) r = cu.ModuleGetFunction(&c->load_sum, c->mod, "kv_load_sum");
	if (r == 0) r = cu.CtxGetStreamPriorityRange(&least, &greatest);
	// Loads gate prefill: their stream gets the greatest priority.
	if (r == 0) r = cu.StreamCreateWithPriority(&c->stream[0], CU_STREAM_NON_BLOCKING, greatest);
	if (r == 0) r = cu.StreamCreateWithPriority(&c->stream[1], CU_STREAM_NON_BLOCKING, least);
	if (r != 0) {
		kv_close(c);
		return r;
	}
	*out = c;
	return 0;
}

void kv_close(kv_ctx *c) {
	if (!c) return;
	cu.CtxSetCurrent(c->ctx);
	for (int i = 0; i < 2; i++) {
		if (c->stream[i]) {
			cu.StreamSynchronize(c->stream[i]);
			cu.StreamDestroy(c->stream[i]);
		}
	}
	if (c->mod) cu.ModuleUnload(c->mod);
	cu.DevicePrimaryCtxRelease(c->dev);
	free(c);
}

const char *kv_name(kv_ctx *c) { return c->name; }
int kv_sms(kv_ctx *c) { return c->sms; }

int kv_host_register(kv_ctx *c, void *p, size_t n) {
	CHECK(cur(c));
	return cu.MemHostRegister(p, n, CU_MEMHOST_PORTABLE_DEVICEMAP);
}

int kv_host_unregister(kv_ctx *c, void *p) {
	CHECK(cur(c));
	return cu.MemHostUnregister(p);
}

int kv_malloc(kv_ctx *c, size_t n, uint64_t *out) {
	CHECK(cur(c));
	CUdeviceptr p = 0;
	CHECK(cu.MemAlloc(&p, n));
	*out = p;
	return 0;
}

int kv_free(kv_ctx *c, uint64_t p) {
	CHECK(cur(c));
	return cu.MemFree(p);
}

int kv_pinned(kv_ctx *c, size_t n, void **out) {
	CHECK(cur(c));
	return cu.MemHostAlloc(out, n, CU_MEMHOST_PORTABLE_DEVICEMAP);
}

int kv_pinned_free(kv_ctx *c, void *p) {
	CHECK(cur(c));
	return cu.MemFreeHost(p);
}

int kv_htod(kv_ctx *c, uint64_t dst, const void *src, size_t n) {
	CHECK(cur(c));
	return cu.MemcpyHtoD(dst, src, n);
}

int kv_dtoh(kv_ctx *c, void *dst, uint64_t src, size_t n) {
	CHECK(cur(c));
	return cu.MemcpyDtoH(dst, src, n);
}

int kv_event_new(kv_ctx *c, int timing, void **ev) {
	CHECK(cur(c));
	return cu.EventCreate(ev, timing ? 0 : CU_EVENT_DISABLE_TIMING);
}

void kv_event_free(kv_ctx *c, void *ev) {
	if (cur(c) == 0) cu.EventDestroy(ev);
}

int kv_event_record(kv_ctx *c, int to_host, void *ev) {
	CHECK(cur(c));
	return cu.EventRecord(ev, c->stream[to_host ? 1 : 0]);
}

int kv_event_query(kv_ctx *c, void *ev) {
	CHECK(cur(c));
	return cu.EventQuery(ev);
}

int kv_event_sync(kv_ctx *c, void *ev) {
	CHECK(cur(c));
	return cu.EventSynchronize(ev);
}

int kv_event_ms(kv_ctx *c, void *start, void *end, float *ms) {
	CHECK(cur(c));
	return cu.EventElapsedTime(ms, start, end);
}

int kv_stream_sync(kv_ctx *c, int to_host) {
	CHECK(cur(c));
	return cu.StreamSynchronize(c->stream[to_host ? 1 : 0]);
}

int kv_copy(kv_ctx *c, int to_host, uint64_t bases, const void *host_pairs, uint64_t dev_pairs, int npairs,
            int nseg, uint64_t seg, uint64_t block_stride, uint64_t host_base, uint64_t slot_stride, int ctas,
            int threads, uint64_t sums, void *done) {
	CHECK(cur(c));
	CUstream s = c->stream[to_host ? 1 : 0];
	if (npairs > 0) {
		CHECK(cu.MemcpyHtoDAsync(dev_pairs, host_pairs, (size_t)npairs * 2 * sizeof(int32_t), s));
		// A warp per (pair, segment) item; no more CTAs than the items need.
		long long items = (long long)npairs * nseg;
		long long need = (items + threads / 32 - 1) / (threads / 32);
		unsigned grid = (unsigned)(need < ctas ? need : ctas);
		void *args[] = {&bases, &dev_pairs, &npairs, &nseg, &seg, &block_stride, &host_base, &slot_stride, &sums};
		CUfunction f = to_host ? (sums ? c->store_sum : c->store) : (sums ? c->load_sum : c->load);
		CHECK(cu.LaunchKernel(f, grid, 1, 1, (unsigned)threads, 1, 1, 0, s, args, NULL));
	}
	if (done) CHECK(cu.EventRecord(done, s));
	return 0;
}

int kv_memcpy_async(kv_ctx *c, int to_host, void *host, uint64_t dev, size_t n) {
	CHECK(cur(c));
	CUstream s = c->stream[to_host ? 1 : 0];
	return to_host ? cu.MemcpyDtoHAsync(host, dev, n, s) : cu.MemcpyHtoDAsync(dev, host, n, s);
}

int kv_memcpy_batch(kv_ctx *c, int to_host, uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count) {
	if (!cu.MemcpyBatchAsync && !cu.MemcpyBatchAsync_v2) return KV_ERR_DLSYM;
	CHECK(cur(c));
	CUstream s = c->stream[to_host ? 1 : 0];
	CUmemLocation gpu = {1, (int)c->dev}, host = {2, 0};
	CUmemcpyAttributes attr = {1, to_host ? gpu : host, to_host ? host : gpu, 0};
	size_t idx = 0, fail = 0;
	if (cu.MemcpyBatchAsync_v2) return cu.MemcpyBatchAsync_v2(dsts, srcs, sizes, count, &attr, &idx, 1, s);
	return cu.MemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &idx, 1, &fail, s);
}
