package engine

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/kvtier/kvtier/offload/crc32c"
)

// A kv_digest is the SHA-256 of one small hash per block, in the request's
// order: the block's SHA-256 (DigestSHA256) or its CRC32C, big-endian
// (DigestCRC32C). The blocks are independent, so they are hashed in
// parallel (issue 12: the SHA-256 digest cost 0.85 s a GiB on one core and
// dominated the whole request); a block's CRC32C that the request's load
// or store computed as it copied the block is taken as it is, so a
// request whose copies moved every block reads none again.

// digestWorkers is how many blocks the engine hashes at once over all its
// digests: every core but one, which stays with the engine loop and the
// admin API, and at least one.
func digestWorkers() int { return max(1, runtime.GOMAXPROCS(0)-1) }

// digestOf computes a kv_digest of kind over GPU blocks. For DigestCRC32C,
// crcs[i] is block gpu[i]'s CRC32C where known[i] (both nil: none known).
// Up to cap(e.hashing) goroutines take the other blocks in turn; each
// holds a token of e.hashing while it hashes one, so concurrent digests
// share the cores instead of multiplying the goroutines that run. The
// goroutines end with the blocks (or the first error) and are joined
// before it returns.
func (e *Engine) digestOf(kind string, gpu []int32, crcs []uint32, known []bool) (string, error) {
	if cap(e.hashing) == 0 {
		panic("engine: a digest without hashing tokens (an Engine not made by New)")
	}
	size := sha256.Size
	if kind == DigestCRC32C {
		size = 4
	}
	leaves := make([]byte, len(gpu)*size)
	todo := make([]int, 0, len(gpu)) // the blocks to read
	for i := range gpu {
		if kind == DigestCRC32C && known != nil && known[i] {
			binary.BigEndian.PutUint32(leaves[i*size:], crcs[i])
			continue
		}
		todo = append(todo, i)
	}
	var next atomic.Int64
	var failed atomic.Bool
	type failure struct {
		block int
		err   error
	}
	fails := make([]failure, min(cap(e.hashing), len(todo)))
	var wg sync.WaitGroup
	for w := range fails {
		wg.Go(func() {
			h := sha256.New()
			for {
				n := int(next.Add(1)) - 1
				if n >= len(todo) {
					return
				}
				i := todo[n]
				e.hashing <- struct{}{}
				if failed.Load() { // another block failed while this one waited
					<-e.hashing
					return
				}
				err := e.leaf(kind, h, gpu[i], leaves[i*size:(i+1)*size:(i+1)*size])
				<-e.hashing
				if err != nil {
					fails[w] = failure{i, err}
					failed.Store(true)
					return
				}
			}
		})
	}
	wg.Wait()
	var first *failure // the earliest block's, whichever hasher met it
	for w := range fails {
		if f := &fails[w]; f.err != nil && (first == nil || f.block < first.block) {
			first = f
		}
	}
	if first != nil {
		return "", first.err
	}
	sum := sha256.Sum256(leaves)
	d := hex.EncodeToString(sum[:])
	if kind == DigestCRC32C {
		d = "crc32c:" + d
	}
	return d, nil
}

// leaf writes block gpu's hash of kind into dst: its SHA-256 (with h, the
// caller's hasher) or its CRC32C.
func (e *Engine) leaf(kind string, h hash.Hash, gpu int32, dst []byte) error {
	if kind == DigestCRC32C {
		var crc uint32
		// In place on the host backend: no copy of the cache (issue 12).
		err := e.x.Visit(gpu, func(p []byte) { crc = crc32c.Update(crc, p) })
		binary.BigEndian.PutUint32(dst, crc)
		return err
	}
	h.Reset()
	err := e.x.Visit(gpu, func(p []byte) { h.Write(p) })
	h.Sum(dst[:0])
	return err
}
