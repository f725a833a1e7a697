#!/usr/bin/env bash
# Installs the Debian 12 packages vrdma needs to build, test and demo. Idempotent: it skips apt
# when every package is already installed. Runs apt as root (directly, or through sudo).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libibverbs-dev ibverbs-utils perftest qperf ucx-utils openmpi-bin libopenmpi-dev
  librdmacm-dev rdmacm-utils
  libcli11-dev libfmt-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libtomlplusplus-dev
  iproute2 procps curl systemd iperf3 python3
  clang-14 libclang-rt-14-dev
  debhelper lintian
  libssl-dev openssl libipsec-mb-dev
  libcurl4-openssl-dev etcd-server etcd-client
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then
    SUDO=(sudo)
  else
    echo "deps: need root to install: ${missing[*]}" >&2
    exit 1
  fi
fi

echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "${PACKAGES[@]}"
