// Package script runs text scenarios, in the style of the data-driven
// tests of cockroachdb/pebble and the interaction tests of etcd-io/raft:
// a file in testdata/ is a sequence of commands, each followed by the
// output it must print.
//
//	# a comment
//	lookup r k1 k2
//	----
//	k1 hit
//	k2 retry
//
// A command is one line: a name and arguments, words or key=value pairs.
// Its expected output follows the "----" line up to the next blank line
// (so an output has no blank lines). With -update the files are rewritten
// with the outputs the commands printed.
//
// It lives in offload so that the tests of p2pd (which may not import
// testing/) and of testing/ share one runner: testing/tiering's manager
// scenarios and p2pd/p2p's protocol scenarios. It uses the standard
// library only and is imported by tests only.
package script

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"
)

var update = flag.Bool("update", false, "rewrite the scripts' expected outputs with what the commands printed")

// Cmd is one command of a script.
type Cmd struct {
	Name string
	Args []string          // the words after the name, key=value pairs included
	Vals map[string]string // the key=value pairs
	Line int               // where it is in the file
	Pos  string            // file:line, for messages
	used map[string]bool   // the keys a command read (Val, Lookup)
}

// Has says whether the command has the word w among its arguments.
func (c *Cmd) Has(w string) bool {
	for _, a := range c.Args {
		if a == w {
			return true
		}
	}
	return false
}

// Words are the arguments that are not key=value pairs.
func (c *Cmd) Words() []string {
	var out []string
	for _, a := range c.Args {
		if !strings.Contains(a, "=") {
			out = append(out, a)
		}
	}
	return out
}

// Val returns the value of key, or def when the command has none.
func (c *Cmd) Val(key, def string) string {
	if v, ok := c.Lookup(key); ok {
		return v
	}
	return def
}

// Lookup returns the value of key and whether the command has it. A
// key=value pair that no command reads through Val or Lookup is an error
// (a misspelt argument would otherwise be ignored).
func (c *Cmd) Lookup(key string) (string, bool) {
	if c.used == nil {
		c.used = map[string]bool{}
	}
	c.used[key] = true
	v, ok := c.Vals[key]
	return v, ok
}

type block struct {
	cmd      Cmd
	raw      string // the command line as written
	comments []string
	want     string
}

// Run reads the script at path and runs each command through do, which
// returns what the command printed; a mismatch fails t, naming the line,
// and stops the script (later commands build on earlier ones). With
// -update the file is rewritten instead.
func Run(t *testing.T, path string, do func(t *testing.T, c *Cmd) string) {
	t.Helper()
	blocks, trailing, err := parse(path)
	if err != nil {
		t.Fatal(err)
	}
	text, diff := execute(blocks, trailing, *update, func(c *Cmd) string { return do(t, c) })
	if diff != "" {
		t.Fatal(diff)
	}
	if *update {
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// execute runs the blocks and returns the script with the outputs
// printed, and the first mismatch (unless updating) or output a script
// cannot hold.
func execute(blocks []block, trailing []string, updating bool, do func(c *Cmd) string) (text, diff string) {
	if len(blocks) == 0 {
		return "", "the script has no commands"
	}
	var out strings.Builder
	for _, b := range blocks {
		got := strings.TrimRight(do(&b.cmd), "\n")
		for k := range b.cmd.Vals {
			if !b.cmd.used[k] {
				return "", fmt.Sprintf("%s: %s does not take %s=", b.cmd.Pos, b.cmd.Name, k)
			}
		}
		if strings.Contains(got, "\n\n") {
			return "", fmt.Sprintf("%s: %s printed a blank line, which a script cannot hold", b.cmd.Pos, b.cmd.Name)
		}
		if !updating && got != b.want {
			return "", fmt.Sprintf("%s: %s\n got:\n%s\nwant:\n%s", b.cmd.Pos, b.raw, indent(got), indent(b.want))
		}
		for _, c := range b.comments {
			out.WriteString(c + "\n")
		}
		out.WriteString(b.raw + "\n----\n")
		if got != "" {
			out.WriteString(got + "\n")
		}
		out.WriteString("\n")
	}
	for _, c := range trailing {
		out.WriteString(c + "\n")
	}
	return strings.TrimRight(out.String(), "\n") + "\n", ""
}

func indent(s string) string {
	if s == "" {
		return "    (nothing)"
	}
	return "    " + strings.ReplaceAll(s, "\n", "\n    ")
}

func parse(path string) (blocks []block, trailing []string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	n := 0
	var comments []string
	for sc.Scan() {
		n++
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		switch {
		case trimmed == "":
			if len(comments) > 0 {
				comments = append(comments, "")
			}
			continue
		case strings.HasPrefix(trimmed, "#"):
			comments = append(comments, line)
			continue
		}
		for len(comments) > 0 && comments[len(comments)-1] == "" {
			comments = comments[:len(comments)-1]
		}
		b := block{raw: trimmed, comments: comments}
		comments = nil
		fields := strings.Fields(trimmed)
		b.cmd = Cmd{Name: fields[0], Args: fields[1:], Vals: map[string]string{}, Line: n, Pos: fmt.Sprintf("%s:%d", path, n)}
		for _, a := range b.cmd.Args {
			if k, v, ok := strings.Cut(a, "="); ok {
				b.cmd.Vals[k] = v
			}
		}
		if !sc.Scan() || strings.TrimSpace(sc.Text()) != "----" {
			return nil, nil, fmt.Errorf("%s: a command must be followed by a ---- line", b.cmd.Pos)
		}
		n++
		var want []string
		for sc.Scan() {
			n++
			if sc.Text() == "" {
				break
			}
			want = append(want, sc.Text())
		}
		b.want = strings.Join(want, "\n")
		blocks = append(blocks, b)
	}
	if err := sc.Err(); err != nil {
		return nil, nil, err
	}
	return blocks, comments, nil
}

// RunDir runs every script of dir (Files) as a subtest named after it, each
// in its own testing/synctest bubble (fake time), with the command
// function that start returns for it (fresh state per script).
func RunDir(t *testing.T, dir string, start func(t *testing.T) func(t *testing.T, c *Cmd) string) {
	t.Helper()
	for _, path := range Files(t, dir) {
		t.Run(strings.TrimSuffix(filepath.Base(path), ".txt"), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { Run(t, path, start(t)) })
		})
	}
}

// Files lists the scripts of a testdata directory.
func Files(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if !e.IsDir() && strings.HasSuffix(e.Name(), ".txt") {
			out = append(out, dir+"/"+e.Name())
		}
	}
	if len(out) == 0 {
		t.Fatalf("no scripts (*.txt) in %s", dir)
	}
	return out
}
