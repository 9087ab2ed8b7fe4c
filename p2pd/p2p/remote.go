package p2p

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// RemoteSource is a request's kv_transfer_params.remote_kv_source: the
// peer that holds its KV and the id the peer knows the request by.
type RemoteSource struct {
	// KVRequestID is the producer's request id (kv_request_id).
	KVRequestID string
	// Addr is the producer's P2P address, host:port.
	Addr string
}

// ErrRemoteSource is a kv_transfer_params.remote_kv_source that is present
// but malformed.
var ErrRemoteSource = errors.New("p2p: bad kv_transfer_params.remote_kv_source")

// ParseRemoteSource reads kv_transfer_params.remote_kv_source, the one
// parser both the admin API (which rejects a bad source with HTTP 400) and
// the tier (which fetches from it) use. Absent or null, the request is not
// a consumer: ok is false and err nil. Present, it must be an object with
// kv_request_id (a non-empty string of at most 4096 bytes), remote_host (a
// non-empty string of at most 4096 bytes) and remote_port (an integer 1 to
// 65535: a JSON number without fraction or exponent, or a decimal
// string); otherwise err wraps ErrRemoteSource and names the field.
// Other fields are ignored.
func ParseRemoteSource(params map[string]any) (src RemoteSource, ok bool, err error) {
	v, present := params["remote_kv_source"]
	if !present || v == nil {
		return RemoteSource{}, false, nil
	}
	m, isObj := v.(map[string]any)
	if !isObj {
		return RemoteSource{}, false, fmt.Errorf("%w: want an object with kv_request_id, remote_host and remote_port", ErrRemoteSource)
	}
	id, err := nonEmpty(m, "kv_request_id")
	if err != nil {
		return RemoteSource{}, false, err
	}
	host, err := nonEmpty(m, "remote_host")
	if err != nil {
		return RemoteSource{}, false, err
	}
	port, err := portOf(m["remote_port"])
	if err != nil {
		return RemoteSource{}, false, err
	}
	return RemoteSource{KVRequestID: id, Addr: net.JoinHostPort(host, strconv.Itoa(port))}, true, nil
}

func nonEmpty(m map[string]any, field string) (string, error) {
	s, isStr := m[field].(string)
	switch {
	case !isStr:
		return "", fmt.Errorf("%w: %s: want a non-empty string", ErrRemoteSource, field)
	case s == "":
		return "", fmt.Errorf("%w: %s: empty", ErrRemoteSource, field)
	case len(s) > wire.MaxString:
		return "", fmt.Errorf("%w: %s: %d bytes (at most %d)", ErrRemoteSource, field, len(s), wire.MaxString)
	}
	return s, nil
}

// portOf accepts what a JSON decoder may have made of a port: a float64
// or json.Number (UseNumber), a decimal string, or an int from callers in
// the same process.
func portOf(v any) (int, error) {
	bad := func(what string) (int, error) {
		return 0, fmt.Errorf("%w: remote_port: %s is not a port (want an integer 1 to 65535)", ErrRemoteSource, what)
	}
	var s string
	switch p := v.(type) {
	case nil:
		return 0, fmt.Errorf("%w: remote_port: missing (want an integer 1 to 65535)", ErrRemoteSource)
	case float64:
		if p != math.Trunc(p) || p < 1 || p > 65535 {
			return bad(strconv.FormatFloat(p, 'g', -1, 64))
		}
		return int(p), nil
	case int:
		if p < 1 || p > 65535 {
			return bad(strconv.Itoa(p))
		}
		return p, nil
	case json.Number:
		s = string(p)
	case string:
		s = p
	default:
		return bad(fmt.Sprintf("a %T", v))
	}
	if len(s) > 5 {
		return bad(strconv.Quote(s[:5] + "..."))
	}
	n := 0
	for _, c := range []byte(s) {
		if c < '0' || c > '9' {
			return bad(strconv.Quote(s))
		}
		n = n*10 + int(c-'0')
	}
	if n < 1 || n > 65535 {
		return bad(strconv.Quote(s))
	}
	return n, nil
}
