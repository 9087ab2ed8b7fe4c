package main

import (
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/p2pd/node"
)

// Every flag defaults to node.DefaultConfig's value (issue 13: one source
// of defaults): giving each flag its own default changes nothing, and so
// does giving no flag.
func TestFlagDefaultsAreTheConfigs(t *testing.T) {
	d := node.DefaultConfig()
	fs, apply := flags(d)
	set := map[string]bool{}
	fs.VisitAll(func(f *flag.Flag) {
		set[f.Name] = true
		if err := fs.Set(f.Name, f.DefValue); err != nil {
			t.Errorf("-%s %q: %v", f.Name, f.DefValue, err)
		}
	})
	cfg := d
	if err := apply(&cfg, set); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(cfg, d) {
		t.Errorf("every flag at its default gives\n%+v\nnot DefaultConfig\n%+v", cfg, d)
	}
	got, err := parse(nil)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, d) {
		t.Errorf("no flags gives\n%+v\nnot DefaultConfig\n%+v", got, d)
	}
}

// A flag not given leaves the config file's value; a flag given wins.
func TestFlagsOverrideTheFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p2pd.json")
	if err := os.WriteFile(path, []byte(`{"gpu_blocks": 77, "disk_bytes": 1048576}`), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := parse([]string{"-config", path, "-gpu-blocks", "9"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.GPUBlocks != 9 || cfg.DiskBytes != 1<<20 {
		t.Errorf("gpu_blocks %d (want the flag's 9), disk_bytes %d (want the file's 1048576)", cfg.GPUBlocks, cfg.DiskBytes)
	}
}
