package p2ptest

import (
	"testing"
)

// End to end with mutual TLS on, over real loopback sockets, with
// certificates from package pki: the consumer fetches 24 blocks byte for
// byte and both nodes end clean; a node with another CA's certificate
// fetches nothing.
func TestFetchTLSEndToEnd(t *testing.T) { // S6.1, S7.1
	if DataPlane == "nixl" {
		t.Skip("TLS covers the TCP data plane only; a nixl build refuses p2p_tls_* with data_plane nixl")
	}
	cluster := TLS(t)
	prod := NewNode(t, tiny, 64, nil, cluster("producer"))
	cons := NewNode(t, tiny, 64, nil, cluster("consumer"))
	keys := Keys(1, 24, tiny.BlockTokens)
	prod.Store(t, keys)
	if hits, bad := cons.Fetch(t, "kv-tls", prod.Tier.Addr(), keys); hits != 24 || bad != 0 {
		t.Errorf("fetched %d blocks, %d wrong; want 24, 0", hits, bad)
	}
	prod.WaitClean(t)
	cons.WaitClean(t)
	stranger := NewNode(t, tiny, 64, nil, TLS(t)("stranger"))
	if hits, _ := stranger.Fetch(t, "kv-stranger", prod.Tier.Addr(), keys); hits != 0 {
		t.Errorf("a node of another CA fetched %d blocks, want 0", hits)
	}
}
