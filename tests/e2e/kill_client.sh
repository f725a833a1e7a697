#!/usr/bin/env bash
# A guest that dies mid-run (SIGKILL) is cleaned up by the backend: its session and resources
# go away, the backend survives, and a new pair works afterwards.
# Usage: kill_client.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

start_server long victim-srv -n "$PP_UNTIL_STOPPED"
srv=$SERVER_PID
start_client long victim-cli "$PORT" -n "$PP_UNTIL_STOPPED"
cli=$CLIENT_PID
sleep 1
kill -0 "$cli" 2>/dev/null || fail "the client ended before it was killed: $(cat "$E2E_TMP/long.client.out")"
bpid="$(backend_pid)"
[[ -n $bpid ]] || fail "no backend"
wait_status "scalar grep { \$_->{pid} == $cli } map { @{\$_->{sessions}} } @{\$j->{guests}}" 1 5 ||
  fail "the client's session (pid $cli) is not in the status: $(status_json)"

log "SIGKILL client $cli"
kill -KILL "$cli"
wait "$cli" 2>/dev/null || true

nap 0.5
kill -0 "$bpid" 2>/dev/null || fail "the backend ($bpid) died with the client"
wait_status "scalar grep { \$_->{pid} == $cli } map { @{\$_->{sessions}} } @{\$j->{guests}}" 0 10 ||
  fail "the killed client's session is still there: $(status_json)"
# The client's guest: gone, or left with no sessions and no resources.
wait_status 'my ($g) = grep { $_->{guest} eq "victim-cli" } @{$j->{guests}};
             !$g ? "released"
                 : (@{$g->{sessions}} || grep { ($g->{resources}{$_} // 0) != 0 } qw(pd mr cq qp))
                 ? "left" : "released"' released 10 ||
  fail "the killed client's session or resources remain: $(status_json)"
log "client resources released; status: $(status_json)"

# The server's peer is gone: it may fail on its own; give it a moment, then kill it.
wait_pid "$srv" 5
log "server ended with $WAIT_RC (124: killed by the test)"
kill -0 "$bpid" 2>/dev/null || fail "the backend ($bpid) died with the server"
wait_status '$j->{totals}{qp}' 0 10 || fail "QPs left after both ends are gone: $(status_json)"
wait_status '$j->{totals}{sessions}' 0 10 || fail "sessions left: $(status_json)"

# The backend still serves new guests.
run_pair after victim-srv victim-cli
[[ "$(backend_pid)" == "$bpid" ]] || fail "the backend was replaced"
e2e_pass
