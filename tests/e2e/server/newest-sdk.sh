#!/usr/bin/env bash
# newest-sdk.sh: the fidelity suite under the newest released E2B SDKs.
#
# The pinned SDKs (tests/e2e/setup.sh) keep CI reproducible; this job
# installs whatever `e2b` PyPI and npm call newest *now*, prints the
# versions, and runs the fidelity files (Python and JS) with them against
# the server run.sh started, so an SDK release that breaks tine shows up
# at the next CI run. Called by run.sh with its environment (E2B_API_URL,
# E2B_SANDBOX_URL, E2B_API_KEY, TINE_E2E_PORT) while the server is up.
#
# A registry that cannot be reached is a warning, not a failure (nothing
# was tested, and it says so); a failing test is a failure.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
BASE_DATA_DIR="${TINE_BASE_DATA_DIR:-/var/lib/tine}"
VENV="$BASE_DATA_DIR/venv-e2b-newest"
JS_DIR="$BASE_DATA_DIR/js-e2b-newest"

log() { printf '==> %s\n' "$*" >&2; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }

status=0

log "newest Python SDK: pip install --upgrade e2b (into $VENV)"
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
if "$VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade \
    e2b "pytest==9.2.0" "pytest-asyncio==1.5.0"; then
    py_version="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("e2b"))')"
    log "newest Python SDK: e2b $py_version (pinned: $(grep -m1 '^E2B_PY_VERSION=' "$ROOT/tests/e2e/setup.sh" | cut -d= -f2))"
    (cd "$HERE/python" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider test_e2b_fidelity.py) || status=1
else
    warn "could not install the newest e2b from PyPI: the newest Python SDK was NOT tested"
fi

if [[ "${TINE_E2E_SKIP_JS:-0}" == 1 ]]; then
    log "newest JS SDK skipped (TINE_E2E_SKIP_JS=1)"
    exit $status
fi
log "newest JS SDK: npm install e2b@latest (into $JS_DIR)"
mkdir -p "$JS_DIR"
[[ -f "$JS_DIR/package.json" ]] || echo '{"name":"tine-e2e-js-newest","private":true,"type":"module"}' >"$JS_DIR/package.json"
if (cd "$JS_DIR" && npm install --no-audit --no-fund --loglevel=error e2b@latest >/dev/null); then
    js_version="$(node -p "require('$JS_DIR/node_modules/e2b/package.json').version")"
    log "newest JS SDK: e2b $js_version (pinned: $(node -p "require('$ROOT/tests/e2e/js/package.json').dependencies.e2b"))"
    ln -sfn "$JS_DIR/node_modules" "$HERE/js/node_modules"
    (cd "$HERE/js" && node --test --test-concurrency=1 fidelity.test.mjs) || status=1
    ln -sfn ../../js/node_modules "$HERE/js/node_modules"
else
    warn "could not install e2b@latest from npm: the newest JS SDK was NOT tested"
fi
exit $status
