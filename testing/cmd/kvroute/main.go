// Command kvroute is issue 14's worked example of a KV-cache-aware router
// (package testing/route): it follows the event streams of the p2pd nodes
// named with -node and answers, for a prompt, the node holding its longest
// cached prefix — the remote_kv_source for the request's
// kv_transfer_params.
//
//	kvroute -node a=/run/a.sock -node b=/run/b.sock [-listen 127.0.0.1:8700]
//	        [-hash-algo kvtier] [-hash-seed kvtier-v1] [-block-tokens 16]
//
// A node whose status names another key scheme, seed or block size is not
// followed (its keys would never match; the log says why).
//
//	POST /route {"prompt_token_ids": [...], "except": "b", "kv_request_id": "r1"}
//	→ {"node": "a", "p2p": "127.0.0.1:4100", "blocks": 12, "of": 14,
//	   "remote_kv_source": {"kv_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 4100}}
//
// except names the node the request goes to (it needs no peer for what it
// holds itself). It stops on SIGINT or SIGTERM.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/testing/route"
)

type nodeFlags map[string]string

func (n nodeFlags) String() string { return fmt.Sprint(map[string]string(n)) }

func (n nodeFlags) Set(v string) error {
	name, sock, ok := strings.Cut(v, "=")
	if !ok || name == "" || sock == "" {
		return fmt.Errorf("want NAME=ADMIN_SOCKET, not %q", v)
	}
	n[name] = sock
	return nil
}

func main() {
	nodes := nodeFlags{}
	flag.Var(nodes, "node", "a node to follow, NAME=ADMIN_SOCKET (repeatable)")
	listen := flag.String("listen", "127.0.0.1:8700", "where to answer POST /route")
	seed := flag.String("hash-seed", "kvtier-v1", "the nodes' hash_seed")
	blockTokens := flag.Int("block-tokens", 16, "tokens per block of the nodes' geometry")
	algo := flag.String("hash-algo", "kvtier", "the nodes' hash_algo: kvtier or vllm-sha256-cbor (a node that differs is not followed)")
	flag.Parse()
	if len(nodes) == 0 {
		fmt.Fprintln(os.Stderr, "kvroute: no -node given")
		os.Exit(2)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, nodes, *listen, route.Scheme{Algo: *algo, Seed: *seed, BlockTokens: *blockTokens}, log); err != nil {
		fmt.Fprintln(os.Stderr, "kvroute:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, nodes nodeFlags, listen string, scheme route.Scheme, log *slog.Logger) error {
	r := route.New(scheme, log)
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	for name, sock := range nodes {
		wg.Go(func() { r.Follow(ctx, name, ctl.New(sock, ""), time.Second) })
	}
	srv := &http.Server{Handler: handler(r), ReadHeaderTimeout: 10 * time.Second}
	log.Info("kvroute: ready", "listen", ln.Addr().String(), "nodes", len(nodes))
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(shut)
	}()
	err = srv.Serve(ln)
	wg.Wait()
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

func handler(r *route.Router) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /route", func(w http.ResponseWriter, req *http.Request) {
		var body struct {
			Tokens []uint32 `json:"prompt_token_ids"`
			Except string   `json:"except"`
			KVID   string   `json:"kv_request_id"`
		}
		dec := json.NewDecoder(http.MaxBytesReader(w, req.Body, 64<<20))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&body); err != nil {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(400)
			json.NewEncoder(w).Encode(map[string]string{"error": err.Error()})
			return
		}
		c := r.Route(body.Tokens, body.Except)
		out := struct {
			route.Choice
			Source map[string]any `json:"remote_kv_source,omitempty"`
		}{c, c.RemoteSource(body.KVID)}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(out)
	})
	return mux
}
