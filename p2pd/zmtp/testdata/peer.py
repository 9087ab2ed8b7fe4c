# A libzmq peer for package zmtp's tests (Debian's python3-zmq). Usage:
#   peer.py dealer ADDR IDENTITY   connect a DEALER with heartbeats (100 ms, timeout 500 ms),
#                                  send "one", "two", then after 1.5 s "three"; print what
#                                  comes back, one line each
#   peer.py router PORTFILE        bind a ROUTER on 127.0.0.1:0, write its port to PORTFILE,
#                                  print the identity and frames of 3 messages; answer each
#                                  with [identity, b"ack:" + payload]
import sys, time, zmq

ctx = zmq.Context()
mode = sys.argv[1]
if mode == "dealer":
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, sys.argv[3].encode())
    s.setsockopt(zmq.HEARTBEAT_IVL, 100)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 500)
    s.setsockopt(zmq.HEARTBEAT_TTL, 1000)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect("tcp://" + sys.argv[2])
    s.send(b"one")
    s.send_multipart([b"two", b"x" * 70000])
    time.sleep(1.5)  # heartbeats keep the pipe alive only if the peer answers PING
    s.send(b"three")
    s.setsockopt(zmq.RCVTIMEO, 5000)
    for _ in range(2):
        print(s.recv_multipart()[0].decode(), flush=True)
elif mode == "router":
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    with open(sys.argv[2], "w") as f:
        f.write(str(port))
    s.setsockopt(zmq.RCVTIMEO, 10000)
    for _ in range(3):
        frames = s.recv_multipart()
        print(frames[0].decode(), [len(f) for f in frames[1:]], frames[1][:8].decode(), flush=True)
        s.send_multipart([frames[0], b"ack:" + frames[1][:8]])
    time.sleep(0.5)
s.close()
ctx.term()
