// Command p2pd runs a kvtier node: the tiering manager with its CPU,
// disk and P2P tiers, a reference engine, and the admin API that kvctl
// drives. See docs/operations.md.
package main

import (
	"context"
	"errors"
	"expvar"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/node"
)

func main() {
	os.Exit(run())
}

func run() int {
	cfg, err := parse(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "p2pd:", err)
		return 2
	}
	log, err := logger(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "p2pd:", err)
		return 2
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	n, err := node.Start(cfg, log)
	if err != nil {
		log.Error("start failed", "err", err)
		if errors.Is(err, offload.ErrConfig) {
			return 2
		}
		return 1
	}
	expvar.Publish("kv_offload", offload.ExpvarFunc(n.M))
	log.Info("ready", "node", n.P2P.NodeID(), "admin", strings.Join(n.AdminAddrs(), ","), "p2p", n.P2P.Addr(), "copies", n.Eng.Backend())
	grace := time.Duration(cfg.ShutdownGrace)
	select {
	case sig := <-sigs:
		log.Info("signal", "signal", sig.String())
	case grace = <-n.ShutdownRequested():
	}
	done := make(chan error, 1)
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	go func() { done <- n.Shutdown(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			log.Error("shutdown", "err", err)
			return 1
		}
		log.Info("stopped")
		return 0
	case sig := <-sigs:
		log.Error("second signal: exiting at once", "signal", sig.String())
		return 1
	}
}

// parse builds the config: node.DefaultConfig, then -config's JSON, then
// the flags given. A flag's default is DefaultConfig's value (one source
// of defaults); a flag not given changes nothing.
func parse(args []string) (node.Config, error) {
	d := node.DefaultConfig()
	fs, apply := flags(d)
	configFile := fs.String("config", "", "JSON config file (snake_case keys; flags override it)")
	if err := fs.Parse(args); err != nil {
		return node.Config{}, err
	}
	if fs.NArg() > 0 {
		return node.Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	cfg := d
	if *configFile != "" {
		f, err := os.Open(*configFile)
		if err != nil {
			return cfg, err
		}
		cfg, err = node.LoadConfig(f)
		f.Close()
		if err != nil {
			return cfg, fmt.Errorf("%s: %w", *configFile, err)
		}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := apply(&cfg, set); err != nil {
		return cfg, err
	}
	return cfg, cfg.Validate()
}

// flags defines the config's flags, each defaulting to d's value, and
// returns the function that applies those in set to a config.
func flags(d node.Config) (*flag.FlagSet, func(cfg *node.Config, set map[string]bool) error) {
	fs := flag.NewFlagSet("p2pd", flag.ContinueOnError)
	var (
		nodeID     = fs.String("node-id", d.NodeID, "node id (default: random)")
		listen     = fs.String("p2p-listen", d.Listen, "P2P port: host:port")
		advertise  = fs.String("p2p-advertise", d.Advertise, "address peers dial back (default: the listener's)")
		admin      = fs.String("admin", d.Admin, "admin unix socket (mode 0600)")
		adminTCP   = fs.String("admin-tcp", d.AdminTCP, "also serve the admin API on this loopback host:port")
		model      = fs.String("model", geometryName(d.Geometry), "geometry preset: "+strings.Join(offload.GeometryNames(), " or "))
		layers     = fs.Int("layers", d.Geometry.Layers, "custom geometry: layers")
		kvHeads    = fs.Int("kv-heads", d.Geometry.KVHeads, "custom geometry: KV heads")
		headDim    = fs.Int("head-dim", d.Geometry.HeadDim, "custom geometry: head dim")
		blockTok   = fs.Int("block-tokens", d.Geometry.BlockTokens, "custom geometry: tokens per block")
		dtypeBytes = fs.Int("dtype-bytes", d.Geometry.DTypeBytes(), "custom geometry: bytes per element (1, 2 or 4)")
		cpuSlots   = fs.Int("cpu-slots", d.CPUSlots, "CPU tier slots (overrides cpu_bytes)")
		gpuBlocks  = fs.Int("gpu-blocks", d.GPUBlocks, "GPU KV cache blocks")
		loadWindow = fs.Int("load-window", d.LoadWindow, "blocks of a prefix asked about at once (a peer's lookup round); the ready ones load meanwhile (0: the whole prefix at once)")
		diskDir    = fs.String("disk-dir", d.DiskDir, "disk tier directory (default: no disk tier)")
		diskBytes  = fs.Int64("disk-bytes", d.DiskBytes, "disk tier cap in bytes")
		pollEvery  = fs.Duration("tier-poll-interval", time.Duration(d.TierPollInterval), "how often the poll goroutine services polled tiers (≤ 0: engine steps service them; docs/operations.md)")
		hitPending = fs.Duration("hit-pending-timeout", time.Duration(d.HitPendingTimeout), "HitPending bound")
		hashSeed   = fs.String("hash-seed", d.HashSeed, "block key hash seed")
		hashAlgo   = fs.String("hash-algo", d.HashAlgo, "block key scheme: "+strings.Join(offload.HashAlgos, " or ")+" (vLLM's sha256_cbor, with -hash-seed "+offload.VLLMDefaultSeed+" unless vLLM's PYTHONHASHSEED is set)")
		tokenFile  = fs.String("cluster-token-file", d.ClusterTokenFile, "file holding the cluster token (none: the P2P port is unauthenticated)")
		tlsCert    = fs.String("p2p-tls-cert", d.TLSCert, "P2P mutual TLS: this node's certificate (PEM; with -p2p-tls-key and -p2p-tls-ca)")
		tlsKey     = fs.String("p2p-tls-key", d.TLSKey, "P2P mutual TLS: this node's private key (PEM)")
		tlsCA      = fs.String("p2p-tls-ca", d.TLSCA, "P2P mutual TLS: the cluster CA certificates (PEM)")
		peers      = fs.String("peers", strings.Join(d.Peers, ","), "comma-separated peers dialled at start")
		dataPlane  = fs.String("data-plane", d.DataPlane, "P2P data plane: tcp, or nixl in a binary built with -tags nixl (with -p2p-dialect vllm: nixl, or none: no blocks move)")
		dialect    = fs.String("p2p-dialect", d.Dialect, "P2P wire: kvtier, or vllm (vLLM's G2 P2P wire; needs -hash-algo vllm-sha256-cbor with vLLM's -hash-seed, and -p2p-listen naming a host or -p2p-advertise host:port; docs/vllm.md)")
		dataConns  = fs.Int("data-conns", d.DataConns, "TCP data connections per peer")
		dataNice   = fs.Int("data-nice", d.DataNice, "nice value (0-19) of the threads moving block bytes")
		bulk       = fs.Int("bulk-concurrency", d.BulkConcurrency, "blocks written at once across all peers (0: GOMAXPROCS, one fewer while the engine has requests)")
		kvEvents   = fs.String("kv-events-endpoint", d.KVEventsEndpoint, "publish KV events in vLLM's format on a ZMQ PUB socket bound here (host:port; needs -hash-algo vllm-sha256-cbor)")
		kvTopic    = fs.String("kv-events-topic", d.KVEventsTopic, "the topic of vLLM-format KV events")
		evHistory  = fs.Int("event-history", d.EventHistory, "events kept for /v0/events readers that resume or fall behind")
		grace      = fs.Duration("shutdown-grace", time.Duration(d.ShutdownGrace), "grace for running requests on shutdown")
		copies     = fs.String("copy-backend", d.CopyBackend, "GPU copies: auto, cuda or host")
		logFormat  = fs.String("log-format", d.LogFormat, "text or json")
		logLevel   = fs.String("log-level", d.LogLevel, "debug, info, warn or error")
	)
	return fs, func(cfg *node.Config, set map[string]bool) error {
		apply := func(name string, fn func()) {
			if set[name] {
				fn()
			}
		}
		apply("node-id", func() { cfg.NodeID = *nodeID })
		apply("p2p-listen", func() { cfg.Listen = *listen })
		apply("p2p-advertise", func() { cfg.Advertise = *advertise })
		apply("admin", func() { cfg.Admin = *admin })
		apply("admin-tcp", func() { cfg.AdminTCP = *adminTCP })
		if set["model"] {
			g, err := offload.GeometryByName(*model)
			if err != nil {
				return err
			}
			cfg.Geometry = g
		}
		apply("layers", func() { cfg.Geometry.Layers = *layers })
		apply("kv-heads", func() { cfg.Geometry.KVHeads = *kvHeads })
		apply("head-dim", func() { cfg.Geometry.HeadDim = *headDim })
		apply("block-tokens", func() { cfg.Geometry.BlockTokens = *blockTok })
		if set["dtype-bytes"] {
			cfg.Geometry.DType = map[int]string{1: "fp8", 2: "bf16", 4: "fp32"}[*dtypeBytes]
			if cfg.Geometry.DType == "" {
				return fmt.Errorf("-dtype-bytes %d: want 1, 2 or 4", *dtypeBytes)
			}
		}
		apply("cpu-slots", func() { cfg.CPUSlots = *cpuSlots })
		apply("gpu-blocks", func() { cfg.GPUBlocks = *gpuBlocks })
		apply("load-window", func() { cfg.LoadWindow = *loadWindow })
		apply("event-history", func() { cfg.EventHistory = *evHistory })
		apply("kv-events-endpoint", func() { cfg.KVEventsEndpoint = *kvEvents })
		apply("kv-events-topic", func() { cfg.KVEventsTopic = *kvTopic })
		apply("disk-dir", func() { cfg.DiskDir = *diskDir })
		apply("disk-bytes", func() { cfg.DiskBytes = *diskBytes })
		apply("tier-poll-interval", func() { cfg.TierPollInterval = offload.Duration(*pollEvery) })
		apply("hit-pending-timeout", func() { cfg.HitPendingTimeout = offload.Duration(*hitPending) })
		apply("hash-seed", func() { cfg.HashSeed = *hashSeed })
		apply("hash-algo", func() { cfg.HashAlgo = *hashAlgo })
		apply("cluster-token-file", func() { cfg.ClusterTokenFile = *tokenFile })
		apply("p2p-tls-cert", func() { cfg.TLSCert = *tlsCert })
		apply("p2p-tls-key", func() { cfg.TLSKey = *tlsKey })
		apply("p2p-tls-ca", func() { cfg.TLSCA = *tlsCA })
		apply("shutdown-grace", func() { cfg.ShutdownGrace = offload.Duration(*grace) })
		apply("copy-backend", func() { cfg.CopyBackend = *copies })
		apply("data-plane", func() { cfg.DataPlane = *dataPlane })
		apply("p2p-dialect", func() { cfg.Dialect = *dialect })
		apply("data-conns", func() { cfg.DataConns = *dataConns })
		apply("data-nice", func() { cfg.DataNice = *dataNice })
		apply("bulk-concurrency", func() { cfg.BulkConcurrency = *bulk })
		apply("log-format", func() { cfg.LogFormat = *logFormat })
		apply("log-level", func() { cfg.LogLevel = *logLevel })
		apply("peers", func() {
			cfg.Peers = nil
			for _, p := range strings.Split(*peers, ",") {
				if p = strings.TrimSpace(p); p != "" {
					cfg.Peers = append(cfg.Peers, p)
				}
			}
		})
		return nil
	}
}

// geometryName is the preset g is, for -model's default.
func geometryName(g offload.Geometry) string {
	for _, name := range offload.GeometryNames() {
		if offload.Geometries[name] == g {
			return name
		}
	}
	return ""
}

func logger(cfg node.Config) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); err != nil {
		return nil, fmt.Errorf("log_level %q: %w", cfg.LogLevel, err)
	}
	opts := &slog.HandlerOptions{Level: level}
	if cfg.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
}
