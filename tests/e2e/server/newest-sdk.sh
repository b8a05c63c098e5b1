#!/usr/bin/env bash
# newest-sdk.sh: the fidelity suite under the newest released E2B SDKs.
#
# The pinned SDKs keep CI reproducible. tests/e2e/setup.sh also installs
# whatever `e2b` PyPI and npm call newest at that moment (at every CI run)
# into <data>/venv-e2b-newest and <data>/js-e2b-newest; this job prints
# those versions and runs the fidelity files (Python and JS) with them
# against the server run.sh started, so an SDK release that breaks tine
# shows up at the next CI run. Called by run.sh with its environment
# (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, TINE_E2E_PORT) while the
# server is up. (Nothing is fetched here: the tests reach only loopback.)
#
# An SDK that setup.sh could not install is a warning (nothing was tested,
# and it says so); a failing test is a failure.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
BASE_DATA_DIR="${TINE_BASE_DATA_DIR:-/var/lib/tine}"
VENV="$BASE_DATA_DIR/venv-e2b-newest"
JS_DIR="$BASE_DATA_DIR/js-e2b-newest"

# (each line with the seconds since this script started: where its time goes)
log() { printf '==> [%4ss] %s\n' "$SECONDS" "$*" >&2; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }

status=0
pinned_py="$(grep -m1 '^E2B_PY_VERSION=' "$ROOT/tests/e2e/setup.sh" | cut -d= -f2)"
if py_version="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("e2b"))' 2>/dev/null)"; then
    log "newest released Python SDK: e2b $py_version (pinned: $pinned_py)"
    (cd "$HERE/python" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider test_e2b_fidelity.py) || status=1
else
    warn "no newest Python SDK in $VENV (tests/e2e/setup.sh could not install it): NOT tested"
fi

if [[ "${TINE_E2E_SKIP_JS:-0}" == 1 ]]; then
    log "newest JS SDK skipped (TINE_E2E_SKIP_JS=1)"
    exit $status
fi
if [[ -f "$JS_DIR/node_modules/e2b/package.json" ]]; then
    js_version="$(node -p "require('$JS_DIR/node_modules/e2b/package.json').version")"
    log "newest released JS SDK: e2b $js_version (pinned: $(node -p "require('$ROOT/tests/e2e/js/package.json').dependencies.e2b"))"
    ln -sfn "$JS_DIR/node_modules" "$HERE/js/node_modules"
    (cd "$HERE/js" && node --test --test-concurrency=1 fidelity.test.mjs) || status=1
    ln -sfn ../../js/node_modules "$HERE/js/node_modules"
else
    warn "no newest JS SDK in $JS_DIR (tests/e2e/setup.sh could not install it): NOT tested"
fi
exit $status
