//go:build !cgo || !linux

package cudakv

import (
	"fmt"
	"log/slog"
)

// openCUDA without cgo: the CUDA backend needs cgo (to dlopen the driver).
func openCUDA(*Spec, *slog.Logger) (backend, error) {
	return nil, fmt.Errorf("%w: built without cgo", ErrUnavailable)
}

// DeviceCount without cgo: no GPU can be used.
func DeviceCount() (int, error) { return 0, fmt.Errorf("%w: built without cgo", ErrUnavailable) }
