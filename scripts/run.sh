#!/usr/bin/env bash
# run.sh: install what is missing, then run the tine server on loopback with
# the default template (`base`), and print the environment variables that
# point the E2B SDKs at it.
#
# The template `mcp-gateway` (Sandbox.create(mcp=...)) is built in the
# background once the server listens (log: $TINE_DATA_DIR/mcp-gateway/
# build.log); a create with mcp= before it is done gets a 404 that says so.
#
# Environment: TINE_LISTEN (default 127.0.0.1:3000), TINE_DATA_DIR,
# TINE_SKIP_MCP=1 (no mcp-gateway template).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$TINE_SCRIPTS_DIR/.."
need_root

listen="${TINE_LISTEN:-127.0.0.1:3000}"

run_start=$(now)
# The CLI (the longest step) builds in the background from the start,
# while the host is set up and the agent builds (in its own target dir).
"$TINE_SCRIPTS_DIR/setup-host.sh" packages
mkdir -p target
cli_log=target/run-cli-build.log
log "building the tine CLI (release) in the background (log: $cli_log)"
# (Its own process group: stopping run.sh stops every rustc of it too.)
setsid cargo build --release --locked -p tine-cli >"$cli_log" 2>&1 </dev/null &
cli=$!
trap 'kill -TERM -- "-$cli" 2>/dev/null || true' EXIT
"$TINE_SCRIPTS_DIR/setup-host.sh"
"$TINE_SCRIPTS_DIR/build-agent.sh"
log "waiting for the tine CLI build"
while kill -0 "$cli" 2>/dev/null; do
    info "CLI build: $(grep -c '^ *Compiling' "$cli_log") crates compiled, $(elapsed "$run_start") since run.sh started"
    for _ in $(seq 1 15); do kill -0 "$cli" 2>/dev/null && sleep 1; done
done
if ! wait "$cli"; then
    tail -30 "$cli_log" >&2
    die "building the tine CLI failed (log: $cli_log)"
fi
trap - EXIT
info "CLI built, $(elapsed "$run_start") since run.sh started"
tine=target/release/tine

log "creating an API key for this run (list them: $tine keys list)"
key="$("$tine" keys create --name "run.sh $(date -u +%FT%TZ)" 2>/dev/null)"

log "starting tine serve on http://$listen"
"$tine" serve --listen "$listen" &
server=$!
# A script's background jobs ignore SIGINT, so Ctrl-C (and any exit of
# run.sh) stops the server with SIGTERM, which it handles as Ctrl-C.
stop() {
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 600); do
    curl -fsS -o /dev/null "http://$listen/health" 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || die "tine serve exited (its log is above)"
    sleep 0.1
done
curl -fsS -o /dev/null "http://$listen/health" || die "tine serve does not answer on http://$listen/health"
info "listening $(elapsed "$run_start") after run.sh started"

# The template Sandbox.create(mcp=...) starts from: built in the
# background now that the server listens (once per recipe; a create with
# mcp= before it is done gets a 404 that says so). TINE_SKIP_MCP=1 skips it.
if [[ "${TINE_SKIP_MCP:-0}" != 1 ]]; then
    mkdir -p "$TINE_DATA_DIR/mcp-gateway"
    mcp_log="$TINE_DATA_DIR/mcp-gateway/build.log"
    log "building the template mcp-gateway in the background (log: $mcp_log)"
    # Not stopped with the server: it finishes on its own (the next run.sh
    # finds the template built, or waits for this build's lock). Its last
    # log line says whether it was built or failed.
    TINE_BIN="$PWD/$tine" setsid bash -c '"$1" || echo "==> FAILED: the template mcp-gateway was not built (exit $?)"' \
        _ "$TINE_SCRIPTS_DIR/build-mcp-gateway.sh" >"$mcp_log" 2>&1 </dev/null &
fi

cat >&2 <<MSG

==> tine is running on http://$listen (Ctrl-C stops it; sandboxes keep
    running and are adopted again by the next start). In another shell:

export E2B_API_URL=http://$listen
export E2B_SANDBOX_URL=http://$listen
export E2B_VOLUME_API_URL=http://$listen
export E2B_API_KEY=$key

    then e.g.: python3 -c 'from e2b import Sandbox; s = Sandbox.create(); print(s.commands.run("uname -a").stdout)'
    The first create builds the template snapshot (one cold boot).

MSG
wait "$server" || true
