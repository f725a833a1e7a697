#!/usr/bin/env bash
# check_symbols.sh OUR_LIBRDMACM: fails unless our librdmacm.so.1 has the soname, version nodes
# (RDMACM_1.0 .. 1.3, chained) and exported symbol@version set of Debian's (rdma-core 44), and
# every RDMACM symbol that Debian's rdma_cm programs import binds to it. 77: reference missing.
# Env: REAL_LIBRDMACM (default: the multiarch /usr/lib/<triplet>/librdmacm.so.1).
set -euo pipefail
ours=${1:?usage: $0 <path-to-our-librdmacm.so.1>}
triplet=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
real=${REAL_LIBRDMACM:-/usr/lib/${triplet:-x86_64-linux-gnu}/librdmacm.so.1}
command -v objdump >/dev/null || { echo "SKIP: objdump not found" >&2; exit 77; }
[[ -r $real ]] || { echo "SKIP: $real not found (install librdmacm1)" >&2; exit 77; }
[[ -r $ours ]] || { echo "FAIL: $ours not found" >&2; exit 1; }
status=0

# "name version" for each defined dynamic symbol ("(ver)" is a hidden, non-default one).
exports() { objdump -T "$1" | awk 'NF >= 6 && !/\*UND\*/ && $1 ~ /^[0-9a-f]+$/ { print $NF, $(NF-1) }' | LC_ALL=C sort; }
# The version definitions with their parents, in order.
versions() { objdump -p "$1" | sed -n '/^Version definitions:/,/^$/p' | awk 'NF >= 4 { print $4, $5 } NF == 1 { print "  <-", $1 }'; }
soname() { objdump -p "$1" | awk '$1 == "SONAME" { print $2 }'; }

compare() {  # what, then two commands' outputs
  if [[ $2 == "$3" ]]; then
    echo "ok:   $1 ($(wc -l <<<"$2") lines)"
  else
    echo "FAIL: $1 differ from $real:"
    diff <(echo "$2") <(echo "$3") | sed -n 's/^</  - missing:/p; s/^>/  + extra:  /p'
    status=1
  fi
}
compare soname "$(soname "$real")" "$(soname "$ours")"
compare "exported symbol@version set" "$(exports "$real")" "$(exports "$ours")"
compare "version definitions" "$(versions "$real")" "$(versions "$ours")"

# The imports of Debian's rdma_cm programs resolve against ours (ldd -r runs no constructor).
libs=$(mktemp -d)
trap 'rm -rf "$libs"' EXIT
ln -s "$(readlink -f "$ours")" "$libs/librdmacm.so.1"
ln -s "$(readlink -f "$(dirname "$ours")/libibverbs.so.1")" "$libs/libibverbs.so.1"
n=0
for f in /usr/bin/rping /usr/bin/ucmatose /usr/bin/udaddy /usr/bin/rdma_server /usr/bin/rdma_client \
  /usr/bin/ib_send_lat /usr/bin/ib_write_bw; do
  [[ -x $f ]] || continue
  n=$((n + 1))
  bad=$(LD_LIBRARY_PATH=$libs ldd -r "$f" 2>&1 | grep -E 'undefined symbol|RDMACM.* not found' || true)
  bound=$(LD_LIBRARY_PATH=$libs ldd "$f" 2>/dev/null | awk '$1 == "librdmacm.so.1" { print $3 }')
  if [[ -n $bad || $bound != "$libs/librdmacm.so.1" ]]; then
    echo "FAIL: $f with ours (bound to $bound): $bad"
    status=1
  fi
done
echo "ok:   ldd -r of $n Debian programs ran"
[[ $status == 0 ]] && echo "check_symbols: PASSED" || echo "check_symbols: FAILED"
exit $status
