# A vLLM P2P peer of the G2 wire, written here from vLLM's protocol (not
# vLLM's code): libzmq through Debian's python3-zmq (a ROUTER bound on
# loopback, a DEALER per peer whose identity is this peer's host:port,
# heartbeats on), msgpack through python3-msgpack (bin keys, as msgspec
# encodes them), and vLLM's sha256_cbor block keys through python3-cbor2
# and hashlib, plus the 4-byte KV cache group index.
#
# Usage: vllm_peer.py NODE BLOCK_LEN PROMPTS_JSON
# It plays a consumer against the kvtier node at NODE (p2p_dialect vllm,
# data_plane none, holding the first prompt's blocks), then a
# producer the node looks blocks up on, and prints a line per step; at
# "pinned N" and "terminal" it waits for a line on stdin (the test checks
# the node's pins); at "serve ID" the test makes the node fetch a request
# from ID. Any surprise raises.
import json
import hashlib
import sys

import cbor2
import msgpack
import zmq

node, block_len, (toks, toks2) = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
HB = 100  # ms: libzmq drops a connection whose PINGs go unanswered for 4 of these
ctx = zmq.Context()


def heartbeat(s):
    s.setsockopt(zmq.HEARTBEAT_IVL, HB)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4 * HB)
    s.setsockopt(zmq.HEARTBEAT_TTL, 4 * HB)
    s.setsockopt(zmq.LINGER, 0)


class Peer:
    def __init__(self):
        self.router = ctx.socket(zmq.ROUTER)
        heartbeat(self.router)
        self.router.setsockopt(zmq.RCVTIMEO, 10000)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.id = "127.0.0.1:%d" % port
        self.dealer = None

    def dial(self, reconnect=True):
        d = ctx.socket(zmq.DEALER)
        heartbeat(d)
        if not reconnect:
            d.setsockopt(zmq.RECONNECT_IVL, -1)
        d.setsockopt(zmq.IDENTITY, self.id.encode())
        self.monitor = d.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        d.connect("tcp://" + node)
        self.dealer = d

    def hang_up(self):
        """Closes the DEALER, its monitor stopped first. Closing the DEALER
        and then the monitor's socket, with the monitor still on, left
        this process's libzmq stalled in 1 run of 5 – 15 under the race
        detector with two CPU hogs: its ROUTER delivered no further
        message and no monitor event of its own. Stopped first, 0 of 60."""
        self.dealer.disable_monitor()
        self.monitor.close()
        self.dealer.close()

    def send(self, **m):
        self.dealer.send(msgpack.packb(m, use_bin_type=True))

    def recv(self):
        frames = self.router.recv_multipart()
        assert len(frames) == 2, frames  # [identity, payload]: one frame a message
        assert frames[0].decode() == node, frames[0]
        return msgpack.unpackb(frames[1], raw=False)

    def expect(self, typ):
        m = self.recv()
        assert m["type"] == typ, (typ, m)
        return m

    def connect(self, **edit):
        m = dict(type="connect", peer_id=self.id, agent_metadata=b"", base_addr=0, num_blocks=64,
                 block_len=block_len, config_fingerprint="", hash_seed="vllm-none-hash")
        m.update(edit)
        self.send(**m)

    def disconnected(self, ms):
        """Whether libzmq reported the DEALER's connection lost within ms."""
        return self.monitor.poll(ms) != 0


def h(o):
    return hashlib.sha256(cbor2.dumps(o, canonical=True)).digest()


def block_keys(toks):
    parent, out = h("vllm-none-hash"), []
    for i in range(len(toks) // 16):
        parent = h((parent, tuple(toks[i * 16:(i + 1) * 16]), None))
        out.append(parent + (0).to_bytes(4, "big"))
    return out


keys, keys2 = block_keys(toks), block_keys(toks2)

# Handshake: both sides send connect and acknowledge the other's.
p = Peer()
p.dial()
p.connect()
c = p.expect("connect")
assert c["peer_id"] == node and c["block_len"] == block_len and c["hash_seed"] == "vllm-none-hash", c
assert isinstance(c["agent_metadata"], bytes) and c["num_blocks"] > 0, c
assert p.expect("connect_ack")["peer_id"] == node
p.send(type="connect_ack", peer_id=p.id)
print("handshake", flush=True)

# The node answers PINGs: libzmq would drop the connection otherwise.
assert not p.disconnected(15 * HB), "libzmq's heartbeat dropped the node"
print("heartbeats", flush=True)

# Lookup: one lookup_resp, keys in wire order, no round on the wire.
unknown = bytes(36)
p.send(type="lookup", kv_request_id="kv-1", keys=keys + [unknown], round_seq=0)
r = p.expect("lookup_resp")
assert r["kv_request_id"] == "kv-1" and r["keys"] == keys + [unknown], r
assert r["hits"] == [True] * len(keys) + [False], r["hits"]
print("lookup", sum(r["hits"]), flush=True)

# Fetch: data_plane none moves nothing, so the round fails.
p.send(type="fetch", kv_request_id="kv-1", keys=keys, block_indexes=list(range(len(keys))), round_seq=0)
t = p.expect("transfer_done")
assert t["kv_request_id"] == "kv-1" and t["round_seq"] == 0 and t["success"] is False, t
print("fetch failed", flush=True)

# Abort of a round not being written: acknowledged at once.
p.send(type="abort_fetch", kv_request_id="kv-2", round_seq=3)
a = p.expect("abort_ack")
assert a["kv_request_id"] == "kv-2" and a["round_seq"] == 3, a
print("abort", flush=True)

# A lookup pins; the terminal empty fetch releases the pins.
p.send(type="lookup", kv_request_id="kv-3", keys=keys[:4], round_seq=1)
assert p.expect("lookup_resp")["hits"] == [True] * 4
print("pinned", 4, flush=True)
sys.stdin.readline()
p.send(type="fetch", kv_request_id="kv-3", keys=[], block_indexes=[], round_seq=1)
print("terminal", flush=True)
sys.stdin.readline()  # the test saw the pins go

# An unknown type is dropped; the session goes on.
p.send(type="from_a_later_version", x=1)
p.send(type="lookup", kv_request_id="kv-4", keys=keys[:1], round_seq=2)
assert p.expect("lookup_resp")["hits"] == [True]
print("unknown type", flush=True)

# A new DEALER of the same identity (vLLM's new session or process)
# connects again: the node starts over on its DEALER, which libzmq's
# ROUTER accepts (no second connection of the identity).
p.hang_up()
p.dial()
p.connect()
p.expect("connect")
p.expect("connect_ack")
p.send(type="connect_ack", peer_id=p.id)
p.send(type="lookup", kv_request_id="kv-5", keys=keys[:2], round_seq=0)
assert p.expect("lookup_resp")["hits"] == [True, True]
print("reconnect", flush=True)

# The node fetching from this peer (a request of the second prompt naming
# it, which the test submits at "serve"): its lookup carries 36-byte keys and a round, this
# peer's lookup_resp none; on data_plane none its load fails unsent, and
# finishing the request sends the terminal empty fetch of that round.
print("serve", p.id, flush=True)
l = p.expect("lookup")
assert l["kv_request_id"] == "kv-9" and all(len(k) == 36 and k[32:] == bytes(4) for k in l["keys"]), l
assert l["keys"][0] == keys2[0], "the node's first key is not vLLM's sha256_cbor block hash of the prompt"
p.send(type="lookup_resp", kv_request_id="kv-9", keys=l["keys"], hits=[True] * len(l["keys"]))
while True:  # more lookups of the same round until the node's load fails
    m = p.recv()
    if m["type"] == "lookup":
        assert m["round_seq"] == l["round_seq"], m
        p.send(type="lookup_resp", kv_request_id="kv-9", keys=m["keys"], hits=[False] * len(m["keys"]))
        continue
    assert m["type"] == "fetch" and m["keys"] == [] and m["block_indexes"] == [], m
    assert m["kv_request_id"] == "kv-9" and m["round_seq"] == l["round_seq"], m
    break
print("terminal from the node", flush=True)

# A peer with another block_len is refused: its connection closes.
q = Peer()
q.dial(reconnect=False)
q.connect(block_len=block_len + 1)
assert q.disconnected(10000), "a connect with another block_len was not refused"
print("refused", flush=True)

p.send(type="disconnect")
print("ok", flush=True)
