// Command kvctl drives a p2pd node through its admin API: status, pause,
// resume, shutdown, reset-cache, scrub, submit, keys, metrics, peers,
// events, blocks, pins.
//
// Exit status: 0 on success, 1 when the operation failed, 2 on a usage
// error.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/p2pd/api"
)

const usage = `usage: kvctl [-admin PATH | -admin-tcp ADDR] COMMAND [flags]

commands:
  status [--json]                          the node's state
  pause [--mode wait|abort|keep] [--clear-cache] [--timeout 60s]
  resume
  shutdown [--grace 30s]
  reset-cache
  scrub [--json]                           verify every CPU block against its checksum
  submit (--tokens-seed S --tokens N | --tokens-file F)
         [--remote-kv-source host:port --kv-request-id ID] [--request-id ID] [--fetch-only]
         [--digest sha256|crc32c|none] [--json]
  metrics                                  Prometheus text
  peers [--json]
  keys (--tokens-seed S --tokens N | --tokens-file F) [--json]
                                           the node's block keys for a prompt, one hex key a line
  events [--since N] [--follow] [--json]   what the tiers stored and removed (S2.8)
  blocks [--tier cpu|disk] [--json]        every block a tier holds, and the event it is current to
  pins [--older-than 30s] [--json]         the CPU tier's pins, oldest first (S1.3)
`

// authText says what status's p2p_auth means.
// wireText says which P2P wire the node speaks, what moves its blocks
// and whether they are checksummed.
func wireText(s api.Status) string {
	sums := "blocks checked with CRC32C"
	if !s.P2PChecksums {
		sums = "no checksums"
	}
	if s.P2PDataPlane == "none" {
		sums = "no blocks move"
	}
	return fmt.Sprintf("%s, data plane %s, %s", s.P2PDialect, s.P2PDataPlane, sums)
}

func authText(auth string) string {
	switch auth {
	case "none":
		return "none (anyone who can reach the P2P port can fetch and inject KV blocks)"
	case "":
		return "unknown"
	}
	return auth
}

type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func main() {
	err := run(os.Args[1:], os.Stdout, os.Stderr)
	var ue usageError
	switch {
	case err == nil:
	case errors.As(err, &ue):
		fmt.Fprintf(os.Stderr, "kvctl: %v\n\n%s", err, usage)
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "kvctl:", err)
		os.Exit(1)
	}
}

func run(args []string, out, errw io.Writer) error {
	top := flag.NewFlagSet("kvctl", flag.ContinueOnError)
	top.SetOutput(io.Discard)
	admin := top.String("admin", "./p2pd.sock", "p2pd's admin socket")
	adminTCP := top.String("admin-tcp", "", "p2pd's admin loopback TCP address")
	if err := top.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if top.NArg() == 0 {
		return usageError{"no command"}
	}
	c := ctl.New(*admin, *adminTCP)
	cmd, rest := top.Arg(0), top.Args()[1:]
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	asJSON := fs.Bool("json", false, "print JSON")
	ctx := context.Background()
	interactive := isTerminal(errw)
	switch cmd {
	case "status":
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		s, err := c.Status(ctx)
		if err != nil {
			return err
		}
		if *asJSON {
			return printJSON(out, s)
		}
		fmt.Fprintf(out, "node %s (%s): %s\nrequests: %d running, %d waiting\nCPU tier: %d of %d slots used, %d pinned\npeers: %d · pending work: %v · poll goroutine: %s · copies: %s\nP2P authentication: %s\nP2P wire: %s\nP2P port: %s\nblocks: %d bytes, %d tokens · keys: %s, seed %q\n",
			s.Node, s.P2P, s.State, s.Requests.Running, s.Requests.Waiting, s.CPUTier.Used, s.CPUTier.Slots, s.CPUTier.Pinned,
			s.Peers, s.HasPendingWork, s.Poll, s.Copies, authText(s.P2PAuth), wireText(s), healthText(s.P2PHealth), s.BlockBytes, s.BlockTokens, s.HashAlgo, s.HashSeed)
		return nil
	case "pause":
		mode := fs.String("mode", "wait", "wait, abort or keep")
		clearCache := fs.Bool("clear-cache", false, "reset the cache once quiet")
		timeout := fs.Duration("timeout", 60*time.Second, "give up after this long")
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		q := url.Values{"mode": {*mode}, "clear_cache": {strconv.FormatBool(*clearCache)}, "timeout": {timeout.String()}}
		var res map[string]any
		stop := progress(ctx, c, interactive, errw, "pausing")
		err := c.Do(ctx, "POST", "/v0/pause", q, nil, &res)
		stop()
		if err != nil {
			return explain(err)
		}
		fmt.Fprintf(out, "paused in %v ms\n", res["elapsed_ms"])
		return nil
	case "resume":
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		if err := c.Do(ctx, "POST", "/v0/resume", nil, nil, nil); err != nil {
			return explain(err)
		}
		fmt.Fprintln(out, "running")
		return nil
	case "shutdown":
		grace := fs.Duration("grace", 30*time.Second, "time running requests get to finish")
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		if err := c.Do(ctx, "POST", "/v0/shutdown", url.Values{"grace": {grace.String()}}, nil, nil); err != nil {
			return explain(err)
		}
		// Wait until the node is gone, showing what still runs.
		wctx, cancel := context.WithTimeout(ctx, *grace+30*time.Second)
		defer cancel()
		err := c.Wait(wctx, 100*time.Millisecond, func(api.Status) bool { return false }, func(s api.Status) {
			if interactive {
				fmt.Fprintf(errw, "\rshutting down: %d requests running   ", s.Requests.Running)
			}
		})
		if interactive {
			fmt.Fprintln(errw)
		}
		var ne *net.OpError
		if err != nil && !errors.As(err, &ne) && !strings.Contains(err.Error(), "cannot reach") {
			return err
		}
		fmt.Fprintln(out, "stopped")
		return nil
	case "scrub":
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		var res api.Scrub
		if err := c.Do(ctx, "POST", "/v0/scrub", nil, nil, &res); err != nil {
			return explain(err)
		}
		if *asJSON {
			if err := printJSON(out, res); err != nil {
				return err
			}
		} else {
			scrubText(out, res)
		}
		if res.Mismatched > 0 {
			return fmt.Errorf("%d corrupt blocks removed (memory errors?)", res.Mismatched)
		}
		return nil
	case "reset-cache":
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		var res map[string]any
		if err := c.Do(ctx, "POST", "/v0/reset-cache", nil, nil, &res); err != nil {
			return explain(err)
		}
		fmt.Fprintf(out, "cache reset in %v ms\n", res["elapsed_ms"])
		return nil
	case "submit":
		seed := fs.String("tokens-seed", "", "seed of a generated prompt")
		n := fs.Int("tokens", 0, "length of the generated prompt")
		file := fs.String("tokens-file", "", "file of whitespace-separated token ids")
		src := fs.String("remote-kv-source", "", "host:port of a peer to fetch KV from")
		kvID := fs.String("kv-request-id", "", "the request id both peers use")
		id := fs.String("request-id", "", "this node's request id (default: generated)")
		digest := fs.String("digest", "", "kv_digest: crc32c (default: off the copies' checksums), sha256 (reads every block again) or none")
		fetchOnly := fs.Bool("fetch-only", false, "load what tiers and peers hold of the prefix, compute nothing (a cache node taking KV from a vLLM instance)")
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		var body api.Request
		p, err := promptOf(*file, *seed, *n)
		if err != nil {
			return err
		}
		body.PromptTokenIDs, body.Seed, body.Tokens = p.PromptTokenIDs, p.Seed, p.Tokens
		if *id != "" {
			body.RequestID = *id
		}
		if *digest != "" {
			body.Digest = *digest
		}
		body.FetchOnly = *fetchOnly
		if *src != "" {
			host, port, err := net.SplitHostPort(*src)
			if err != nil || *kvID == "" {
				return usageError{"--remote-kv-source wants host:port, together with --kv-request-id"}
			}
			portN, err := strconv.Atoi(port)
			if err != nil {
				return usageError{"--remote-kv-source wants host:port with a numeric port"}
			}
			body.TransferParams = map[string]any{"remote_kv_source": map[string]any{"kv_request_id": *kvID, "remote_host": host, "remote_port": portN}} // an integer, as vLLM reads it
		}
		var res api.Result
		var raw string
		if err := c.Do(ctx, "POST", "/v0/requests", nil, body, &raw); err != nil {
			return explain(err)
		}
		if *asJSON {
			fmt.Fprint(out, raw)
			return nil
		}
		json.Unmarshal([]byte(raw), &res)
		missed := ""
		if res.Sources.Missed > 0 {
			missed = fmt.Sprintf(", missed %d", res.Sources.Missed)
		}
		fmt.Fprintf(out, "%s: %d blocks (cpu %d, disk %d, peer %d, computed %d%s) in %.1f ms\nkv_digest %s\n", res.RequestID, res.Blocks,
			res.Sources.CPU, res.Sources.Disk, res.Sources.Peer, res.Sources.Computed, missed, res.ElapsedMS, res.KVDigest)
		return nil
	case "metrics":
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		var text string
		if err := c.Do(ctx, "GET", "/metrics", nil, nil, &text); err != nil {
			return explain(err)
		}
		fmt.Fprint(out, text)
		return nil
	case "peers":
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		var res api.Peers
		if err := c.Do(ctx, "GET", "/v0/peers", nil, nil, &res); err != nil {
			return explain(err)
		}
		if *asJSON {
			return printJSON(out, res)
		}
		if len(res.Peers) == 0 {
			fmt.Fprintln(out, "no peers")
		}
		for _, p := range res.Peers {
			fmt.Fprintf(out, "%-20s %-22s ready=%v dialed=%v requests=%d rounds=%d\n", p.Node, p.Addr, p.Ready, p.Dialed, p.Requests, p.Rounds)
		}
		return nil
	case "keys":
		seed := fs.String("tokens-seed", "", "seed of a generated prompt")
		n := fs.Int("tokens", 0, "length of the generated prompt")
		file := fs.String("tokens-file", "", "file of whitespace-separated token ids")
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		p, err := promptOf(*file, *seed, *n)
		if err != nil {
			return err
		}
		var res api.Keys
		if err := c.Do(ctx, "POST", "/v0/keys", nil, p, &res); err != nil {
			return explain(err)
		}
		if *asJSON {
			return printJSON(out, res)
		}
		for _, k := range res.Keys {
			fmt.Fprintln(out, k)
		}
		return nil
	case "events":
		follow := fs.Bool("follow", false, "keep following until the node shuts down (Ctrl-C ends it)")
		since := fs.String("since", "0", "print the events after this sequence number (0: every event the node still holds)")
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		s, err := strconv.ParseUint(*since, 10, 64)
		if err != nil {
			return usageError{fmt.Sprintf("--since %q: not a sequence number", *since)}
		}
		if *follow {
			var stop context.CancelFunc
			ctx, stop = signalContext(ctx)
			defer stop()
		}
		enc := json.NewEncoder(out)
		return explain(c.Events(ctx, &s, *follow, func(e api.Event) error {
			if *asJSON {
				return enc.Encode(e)
			}
			_, err := fmt.Fprintln(out, eventText(e))
			return err
		}))
	case "blocks":
		tier := fs.String("tier", "cpu", "the tier: cpu or disk")
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		keys, seq, err := c.AllBlocks(ctx, *tier)
		if err != nil {
			return explain(err)
		}
		if *asJSON {
			return printJSON(out, api.Blocks{Tier: *tier, Seq: seq, Keys: keys})
		}
		fmt.Fprintf(out, "%s: %d blocks (as of event %d)\n", *tier, len(keys), seq)
		for _, k := range keys {
			fmt.Fprintln(out, k)
		}
		return nil
	case "pins":
		older := fs.Duration("older-than", 0, "only pins held at least this long")
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error()}
		}
		var res api.Pins
		if err := c.Do(ctx, "GET", "/v0/pins", url.Values{"older_than": {older.String()}}, nil, &res); err != nil {
			return explain(err)
		}
		if *asJSON {
			return printJSON(out, res)
		}
		if len(res.Pins) == 0 {
			fmt.Fprintf(out, "no pins older than %v\n", *older)
		}
		for _, p := range res.Pins {
			d := ""
			if p.Detached {
				d = " (detached by a reset)"
			}
			fmt.Fprintf(out, "%s slot %-6d %-24s %8.1f s%s\n", p.Key[:16], p.Slot, p.Owner, p.AgeMS/1000, d)
		}
		return nil
	}
	return usageError{fmt.Sprintf("unknown command %q", cmd)}
}

// promptOf reads the prompt flags: --tokens-file F, or --tokens-seed S
// with --tokens N.
func promptOf(file, seed string, n int) (api.KeysRequest, error) {
	var p api.KeysRequest
	switch {
	case file != "" && seed == "":
		toks, err := readTokens(file)
		if err != nil {
			return p, err
		}
		p.PromptTokenIDs = toks
	case seed != "" && file == "" && n > 0:
		s, err := strconv.ParseUint(seed, 10, 64)
		if err != nil {
			return p, usageError{"--tokens-seed wants a non-negative integer"}
		}
		p.Seed, p.Tokens = &s, n
	default:
		return p, usageError{"give --tokens-seed S --tokens N, or --tokens-file F"}
	}
	return p, nil
}

// eventText is one event as a line for people.
func eventText(e api.Event) string {
	switch e.Kind {
	case "cleared":
		return fmt.Sprintf("%8d cleared  %s (epoch %d)", e.Seq, e.Tier, e.Epoch)
	case "lost":
		return fmt.Sprintf("%8d lost     %d events (resynchronise with kvctl blocks)", e.Seq, e.Lost)
	}
	first := ""
	if len(e.Keys) > 0 {
		first = e.Keys[0][:16]
	}
	tokens := ""
	if len(e.TokenIDs) > 0 {
		tokens = fmt.Sprintf(", %d token ids", len(e.TokenIDs))
	}
	return fmt.Sprintf("%8d %-8s %-5s %d blocks from %s%s", e.Seq, e.Kind, e.Tier, len(e.Keys), first, tokens)
}

func printJSON(w io.Writer, v any) error {
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	return e.Encode(v)
}

// explain adds what to try to the API's errors.
func explain(err error) error {
	var ae *ctl.APIError
	if !errors.As(err, &ae) {
		return err
	}
	switch ae.Code {
	case 504:
		return fmt.Errorf("%w (try a longer --timeout, or --mode abort)", err)
	case 409:
		return fmt.Errorf("%w (check kvctl status)", err)
	case 503:
		return fmt.Errorf("%w (the node is shutting down)", err)
	}
	return err
}

// progress shows, on a terminal, what a long wait is waiting for.
func progress(ctx context.Context, c *ctl.Client, on bool, w io.Writer, what string) func() {
	if !on {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Wait(ctx, 500*time.Millisecond, func(api.Status) bool { return false }, func(s api.Status) {
			fmt.Fprintf(w, "\r%s: %d running, %d waiting   ", what, s.Requests.Running, s.Requests.Waiting)
		})
	}()
	return func() {
		cancel()
		<-done
		fmt.Fprint(w, "\r"+strings.Repeat(" ", 50)+"\r")
	}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func readTokens(path string) ([]uint32, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []uint32
	sc := bufio.NewScanner(f)
	sc.Split(bufio.ScanWords)
	for sc.Scan() {
		v, err := strconv.ParseUint(sc.Text(), 10, 32)
		if err != nil || v > math.MaxUint32 {
			return nil, fmt.Errorf("%s: %q is not a token id", path, sc.Text())
		}
		out = append(out, uint32(v))
	}
	return out, sc.Err()
}

// healthText describes the P2P port's accept loop.
func healthText(h api.Health) string {
	switch {
	case !h.Accepting:
		return "NOT ACCEPTING (the listener closed; restart the node)"
	case !h.OK:
		return fmt.Sprintf("accept errors (%d in all; last %s: %s)", h.AcceptErrors, h.LastErrorAt.Format(time.RFC3339), h.LastAcceptError)
	case h.AcceptErrors > 0:
		return fmt.Sprintf("accepting (%d accept errors since start)", h.AcceptErrors)
	}
	return "accepting"
}

// signalContext ends with Ctrl-C or SIGTERM: following events ends cleanly.
func signalContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
}

// scrubText prints a scrub's result as a line of text.
func scrubText(out io.Writer, res api.Scrub) {
	fmt.Fprintf(out, "scrubbed %d blocks in %.0f ms: %d disagreed with their checksum and were removed", res.Checked, res.ElapsedMS, res.Mismatched)
	if res.Unrecorded > 0 {
		fmt.Fprintf(out, "; %d had no checksum kept (now recorded)", res.Unrecorded)
	}
	fmt.Fprintln(out)
}
