#!/usr/bin/env bash
# The backend's config file through `vrdma backend`: the documented example validates; a typo, a
# wrong type or a bad value is rejected naming FILE:LINE, and the backend does not start (no
# socket, no process); a metrics address that cannot be bound stops start-up too; a valid file
# is applied (its quotas show in `vrdma status`, the engine's nice value in /proc) and flags
# override it.
# Usage: config.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
HERE="$(dirname "${BASH_SOURCE[0]}")"
EXAMPLE="$HERE/../../packaging/vrdmad.toml"

out="$("$VRDMA" backend --check-config "$EXAMPLE")" || fail "the example config is rejected: $out"
[[ $out == "$EXAMPLE: ok" ]] || fail "check-config said: $out"
# One form in both programs: `--check-config FILE` or `--config FILE --check-config`.
VRDMAD="$(dirname "$VRDMA")/vrdmad"
for form in "$VRDMA backend --config $EXAMPLE --check-config" "$VRDMAD --check-config $EXAMPLE" \
  "$VRDMAD --config $EXAMPLE --check-config"; do
  # shellcheck disable=SC2086  # the form's words
  out="$($form 2>&1)" || fail "$form: $out"
  [[ $out == "$EXAMPLE: ok" ]] || fail "$form said: $out"
done

# Expects `vrdma backend --check-config FILE` and a real start with FILE to fail, naming
# FILE:LINE and the text WHAT, and no backend to be left. Usage: reject FILE LINE WHAT
reject() {
  local f=$1 line=$2 what=$3 rc=0
  "$VRDMA" backend --check-config "$f" >"$E2E_TMP/check.out" 2>&1 || rc=$?
  [[ $rc -ne 0 ]] || fail "$f accepted: $(cat "$E2E_TMP/check.out")"
  grep -qF "$f:$line: " "$E2E_TMP/check.out" || fail "no $f:$line in: $(cat "$E2E_TMP/check.out")"
  grep -qF "$what" "$E2E_TMP/check.out" || fail "no '$what' in: $(cat "$E2E_TMP/check.out")"
  rc=0
  timeout 20 "$VRDMA" backend --socket "$VRDMA_SOCKET" --config "$f" >"$E2E_TMP/start.out" 2>&1 ||
    rc=$?
  [[ $rc -ne 0 && $rc -ne 124 ]] || fail "backend started with $f (rc $rc)"
  grep -qF "$f:$line: " "$E2E_TMP/start.out" || fail "start: no $f:$line in $(cat "$E2E_TMP/start.out")"
  [[ ! -e $VRDMA_SOCKET && -z "$(backend_pid)" ]] || fail "a backend is up after $f was rejected"
  log "rejected: $(head -n 1 "$E2E_TMP/check.out")"
}

printf '[backend]\nidle_exit_s = 0\n\n[quotas]\nmax_qps = 8\nmax_qp = 9\n' >"$E2E_TMP/typo.toml"
reject "$E2E_TMP/typo.toml" 6 'unknown key "max_qp" in [quotas] (did you mean max_qps?)'
printf '[datapath]\nspin_us = "fast"\n' >"$E2E_TMP/type.toml"
reject "$E2E_TMP/type.toml" 2 'expected an integer'
printf '# metrics\n[metrics]\nenabled = true\nlisten = "127.0.0.1:99999"\n' >"$E2E_TMP/range.toml"
reject "$E2E_TMP/range.toml" 4 'is not ADDR:PORT'
printf '[metrics]\nenabled = true\n[metrcs]\n' >"$E2E_TMP/section.toml"
reject "$E2E_TMP/section.toml" 3 'unknown section [metrcs]'
printf '[backend]\nlog_level = "info\n' >"$E2E_TMP/syntax.toml"
reject "$E2E_TMP/syntax.toml" 2 ''
rc=0
"$VRDMA" backend --check-config "$E2E_TMP/missing.toml" >"$E2E_TMP/check.out" 2>&1 || rc=$?
[[ $rc -ne 0 ]] && grep -q "cannot read config file $E2E_TMP/missing.toml" "$E2E_TMP/check.out" ||
  fail "missing file: rc $rc, $(cat "$E2E_TMP/check.out")"

# A metrics address already taken: the backend says so and does not start.
busy="$(free_port)"
perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(LocalAddr => "127.0.0.1:'"$busy"'",
  Listen => 1, ReuseAddr => 0) or die; sleep 60' &
holder=$!
for ((i = 0; i < 50; i++)); do
  port_in_use "$busy" && break
  nap 0.1
done
printf '[metrics]\nenabled = true\nlisten = "127.0.0.1:%s"\n' "$busy" >"$E2E_TMP/taken.toml"
rc=0
timeout 20 "$VRDMA" backend --socket "$VRDMA_SOCKET" --config "$E2E_TMP/taken.toml" \
  >"$E2E_TMP/taken.out" 2>&1 || rc=$?
kill "$holder" 2>/dev/null || true
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "backend started on a taken metrics port (rc $rc)"
grep -q "metrics listen 127.0.0.1:$busy: Address already in use" "$E2E_TMP/taken.out" ||
  fail "taken port: $(cat "$E2E_TMP/taken.out")"
[[ ! -e $VRDMA_SOCKET ]] || fail "the socket exists after a failed start"

# A valid file is applied; --socket on the command line wins over the file's socket.
printf '[backend]\nsocket = "%s"\nidle_exit_s = 0\n[quotas]\nmax_qps = 7\nmax_cqs = 5\n' \
  "$E2E_TMP/from-file.sock" >"$E2E_TMP/good.toml"
"$VRDMA" backend --socket "$VRDMA_SOCKET" --config "$E2E_TMP/good.toml" >"$E2E_TMP/vrdmad.log" 2>&1 &
for ((i = 0; i < 100; i++)); do
  [[ -S $VRDMA_SOCKET ]] && break
  nap 0.1
done
[[ -S $VRDMA_SOCKET ]] || fail "the backend did not listen on --socket $VRDMA_SOCKET"
[[ ! -e $E2E_TMP/from-file.sock ]] || fail "the file's socket was used over --socket"
"$VRDMA" status >"$E2E_TMP/status.out" || fail "status failed"
grep -Eq '^quotas per guest .*cq 0/5, .*qp 0/7' "$E2E_TMP/status.out" ||
  fail "quotas not applied: $(cat "$E2E_TMP/status.out")"
# The engine thread (the process's first) runs at [datapath] nice, -3 unless the file says
# otherwise, where the backend may lower it (root; elsewhere it says why not and goes on).
ni="$(awk '{print $19}' "/proc/$(backend_pid)/stat")"
if [[ $(id -u) == 0 ]]; then
  [[ $ni == -3 ]] || fail "the engine thread runs at nice $ni, not [datapath] nice's -3"
  grep -q "engine thread at nice -3" "$E2E_TMP/vrdmad.log" || fail "no line for the nice value"
else
  grep -q "engine thread stays at nice" "$E2E_TMP/vrdmad.log" || fail "no line for the nice value"
fi
e2e_pass
