#!/usr/bin/env bash
# Installs the dependencies, builds one preset and runs its whole test suite (unit + e2e).
# Usage: scripts/test.sh [PRESET] [extra ctest args...]   PRESET: release (default),
# debug, asan-ubsan, tsan.   Example: scripts/test.sh asan-ubsan -R e2e
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PRESET="${1:-release}"
shift || true

"$ROOT/scripts/deps.sh"
cmake --preset "$PRESET"
cmake --build --preset "$PRESET"
ctest --preset "$PRESET" "$@"
