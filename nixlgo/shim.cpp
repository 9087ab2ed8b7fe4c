//go:build nixl

#include "shim.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <nixl.h>

struct nx_agent {
	nixlAgent *agent;
	nixlBackendH *ucx;
};

static thread_local std::string last_error;

const char *nx_last_error(void) { return last_error.c_str(); }

#define GUARD(...)                           \
	try {                                    \
		__VA_ARGS__                          \
	} catch (const std::exception &e) {      \
		last_error = e.what();               \
		return NIXL_ERR_UNKNOWN;             \
	} catch (...) {                          \
		last_error = "unknown C++ exception"; \
		return NIXL_ERR_UNKNOWN;             \
	}

int nx_agent_new(const char *name, int prog_thread, nx_agent **out) {
	GUARD({
		nixlAgentConfig cfg(prog_thread != 0, false, 0, nixl_thread_sync_t::NIXL_THREAD_SYNC_NONE);
		auto *a = new nx_agent{new nixlAgent(name, cfg), nullptr};
		*out = a;
		return NIXL_SUCCESS;
	})
}

void nx_agent_free(nx_agent *a) {
	try {
		delete a->agent;
	} catch (...) {
	}
	delete a;
}

int nx_create_ucx(nx_agent *a, const char **keys, const char **vals, int n) {
	GUARD({
		nixl_mem_list_t mems;
		nixl_b_params_t params;
		nixl_status_t s = a->agent->getPluginParams("UCX", mems, params);
		if (s != NIXL_SUCCESS) return s;
		for (int i = 0; i < n; i++) params[keys[i]] = vals[i];
		return a->agent->createBackend("UCX", params, a->ucx);
	})
}

static nixl_reg_dlist_t region(uintptr_t base, size_t len) {
	nixl_reg_dlist_t d(DRAM_SEG);
	d.addDesc(nixlBlobDesc(base, len, 0, ""));
	return d;
}

int nx_register(nx_agent *a, uintptr_t base, size_t len) {
	GUARD({ return a->agent->registerMem(region(base, len)); })
}

int nx_deregister(nx_agent *a, uintptr_t base, size_t len) {
	GUARD({ return a->agent->deregisterMem(region(base, len)); })
}

int nx_local_md(nx_agent *a, char **md, size_t *len) {
	GUARD({
		nixl_blob_t blob;
		nixl_status_t s = a->agent->getLocalMD(blob);
		if (s != NIXL_SUCCESS) return s;
		*md = static_cast<char *>(std::malloc(blob.size() ? blob.size() : 1));
		std::memcpy(*md, blob.data(), blob.size());
		*len = blob.size();
		return NIXL_SUCCESS;
	})
}

int nx_load_md(nx_agent *a, const char *md, size_t len, char **name) {
	GUARD({
		std::string remote;
		nixl_status_t s = a->agent->loadRemoteMD(nixl_blob_t(md, len), remote);
		if (s != NIXL_SUCCESS) return s;
		*name = strdup(remote.c_str());
		return NIXL_SUCCESS;
	})
}

int nx_invalidate(nx_agent *a, const char *name) {
	GUARD({ return a->agent->invalidateRemoteMD(name); })
}

int nx_prep(nx_agent *a, const char *name, uintptr_t base, size_t stride, size_t size, int n, void **dlist) {
	GUARD({
		nixl_xfer_dlist_t d(DRAM_SEG);
		for (int i = 0; i < n; i++) d.addDesc(nixlBasicDesc(base + (uintptr_t)i * stride, size, 0));
		nixlDlistH *h = nullptr;
		nixl_status_t s = a->agent->prepXferDlist(name ? std::string(name) : std::string(NIXL_INIT_AGENT), d, h);
		*dlist = h;
		return s;
	})
}

int nx_release_dlist(nx_agent *a, void *dlist) {
	GUARD({ return a->agent->releasedDlistH(static_cast<nixlDlistH *>(dlist)); })
}

int nx_make_xfer(nx_agent *a, int op, void *local, const int *lidx, void *remote, const int *ridx, int n,
                 const char *notif, size_t notif_len, void **req) {
	GUARD({
		std::vector<int> l(lidx, lidx + n), r(ridx, ridx + n);
		nixl_opt_args_t opt;
		if (notif) opt.notif = nixl_blob_t(notif, notif_len);
		nixlXferReqH *h = nullptr;
		nixl_status_t s = a->agent->makeXferReq(op == 1 ? NIXL_WRITE : NIXL_READ, static_cast<nixlDlistH *>(local), l,
		                                        static_cast<nixlDlistH *>(remote), r, h, notif ? &opt : nullptr);
		*req = h;
		return s;
	})
}

int nx_post(nx_agent *a, void *req) {
	GUARD({ return a->agent->postXferReq(static_cast<nixlXferReqH *>(req)); })
}

int nx_status(nx_agent *a, void *req) {
	GUARD({ return a->agent->getXferStatus(static_cast<nixlXferReqH *>(req)); })
}

int nx_release_req(nx_agent *a, void *req) {
	GUARD({ return a->agent->releaseXferReq(static_cast<nixlXferReqH *>(req)); })
}

int nx_notifs(nx_agent *a, char **buf, size_t *len) {
	GUARD({
		nixl_notifs_t m;
		nixl_status_t s = a->agent->getNotifs(m);
		if (s != NIXL_SUCCESS) return s;
		std::string out;
		auto put32 = [&out](uint32_t v) { out.append(reinterpret_cast<const char *>(&v), 4); };
		for (const auto &kv : m) {
			for (const auto &msg : kv.second) {
				put32(kv.first.size());
				out += kv.first;
				put32(msg.size());
				out += msg;
			}
		}
		*buf = static_cast<char *>(std::malloc(out.size() ? out.size() : 1));
		std::memcpy(*buf, out.data(), out.size());
		*len = out.size();
		return NIXL_SUCCESS;
	})
}
