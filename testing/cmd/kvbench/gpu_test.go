package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestGPUScriptOut runs gpu.sh (the bundle's kvbench.sh) with a stand-in
// kvbench: results land beside the script by default, and a relative
// OUT is taken from where the script was run, not from the bundle it
// changes into (found in review: it was the bundle's).
func TestGPUScriptOut(t *testing.T) {
	script, err := os.ReadFile("gpu.sh")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bundle, caller := filepath.Join(dir, "bundle"), filepath.Join(dir, "caller")
	for _, d := range []string{bundle, caller} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(bundle, "kvbench.sh"), script, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "kvbench"), []byte("#!/bin/sh\necho stand-in \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ out, want string }{
		{"", filepath.Join(bundle, "results")},
		{"rel", filepath.Join(caller, "rel")},
		{filepath.Join(dir, "abs"), filepath.Join(dir, "abs")},
	} {
		cmd := exec.Command("sh", filepath.Join(bundle, "kvbench.sh"))
		cmd.Dir = caller
		cmd.Env = append(os.Environ(), "OUT="+c.out)
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("OUT=%q: %v\n%s", c.out, err, b)
		}
		got, err := os.ReadFile(filepath.Join(c.want, "kvbench.txt"))
		if err != nil {
			t.Fatalf("OUT=%q: %v", c.out, err)
		}
		if !strings.Contains(string(got), "stand-in -bin "+bundle+" ") {
			t.Fatalf("OUT=%q: kvbench ran as %q", c.out, got)
		}
	}
}
