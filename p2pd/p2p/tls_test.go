package p2p

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// testCA is a throwaway certificate authority writing PEM files into dir.
type testCA struct {
	t    testing.TB
	dir  string
	name string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	file string // the CA certificate's PEM file
}

func newTestCA(t testing.TB, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &testCA{t: t, dir: t.TempDir(), name: name, cert: cert, key: key}
	ca.file = ca.write(name+"-ca.pem", "CERTIFICATE", der)
	return ca
}

func (ca *testCA) write(name, typ string, der []byte) string {
	ca.t.Helper()
	p := filepath.Join(ca.dir, name)
	if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		ca.t.Fatal(err)
	}
	return p
}

// node issues a node certificate for name (a DNS name only: no address
// of the tests is in it) usable as server and client, and returns the
// paths of its certificate and key.
func (ca *testCA) node(name string) (cert, key string) {
	ca.t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		ca.t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name}, DNSNames: []string{name + ".cluster.invalid"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &k.PublicKey, ca.key)
	if err != nil {
		ca.t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		ca.t.Fatal(err)
	}
	return ca.write(name+".pem", "CERTIFICATE", der), ca.write(name+"-key.pem", "PRIVATE KEY", kder)
}

// tlsEdit configures a node with a certificate of ca.
func (ca *testCA) tlsEdit(name string, more func(*Config)) func(*Config) {
	cert, key := ca.node(name)
	return func(c *Config) {
		c.TLSCert, c.TLSKey, c.TLSCA = cert, key, ca.file
		if more != nil {
			more(c)
		}
	}
}

// network is a TLSNetwork over TCP with a certificate of ca.
func (ca *testCA) network(name string, timeout time.Duration) Network {
	ca.t.Helper()
	cert, key := ca.node(name)
	n, err := TLSNetwork(TCP{}, TLSConfig{CertFile: cert, KeyFile: key, CAFile: ca.file, HandshakeTimeout: timeout})
	if err != nil {
		ca.t.Fatal(err)
	}
	return n
}

// rogueConfig is a TLS config with a certificate of ca that trusts trust:
// a peer that would accept us but that we must refuse.
func (ca *testCA) rogueConfig(name string, trust *testCA) *tls.Config {
	ca.t.Helper()
	certFile, keyFile := ca.node(name)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		ca.t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(trust.cert)
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}, RootCAs: pool,
		ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil },
		InsecureSkipVerify:   true, NextProtos: []string{tlsALPN}}
}

// Each bad TLS setting fails the start with an error naming its key.
func TestTLSConfigErrors(t *testing.T) { // S6.1
	ca, other := newTestCA(t, "ca"), newTestCA(t, "other")
	cert, key := ca.node("a")
	otherCert, otherKey := other.node("b")
	missing := filepath.Join(t.TempDir(), "missing.pem")
	for _, tc := range []struct {
		name            string
		cert, key, file string
		plane           string
		want            string
	}{
		{"cert only", cert, "", "", "", "p2p_tls_key: empty"},
		{"no ca", cert, key, "", "", "p2p_tls_ca: empty"},
		{"key and ca only", "", key, ca.file, "", "p2p_tls_cert: empty"},
		{"nixl", cert, key, ca.file, "nixl", "p2p_tls_cert: TLS covers TCP connections only"},
		{"missing cert", missing, key, ca.file, "", "p2p_tls_cert: open " + missing},
		{"cert is a key", key, key, ca.file, "", "p2p_tls_cert: " + key + ": no PEM certificate"},
		{"missing key", cert, missing, ca.file, "", "p2p_tls_key: open " + missing},
		{"key of another cert", cert, otherKey, ca.file, "", "p2p_tls_key: " + otherKey + ": not the key of p2p_tls_cert"},
		{"missing ca", cert, key, missing, "", "p2p_tls_ca: open " + missing},
		{"ca is a key", cert, key, key, "", "p2p_tls_ca: " + key + ": no PEM certificate"},
		{"cert of another ca", otherCert, otherKey, ca.file, "", "p2p_tls_cert: " + otherCert + ": not valid under p2p_tls_ca"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pc := DefaultConfig()
			pc.Listen = "127.0.0.1:0"
			pc.TLSCert, pc.TLSKey, pc.TLSCA = tc.cert, tc.key, tc.file
			if tc.plane != "" {
				pc.DataPlane = tc.plane
			}
			_, err := offload.New(tinyConfig(8), Spec(pc, tinyConfig(8), nil))
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("start: %v, want an ErrConfig saying %q", err, tc.want)
			}
		})
	}
}

// firstBytes is a TCP network that records the first byte each dialled
// connection writes.
type firstBytes struct {
	TCP
	mu    sync.Mutex
	first []byte
}

type firstConn struct {
	net.Conn
	r    *firstBytes
	once sync.Once
}

func (r *firstBytes) Dial(ctx context.Context, addr string) (net.Conn, error) {
	c, err := r.TCP.Dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	return &firstConn{Conn: c, r: r}, nil
}

func (c *firstConn) Write(b []byte) (int, error) {
	if len(b) > 0 {
		c.once.Do(func() {
			c.r.mu.Lock()
			c.r.first = append(c.r.first, b[0])
			c.r.mu.Unlock()
		})
	}
	return c.Conn.Write(b)
}

// With p2p_tls_* set, a consumer fetches a producer's blocks byte for byte
// over TLS on loopback although no certificate names 127.0.0.1, and every
// connection — the control one and each data connection — starts with a
// TLS handshake record.
func TestTLSFetch(t *testing.T) { // S6.1, S7.1
	ca := newTestCA(t, "cluster")
	rec := &firstBytes{}
	prod := newNode(t, rec, ca.tlsEdit("prod", nil), 32)
	cons := newNode(t, rec, ca.tlsEdit("cons", nil), 32)
	keys := testKeys(1, 6)
	prod.store(t, keys[:4])
	req := &offload.Request{ID: "r1", TransferParams: source("kv-1", prod.tier.Addr())}
	cons.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	got := cons.prefix(t, req, keys, realWait(cons.m))
	want := []offload.Result{offload.Hit, offload.Hit, offload.Hit, offload.Hit, offload.Miss}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("answers %v, want %v", got, want)
	}
	cons.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	waitClean(t, prod)
	waitClean(t, cons)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	// One control connection and data_conns (2) data connections.
	if len(rec.first) < 3 {
		t.Fatalf("%d connections dialled, want at least 3", len(rec.first))
	}
	for i, b := range rec.first {
		if b != 0x16 { // a TLS handshake record
			t.Errorf("connection %d began with byte %#x, not a TLS handshake", i, b)
		}
	}
}

// A peer whose certificate comes from another CA is refused both ways: as
// a client (its certificate fails our verification though it trusts us)
// and as a server (we refuse its certificate).
func TestTLSRefusesAnotherCA(t *testing.T) { // S6.1
	ca, other := newTestCA(t, "cluster"), newTestCA(t, "other")
	n := ca.network("node-a", 10*time.Second)
	rogue := other.rogueConfig("rogue", ca)

	t.Run("rogue client", func(t *testing.T) {
		ln, err := n.Listen("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		served := make(chan error, 1)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				served <- err
				return
			}
			defer c.Close()
			var b [1]byte
			_, err = c.Read(b[:])
			served <- err
		}()
		raw, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c := tls.Client(raw, rogue)
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		// TLS 1.3: the client's handshake ends before the server checked
		// its certificate; the refusal arrives on its next read.
		if err := c.Handshake(); err == nil {
			c.Write([]byte{1})
			_, err = c.Read(make([]byte, 1))
			if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("rogue client read: %v, want a refusal", err)
			}
		}
		var ua x509.UnknownAuthorityError
		if err := <-served; !errors.As(err, &ua) {
			t.Errorf("server read from a rogue client: %v, want an unknown-authority error", err)
		}
	})

	t.Run("rogue server", func(t *testing.T) {
		ln, err := tls.Listen("tcp", "127.0.0.1:0", rogue)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		var wg sync.WaitGroup
		defer wg.Wait()
		wg.Go(func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			c.(*tls.Conn).Handshake()
		})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := n.Dial(ctx, ln.Addr().String())
		var ua x509.UnknownAuthorityError
		if !errors.As(err, &ua) {
			if c != nil {
				c.Close()
			}
			t.Fatalf("dialling a rogue server: %v, want an unknown-authority error", err)
		}
	})
}

// Two nodes of different CAs fetch nothing from each other, either way.
func TestTLSTierRefusesAnotherCA(t *testing.T) { // S6.1
	a := newNode(t, nil, newTestCA(t, "cluster").tlsEdit("a", nil), 32)
	b := newNode(t, nil, newTestCA(t, "other").tlsEdit("b", nil), 32)
	for i, p := range []struct{ prod, cons *node }{{a, b}, {b, a}} {
		keys := testKeys(10+i, 2)
		p.prod.store(t, keys)
		req := &offload.Request{ID: fmt.Sprint("r", i), TransferParams: source(fmt.Sprint("kv-", i), p.prod.tier.Addr())}
		p.cons.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
		if got := p.cons.prefix(t, req, keys, realWait(p.cons.m)); fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Miss}) {
			t.Errorf("direction %d: answers %v, want [Miss]", i, got)
		}
		p.cons.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	}
}

// A plain-TCP client that sends a valid hello to a TLS port is closed at
// once, and the port goes on serving TLS peers.
func TestTLSRefusesPlainClient(t *testing.T) { // S8.1
	ca := newTestCA(t, "cluster")
	prod := newNode(t, nil, ca.tlsEdit("prod", nil), 32)
	for range 3 {
		c, err := TCP{}.Dial(context.Background(), prod.tier.Addr())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := wire.Write(c, nil, wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: "plain"}); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, err := c.Read(make([]byte, 64))
		c.Close()
		if n != 0 || err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("plain client read %d bytes, %v; want the port to close it", n, err)
		}
	}
	cons := newNode(t, nil, ca.tlsEdit("cons", nil), 32)
	keys := testKeys(2, 2)
	prod.store(t, keys)
	req := &offload.Request{ID: "r", TransferParams: source("kv", prod.tier.Addr())}
	cons.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	if got := cons.prefix(t, req, keys, realWait(cons.m)); fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Hit, offload.Hit}) {
		t.Fatalf("answers %v after plain clients, want [Hit Hit]", got)
	}
	cons.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
}

// A client that connects and sends nothing does not hold up Accept: with
// a long handshake timeout, a second client handshakes and is served while
// the first is still silent.
func TestTLSAcceptDoesNotHandshake(t *testing.T) { // S8.1
	ca := newTestCA(t, "cluster")
	n := ca.network("node-a", time.Minute)
	ln, err := n.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer ln.Close()
	accepted := make(chan net.Conn, 2)
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	})
	silent, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	// Accept returns although the client sent nothing.
	select {
	case first := <-accepted:
		defer first.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("Accept did not return a silent client's connection in 10 s")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	wg.Go(func() {
		var c net.Conn
		select {
		case c = <-accepted:
		case <-ctx.Done():
			t.Error("the second client was not accepted in 10 s")
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		var b [1]byte
		if _, err := io.ReadFull(c, b[:]); err == nil {
			c.Write(b[:])
		}
	})
	c, err := n.Dial(ctx, ln.Addr().String())
	if err != nil {
		t.Fatalf("second client, while the first is silent: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	var b [1]byte
	if _, err := c.Write([]byte{7}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, b[:]); err != nil || b[0] != 7 {
		t.Fatalf("echo %v %v", b, err)
	}
}

// An accepted connection whose client sends nothing fails its first Read
// at the handshake timeout, with no deadline set by the caller, and the
// client sees the connection closed.
func TestTLSSilentClientTimesOut(t *testing.T) { // S8.1
	ca := newTestCA(t, "cluster")
	const timeout = 300 * time.Millisecond
	n := ca.network("node-a", timeout)
	ln, err := n.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	silent, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	t0 := time.Now()
	read := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		read <- err
	}()
	select {
	case err := <-read:
		if err == nil {
			t.Fatal("read from a silent client succeeded")
		}
		if d := time.Since(t0); d < timeout {
			t.Errorf("read failed after %v, before the %v handshake timeout: %v", d, timeout, err)
		}
	case <-time.After(10 * time.Second):
		c.Close()
		<-read
		t.Fatal("read from a silent client still blocked after 10 s")
	}
	silent.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := silent.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("silent client read %v, want the connection closed", err)
	}
}

// A silent client of the tier's TLS port does not hold up its accept
// loop: with a handshake timeout far beyond the fetch's 10 s bound, a TLS
// peer that connects after it fetches.
func TestTLSTierServesBesideSilentClient(t *testing.T) { // S8.1
	ca := newTestCA(t, "cluster")
	long := func(c *Config) { c.HandshakeTimeout = offload.Duration(time.Minute) }
	prod := newNode(t, nil, ca.tlsEdit("prod", long), 32)
	cons := newNode(t, nil, ca.tlsEdit("cons", long), 32)
	silent, err := net.Dial("tcp", prod.tier.Addr())
	if err != nil {
		t.Fatal(err)
	}
	// Closed before the nodes, so that their handshake goroutines end.
	defer silent.Close()
	keys := testKeys(3, 2)
	prod.store(t, keys)
	req := &offload.Request{ID: "r", TransferParams: source("kv", prod.tier.Addr())}
	cons.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	if got := cons.prefix(t, req, keys, realWait(cons.m)); fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Hit, offload.Hit}) {
		t.Fatalf("answers %v beside a silent client, want [Hit Hit]", got)
	}
	cons.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
}

// S6.1: over TLS the handshake proofs bind the TLS session (exported
// keying material): a fetch with a cluster token works, so both sides
// computed the same binding, and the binding is there on both ends of a
// TLS connection and differs between connections.
func TestTLSChannelBinding(t *testing.T) {
	ca := newTestCA(t, "cluster")
	token := func(c *Config) { c.ClusterToken = "s3cret" }
	prod := newNode(t, nil, ca.tlsEdit("prod", token), 32)
	cons := newNode(t, nil, ca.tlsEdit("cons", token), 32)
	keys := testKeys(3, 4)
	prod.store(t, keys)
	if got := cons.fetchFrom(t, "kv-1", prod.tier.Addr(), keys); fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Hit, offload.Hit, offload.Hit, offload.Hit}) {
		t.Fatalf("answers %v over TLS with a token, want four hits", got)
	}

	n := ca.network("node-a", 10*time.Second)
	ln, err := n.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var bindings [][]byte
	for range 2 {
		srv := make(chan []byte, 1)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				srv <- nil
				return
			}
			defer c.Close()
			var b [1]byte
			c.Read(b[:]) // finishes the handshake
			srv <- binding(c)
		}()
		c, err := n.Dial(context.Background(), ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte{1})
		mine := binding(c)
		theirs := <-srv
		c.Close()
		if len(mine) != 32 || string(mine) != string(theirs) {
			t.Fatalf("bindings %x (dialler) and %x (acceptor), want 32 equal bytes", mine, theirs)
		}
		bindings = append(bindings, mine)
	}
	if string(bindings[0]) == string(bindings[1]) {
		t.Error("two TLS connections have the same binding")
	}
}
