#!/usr/bin/env bash
# check_symbols.sh OUR_LIBIBVERBS: fails (exit 1) unless our drop-in libibverbs.so.1 exports exactly
# the dynamic symbol@version set and version-node chain of Debian's real one, and every IBVERBS
# symbol that Debian's providers and verbs tools import. Exit 77 (skip) when the reference is absent.
#
# Env: REAL_LIBIBVERBS (default: the multiarch /usr/lib/<triplet>/libibverbs.so.1).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 <path-to-our-libibverbs.so.1>" >&2
  exit 2
fi
ours=$1
triplet=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
libdir=/usr/lib/${triplet:-x86_64-linux-gnu}
real=${REAL_LIBIBVERBS:-$libdir/libibverbs.so.1}

for tool in readelf ldd comm sort; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found" >&2; exit 77; }
done
if [[ ! -r $real ]]; then
  echo "SKIP: reference library $real not found (install libibverbs1)" >&2
  exit 77
fi
if [[ ! -r $ours ]]; then
  echo "FAIL: $ours not found" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0

# Defined dynamic symbols as "TYPE name@@ver" (default) / "TYPE name@ver" (hidden); the ABS
# version-name symbols appear as "OBJECT IBVERBS_x". OBJECTs carry their size: executables
# copy-relocate them, so a size change is an ABI break.
defined_syms() {
  readelf --dyn-syms --wide "$1" | awk '
    $1 ~ /^[0-9]+:$/ && $7 != "UND" && $8 != "" && ($5 == "GLOBAL" || $5 == "WEAK") {
      if ($4 == "OBJECT" && $7 != "ABS") print $4 "/" $3, $8; else print $4, $8
    }' | LC_ALL=C sort -u
}

# Version definitions, one line each: "name [flags] <- parents" (no parents for a root node).
version_defs() {
  readelf -V --wide "$1" | awk '
    /^Version definition section/ { in_def = 1; next }
    /^Version (needs|symbols) section/ { in_def = 0 }
    in_def && /Name:/ {
      if (name != "") print name " [" flags "] <-" parents
      flags = $0; sub(/.*Flags: /, "", flags); sub(/ .*/, "", flags)
      name = $0; sub(/.*Name: /, "", name)
      parents = ""; next
    }
    in_def && /Parent [0-9]+:/ { p = $0; sub(/.*Parent [0-9]+: /, "", p); parents = parents " " p }
    END { if (name != "") print name " [" flags "] <-" parents }' | LC_ALL=C sort
}

# Prints the lines only in the reference ("-", missing from ours) or only in ours ("+", extra).
report_diff() {  # what ref_file our_file
  local missing extra
  missing=$(LC_ALL=C comm -23 "$2" "$3")
  extra=$(LC_ALL=C comm -13 "$2" "$3")
  if [[ -z $missing && -z $extra ]]; then
    echo "ok:   $1 ($(wc -l <"$2") entries)"
    return 0
  fi
  echo "FAIL: $1 differ from $real"
  [[ -n $missing ]] && printf "%s\n" "$missing" | sed 's/^/  - missing: /'
  [[ -n $extra ]] && printf "%s\n" "$extra" | sed 's/^/  + extra:   /'
  return 1
}

# 1. The exported symbol@version set, default and hidden versions alike.
defined_syms "$real" >"$tmp/real.syms"
defined_syms "$ours" >"$tmp/ours.syms"
if [[ ! -s $tmp/real.syms ]]; then
  echo "FAIL: could not read the dynamic symbols of $real" >&2
  exit 1
fi
report_diff "exported symbol@version sets" "$tmp/real.syms" "$tmp/ours.syms" || status=1

# 2. The version nodes and their parents.
version_defs "$real" >"$tmp/real.vers"
version_defs "$ours" >"$tmp/ours.vers"
report_diff "version definitions (node <- parent)" "$tmp/real.vers" "$tmp/ours.vers" || status=1

# 3. Every IBVERBS symbol imported by Debian's providers and tools resolves in ours. An import
# "name@ver" binds to a default or a hidden definition alike, so compare without the '@@'.
sed -E 's/^[^ ]+ //; s/@@/@/' "$tmp/ours.syms" | LC_ALL=C sort -u >"$tmp/ours.names"
consumers=()
for f in "$libdir/libmlx5.so.1" "$libdir/libefa.so.1" "$libdir"/libibverbs/*.so \
  /usr/bin/ibv_* /usr/bin/ib_*; do
  [[ -f $f ]] && readelf -h "$f" >/dev/null 2>&1 && consumers+=("$f")
done
if [[ ${#consumers[@]} -eq 0 ]]; then
  echo "note: no Debian consumers of libibverbs found; import check skipped"
fi
for f in "${consumers[@]}"; do
  readelf --dyn-syms --wide "$f" |
    awk '$1 ~ /^[0-9]+:$/ && $7 == "UND" && $8 ~ /@IBVERBS_/ { print $8 }' |
    LC_ALL=C sort -u >"$tmp/imports"
  unresolved=$(LC_ALL=C comm -23 "$tmp/imports" "$tmp/ours.names")
  if [[ -n $unresolved ]]; then
    echo "FAIL: $f imports symbols ours does not export:"
    printf "%s\n" "$unresolved" | sed 's/^/  - /'
    status=1
  fi
done
[[ ${#consumers[@]} -gt 0 ]] && echo "ok:   imports of ${#consumers[@]} Debian binaries checked"

# 4. The dynamic linker agrees: with ours first on the search path, nothing in those consumers
# is left undefined against a libibverbs version. ldd -r does not run constructors.
libs=$tmp/lib
mkdir -p "$libs"
ln -s "$(readlink -f "$ours")" "$libs/libibverbs.so.1"
for f in "${consumers[@]}"; do
  undefined=$(LD_LIBRARY_PATH=$libs ldd -r "$f" 2>&1 | grep -E 'undefined symbol.*IBVERBS|version .IBVERBS.* not found' || true)
  bound=$(LD_LIBRARY_PATH=$libs ldd "$f" 2>/dev/null | awk '$1 == "libibverbs.so.1" { print $3 }')
  if [[ -n $bound && $bound != "$libs/libibverbs.so.1" ]]; then
    echo "FAIL: ldd bound $f to $bound instead of ours"
    status=1
  fi
  if [[ -n $undefined ]]; then
    echo "FAIL: ldd -r $f with ours:"
    printf "%s\n" "$undefined" | sed 's/^/  /'
    status=1
  fi
done
[[ ${#consumers[@]} -gt 0 ]] && echo "ok:   ldd -r of the same binaries ran"

if [[ $status -ne 0 ]]; then
  echo "check_symbols: FAILED ($ours vs $real)"
else
  echo "check_symbols: PASSED ($ours matches $real)"
fi
exit $status
