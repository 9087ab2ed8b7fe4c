#!/usr/bin/env bash
# Installs nvcc from Debian bookworm's nvidia-cuda-toolkit (CUDA 11.8, which
# targets sm_80 and sm_90) when it is missing. The package lives in the
# non-free component, which the default bookworm sources do not list.
set -euo pipefail
if command -v nvcc >/dev/null 2>&1; then
	exit 0
fi
if [ "$(id -u)" != 0 ]; then
	echo "install-nvcc: nvcc is missing and installing it needs root (apt-get)" >&2
	exit 1
fi
cat > /etc/apt/sources.list.d/kvtier-non-free.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit >/dev/null
nvcc --version | tail -1
