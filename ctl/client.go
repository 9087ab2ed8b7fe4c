// Package ctl is the client side of p2pd's admin API: kvctl's commands.
// It uses the standard library only and imports no other kvtier module.
package ctl

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// Client talks to one p2pd's admin API.
type Client struct {
	http *http.Client
	base string
}

// New returns a client for a unix socket path, or for a loopback TCP
// address when tcp is set.
func New(socket, tcp string) *Client {
	if tcp != "" {
		return &Client{http: &http.Client{}, base: "http://" + tcp}
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}
	return &Client{http: &http.Client{Transport: tr}, base: "http://p2pd"}
}

// APIError is an answer other than 200.
type APIError struct {
	Code int
	Msg  string
}

func (e *APIError) Error() string { return fmt.Sprintf("p2pd answered %d: %s", e.Code, e.Msg) }

// Do sends a request and decodes a JSON answer into out (raw text when out
// is a *string).
func (c *Client) Do(ctx context.Context, method, path string, q url.Values, body any, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = strings.NewReader(string(b))
	}
	u := c.base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach p2pd (is it running, and is the admin path right?): %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		var e struct{ Error string }
		if json.Unmarshal(data, &e) != nil || e.Error == "" {
			e.Error = strings.TrimSpace(string(data))
		}
		return &APIError{Code: resp.StatusCode, Msg: e.Error}
	}
	switch o := out.(type) {
	case nil:
		return nil
	case *string:
		*o = string(data)
		return nil
	}
	return json.Unmarshal(data, out)
}

// Result is p2pd's answer to POST /v0/requests.
type Result struct {
	RequestID string `json:"request_id"`
	Blocks    int    `json:"blocks"`
	Sources   struct {
		CPU      int `json:"cpu"`
		Disk     int `json:"disk"`
		Peer     int `json:"peer"`
		Computed int `json:"computed"`
	} `json:"sources"`
	KVDigest  string  `json:"kv_digest"`
	ElapsedMS float64 `json:"elapsed_ms"`
}

// Peers is p2pd's GET /v0/peers.
type Peers struct {
	Node  string `json:"node"`
	P2P   string `json:"p2p"`
	Peers []struct {
		Node     string `json:"node"`
		Addr     string `json:"addr"`
		Ready    bool   `json:"ready"`
		Dialed   bool   `json:"dialed"`
		Requests int    `json:"requests"`
		Rounds   int    `json:"rounds"`
	} `json:"peers"`
}

// Status is p2pd's GET /v0/status.
type Status struct {
	Node     string `json:"node"`
	State    string `json:"state"`
	Requests struct {
		Running int `json:"running"`
		Waiting int `json:"waiting"`
	} `json:"requests"`
	CPUTier struct {
		Slots  int `json:"slots"`
		Used   int `json:"used"`
		Pinned int `json:"pinned"`
	} `json:"cpu_tier"`
	Peers          int    `json:"peers"`
	HasPendingWork bool   `json:"has_pending_work"`
	Poll           string `json:"poll"`
	P2P            string `json:"p2p"`
	// P2PAuth is "token", "tls", "token+tls" or "none" (the P2P port is
	// unauthenticated).
	P2PAuth string `json:"p2p_auth"`
	// P2PHealth is the P2P port's accept loop.
	P2PHealth P2PHealth `json:"p2p_health"`
	Copies    string    `json:"copies"`
}

// P2PHealth mirrors p2p.Health: OK unless the P2P accept loop stopped or
// failed in the last 10 s.
type P2PHealth struct {
	OK              bool      `json:"ok"`
	Accepting       bool      `json:"accepting"`
	AcceptErrors    uint64    `json:"accept_errors"`
	LastAcceptError string    `json:"last_accept_error,omitempty"`
	LastErrorAt     time.Time `json:"last_accept_error_at,omitzero"`
}

// Status fetches the node's status.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var s Status
	err := c.Do(ctx, "GET", "/v0/status", nil, nil, &s)
	return s, err
}

// Wait polls status every interval until done(status) or ctx ends,
// calling progress with each status.
func (c *Client) Wait(ctx context.Context, every time.Duration, done func(Status) bool, progress func(Status)) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		s, err := c.Status(ctx)
		if err != nil {
			return err
		}
		if done(s) {
			return nil
		}
		if progress != nil {
			progress(s)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
