#!/usr/bin/env bash
# server.sh: start or stop the `tine serve` that the server suites talk to.
#
#   server.sh start          start it in the background, wait for /health
#   server.sh stop [SIG]     send SIG (default TERM) and wait for it to exit
#
# Everything it needs comes from the environment that run.sh sets up:
# TINE_E2E_STATE (a directory holding config.toml, server.pid, server.log),
# TINE_E2E_PORT, TINE_BIN, TINE_DATA_DIR, TINE_SHM_DIR. The restart test
# calls this script too, so that a restarted server is started exactly like
# the first one.
set -euo pipefail

: "${TINE_E2E_STATE:?run through tests/e2e/server/run.sh}"
: "${TINE_E2E_PORT:?}" "${TINE_BIN:?}"
PIDFILE="$TINE_E2E_STATE/server.pid"
LOG="$TINE_E2E_STATE/server.log"

# TINE_E2E_TLS=1: domain mode over HTTPS, for tine.localhost:$TINE_E2E_PORT.
TLS_DOMAIN="tine.localhost:$TINE_E2E_PORT"
SERVE_ARGS=()
if [[ "${TINE_E2E_TLS:-0}" == 1 ]]; then
    SERVE_ARGS=(--tls --domain "$TLS_DOMAIN")
fi

health() {
    if [[ "${TINE_E2E_TLS:-0}" == 1 ]]; then
        curl -s -o /dev/null -w '%{http_code}' --max-time 2 \
            --cacert "$TINE_DATA_DIR/tls/ca.crt" \
            --resolve "api.$TLS_DOMAIN:127.0.0.1" "https://api.$TLS_DOMAIN/health" 2>/dev/null | grep -q '^2'
    else
        curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$TINE_E2E_PORT/health" 2>/dev/null | grep -q '^2'
    fi
}

running_pid() {
    [[ -f "$PIDFILE" ]] || return 1
    local pid
    pid="$(cat "$PIDFILE")"
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

case "${1:-}" in
start)
    if running_pid >/dev/null; then
        echo "error: the test server is already running (pid $(cat "$PIDFILE"))" >&2
        exit 1
    fi
    {
        echo "==== start $(date -Is)"
    } >>"$LOG"
    # setsid: a server started by the restart test must outlive pytest's
    # subprocess; the pid file is how run.sh finds it at the end.
    TINE_LOG="${TINE_LOG:-info}" setsid "$TINE_BIN" serve \
        --listen "127.0.0.1:$TINE_E2E_PORT" -c "$TINE_E2E_STATE/config.toml" "${SERVE_ARGS[@]}" \
        >>"$LOG" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PIDFILE"
    for _ in $(seq 1 300); do
        if health; then
            exit 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "error: tine serve exited; the end of its log:" >&2
            tail -30 "$LOG" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "error: tine serve did not answer /health within 30 s" >&2
    exit 1
    ;;
stop)
    sig="${2:-TERM}"
    pid="$(running_pid)" || exit 0
    kill "-$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || exit 0
        sleep 0.1
    done
    echo "warning: tine serve (pid $pid) ignored SIG$sig for 10 s; sending KILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
    ;;
*)
    echo "usage: $0 start | stop [SIGNAL]" >&2
    exit 2
    ;;
esac
