package script

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const sample = `# a comment
echo a b
----
a b

# two lines
echo x=1 y
----
x=1
y

echo
----
`

func write(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "s.txt")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// echo prints its words, one a line when they hold key=value pairs (it
// reads x and y).
func echo(c *Cmd) string {
	c.Val("x", "")
	c.Val("y", "")
	if len(c.Vals) > 0 {
		return strings.Join(c.Args, "\n")
	}
	return strings.Join(c.Args, " ")
}

func TestParseAndRun(t *testing.T) {
	blocks, trailing, err := parse(write(t, sample))
	if err != nil {
		t.Fatal(err)
	}
	if len(blocks) != 3 || len(trailing) != 0 {
		t.Fatalf("%d blocks, %d trailing lines; want 3, 0", len(blocks), len(trailing))
	}
	if c := blocks[1].cmd; c.Name != "echo" || c.Val("x", "") != "1" || !c.Has("y") || len(c.Words()) != 1 || c.Line != 7 {
		t.Errorf("second command parsed as %+v", c)
	}
	text, diff := execute(blocks, trailing, false, echo)
	if diff != "" {
		t.Fatal(diff)
	}
	if text != sample {
		t.Errorf("the script as run differs from the file:\n%s", text)
	}
}

func TestMismatchNamesTheLine(t *testing.T) {
	blocks, trailing, err := parse(write(t, strings.Replace(sample, "a b\n\n", "a c\n\n", 1)))
	if err != nil {
		t.Fatal(err)
	}
	_, diff := execute(blocks, trailing, false, echo)
	if !strings.Contains(diff, "s.txt:2: echo a b") || !strings.Contains(diff, "a c") {
		t.Errorf("mismatch reported as %q", diff)
	}
	// Updating rewrites the output instead.
	text, diff := execute(blocks, trailing, true, echo)
	if diff != "" || text != sample {
		t.Errorf("update gave %q, %q", text, diff)
	}
}

func TestBadScripts(t *testing.T) {
	if _, _, err := parse(write(t, "echo a\nno separator\n")); err == nil || !strings.Contains(err.Error(), ":1: a command must be followed by a ---- line") {
		t.Errorf("a command without ----: %v", err)
	}
	blocks, _, err := parse(write(t, "echo\n----\n"))
	if err != nil {
		t.Fatal(err)
	}
	_, diff := execute(blocks, nil, false, func(*Cmd) string { return "a\n\nb" })
	if !strings.Contains(diff, "blank line") {
		t.Errorf("an output with a blank line: %q", diff)
	}
	if _, diff := execute(nil, nil, false, echo); !strings.Contains(diff, "no commands") {
		t.Errorf("an empty script: %q", diff)
	}
	blocks, _, err = parse(write(t, "echo z=1\n----\n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, diff := execute(blocks, nil, false, echo); !strings.Contains(diff, "echo does not take z=") {
		t.Errorf("an argument nobody reads: %q", diff)
	}
}
