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
	"strconv"
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
	resp, err := c.open(ctx, method, path, q, rd)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
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

// open sends a request and returns a 200 answer for its body to be read;
// any other answer is an *APIError with the node's message.
func (c *Client) open(ctx context.Context, method, path string, q url.Values, body io.Reader) (*http.Response, error) {
	u := c.base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("cannot reach p2pd (is it running, and is the admin path right?): %w", err)
	}
	if resp.StatusCode == http.StatusOK {
		return resp, nil
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	var e struct{ Error string }
	if json.Unmarshal(data, &e) != nil || e.Error == "" {
		e.Error = strings.TrimSpace(string(data))
	}
	return nil, &APIError{Code: resp.StatusCode, Msg: e.Error}
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

// Events reads GET /v0/events from since (nil: only new events) and hands
// each line to fn, until the stream ends (follow false: once the events
// the node holds are read; follow true: when the node shuts down or ctx
// ends), fn returns an error, or a line does not decode. A clean end
// returns nil.
func (c *Client) Events(ctx context.Context, since *uint64, follow bool, fn func(api.Event) error) error {
	q := url.Values{"follow": {strconv.FormatBool(follow)}}
	if since != nil {
		q.Set("since", strconv.FormatUint(*since, 10))
	}
	resp, err := c.open(ctx, "GET", "/v0/events", q, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(resp.Body)
	for {
		var e api.Event
		switch err := dec.Decode(&e); {
		case err == io.EOF:
			return nil
		case err != nil && ctx.Err() != nil:
			return nil // the caller stopped following
		case err != nil:
			return fmt.Errorf("reading /v0/events: %w", err)
		}
		if err := fn(e); err != nil {
			return err
		}
	}
}

// AllBlocks pages through GET /v0/blocks for tier and returns every key
// and the first page's Seq: following /v0/events after that Seq over
// these keys gives what the tier holds.
func (c *Client) AllBlocks(ctx context.Context, tier string) (keys []string, seq uint64, err error) {
	cursor := ""
	for first := true; ; first = false {
		q := url.Values{"tier": {tier}, "limit": {"10000"}}
		if cursor != "" {
			q.Set("cursor", cursor)
		}
		var page api.Blocks
		if err := c.Do(ctx, "GET", "/v0/blocks", q, nil, &page); err != nil {
			return nil, 0, err
		}
		if first {
			seq = page.Seq
		}
		keys = append(keys, page.Keys...)
		if page.Next == "" {
			return keys, seq, nil
		}
		cursor = page.Next
	}
}
