// Command p2pd runs a kvtier node: the tiering manager with its CPU,
// disk and P2P tiers, a reference engine, and the admin API that kvctl
// drives. See docs/operations.md.
package main

import (
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
	"github.com/kvtier/kvtier/p2pd/p2p"
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
	go func() { done <- n.Shutdown(grace) }()
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

// parse builds the config: defaults, then -config's JSON, then flags.
func parse(args []string) (node.Config, error) {
	fs := flag.NewFlagSet("p2pd", flag.ContinueOnError)
	var (
		configFile = fs.String("config", "", "JSON config file (snake_case keys; flags override it)")
		nodeID     = fs.String("node-id", "", "node id (default: random)")
		listen     = fs.String("p2p-listen", "127.0.0.1:5710", "P2P port: host:port")
		advertise  = fs.String("p2p-advertise", "", "address peers dial back (default: the listener's)")
		admin      = fs.String("admin", "./p2pd.sock", "admin unix socket (mode 0600)")
		adminTCP   = fs.String("admin-tcp", "", "also serve the admin API on this loopback host:port")
		model      = fs.String("model", "qwen3-0.6b", "geometry preset: qwen3-0.6b or tiny")
		layers     = fs.Int("layers", 0, "custom geometry: layers")
		kvHeads    = fs.Int("kv-heads", 0, "custom geometry: KV heads")
		headDim    = fs.Int("head-dim", 0, "custom geometry: head dim")
		blockTok   = fs.Int("block-tokens", 0, "custom geometry: tokens per block")
		dtypeBytes = fs.Int("dtype-bytes", 0, "custom geometry: bytes per element (1, 2 or 4)")
		cpuSlots   = fs.Int("cpu-slots", 0, "CPU tier slots (overrides cpu_bytes)")
		gpuBlocks  = fs.Int("gpu-blocks", 1024, "GPU KV cache blocks")
		diskDir    = fs.String("disk-dir", "", "disk tier directory (default: no disk tier)")
		diskBytes  = fs.Int64("disk-bytes", 16<<30, "disk tier cap in bytes")
		pollEvery  = fs.Duration("tier-poll-interval", time.Millisecond, "tier-poll interval (≤ 0: no poll goroutine)")
		hitPending = fs.Duration("hit-pending-timeout", 5*time.Second, "HitPending bound")
		hashSeed   = fs.String("hash-seed", offload.DefaultHashSeed, "block key hash seed")
		tokenFile  = fs.String("cluster-token-file", "", "file holding the cluster token (none: the P2P port is unauthenticated)")
		tlsCert    = fs.String("p2p-tls-cert", "", "P2P mutual TLS: this node's certificate (PEM; with -p2p-tls-key and -p2p-tls-ca)")
		tlsKey     = fs.String("p2p-tls-key", "", "P2P mutual TLS: this node's private key (PEM)")
		tlsCA      = fs.String("p2p-tls-ca", "", "P2P mutual TLS: the cluster CA certificates (PEM)")
		peers      = fs.String("peers", "", "comma-separated peers dialled at start")
		dataPlane  = fs.String("data-plane", "tcp", "P2P data plane: tcp, or nixl in a binary built with -tags nixl")
		dataConns  = fs.Int("data-conns", p2p.DefaultConfig().DataConns, "TCP data connections per peer")
		dataNice   = fs.Int("data-nice", p2p.DefaultConfig().DataNice, "nice value (0-19) of the threads moving block bytes")
		grace      = fs.Duration("shutdown-grace", 30*time.Second, "grace for running requests on shutdown")
		copies     = fs.String("copy-backend", "auto", "GPU copies: auto, cuda or host")
		logFormat  = fs.String("log-format", "text", "text or json")
		logLevel   = fs.String("log-level", "info", "debug, info, warn or error")
	)
	if err := fs.Parse(args); err != nil {
		return node.Config{}, err
	}
	if fs.NArg() > 0 {
		return node.Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	cfg := node.DefaultConfig()
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
	apply := func(name string, fn func()) {
		if set[name] || *configFile == "" {
			fn()
		}
	}
	apply("node-id", func() { cfg.NodeID = *nodeID })
	apply("p2p-listen", func() { cfg.Listen = *listen })
	apply("p2p-advertise", func() { cfg.Advertise = *advertise })
	apply("admin", func() { cfg.Admin = *admin })
	apply("admin-tcp", func() { cfg.AdminTCP = *adminTCP })
	if set["model"] || *configFile == "" {
		g, err := offload.GeometryByName(*model)
		if err != nil {
			return cfg, err
		}
		cfg.Geometry = g
	}
	custom := map[string]*int{"layers": &cfg.Geometry.Layers, "kv-heads": &cfg.Geometry.KVHeads, "head-dim": &cfg.Geometry.HeadDim, "block-tokens": &cfg.Geometry.BlockTokens}
	for name, v := range map[string]*int{"layers": layers, "kv-heads": kvHeads, "head-dim": headDim, "block-tokens": blockTok} {
		if set[name] {
			*custom[name] = *v
		}
	}
	if set["dtype-bytes"] {
		cfg.Geometry.DType = map[int]string{1: "fp8", 2: "bf16", 4: "fp32"}[*dtypeBytes]
		if cfg.Geometry.DType == "" {
			return cfg, fmt.Errorf("-dtype-bytes %d: want 1, 2 or 4", *dtypeBytes)
		}
	}
	apply("cpu-slots", func() { cfg.CPUSlots = *cpuSlots })
	apply("gpu-blocks", func() { cfg.GPUBlocks = *gpuBlocks })
	apply("disk-dir", func() { cfg.DiskDir = *diskDir })
	apply("disk-bytes", func() { cfg.DiskBytes = *diskBytes })
	apply("tier-poll-interval", func() { cfg.TierPollInterval = offload.Duration(*pollEvery) })
	apply("hit-pending-timeout", func() { cfg.HitPendingTimeout = offload.Duration(*hitPending) })
	apply("hash-seed", func() { cfg.HashSeed = *hashSeed })
	apply("cluster-token-file", func() { cfg.ClusterTokenFile = *tokenFile })
	apply("p2p-tls-cert", func() { cfg.TLSCert = *tlsCert })
	apply("p2p-tls-key", func() { cfg.TLSKey = *tlsKey })
	apply("p2p-tls-ca", func() { cfg.TLSCA = *tlsCA })
	apply("shutdown-grace", func() { cfg.ShutdownGrace = offload.Duration(*grace) })
	apply("copy-backend", func() { cfg.CopyBackend = *copies })
	apply("data-plane", func() { cfg.DataPlane = *dataPlane })
	apply("data-conns", func() { cfg.DataConns = *dataConns })
	apply("data-nice", func() { cfg.DataNice = *dataNice })
	apply("log-format", func() { cfg.LogFormat = *logFormat })
	apply("log-level", func() { cfg.LogLevel = *logLevel })
	if set["peers"] || (*configFile == "" && *peers != "") {
		cfg.Peers = nil
		for _, p := range strings.Split(*peers, ",") {
			if p = strings.TrimSpace(p); p != "" {
				cfg.Peers = append(cfg.Peers, p)
			}
		}
	}
	return cfg, cfg.Validate()
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
