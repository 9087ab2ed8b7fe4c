// Package p2p is kvtier's peer-to-peer secondary tier: a node fetches
// blocks that a peer already holds in its CPU tier instead of recomputing
// them. One port per node carries the control connection of each peer pair
// and the data connections; the control protocol is in package wire and
// docs/protocol.md; blocks move over a DataPlane (TCP here, NIXL in a
// build with NIXL).
//
// The tier is polled (SEMANTICS.md S3.1): socket goroutines only queue
// events and wake the manager's poll goroutine; every manager call happens
// in that goroutine's pass or in an engine step.
package p2p

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// Config configures the P2P tier. Keys are snake_case in JSON.
type Config struct {
	// NodeID names this node among its peers; empty picks a random one.
	NodeID string `json:"node_id"`
	// Listen is the P2P port's address ("127.0.0.1:5710", ":5710").
	Listen string `json:"p2p_listen"`
	// Advertise is the address peers dial back for data connections;
	// empty uses the listener's address.
	Advertise string `json:"p2p_advertise"`
	// Peers are dialled at start (host:port; DNS names resolve on
	// connect).
	Peers []string `json:"peers"`
	// ClusterToken, when set, must be held by every peer (HMAC
	// challenge-response; the token never travels).
	ClusterToken string `json:"cluster_token"`
	// TLSCert, TLSKey and TLSCA, all three or none, turn on mutual TLS
	// for every control and TCP data connection (TLSNetwork): this node's
	// certificate and key, and the cluster CA that every peer's
	// certificate must chain to (PEM files, read at start).
	TLSCert string `json:"p2p_tls_cert"`
	TLSKey  string `json:"p2p_tls_key"`
	TLSCA   string `json:"p2p_tls_ca"`

	LookupHold        offload.Duration `json:"lookup_hold"`
	PinHold           offload.Duration `json:"pin_hold"`
	LoadTimeout       offload.Duration `json:"load_timeout"`
	AbortAckTimeout   offload.Duration `json:"abort_ack_timeout"`
	KeepaliveInterval offload.Duration `json:"keepalive_interval"`
	KeepaliveTimeout  offload.Duration `json:"keepalive_timeout"`
	HandshakeTimeout  offload.Duration `json:"handshake_timeout"`
	// LookupTimeout bounds a consumer's lookup (S6.10): unanswered after
	// it, the lookup's keys answer Miss. Zero means lookup_hold + 2s.
	LookupTimeout offload.Duration `json:"lookup_timeout"`
	// DataConns is the number of data connections per peer (TCP).
	DataConns int `json:"data_conns"`
	// MaxSessions caps peer sessions; MaxHandshakes caps accepted
	// connections still in their handshake; MaxDataConns caps a peer's
	// inbound data connections (S8.1).
	MaxSessions   int `json:"max_sessions"`
	MaxHandshakes int `json:"max_handshakes"`
	MaxDataConns  int `json:"max_data_conns"`
	// DataNice, when above 0, runs each TCP data connection's reader and
	// writer on an OS thread of its own at this nice value, so bulk
	// transfers yield the CPU to control frames, the engine and the admin
	// API. Off by default: a locked thread costs a thread switch each time
	// its goroutine waits for the socket, 10–12 % of B1 on two cores, and
	// B2 was met without it (docs/benchmarks.md, issue 12).
	DataNice int `json:"data_nice"`
	// BulkConcurrency bounds the blocks this node's TCP data plane writes
	// at once, across every peer (reads take no token). 0: GOMAXPROCS,
	// and one fewer (at least 1) while the engine has requests of its own
	// in flight, so bulk writes leave it a CPU when it computes and take
	// every CPU when only peers want them.
	BulkConcurrency int `json:"bulk_concurrency"`
	// DataIdleTimeout closes an inbound data connection that carried no
	// block for this long (the producer dials again when it needs one),
	// and bounds each block's read and write.
	DataIdleTimeout offload.Duration `json:"data_idle_timeout"`
	// DataPlane moves the blocks: "tcp" (the default) or "nixl" (a binary
	// built with the nixl tag; every peer must use the same).
	DataPlane string `json:"data_plane"`
	// NIXLParams are the NIXL UCX backend's parameters (data_plane nixl).
	NIXLParams map[string]string `json:"nixl_params"`
	// Dialect is the P2P wire: "kvtier" (the default, docs/protocol.md)
	// or "vllm", vLLM's G2 P2P wire (ZeroMQ ROUTER/DEALER, msgpack,
	// 36-byte keys; docs/vllm.md), which needs hash_algo
	// vllm-sha256-cbor, an advertised host:port (vLLM's peer id) and
	// data_plane nixl — or none, which moves no blocks (every fetch
	// fails) and is for testing the control plane. vLLM's wire has no
	// authentication and no checksums: cluster_token and TLS do not apply.
	Dialect string `json:"p2p_dialect"`
	// VLLMSourceCheck (vLLM's dialect) refuses a connection that claims a
	// vLLM identity whose host is an IP address unless it comes from that
	// address: a stranger elsewhere cannot act as a peer by naming it.
	// Off only for peers whose connections leave from another address
	// than their identity's (multi-homed hosts).
	VLLMSourceCheck bool `json:"vllm_source_check"`
}

// Dialects of the P2P wire.
const (
	DialectKvtier = "kvtier"
	DialectVLLM   = "vllm"
)

// DefaultConfig returns the defaults of SEMANTICS.md §9.
func DefaultConfig() Config {
	return Config{
		Listen:            "127.0.0.1:5710",
		LookupHold:        offload.Duration(5 * time.Second),
		PinHold:           offload.Duration(30 * time.Second),
		LoadTimeout:       offload.Duration(30 * time.Second),
		AbortAckTimeout:   offload.Duration(10 * time.Second),
		KeepaliveInterval: offload.Duration(2 * time.Second),
		KeepaliveTimeout:  offload.Duration(10 * time.Second),
		HandshakeTimeout:  offload.Duration(5 * time.Second),
		DataConns:         4,
		MaxSessions:       256,
		MaxHandshakes:     64,
		MaxDataConns:      16,
		DataNice:          0,
		DataIdleTimeout:   offload.Duration(5 * time.Minute),
		DataPlane:         "tcp",
		Dialect:           DialectKvtier,
		VLLMSourceCheck:   true,
	}
}

// lookupTimeout is lookup_timeout, or lookup_hold + 2s when unset.
func (c *Config) lookupTimeout() time.Duration {
	if c.LookupTimeout > 0 {
		return time.Duration(c.LookupTimeout)
	}
	return time.Duration(c.LookupHold) + 2*time.Second
}

// ErrConfig is a bad P2P configuration value.
var ErrConfig = errors.New("p2p: bad config")

// Validate reports the first bad value, naming its key.
func (c *Config) Validate() error {
	for _, d := range []struct {
		key string
		v   offload.Duration
	}{{"lookup_hold", c.LookupHold}, {"pin_hold", c.PinHold}, {"load_timeout", c.LoadTimeout},
		{"abort_ack_timeout", c.AbortAckTimeout}, {"keepalive_interval", c.KeepaliveInterval},
		{"keepalive_timeout", c.KeepaliveTimeout}, {"handshake_timeout", c.HandshakeTimeout},
		{"data_idle_timeout", c.DataIdleTimeout}} {
		if d.v <= 0 {
			return fmt.Errorf("%w: %s: %v is not a positive duration", ErrConfig, d.key, time.Duration(d.v))
		}
	}
	switch {
	case c.KeepaliveTimeout <= c.KeepaliveInterval:
		return fmt.Errorf("%w: keepalive_timeout: %v must exceed keepalive_interval %v", ErrConfig,
			time.Duration(c.KeepaliveTimeout), time.Duration(c.KeepaliveInterval))
	case c.LookupTimeout < 0:
		return fmt.Errorf("%w: lookup_timeout: %v is negative", ErrConfig, time.Duration(c.LookupTimeout))
	case c.DataConns < 1 || c.DataConns > 64:
		return fmt.Errorf("%w: data_conns: %d is not in [1, 64]", ErrConfig, c.DataConns)
	case c.DataNice < 0 || c.DataNice > 19:
		return fmt.Errorf("%w: data_nice: %d is not in [0, 19]", ErrConfig, c.DataNice)
	case c.BulkConcurrency < 0 || c.BulkConcurrency > 1024:
		return fmt.Errorf("%w: bulk_concurrency: %d is not in [0, 1024] (0: GOMAXPROCS, one fewer while the engine has requests)", ErrConfig, c.BulkConcurrency)
	case c.MaxSessions < 1:
		return fmt.Errorf("%w: max_sessions: %d is not positive", ErrConfig, c.MaxSessions)
	case c.MaxHandshakes < 1:
		return fmt.Errorf("%w: max_handshakes: %d is not positive", ErrConfig, c.MaxHandshakes)
	case c.MaxDataConns < c.DataConns:
		return fmt.Errorf("%w: max_data_conns: %d is below data_conns %d", ErrConfig, c.MaxDataConns, c.DataConns)
	case len(c.NodeID) > 256:
		return fmt.Errorf("%w: node_id: longer than 256 bytes", ErrConfig)
	case !wire.PrintableID(c.NodeID):
		return fmt.Errorf("%w: node_id: %q is not printable UTF-8", ErrConfig, c.NodeID)
	case c.Listen == "":
		return fmt.Errorf("%w: p2p_listen: empty", ErrConfig)
	case c.Dialect != "" && c.Dialect != DialectKvtier && c.Dialect != DialectVLLM:
		return fmt.Errorf("%w: p2p_dialect: %q (want kvtier or vllm)", ErrConfig, c.Dialect)
	case c.Dialect == DialectVLLM:
		return c.validateVLLM()
	case c.DataPlane != "" && c.DataPlane != "tcp" && c.DataPlane != "nixl":
		return fmt.Errorf("%w: data_plane: %q (want tcp or nixl)", ErrConfig, c.DataPlane)
	}
	return c.validateTLS()
}

// validateVLLM checks what vLLM's wire allows.
func (c *Config) validateVLLM() error {
	switch {
	case c.DataPlane != "nixl" && c.DataPlane != "none" && testPlanes[c.DataPlane] == nil:
		return fmt.Errorf("%w: data_plane: %q with p2p_dialect vllm (want nixl, which vLLM speaks, or none: no blocks move)", ErrConfig, c.DataPlane)
	case c.ClusterToken != "":
		return fmt.Errorf("%w: cluster_token: vLLM's P2P wire has no authentication; p2p_dialect vllm cannot require a token", ErrConfig)
	case c.TLSCert != "" || c.TLSKey != "" || c.TLSCA != "":
		return fmt.Errorf("%w: p2p_tls_cert: vLLM's P2P wire is plain ZeroMQ; p2p_dialect vllm cannot use TLS", ErrConfig)
	case c.Advertise != "":
		return vllmLocalID("p2p_advertise", c.Advertise)
	}
	// The identity is the listener's address: it needs a host (its port
	// may be 0, the listener's choice).
	if host, _, err := net.SplitHostPort(c.Listen); err == nil {
		if ip, perr := netip.ParseAddr(host); host == "" || (perr == nil && ip.IsUnspecified()) {
			return fmt.Errorf("%w: p2p_listen: %q names no host vLLM peers can dial back (a node's identity on vLLM's wire is its host:port): set p2p_advertise (-p2p-advertise) to this node's routable host:port, e.g. 10.0.0.5:5710", ErrConfig, c.Listen)
		}
	}
	return nil
}

func (c *Config) validateTLS() error {
	keys := []struct{ key, v string }{{"p2p_tls_cert", c.TLSCert}, {"p2p_tls_key", c.TLSKey}, {"p2p_tls_ca", c.TLSCA}}
	set := 0
	for _, k := range keys {
		if k.v != "" {
			set++
		}
	}
	switch {
	case set == 0:
		return nil
	case set < len(keys):
		for _, k := range keys {
			if k.v == "" {
				return fmt.Errorf("%w: %s: empty, but the other p2p_tls_ keys are set (TLS needs all three)", ErrConfig, k.key)
			}
		}
	case c.DataPlane == "nixl":
		// NIXL moves blocks over UCX, outside TLS: refuse rather than send
		// them in the clear on a network that was declared untrusted.
		return fmt.Errorf("%w: p2p_tls_cert: TLS covers TCP connections only; data_plane nixl would move blocks unencrypted", ErrConfig)
	}
	return nil
}
