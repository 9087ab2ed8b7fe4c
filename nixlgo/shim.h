// Our own extern "C" shim over NIXL's C++ API: opaque handles, NIXL's
// status codes passed through unchanged, exceptions caught. Compiled by
// cgo only with the `nixl` build tag.
#ifndef KVTIER_NIXLGO_SHIM_H
#define KVTIER_NIXLGO_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nx_agent nx_agent;

// Every function returns a nixl_status_t; when a C++ exception was caught
// it returns NIXL_ERR_UNKNOWN (-8) and nx_last_error() says why.
const char *nx_last_error(void);

int nx_agent_new(const char *name, int prog_thread, nx_agent **out);
void nx_agent_free(nx_agent *a);
int nx_create_ucx(nx_agent *a, const char **keys, const char **vals, int n);
int nx_register(nx_agent *a, uintptr_t base, size_t len);
int nx_deregister(nx_agent *a, uintptr_t base, size_t len);
// nx_local_md returns a malloc'ed blob; free it with free().
int nx_local_md(nx_agent *a, char **md, size_t *len);
// nx_load_md returns the remote agent's name, malloc'ed.
int nx_load_md(nx_agent *a, const char *md, size_t len, char **name);
int nx_invalidate(nx_agent *a, const char *name);
// nx_prep prepares n descriptors of size bytes at base + i*stride (DRAM)
// on the local side (name NULL) or on a loaded remote agent's side.
int nx_prep(nx_agent *a, const char *name, uintptr_t base, size_t stride, size_t size, int n, void **dlist);
int nx_release_dlist(nx_agent *a, void *dlist);
int nx_make_xfer(nx_agent *a, int op, void *local, const int *lidx, void *remote, const int *ridx, int n,
                 const char *notif, size_t notif_len, void **req);
int nx_post(nx_agent *a, void *req);
int nx_status(nx_agent *a, void *req);
int nx_release_req(nx_agent *a, void *req);
// nx_notifs drains the notifications into a malloc'ed buffer: for each
// (sender, message): u32 sender length, sender, u32 message length,
// message. Free it with free().
int nx_notifs(nx_agent *a, char **buf, size_t *len);

#ifdef __cplusplus
}
#endif

#endif
