package wire

import (
	"encoding/binary"
	"fmt"
	"io"
	"slices"
)

// Append encodes m as a frame appended to b.
func Append(b []byte, m Msg) []byte {
	start := len(b)
	b = append(b, 0, 0, 0, 0, byte(m.Type()))
	switch m := m.(type) {
	case Hello:
		b = binary.BigEndian.AppendUint16(b, m.Version)
		b = append(b, byte(m.Kind))
		b = appendString(b, m.NodeID)
		b = append(b, m.Incarnation[:]...)
		b = append(b, m.Nonce[:]...)
	case Challenge:
		b = appendString(b, m.NodeID)
		b = append(b, m.Incarnation[:]...)
		b = append(b, m.Nonce[:]...)
	case Auth:
		b = append(b, m.Proof[:]...)
	case Connect:
		b = appendString(b, m.NodeID)
		b = append(b, m.Incarnation[:]...)
		b = binary.BigEndian.AppendUint16(b, m.Version)
		b = binary.BigEndian.AppendUint64(b, m.BlockBytes)
		b = appendString(b, m.Fingerprint)
		b = appendString(b, m.HashSeed)
		b = appendString(b, m.Addr)
		b = appendString(b, m.DataPlane)
		b = binary.BigEndian.AppendUint32(b, uint32(len(m.DataInfo)))
		b = append(b, m.DataInfo...)
	case ConnectAck:
	case Lookup:
		b = appendString(b, m.ReqID)
		b = binary.BigEndian.AppendUint64(b, m.Round)
		b = appendKeys(b, m.Keys)
	case LookupResp:
		b = appendString(b, m.ReqID)
		b = binary.BigEndian.AppendUint64(b, m.Round)
		b = appendKeys(b, m.Keys)
		for _, h := range m.Hits {
			b = append(b, boolByte(h))
		}
	case Fetch:
		b = appendString(b, m.ReqID)
		b = binary.BigEndian.AppendUint64(b, m.Round)
		b = appendKeys(b, m.Keys)
		for _, s := range m.Slots {
			b = binary.BigEndian.AppendUint32(b, s)
		}
	case TransferDone:
		b = appendString(b, m.ReqID)
		b = binary.BigEndian.AppendUint64(b, m.Round)
		b = append(b, boolByte(m.OK))
	case AbortFetch:
		b = appendString(b, m.ReqID)
		b = binary.BigEndian.AppendUint64(b, m.Round)
	case AbortAck:
		b = appendString(b, m.ReqID)
		b = binary.BigEndian.AppendUint64(b, m.Round)
	case Disconnect:
		b = append(b, byte(m.Code))
		b = appendString(b, m.Reason)
	case Ping:
		b = binary.BigEndian.AppendUint64(b, m.Seq)
	case Pong:
		b = binary.BigEndian.AppendUint64(b, m.Seq)
	}
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-4))
	return b
}

func boolByte(v bool) byte {
	if v {
		return 1
	}
	return 0
}

// appendString writes a length-prefixed string; the encoder truncates
// nothing, so callers keep strings within MaxString (the decoder rejects
// longer ones).
func appendString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

func appendKeys(b []byte, keys []Key) []byte {
	b = slices.Grow(b, 4+len(keys)*len(Key{})+len(keys)) // the keys, and a lookup_resp's hits after them
	b = binary.BigEndian.AppendUint32(b, uint32(len(keys)))
	for _, k := range keys {
		b = append(b, k[:]...)
	}
	return b
}

// growStep is the least a frame buffer grows by while its bytes arrive.
const growStep = 16 << 10

// ReadFrame reads one frame's payload into buf and
// returns it; a frame over limit bytes is malformed. The buffer grows with the bytes that arrived, never to what
// the header claims (S8.1): a peer that announces a large frame and sends
// nothing costs at most growStep (16 KiB).
func ReadFrame(r io.Reader, buf []byte, limit int) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := int(binary.BigEndian.Uint32(hdr[:]))
	if n == 0 || n > limit {
		return nil, fmt.Errorf("%w: frame of %d bytes (limit %d)", ErrMalformed, n, limit)
	}
	buf = buf[:0]
	for len(buf) < n {
		want := n
		if cap(buf) < n {
			want = min(n, max(2*len(buf), growStep))
			if cap(buf) < want {
				buf = append(make([]byte, 0, want), buf...)
			}
		}
		got, err := io.ReadFull(r, buf[len(buf):want])
		buf = buf[:len(buf)+got]
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	return buf, nil
}

// decoder reads fields from a frame payload, remembering the first error.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, args...)...)
	}
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || n > len(d.b) {
		d.fail("need %d bytes, have %d", n, len(d.b))
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *decoder) u16() uint16 {
	if v := d.take(2); v != nil {
		return binary.BigEndian.Uint16(v)
	}
	return 0
}

func (d *decoder) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.BigEndian.Uint32(v)
	}
	return 0
}

func (d *decoder) u64() uint64 {
	if v := d.take(8); v != nil {
		return binary.BigEndian.Uint64(v)
	}
	return 0
}

func (d *decoder) boolean() bool {
	switch d.u8() {
	case 0:
		return false
	case 1:
		return true
	}
	d.fail("a bool is neither 0 nor 1")
	return false
}

func (d *decoder) str() string {
	n := int(d.u16())
	if n > MaxString {
		d.fail("string of %d bytes (limit %d)", n, MaxString)
		return ""
	}
	return string(d.take(n))
}

func (d *decoder) array(dst []byte) {
	copy(dst, d.take(len(dst)))
}

// count reads an element count and checks that count × size bytes remain,
// so that nothing is allocated beyond the frame.
func (d *decoder) count(size int) int {
	n := int(d.u32())
	if n > MaxKeys {
		d.fail("%d elements (limit %d)", n, MaxKeys)
		return 0
	}
	if d.err == nil && n*size > len(d.b) {
		d.fail("%d elements of %d bytes in %d bytes", n, size, len(d.b))
		return 0
	}
	return n
}

func (d *decoder) keys() []Key {
	n := d.count(KeySize)
	if d.err != nil || n == 0 {
		return nil
	}
	ks := make([]Key, n)
	for i := range ks {
		d.array(ks[i][:])
	}
	return ks
}

// Decode decodes one frame payload (as ReadFrame returns it). A Connect's
// DataInfo aliases p; every other field is copied.
func Decode(p []byte) (Msg, error) {
	if len(p) == 0 {
		return nil, fmt.Errorf("%w: empty frame", ErrMalformed)
	}
	d := &decoder{b: p[1:]}
	var m Msg
	switch t := Type(p[0]); t {
	case THello:
		h := Hello{Version: d.u16(), Kind: ConnKind(d.u8()), NodeID: d.str()}
		d.array(h.Incarnation[:])
		d.array(h.Nonce[:])
		if h.Kind != KindControl && h.Kind != KindData {
			d.fail("unknown connection kind %d", h.Kind)
		}
		m = h
	case TConnect:
		c := Connect{NodeID: d.str()}
		d.array(c.Incarnation[:])
		c.Version, c.BlockBytes = d.u16(), d.u64()
		c.Fingerprint, c.HashSeed, c.Addr, c.DataPlane = d.str(), d.str(), d.str(), d.str()
		n := int(d.u32())
		if n > MaxHandshakeFrame {
			d.fail("data-plane info of %d bytes", n)
		}
		c.DataInfo = d.take(n) // aliases p: a 64 MiB frame is not copied twice
		m = c
	case TConnectAck:
		m = ConnectAck{}
	case TChallenge:
		c := Challenge{NodeID: d.str()}
		d.array(c.Incarnation[:])
		d.array(c.Nonce[:])
		m = c
	case TAuth:
		var a Auth
		d.array(a.Proof[:])
		m = a
	case TLookup:
		m = Lookup{ReqID: d.str(), Round: d.u64(), Keys: d.keys()}
	case TLookupResp:
		r := LookupResp{ReqID: d.str(), Round: d.u64(), Keys: d.keys()}
		if len(d.b) < len(r.Keys) {
			d.fail("%d hits for %d keys", len(d.b), len(r.Keys))
		} else if d.err == nil {
			r.Hits = make([]bool, len(r.Keys))
			for i := range r.Hits {
				r.Hits[i] = d.boolean()
			}
		}
		m = r
	case TFetch:
		f := Fetch{ReqID: d.str(), Round: d.u64(), Keys: d.keys()}
		if len(d.b) < 4*len(f.Keys) {
			d.fail("%d slot bytes for %d keys", len(d.b), len(f.Keys))
		} else if d.err == nil && len(f.Keys) > 0 {
			f.Slots = make([]uint32, len(f.Keys))
			for i := range f.Slots {
				f.Slots[i] = d.u32()
			}
		}
		m = f
	case TTransferDone:
		m = TransferDone{ReqID: d.str(), Round: d.u64(), OK: d.boolean()}
	case TAbortFetch:
		m = AbortFetch{ReqID: d.str(), Round: d.u64()}
	case TAbortAck:
		m = AbortAck{ReqID: d.str(), Round: d.u64()}
	case TDisconnect:
		m = Disconnect{Code: Code(d.u8()), Reason: d.str()}
	case TPing:
		m = Ping{Seq: d.u64()}
	case TPong:
		m = Pong{Seq: d.u64()}
	default:
		return nil, fmt.Errorf("%w: unknown message type %d", ErrMalformed, t)
	}
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d bytes left after %v", len(d.b), m.Type())
	}
	if d.err != nil {
		return nil, d.err
	}
	return m, nil
}

// Write encodes m into buf and writes it to w as one frame.
func Write(w io.Writer, buf []byte, m Msg) ([]byte, error) {
	buf = Append(buf[:0], m)
	_, err := w.Write(buf)
	return buf, err
}
