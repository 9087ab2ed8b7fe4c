package p2p

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"time"
)

// TLSConfig configures mutual TLS on the P2P port (TLSNetwork): every
// control and TCP data connection, both ways.
type TLSConfig struct {
	// CertFile and KeyFile are this node's certificate (PEM, optionally
	// followed by intermediates) and its private key (PEM); the
	// certificate is presented both as a server and as a client, so it
	// must allow both uses (extended key usages serverAuth and clientAuth,
	// or none).
	CertFile, KeyFile string
	// CAFile holds the cluster CA certificates (PEM) that every peer's
	// certificate must chain to, and that this node's own must chain to.
	CAFile string
	// HandshakeTimeout bounds the handshake of an accepted connection
	// (default 5 s); a dialled connection's handshake is bounded by the
	// Dial context.
	HandshakeTimeout time.Duration
	// Logger logs the identity of each verified peer at debug level.
	Logger *slog.Logger
}

// tlsALPN names the protocol, so that a TLS client of another service
// holding a certificate of the same CA is refused.
const tlsALPN = "kvtier-p2p"

// TLSNetwork returns a Network that runs mutual TLS 1.3 over inner's
// connections. It loads the files now; a missing or bad file is an
// ErrConfig error naming its key (p2p_tls_cert, p2p_tls_key, p2p_tls_ca).
//
// Both sides present their certificate and verify the other's chain to
// the cluster CA (TLSConfig.CAFile), with its extended key usage. Node
// addresses are IPs or names that certificates need not hold, so no host
// name is checked: every holder of a certificate of the cluster CA is a
// cluster member, and may claim any node id and address. Use a CA that
// signs only the cluster's nodes.
//
// Accept never handshakes: the handshake of an accepted connection runs
// on its first Read or Write, bounded by TLSConfig.HandshakeTimeout (and
// by any deadline the caller set), after which a silent or failed client's
// connection is closed. Dial handshakes before it returns, bounded by its
// context (or HandshakeTimeout when the context has no deadline).
func TLSNetwork(inner Network, tc TLSConfig) (Network, error) {
	cert, pool, err := loadTLS(tc)
	if err != nil {
		return nil, err
	}
	n := &tlsNetwork{inner: inner, timeout: tc.HandshakeTimeout, log: tc.Logger}
	if n.timeout <= 0 {
		n.timeout = 5 * time.Second
	}
	if n.log == nil {
		n.log = slog.New(slog.DiscardHandler)
	}
	n.server = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		NextProtos:   []string{tlsALPN},
		// Every connection verifies the peer's certificate afresh.
		SessionTicketsDisabled: true,
		// Full-size records from the first byte: data connections carry
		// MiB-sized blocks, and control messages are not latency-bound
		// enough to gain from small first records.
		DynamicRecordSizingDisabled: true,
	}
	n.client = &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Always present the node certificate, so that a server of another
		// CA reports a bad certificate rather than a missing one.
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil },
		// No host name check (see above): VerifyConnection checks the
		// chain to the cluster CA instead of the standard verification.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := verifyChain(cs.PeerCertificates, pool, x509.ExtKeyUsageServerAuth)
			return err
		},
		NextProtos:                  []string{tlsALPN},
		DynamicRecordSizingDisabled: true,
	}
	n.log.Info("p2p: TLS on the P2P port", "cert", identity(cert.Leaf), "ca", tc.CAFile)
	return n, nil
}

type tlsNetwork struct {
	inner          Network
	server, client *tls.Config
	timeout        time.Duration
	log            *slog.Logger
}

func (n *tlsNetwork) Listen(addr string) (net.Listener, error) {
	ln, err := n.inner.Listen(addr)
	if err != nil {
		return nil, err
	}
	return &tlsListener{Listener: ln, n: n}, nil
}

func (n *tlsNetwork) Dial(ctx context.Context, addr string) (net.Conn, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, n.timeout)
		defer cancel()
	}
	raw, err := n.inner.Dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	sock := newBulkSocket(raw)
	tc := tls.Client(sock, n.client)
	// On ctx's end the handshake closes raw, so this wait is bounded by ctx.
	if err := tc.HandshakeContext(ctx); err != nil {
		raw.Close()
		return nil, fmt.Errorf("p2p: TLS handshake with %s: %w", addr, err)
	}
	n.log.Debug("p2p: TLS peer verified", "remote", raw.RemoteAddr(), "peer", identity(leaf(tc)))
	c := &tlsConn{Conn: tc, raw: raw, sock: sock, n: n}
	c.shook.Store(true)
	return c, nil
}

type tlsListener struct {
	net.Listener
	n *tlsNetwork
}

// Accept returns the next connection without handshaking with it.
func (l *tlsListener) Accept() (net.Conn, error) {
	raw, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	sock := newBulkSocket(raw)
	return &tlsConn{Conn: tls.Server(sock, l.n.server), raw: raw, sock: sock, n: l.n}, nil
}

// tlsConn is a TLS connection whose first Read or Write finishes the
// handshake within the network's handshake timeout, and whose Close never
// blocks.
type tlsConn struct {
	*tls.Conn
	raw   net.Conn
	sock  *bulkSocket // raw, as TLS writes to it (bulk.go)
	n     *tlsNetwork
	shook atomic.Bool
}

func (c *tlsConn) handshake() error {
	if c.shook.Load() {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.n.timeout)
	defer cancel()
	// On ctx's end (the handshake timeout) the handshake closes raw.
	if err := c.Conn.HandshakeContext(ctx); err != nil {
		return fmt.Errorf("p2p: TLS handshake with %s: %w", c.raw.RemoteAddr(), err)
	}
	if !c.shook.Swap(true) {
		c.n.log.Debug("p2p: TLS peer verified", "remote", c.raw.RemoteAddr(), "peer", identity(leaf(c.Conn)))
	}
	return nil
}

func (c *tlsConn) Read(b []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Read(b)
}

func (c *tlsConn) Write(b []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}

// Close closes the connection without a close_notify alert: sending one
// may block for seconds on a peer that stopped reading. The protocol has
// its own framing and goodbye, so a peer sees the end as an EOF.
func (c *tlsConn) Close() error { return c.raw.Close() }

func leaf(c *tls.Conn) *x509.Certificate {
	if cs := c.ConnectionState(); len(cs.PeerCertificates) > 0 {
		return cs.PeerCertificates[0]
	}
	return nil
}

// identity names a certificate in logs: subject, names and serial.
func identity(c *x509.Certificate) string {
	if c == nil {
		return "none"
	}
	s := []string{c.Subject.String()}
	s = append(s, c.DNSNames...)
	for _, ip := range c.IPAddresses {
		s = append(s, ip.String())
	}
	for _, u := range c.URIs {
		s = append(s, u.String())
	}
	return strings.Join(s, " ") + " serial " + c.SerialNumber.Text(16)
}

// verifyChain verifies that certs (a leaf and intermediates) chain to a
// root in pool for usage, now.
func verifyChain(certs []*x509.Certificate, pool *x509.CertPool, usage x509.ExtKeyUsage) ([][]*x509.Certificate, error) {
	if len(certs) == 0 {
		return nil, errors.New("p2p: the peer sent no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	return certs[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{usage}})
}

// loadTLS reads the three files, naming the key of the one that is bad.
func loadTLS(tc TLSConfig) (tls.Certificate, *x509.CertPool, error) {
	bad := func(key, file string, err error) (tls.Certificate, *x509.CertPool, error) {
		if file == "" { // err names the file
			return tls.Certificate{}, nil, fmt.Errorf("%w: %s: %w", ErrConfig, key, err)
		}
		return tls.Certificate{}, nil, fmt.Errorf("%w: %s: %s: %w", ErrConfig, key, file, err)
	}
	certPEM, err := os.ReadFile(tc.CertFile)
	if err != nil {
		return bad("p2p_tls_cert", "", err)
	}
	var chain []*x509.Certificate
	for rest := certPEM; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return bad("p2p_tls_cert", tc.CertFile, err)
		}
		chain = append(chain, c)
	}
	if len(chain) == 0 {
		return bad("p2p_tls_cert", tc.CertFile, errors.New("no PEM certificate"))
	}
	keyPEM, err := os.ReadFile(tc.KeyFile)
	if err != nil {
		return bad("p2p_tls_key", "", err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return bad("p2p_tls_key", tc.KeyFile, fmt.Errorf("not the key of p2p_tls_cert %s: %w", tc.CertFile, err))
	}
	caPEM, err := os.ReadFile(tc.CAFile)
	if err != nil {
		return bad("p2p_tls_ca", "", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return bad("p2p_tls_ca", tc.CAFile, errors.New("no PEM certificate"))
	}
	// Peers verify this certificate both ways; refuse to start with one
	// they would refuse.
	for _, u := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := verifyChain(chain, pool, u); err != nil {
			return bad("p2p_tls_cert", tc.CertFile, fmt.Errorf("not valid under p2p_tls_ca %s: %w", tc.CAFile, err))
		}
	}
	return cert, pool, nil
}
