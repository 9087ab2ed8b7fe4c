// Package pki makes a throwaway cluster CA and node certificates (ECDSA
// P-256, PEM files) for the P2P tier's mutual TLS in tests and benchmarks.
package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"time"
)

// Files are one node's p2p_tls_cert, p2p_tls_key and p2p_tls_ca.
type Files struct{ Cert, Key, CA string }

// Args are the p2pd flags that name the files.
func (f Files) Args() []string {
	return []string{"-p2p-tls-cert", f.Cert, "-p2p-tls-key", f.Key, "-p2p-tls-ca", f.CA}
}

// CA is a certificate authority whose files live in a directory.
type CA struct {
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	file string
}

// NewCA makes a CA named name, valid for a day, writing its certificate
// into dir.
func NewCA(dir, name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{dir: dir, cert: cert, key: key}
	ca.file, err = write(dir, name+"-ca.pem", "CERTIFICATE", der)
	return ca, err
}

// Node issues name a certificate for both TLS server and client use
// (a DNS name only: node addresses need not be in it) and writes it and
// its key beside the CA's.
func (ca *CA) Node(name string) (Files, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Files{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return Files{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &k.PublicKey, ca.key)
	if err != nil {
		return Files{}, err
	}
	kder, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return Files{}, err
	}
	f := Files{CA: ca.file}
	if f.Cert, err = write(ca.dir, name+".pem", "CERTIFICATE", der); err != nil {
		return f, err
	}
	f.Key, err = write(ca.dir, name+"-key.pem", "PRIVATE KEY", kder)
	return f, err
}

func write(dir, name, typ string, der []byte) (string, error) {
	p := filepath.Join(dir, name)
	return p, os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}
