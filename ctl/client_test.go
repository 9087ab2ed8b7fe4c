package ctl

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvtier/kvtier/p2pd/api"
)

// The client talks HTTP over a unix socket, decodes JSON answers and turns
// other answers into APIError with the server's message.
func TestClient(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "p2pd.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v0/status", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"node": "a", "state": "paused", "requests": {"running": 2, "waiting": 1}, "p2p_auth": "none"}`))
	})
	mux.HandleFunc("POST /v0/pause", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("mode") != "keep" {
			t.Errorf("query %v", r.URL.Query())
		}
		w.WriteHeader(504)
		w.Write([]byte(`{"error": "pause timed out"}`))
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	defer srv.Close()

	c := New(sock, "")
	ctx := context.Background()
	st, err := c.Status(ctx)
	if err != nil || st.Node != "a" || st.State != "paused" || st.Requests.Running != 2 || st.Requests.Waiting != 1 || st.P2PAuth != "none" {
		t.Errorf("Status = %+v, %v", st, err)
	}
	err = c.Do(ctx, "POST", "/v0/pause", url.Values{"mode": {"keep"}}, nil, nil)
	var ae *APIError
	if !errors.As(err, &ae) || ae.Code != 504 || ae.Msg != "pause timed out" {
		t.Errorf("pause error %v, want an APIError 504 with the server's message", err)
	}
	calls := 0
	err = c.Wait(ctx, time.Millisecond, func(s api.Status) bool { calls++; return calls == 3 }, nil)
	if err != nil || calls != 3 {
		t.Errorf("Wait: %v after %d polls", err, calls)
	}
	if _, err := New(filepath.Join(t.TempDir(), "none.sock"), "").Status(ctx); err == nil {
		t.Error("a missing socket gave no error")
	}
}
