package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/p2pd/api"
)

// kvctl scrub prints the result as text or, with --json, as JSON (the
// flag was accepted and ignored before), and exits with an error when a
// block was removed either way.
func TestScrubOutput(t *testing.T) {
	for _, tc := range []struct {
		res    api.Scrub
		failed bool
	}{
		{api.Scrub{Checked: 6, ElapsedMS: 1}, false},
		{api.Scrub{Checked: 6, Mismatched: 2, ElapsedMS: 1}, true},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != "POST" || r.URL.Path != "/v0/scrub" {
				http.Error(w, "unexpected", 404)
				return
			}
			json.NewEncoder(w).Encode(tc.res)
		}))
		addr := strings.TrimPrefix(srv.URL, "http://")

		var out bytes.Buffer
		err := run([]string{"-admin-tcp", addr, "scrub"}, &out, &bytes.Buffer{})
		if (err != nil) != tc.failed || !strings.HasPrefix(out.String(), "scrubbed 6 blocks") {
			t.Errorf("scrub %+v: %v, %q", tc.res, err, out.String())
		}

		out.Reset()
		err = run([]string{"-admin-tcp", addr, "scrub", "--json"}, &out, &bytes.Buffer{})
		var got api.Scrub
		if jerr := json.Unmarshal(out.Bytes(), &got); jerr != nil || got != tc.res || (err != nil) != tc.failed {
			t.Errorf("scrub --json %+v: %v, %q (%v)", tc.res, err, out.String(), jerr)
		}
		srv.Close()
	}
}
