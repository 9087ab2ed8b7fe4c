# Runs vLLM's own P2P session, protocol and ZeroMQ control modules (G2
# wire), imported unchanged from a vLLM checkout, against a live kvtier
# node in vLLM's dialect (issue 15). Written here; vLLM's code is only
# imported from VLLM_SRC, never copied into this repository.
#
# Usage: harness.py VLLM_SRC DATA NODE BLOCK_LEN SEED PROMPTS_JSON
#   VLLM_SRC     a vLLM checkout (the directory holding vllm/)
#   DATA         none: the nodes run data_plane none, this side moves no
#                bytes; nixl: vLLM's NixlTransport (data/nixl.py, from
#                VLLM_SRC) over NIXL's Python bindings, the nodes run
#                data_plane nixl, and blocks move both ways
#   NODE         the P2P identity (host:port) of a node in vLLM's dialect
#                holding the first prompt's blocks; after "serve ID" a node
#                (this one, or another) fetches from this side
#   BLOCK_LEN    the nodes' block_bytes; SEED their hash seed
#   PROMPTS_JSON two prompts (token id lists, block size 16)
#
# vLLM's package __init__ files import the whole engine (torch, …), so the
# harness builds a package tree in a temporary directory: vLLM's modules
# as symlinks to VLLM_SRC's files, and small stand-ins for what they
# import from the rest of vLLM — vllm.logger, vllm.envs, OffloadKey /
# LookupResult / ReqContext (vllm.v1.kv_offload.base), the data package
# without NIXL, and msgspec's msgpack over python3-msgpack (Debian has no
# msgspec). The driver plays vLLM's P2PSecondaryTierManager: it polls the
# ZmqTransport and the P2PSession and serves the peer's lookups through a
# fake ParentManager.
#
# It prints a line per step ("step …"; NIXL's UCX logs to stdout too); at
# "step pinned 4" and "step finished" it waits for a line on stdin (the
# test checks the node's pins); after "step serve ID" it waits for a node
# to fetch from it. Any surprise raises.
import atexit
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time

src, mode, node = sys.argv[1], sys.argv[2], sys.argv[3]
block_len, seed, prompts = int(sys.argv[4]), sys.argv[5], json.loads(sys.argv[6])
assert mode in ("none", "nixl"), mode
P2P = "vllm/v1/kv_offload/tiering/p2p"
VLLM_MODULES = ["session/protocol.py", "session/client.py", "session/server.py", "session/session.py",
                "session/__init__.py", "control/base.py", "control/zmq.py", "control/__init__.py", "data/base.py"]

STAND_INS = {
    "vllm/__init__.py": "",
    "vllm/logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/envs.py": "VLLM_P2P_HANDSHAKE_TIMEOUT_S = 30\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/kv_offload/__init__.py": "",
    "vllm/v1/kv_offload/base.py": '''import enum
from dataclasses import dataclass, field
from typing import Any, NewType

OffloadKey = NewType("OffloadKey", bytes)


class LookupResult(enum.Enum):
    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3


@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: Any = None
    _state: dict = field(default_factory=dict)

    def set_state(self, key, value):
        self._state[key] = value

    def get_state(self, key, default=None):
        return self._state.get(key, default)
''',
    "vllm/v1/kv_offload/tiering/__init__.py": "",
    "vllm/v1/kv_offload/tiering/p2p/__init__.py": "",
    "vllm/v1/kv_offload/tiering/p2p/data/__init__.py": "from .base import DataTransport, PollResult\n",
    "msgspec/__init__.py": "from . import msgpack\n",
    "vllm/distributed/__init__.py": "",
    # vLLM's nixl_utils imports NIXL's Python package lazily; a NIXL built
    # from source names it nixl_cu12.
    "vllm/distributed/nixl_utils.py": '''try:
    from nixl_cu12._api import nixl_agent as NixlWrapper, nixl_agent_config
except ImportError:
    try:
        from nixl._api import nixl_agent as NixlWrapper, nixl_agent_config
    except ImportError:
        NixlWrapper = nixl_agent_config = None
''',
    "msgspec/msgpack.py": '''import msgpack as _msgpack


def encode(obj):
    return _msgpack.packb(obj, use_bin_type=True)


def decode(data):
    return _msgpack.unpackb(data, raw=False)
''',
}


def build_tree():
    root = tempfile.mkdtemp(prefix="kvtier-vllm-harness-")
    atexit.register(shutil.rmtree, root, True)
    for rel in VLLM_MODULES + (["data/nixl.py"] if mode == "nixl" else []):
        real = os.path.join(src, P2P, rel)
        if not os.path.isfile(real):
            sys.exit("harness: %s is not in VLLM_SRC=%s (want a vLLM checkout with the P2P tier, G2 wire)" % (os.path.join(P2P, rel), src))
        os.makedirs(os.path.dirname(os.path.join(root, P2P, rel)), exist_ok=True)
        os.symlink(os.path.abspath(real), os.path.join(root, P2P, rel))
    for rel, text in STAND_INS.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    return root


root = build_tree()
sys.path.insert(0, root)
sys.dont_write_bytecode = True  # nothing written next to vLLM's files

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.control.zmq import ZmqTransport  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.data import DataTransport, PollResult  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.session import P2PSession  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.session import protocol  # noqa: E402

if not hasattr(protocol.LookupMsg, "ROUND_SEQ") or hasattr(protocol, "WIRE_MAJOR"):
    sys.exit("harness: VLLM_SRC's session/protocol.py is not the G2 wire (round_seq, no wire version)")


class NoData(DataTransport):
    """A data transport that moves nothing: the kvtier node runs data_plane
    none, so its fetches never reach here, and this side's fetches fail
    on the node's side first (transfer_done success false)."""

    def __init__(self, view):
        super().__init__(view)
        self.peers, self.failed, self.next = {}, [], 1

    def get_agent_metadata(self):
        return b""

    def add_remote_peer(self, peer_id, agent_metadata, base_addr, num_blocks, block_len):
        self.peers[peer_id] = (base_addr, num_blocks, block_len)

    def remove_remote_peer(self, peer_id):
        self.peers.pop(peer_id, None)

    def write_blocks(self, peer_id, local_idxs, remote_idxs):
        tid, self.next = self.next, self.next + 1
        self.failed.append(tid)  # no data path to the node without NIXL
        return tid

    def poll(self, peer_id=None):
        failed, self.failed = self.failed, []
        return PollResult(done=[], failed=failed)

    def cancel(self, transfer_ids, mode="immediate"):
        return list(transfer_ids)

    def close(self):
        pass


class Ids(list):
    def tolist(self):
        return list(self)


class Job:
    def __init__(self, job_id, keys, slots):
        self.job_id, self.keys, self.block_ids = job_id, list(keys), Ids(slots)


class Parent:
    """vLLM's ParentManager as the tiering manager offers it to the P2P
    tier: this side holds the blocks `have` maps to their slots."""

    def __init__(self, have):
        self.have, self.jobs, self.next, self.open, self.hits, self.finished = dict(have), {}, 100, set(), 0, 0

    def on_new_request(self, ctx):
        self.open.add(ctx.req_id)

    def lookup(self, key, ctx):
        assert ctx.req_id in self.open, ctx.req_id
        return LookupResult.HIT if bytes(key) in self.have else LookupResult.MISS

    def create_store_job(self, keys, ctx):
        job = Job(self.next, keys, [self.have[bytes(k)] for k in keys])
        self.jobs[job.job_id], self.next = job, self.next + 1
        self.hits += len(job.keys)
        return job

    def on_request_finished(self, ctx):
        self.open.discard(ctx.req_id)
        self.finished += 1


def h(o):
    import cbor2
    return hashlib.sha256(cbor2.dumps(o, canonical=True)).digest()


def block_keys(toks):
    """vLLM's OffloadKeys of a prompt under sha256_cbor: block hash, group 0."""
    parent_hash, out = h(seed), []
    for i in range(len(toks) // 16):
        parent_hash = h((parent_hash, tuple(toks[i * 16:(i + 1) * 16]), None))
        out.append(parent_hash + (0).to_bytes(4, "big"))
    return out


keys, theirs = block_keys(prompts[0]), block_keys(prompts[1])

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
local_id = "127.0.0.1:%d" % port
transport = ZmqTransport(local_id, "127.0.0.1", port)
nblocks = 64
region = bytearray(nblocks * block_len)
view = memoryview(region).cast("B", (nblocks, block_len))
if mode == "nixl":
    from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport  # noqa: E402
    data = NixlTransport(local_id, view)
    assert data.available, "vLLM's NixlTransport found no NIXL (PYTHONPATH, LD_LIBRARY_PATH)"
    parent = Parent({k: i for i, k in enumerate(keys)})  # the blocks fetched below, in slots 0…
else:
    data = NoData(view)
    parent = Parent({k: i for i, k in enumerate(theirs[:6])})
sessions, loads, stores = {}, [], []


def poll_once():
    for conn in transport.poll():  # a peer we did not dial: vLLM's manager makes its session
        sess = sessions.get(conn.peer_id)
        if sess is None:
            sessions[conn.peer_id] = P2PSession(conn.peer_id, local_id, data, block_len, seed, conn=conn)
        elif not sess.connected:
            sess.attach_connection(conn)
    for sess in list(sessions.values()):
        r = sess.poll()
        loads.extend(r.loads)
        stores.extend(r.stores)
        sess.serve_external_requests(parent)
        sess.flush_pending_lookups()
        assert sess.alive, "the session with the node died"


def step_line(*words):
    print("step", *words, flush=True)


def until(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        poll_once()
        time.sleep(0.001)


# vLLM's consumer side fetching from the node.
sess = P2PSession(node, local_id, data, block_len, seed, conn=transport.connect(node))
sessions[node] = sess
until(lambda: sess.ready, "the handshake")
step_line("handshake")

unknown = bytes(36)
probe = keys + [unknown]
for k in probe:
    assert sess.register_lookup("kv-1", k) is None
until(lambda: all(sess.register_lookup("kv-1", k) is not None for k in probe), "the lookup's answer")
hits = [sess.register_lookup("kv-1", k) for k in probe]
assert hits == [True] * len(keys) + [False], hits
step_line("lookup", sum(hits))

sess.request_blocks(1, "kv-1", keys, list(range(len(keys))))
until(lambda: any(r.job_id == 1 for r in loads), "the load's end")
if mode == "nixl":  # the node WRITEs into this side's slots 0…
    assert [r.success for r in loads if r.job_id == 1] == [True], loads
    zero = bytes(block_len)
    assert all(region[i * block_len:(i + 1) * block_len] != zero for i in range(len(keys))), "a successful load left a slot empty"
    step_line("load ok", len(keys))
else:
    assert [r.success for r in loads if r.job_id == 1] == [False], loads  # data_plane none on the node
    step_line("load failed")

for k in keys[:4]:
    sess.register_lookup("kv-2", k)
until(lambda: all(sess.register_lookup("kv-2", k) for k in keys[:4]), "the second lookup")
step_line("pinned", 4)
sys.stdin.readline()
sess.finish_request("kv-2")  # a terminal empty fetch: the node's pins go
step_line("finished")
sys.stdin.readline()

# vLLM's producer side: a node fetches from this side — with nixl, the
# blocks just fetched, through vLLM's WRITEs; with none its loads fail
# unsent.
step_line("serve", local_id)
until(lambda: parent.hits > 0, "the node's lookup", timeout=20)
until(lambda: parent.finished > 0 and not parent.open and len(stores) >= len(parent.jobs),
      "the node's request to end (on_request_finished, every store job ended)", timeout=20)
step_line("served", parent.hits, "released", len(stores))

res = sess.close()
transport.close()
step_line("ok")
