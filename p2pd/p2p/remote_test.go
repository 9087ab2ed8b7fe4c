package p2p

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// S8.3, S6.2: remote_kv_source is parsed once, for the admin API and the
// tier alike: absent is not a consumer, present and malformed is an error
// naming the field (the tier used to drop such a source silently while the
// API accepted it), and a good one gives the producer's host:port.
func TestParseRemoteSource(t *testing.T) {
	src := func(id, host string, port any) map[string]any {
		return map[string]any{"remote_kv_source": map[string]any{"kv_request_id": id, "remote_host": host, "remote_port": port}}
	}
	for _, tc := range []struct {
		name   string
		params map[string]any
		want   RemoteSource
		ok     bool
		field  string // named in the error; "" for none
	}{
		{"nil params", nil, RemoteSource{}, false, ""},
		{"absent", map[string]any{"other": 1}, RemoteSource{}, false, ""},
		{"null", map[string]any{"remote_kv_source": nil}, RemoteSource{}, false, ""},
		{"float port", src("kv1", "10.0.0.1", 5710.0), RemoteSource{"kv1", "10.0.0.1:5710"}, true, ""},
		{"int port", src("kv1", "h", 1), RemoteSource{"kv1", "h:1"}, true, ""},
		{"number port", src("kv1", "h", json.Number("65535")), RemoteSource{"kv1", "h:65535"}, true, ""},
		{"string port", src("kv1", "h", "5710"), RemoteSource{"kv1", "h:5710"}, true, ""},
		{"ipv6 host", src("kv1", "::1", "5710"), RemoteSource{"kv1", "[::1]:5710"}, true, ""},
		{"not an object", map[string]any{"remote_kv_source": "h:1"}, RemoteSource{}, false, "remote_kv_source"},
		{"no id", src("", "h", 1), RemoteSource{}, false, "kv_request_id"},
		{"id not a string", src2("kv_request_id", 7), RemoteSource{}, false, "kv_request_id"},
		{"long id", src(strings.Repeat("x", 4097), "h", 1), RemoteSource{}, false, "kv_request_id"},
		{"no host", src("kv1", "", 1), RemoteSource{}, false, "remote_host"},
		{"host not a string", src2("remote_host", true), RemoteSource{}, false, "remote_host"},
		{"no port", src2("remote_port", nil), RemoteSource{}, false, "remote_port"},
		{"port 0", src("kv1", "h", 0.0), RemoteSource{}, false, "remote_port"},
		{"port 65536", src("kv1", "h", 65536), RemoteSource{}, false, "remote_port"},
		{"string port 99999", src("kv1", "h", "99999"), RemoteSource{}, false, "remote_port"},
		{"string port 0", src("kv1", "h", "0"), RemoteSource{}, false, "remote_port"},
		{"empty string port", src("kv1", "h", ""), RemoteSource{}, false, "remote_port"},
		{"signed string port", src("kv1", "h", "+80"), RemoteSource{}, false, "remote_port"},
		{"long string port", src("kv1", "h", "000000000080"), RemoteSource{}, false, "remote_port"},
		{"fraction", src("kv1", "h", 80.5), RemoteSource{}, false, "remote_port"},
		{"number with fraction", src("kv1", "h", json.Number("80.0")), RemoteSource{}, false, "remote_port"},
		{"number with exponent", src("kv1", "h", json.Number("8e1")), RemoteSource{}, false, "remote_port"},
		{"object port", src("kv1", "h", map[string]any{"port": 1}), RemoteSource{}, false, "remote_port"},
		{"negative", src("kv1", "h", -80), RemoteSource{}, false, "remote_port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok, err := ParseRemoteSource(tc.params)
			if got != tc.want || ok != tc.ok {
				t.Errorf("ParseRemoteSource = %+v, %v; want %+v, %v", got, ok, tc.want, tc.ok)
			}
			switch {
			case tc.field == "" && err != nil:
				t.Errorf("unexpected error %v", err)
			case tc.field != "" && (!errors.Is(err, ErrRemoteSource) || !strings.Contains(err.Error(), tc.field)):
				t.Errorf("error %v, want ErrRemoteSource naming %s", err, tc.field)
			}
		})
	}
}

// src2 is a good source with one field replaced.
func src2(field string, v any) map[string]any {
	m := map[string]any{"kv_request_id": "kv1", "remote_host": "h", "remote_port": 1}
	m[field] = v
	return map[string]any{"remote_kv_source": m}
}
