#!/usr/bin/env bash
# run.sh: the agent as a plain host process against the real E2B SDKs.
#
# Builds tine-agent, starts it as root on 127.0.0.1:49983 (the address the
# SDKs use with E2B_DEBUG=true), waits for /health, then runs the Python
# suite (pytest) and the JS suite (node --test). Exits non-zero if either
# fails. Run tests/e2e/setup.sh first. TINE_AGENT_BIN runs that binary
# instead of building one (scripts/test.sh passes the static agent of the
# initramfs). TINE_E2E_VENV picks another SDK venv
# (.ci/run also runs the Python suite with the oldest 2.x SDK);
# TINE_E2E_SKIP_JS=1 skips the JS suite.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
TINE_DATA_DIR="${TINE_DATA_DIR:-/var/lib/tine}"
VENV="${TINE_E2E_VENV:-$TINE_DATA_DIR/venv}"
ADDR=127.0.0.1:49983

# (each line with the seconds since this script started: where its time goes)
log() { printf '==> [%4ss] %s\n' "$SECONDS" "$*" >&2; }

[[ -x "$VENV/bin/python" ]] || { echo "error: no venv at $VENV: run tests/e2e/setup.sh" >&2; exit 1; }
[[ -d "$ROOT/tests/e2e/js/node_modules/e2b" ]] || { echo "error: JS SDK missing: run tests/e2e/setup.sh" >&2; exit 1; }

if [[ -n "${TINE_AGENT_BIN:-}" ]]; then
    log "using $TINE_AGENT_BIN (TINE_AGENT_BIN is set: not building)"
    AGENT="$TINE_AGENT_BIN"
else
    log "building tine-agent"
    (cd "$ROOT" && cargo build -p tine-agent 2>&1)
    AGENT="$ROOT/target/debug/tine-agent"
fi
[[ -x "$AGENT" ]] || { echo "error: no agent binary at $AGENT" >&2; exit 1; }

if (exec 3<>/dev/tcp/127.0.0.1/49983) 2>/dev/null; then
    echo "error: something already listens on $ADDR" >&2
    exit 1
fi

LOG="$(mktemp -t tine-agent-e2e.XXXXXX.log)"
log "starting the agent on $ADDR (log: $LOG)"
TINE_AGENT_LOG="${TINE_AGENT_LOG:-info}" "$AGENT" --listen "$ADDR" >"$LOG" 2>&1 &
AGENT_PID=$!
cleanup() {
    kill "$AGENT_PID" 2>/dev/null || true
    wait "$AGENT_PID" 2>/dev/null || true
}
trap cleanup EXIT

for _ in $(seq 1 100); do
    if "$VENV/bin/python" -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://$ADDR/health', timeout=1).status == 204 else 1)" 2>/dev/null; then
        break
    fi
    if ! kill -0 "$AGENT_PID" 2>/dev/null; then
        echo "error: the agent exited; its log:" >&2
        cat "$LOG" >&2
        exit 1
    fi
    sleep 0.1
done

export E2B_DEBUG=true E2B_API_KEY=tine-e2e
# The tests read the agent's peak memory from /proc/$TINE_AGENT_PID/status.
export TINE_AGENT_PID="$AGENT_PID"
status=0

log "Python SDK suite (e2b $("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("e2b"))'))"
(cd "$HERE/python" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider) || status=1

if [[ "${TINE_E2E_SKIP_JS:-0}" == 1 ]]; then
    log "JS SDK suite skipped (TINE_E2E_SKIP_JS=1)"
else
    log "JS SDK suite"
    ln -sfn ../../js/node_modules "$HERE/js/node_modules"
    (cd "$HERE/js" && node --test --test-concurrency=1) || status=1
fi

if ! kill -0 "$AGENT_PID" 2>/dev/null; then
    echo "error: the agent died during the tests; its log:" >&2
    tail -50 "$LOG" >&2
    status=1
fi
if [[ $status -ne 0 ]]; then
    echo "end-to-end tests FAILED (agent log: $LOG)" >&2
    tail -30 "$LOG" >&2
fi
exit $status
