// Package vllmwire is vLLM's P2P control-plane payload (its "G2" wire,
// shared/reference/vllm-wire.md): one msgpack map per message,
// discriminated by "type". It holds the msgpack subset those maps use —
// maps with string keys, strings, byte strings, unsigned and signed
// integers, booleans, nil and arrays — written here with the standard
// library, the messages, vLLM's KV-event batches (events.go) and the
// dialect's edge to kvtier's protocol messages (dialect.go). Decoding is
// bounded like package wire
// (S8.1): every length is checked against the bytes that remain before
// anything is allocated, lists and strings have fixed caps, and a message
// allocates no more than it holds.
package vllmwire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// ErrMalformed is a payload that is not a valid message.
var ErrMalformed = errors.New("vllmwire: malformed message")

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// encoder appends msgpack values.
type encoder struct{ b []byte }

func (e *encoder) head(fix, fixMax, c8, c16, c32 byte, n int) {
	switch {
	case fix != 0 && n <= int(fixMax):
		e.b = append(e.b, fix|byte(n))
	case c8 != 0 && n <= math.MaxUint8:
		e.b = append(e.b, c8, byte(n))
	case n <= math.MaxUint16:
		e.b = append(e.b, c16)
		e.b = binary.BigEndian.AppendUint16(e.b, uint16(n))
	default:
		e.b = append(e.b, c32)
		e.b = binary.BigEndian.AppendUint32(e.b, uint32(n))
	}
}

func (e *encoder) mapHead(n int)   { e.head(0x80, 15, 0, 0xde, 0xdf, n) }
func (e *encoder) arrayHead(n int) { e.head(0x90, 15, 0, 0xdc, 0xdd, n) }

func (e *encoder) str(s string) {
	e.head(0xa0, 31, 0xd9, 0xda, 0xdb, len(s))
	e.b = append(e.b, s...)
}

func (e *encoder) bin(p []byte) {
	e.head(0, 0, 0xc4, 0xc5, 0xc6, len(p))
	e.b = append(e.b, p...)
}

func (e *encoder) uint(v uint64) {
	switch {
	case v <= 0x7f:
		e.b = append(e.b, byte(v))
	case v <= math.MaxUint8:
		e.b = append(e.b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		e.b = append(e.b, 0xcd)
		e.b = binary.BigEndian.AppendUint16(e.b, uint16(v))
	case v <= math.MaxUint32:
		e.b = append(e.b, 0xce)
		e.b = binary.BigEndian.AppendUint32(e.b, uint32(v))
	default:
		e.b = append(e.b, 0xcf)
		e.b = binary.BigEndian.AppendUint64(e.b, v)
	}
}

func (e *encoder) boolean(v bool) {
	if v {
		e.b = append(e.b, 0xc3)
	} else {
		e.b = append(e.b, 0xc2)
	}
}

// decoder reads msgpack values from one payload.
type decoder struct {
	b []byte
}

func (d *decoder) byte1() (byte, error) {
	if len(d.b) == 0 {
		return 0, malformed("truncated")
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c, nil
}

func (d *decoder) take(n uint64) ([]byte, error) {
	if n > uint64(len(d.b)) {
		return nil, malformed("a length of %d with %d bytes left", n, len(d.b))
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p, nil
}

func (d *decoder) be(n int) (uint64, error) {
	p, err := d.take(uint64(n))
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range p {
		v = v<<8 | uint64(c)
	}
	return v, nil
}

// length reads the length of a value whose head c is one of the fix
// range [fix, fix+fixMax] or the sized codes c8, c16, c32 (0: none).
func (d *decoder) length(c, fix, fixMax, c8, c16, c32 byte, what string) (uint64, error) {
	switch {
	case fix != 0 && c >= fix && c <= fix+fixMax:
		return uint64(c - fix), nil
	case c8 != 0 && c == c8:
		return d.be(1)
	case c == c16:
		return d.be(2)
	case c == c32:
		return d.be(4)
	}
	return 0, malformed("0x%02x where %s was due", c, what)
}

func (d *decoder) mapHead() (int, error) {
	c, err := d.byte1()
	if err != nil {
		return 0, err
	}
	n, err := d.length(c, 0x80, 15, 0, 0xde, 0xdf, "a map")
	// every entry takes at least two bytes
	if err == nil && n > uint64(len(d.b))/2 {
		return 0, malformed("a map of %d entries in %d bytes", n, len(d.b))
	}
	return int(n), err
}

// arrayHead reads an array's length, at most max.
func (d *decoder) arrayHead(max int) (int, error) {
	c, err := d.byte1()
	if err != nil {
		return 0, err
	}
	n, err := d.length(c, 0x90, 15, 0, 0xdc, 0xdd, "an array")
	switch {
	case err != nil:
		return 0, err
	case n > uint64(max):
		return 0, malformed("a list of %d items, at most %d", n, max)
	case n > uint64(len(d.b)): // every item takes at least one byte
		return 0, malformed("a list of %d items in %d bytes", n, len(d.b))
	}
	return int(n), nil
}

// str reads a string of at most max bytes.
func (d *decoder) str(max int) (string, error) {
	c, err := d.byte1()
	if err != nil {
		return "", err
	}
	n, err := d.length(c, 0xa0, 31, 0xd9, 0xda, 0xdb, "a string")
	if err != nil {
		return "", err
	}
	if n > uint64(max) {
		return "", malformed("a string of %d bytes, at most %d", n, max)
	}
	p, err := d.take(n)
	return string(p), err
}

// bin reads a byte string of at most max bytes; the result aliases the
// payload.
func (d *decoder) bin(max int) ([]byte, error) {
	c, err := d.byte1()
	if err != nil {
		return nil, err
	}
	n, err := d.length(c, 0, 0, 0xc4, 0xc5, 0xc6, "bytes")
	if err != nil {
		return nil, err
	}
	if n > uint64(max) {
		return nil, malformed("%d bytes, at most %d", n, max)
	}
	return d.take(n)
}

// uint reads a non-negative integer.
func (d *decoder) uint() (uint64, error) {
	c, err := d.byte1()
	if err != nil {
		return 0, err
	}
	switch {
	case c <= 0x7f:
		return uint64(c), nil
	case c >= 0xcc && c <= 0xcf:
		return d.be(1 << (c - 0xcc))
	case c >= 0xd0 && c <= 0xd3: // a signed encoding of a value ≥ 0
		v, err := d.be(1 << (c - 0xd0))
		if err != nil {
			return 0, err
		}
		if bits := 8 << (c - 0xd0); bits < 64 && v>>(bits-1) != 0 || bits == 64 && v>>63 != 0 {
			return 0, malformed("a negative integer where one ≥ 0 was due")
		}
		return v, nil
	case c >= 0xe0:
		return 0, malformed("a negative integer where one ≥ 0 was due")
	}
	return 0, malformed("0x%02x where an integer was due", c)
}

func (d *decoder) boolean() (bool, error) {
	c, err := d.byte1()
	switch {
	case err != nil:
		return false, err
	case c == 0xc2:
		return false, nil
	case c == 0xc3:
		return true, nil
	}
	return false, malformed("0x%02x where a bool was due", c)
}

// skip passes over one value of any type this package reads (and
// floats), nested at most depth deep.
func (d *decoder) skip(depth int) error {
	if depth <= 0 {
		return malformed("nested too deep")
	}
	c, err := d.byte1()
	if err != nil {
		return err
	}
	var n uint64
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return nil
	case c >= 0xa0 && c <= 0xbf:
		_, err = d.take(uint64(c - 0xa0))
		return err
	case c >= 0x80 && c <= 0x8f:
		n = 2 * uint64(c-0x80)
	case c >= 0x90 && c <= 0x9f:
		n = uint64(c - 0x90)
	case c == 0xc4 || c == 0xd9:
		n, err = d.be(1)
		if err == nil {
			_, err = d.take(n)
		}
		return err
	case c == 0xc5 || c == 0xda:
		n, err = d.be(2)
		if err == nil {
			_, err = d.take(n)
		}
		return err
	case c == 0xc6 || c == 0xdb:
		n, err = d.be(4)
		if err == nil {
			_, err = d.take(n)
		}
		return err
	case c >= 0xcc && c <= 0xcf:
		_, err = d.take(1 << (c - 0xcc))
		return err
	case c >= 0xd0 && c <= 0xd3:
		_, err = d.take(1 << (c - 0xd0))
		return err
	case c == 0xca:
		_, err = d.take(4)
		return err
	case c == 0xcb:
		_, err = d.take(8)
		return err
	case c == 0xdc || c == 0xde:
		n, err = d.be(2)
		if c == 0xde {
			n *= 2
		}
	case c == 0xdd || c == 0xdf:
		n, err = d.be(4)
		if c == 0xdf {
			n *= 2
		}
	default:
		return malformed("0x%02x: a type vLLM's messages do not use", c)
	}
	if err != nil {
		return err
	}
	if n > uint64(len(d.b)) {
		return malformed("%d items in %d bytes", n, len(d.b))
	}
	for range n {
		if err := d.skip(depth - 1); err != nil {
			return err
		}
	}
	return nil
}
