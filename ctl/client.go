// Package ctl is the client side of p2pd's admin API: kvctl's commands.
// Besides the standard library it imports only p2pd/api, the API's
// request and answer types.
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

	"github.com/kvtier/kvtier/p2pd/api"
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

// Status fetches the node's status.
func (c *Client) Status(ctx context.Context) (api.Status, error) {
	var s api.Status
	err := c.Do(ctx, "GET", "/v0/status", nil, nil, &s)
	return s, err
}

// Wait polls status every interval until done(status) or ctx ends,
// calling progress with each status.
func (c *Client) Wait(ctx context.Context, every time.Duration, done func(api.Status) bool, progress func(api.Status)) error {
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
