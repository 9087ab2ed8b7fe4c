# A vLLM KV-events subscriber (libzmq SUB through Debian's python3-zmq,
# msgpack through python3-msgpack), decoding batches as vLLM's
# consumers do. Usage: kvevents_sub.py ADDR TOPIC CLEARS
# Prints "ready" once subscribed, then one line per event:
#   TYPE medium=M hashes=H1,H2 parent=P tokens=N block_size=S
# and "end" after the CLEARS-th AllBlocksCleared.
import sys, zmq, msgpack

ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.RCVTIMEO, 20000)
s.connect("tcp://" + sys.argv[1])
s.setsockopt(zmq.SUBSCRIBE, sys.argv[2].encode())
print("ready", flush=True)
last, clears = -1, int(sys.argv[3])
while True:
    topic, seq, payload = s.recv_multipart()
    seq = int.from_bytes(seq, "big")
    assert topic == sys.argv[2].encode(), topic
    assert seq == last + 1, (seq, last)
    last = seq
    ts, events, rank = msgpack.unpackb(payload, raw=False)  # vLLM's array_like EventBatch
    assert isinstance(ts, float) and rank == 0, (ts, rank)
    for ev in events:
        t = ev["type"]
        if t == "AllBlocksCleared":
            assert list(ev) == ["type"], ev
            print(t, flush=True)
            clears -= 1
            if clears == 0:
                print("end", flush=True)
                sys.exit(0)
            continue
        assert list(ev)[0] == "type", ev
        hashes = ",".join(str(h) for h in ev["block_hashes"])
        assert all(isinstance(h, int) for h in ev["block_hashes"])
        if t == "BlockStored":
            assert ev["lora_id"] is None and ev["lora_name"] is None, ev
            print(t, "medium=" + ev["medium"], "hashes=" + hashes, "parent=" + str(ev["parent_block_hash"]),
                  "tokens=%d" % len(ev["token_ids"]), "block_size=%d" % ev["block_size"], flush=True)
        else:
            assert set(ev) == {"type", "block_hashes", "medium"}, ev
            print(t, "medium=" + ev["medium"], "hashes=" + hashes, flush=True)
