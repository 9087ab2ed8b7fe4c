// Package deps enforces the workspace's import direction: which module may
// import which, where cgo may appear, and which outside modules exist.
package deps

import (
	"bufio"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const prefix = "github.com/kvtier/kvtier/"

// allowed lists, per module, the other kvtier modules and outside
// modules its code (tests included) may import; the standard library is
// always allowed. The module table of the shared ARCHITECTURE.md is the
// source (issue 13 added ctl → p2pd/api).
var allowed = map[string][]string{
	"offload": {"golang.org/x/sys"},
	"nixlgo":  {},
	"cudakv":  {"golang.org/x/sys"},
	"ctl":     {prefix + "p2pd/api"},
	"p2pd":    {prefix + "offload", prefix + "cudakv", prefix + "nixlgo", "golang.org/x/sys"},
	"testing": {prefix + "offload", prefix + "cudakv", prefix + "nixlgo", prefix + "p2pd", prefix + "ctl", "golang.org/x/sys", "github.com/google/go-cmp"},
}

// stdOnly lists packages that import the standard library only, whatever
// their module allows: p2pd/api is the one package ctl imports.
var stdOnly = []string{"p2pd/api"}

// cgo lists the modules that may import "C".
var cgo = []string{"cudakv", "nixlgo"}

func root(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.work above the test's directory")
		}
		dir = parent
	}
}

func stdlib(path string) bool {
	first, _, _ := strings.Cut(path, "/")
	return !strings.Contains(first, ".")
}

// TestImportDirection parses every Go file of every module, whatever its
// build tags, and checks its imports against the rules above.
func TestImportDirection(t *testing.T) {
	top := root(t)
	files := 0
	for mod, allow := range allowed {
		err := filepath.WalkDir(filepath.Join(top, mod), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") {
				return err
			}
			f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
			if err != nil {
				return err
			}
			files++
			rel, _ := filepath.Rel(top, path)
			for _, imp := range f.Imports {
				p, _ := strconv.Unquote(imp.Path.Value)
				switch {
				case p == "C":
					if !slices.Contains(cgo, mod) {
						t.Errorf("%s imports \"C\": only %v may use cgo", rel, cgo)
					}
				case stdlib(p):
				case slices.Contains(stdOnly, filepath.ToSlash(filepath.Dir(rel))):
					t.Errorf("%s imports %s: its package may import the standard library only", rel, p)
				case p == prefix+mod || strings.HasPrefix(p, prefix+mod+"/"):
				default:
					if !slices.ContainsFunc(allow, func(a string) bool { return p == a || strings.HasPrefix(p, a+"/") }) {
						t.Errorf("%s (module %s) imports %s; allowed: the standard library and %v", rel, mod, p, allow)
					}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if files == 0 {
		t.Fatal("no Go files found")
	}
}

// TestOutsideModules: the only outside modules are x/sys and go-cmp.
func TestOutsideModules(t *testing.T) {
	f, err := os.Open(filepath.Join(root(t), "vendor", "modules.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := []string{"github.com/google/go-cmp", "golang.org/x/sys"}
	var got []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) >= 3 && fields[0] == "#" && !strings.HasPrefix(fields[1], prefix) {
			got = append(got, fields[1])
		}
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("vendor/modules.txt lists outside modules %v, want exactly %v", got, want)
	}
}

// TestOneClock (issue 13): in offload's code only the poll goroutine
// (poll.go) makes a timer; everything else asks it for a time (wakeAt,
// TierEnv.WakeAt). A second timer would again take the manager lock on a
// goroutine of its own. And time is an input: policy reads the manager's
// time (nowLocked, from Config.Now), never the wall clock: time.Now is
// named, not called, as that clock's default (manager.go, and cputier.go
// for a CPU tier used alone); only the disk tier, which measures its own
// I/O, reads the clock.
func TestOneClock(t *testing.T) {
	timers := []string{"AfterFunc", "NewTimer", "NewTicker", "After", "Tick"}
	reads := []string{"Now", "Since", "Until"}
	defaults := []string{"manager.go", "cputier.go"} // may name time.Now as a value
	dir := filepath.Join(root(t), "offload")
	found := 0
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		called := map[*ast.SelectorExpr]bool{}
		ast.Inspect(f, func(n ast.Node) bool {
			if c, ok := n.(*ast.CallExpr); ok {
				if sel, ok := c.Fun.(*ast.SelectorExpr); ok {
					called[sel] = true
				}
			}
			return true
		})
		base := filepath.Base(path)
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			pkg, ok := sel.X.(*ast.Ident)
			if !ok || pkg.Name != "time" {
				return true
			}
			if slices.Contains(timers, sel.Sel.Name) {
				found++
				if filepath.Base(path) != "poll.go" {
					t.Errorf("%s: time.%s: only the poll goroutine (offload/poll.go) makes timers; ask its clock (wakeAt)", fset.Position(sel.Pos()), sel.Sel.Name)
				}
			}
			if slices.Contains(reads, sel.Sel.Name) && base != "disk.go" && (called[sel] || !slices.Contains(defaults, base)) {
				t.Errorf("%s: time.%s: policy takes the manager's time (nowLocked, Config.Now), it reads no clock", fset.Position(sel.Pos()), sel.Sel.Name)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found == 0 {
		t.Error("no timer found in offload at all: the poll goroutine's clock is gone, or this test no longer sees it")
	}
}

// TestProtocolMachines (issue 13): the P2P protocol's state machines
// (p2pd/p2p/protocol) touch no socket, file or process and read no clock:
// their I/O layer feeds them events and the time, so a second wire
// dialect can drive them and a test can script them.
func TestProtocolMachines(t *testing.T) {
	dir := filepath.Join(root(t), "p2pd", "p2p", "protocol")
	banned := func(p string) bool {
		return p == "net" || strings.HasPrefix(p, "net/") || p == "os" || p == "os/exec" || p == "syscall" ||
			strings.HasPrefix(p, "golang.org/x/sys")
	}
	clocks := []string{"Now", "Since", "Until", "Sleep", "After", "AfterFunc", "NewTimer", "NewTicker", "Tick"}
	files := 0
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		files++
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); banned(p) {
				t.Errorf("%s imports %s: a protocol machine does no I/O", fset.Position(imp.Pos()), p)
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok {
				if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == "time" && slices.Contains(clocks, sel.Sel.Name) {
					t.Errorf("%s: time.%s: a protocol machine takes the time from its caller", fset.Position(sel.Pos()), sel.Sel.Name)
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files == 0 {
		t.Error("no protocol machine found in p2pd/p2p/protocol")
	}
}
