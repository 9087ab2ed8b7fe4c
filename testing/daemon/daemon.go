// Package daemon starts and measures real p2pd processes, for kvdemo and
// kvbench.
package daemon

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
)

// BlockBytes is a qwen3-0.6b block.
const BlockBytes = 28 * 2 * 16 * 8 * 128 * 2

// Proc is a running p2pd.
type Proc struct {
	Name  string
	Cmd   *exec.Cmd
	C     *ctl.Client
	P2P   string // host:port
	Slots int
	// Copies is the daemon's copy backend, from its status: "host" (the
	// GPU cache is host memory) or "cuda: <device>".
	Copies string
	exited chan error
	Log    string
}

var readyRE = regexp.MustCompile(`msg=ready .*p2p=(\S+)`)

// Start runs bin/p2pd with the qwen3-0.6b geometry, slots CPU slots and
// GPU blocks, its socket and log in dir, and waits for its ready line.
func Start(dir, bin, name string, slots int, extra ...string) (*Proc, error) {
	logPath := filepath.Join(dir, name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, name+".sock")
	s := strconv.Itoa(slots)
	args := append([]string{"-model", "qwen3-0.6b", "-cpu-slots", s, "-gpu-blocks", s,
		"-admin", sock, "-p2p-listen", "127.0.0.1:0", "-node-id", name}, extra...)
	cmd := exec.Command(filepath.Join(bin, "p2pd"), args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting p2pd (run make build first): %w", err)
	}
	p := &Proc{Name: name, Cmd: cmd, C: ctl.New(sock, ""), Slots: slots, exited: make(chan error, 1), Log: logPath}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			if m := readyRE.FindStringSubmatch(sc.Text()); m != nil {
				ready <- m[1]
			}
		}
		logf.Close()
		p.exited <- cmd.Wait()
	}()
	select {
	case p.P2P = <-ready:
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		st, err := p.C.Status(ctx)
		cancel()
		if err != nil {
			cmd.Process.Kill()
			return nil, fmt.Errorf("%s: status: %w (log: %s)", name, err, logPath)
		}
		p.Copies = st.Copies
		return p, nil
	case err := <-p.exited:
		return nil, fmt.Errorf("%s exited before ready: %v (log: %s)", name, err, logPath)
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		return nil, fmt.Errorf("%s not ready in 60 s (log: %s)", name, logPath)
	}
}

// Prompt is the request body of the benchmark prompt: seed, blocks
// blocks of 16 tokens, optionally fetched from a peer.
func Prompt(seed, blocks int, id, peer string) map[string]any {
	b := map[string]any{"seed": seed, "tokens": blocks * 16}
	if id != "" {
		b["request_id"] = id
	}
	if peer != "" {
		i := strings.LastIndexByte(peer, ':')
		b["kv_transfer_params"] = map[string]any{"remote_kv_source": map[string]any{"kv_request_id": id,
			"remote_host": peer[:i], "remote_port": peer[i+1:]}}
	}
	return b
}

// Submit runs a request.
func (p *Proc) Submit(body map[string]any) (api.Result, error) {
	var r api.Result
	err := p.C.Do(context.Background(), "POST", "/v0/requests", nil, body, &r)
	return r, err
}

// Stop sends SIGTERM and returns the exit code and how long the exit
// took (-1 if it had to be killed after 60 s).
func (p *Proc) Stop() (int, time.Duration) {
	t0 := time.Now()
	p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.exited:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode(), time.Since(t0)
		}
		return 0, time.Since(t0)
	case <-time.After(60 * time.Second):
		p.Cmd.Process.Kill()
		return -1, time.Since(t0)
	}
}

// Kill ends the process at once (cleanup).
func (p *Proc) Kill() { p.Cmd.Process.Kill() }

// CtxSwitches sums the context switches of every thread of the process.
func (p *Proc) CtxSwitches() (int64, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", p.Cmd.Process.Pid))
	if err != nil || len(tasks) == 0 {
		return 0, fmt.Errorf("reading /proc/%d/task: %v", p.Cmd.Process.Pid, err)
	}
	var n int64
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // a thread that just exited
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) == 2 && strings.HasSuffix(f[0], "ctxt_switches:") {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				n += v
			}
		}
	}
	return n, nil
}

// CPUSeconds is process pid's CPU time, user and system, from
// /proc/PID/stat: in clock ticks of 10 ms (the kernel reports them in
// USER_HZ, 100 on Linux whatever its own tick).
func CPUSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s, err := statCPU(string(b))
	if err != nil {
		return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return s, nil
}

// statCPU is utime + stime of a /proc/PID/stat line, in seconds. The
// fields after the command name, which is in parentheses and may hold
// spaces and parentheses: state is the first of them, utime and stime
// the 12th and 13th.
func statCPU(line string) (float64, error) {
	var f []string
	if i := strings.LastIndex(line, ") "); i >= 0 {
		f = strings.Fields(line[i+2:])
	}
	if len(f) < 13 {
		return 0, fmt.Errorf("unexpected %q", line)
	}
	var ticks int64
	for _, s := range f[11:13] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, err
		}
		ticks += v
	}
	return float64(ticks) / 100, nil
}

// RSS is the process's resident memory.
func (p *Proc) RSS() int64 { return RSS(p.Cmd.Process.Pid) }

// RSS is process pid's resident memory in bytes (0 when unknown).
func RSS(pid int) int64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			return v << 10
		}
	}
	return 0
}

// RSSBeyondCaches is RSS minus the CPU arena and, on the host backend,
// the GPU cache, both populated at start (slots of each, page-rounded for
// the arena). On the CUDA backend the GPU cache is device memory and the
// driver's own host memory counts as beyond the caches.
func (p *Proc) RSSBeyondCaches() int64 {
	rss := p.RSS() - int64(p.Slots)*int64(offload.SlotStride(BlockBytes))
	if p.Copies == "host" {
		rss -= int64(p.Slots) * BlockBytes
	}
	return rss
}
