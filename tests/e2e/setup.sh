#!/usr/bin/env bash
# setup.sh: what the end-to-end tests need on the host, installed once.
#
#   - a Python venv at $TINE_DATA_DIR/venv with the pinned E2B SDK and pytest,
#     $TINE_DATA_DIR/venv-e2b-oldest with the oldest 2.x SDK (2.0.0) and
#     $TINE_DATA_DIR/venv-e2b-between with 2.25.0
#   - $TINE_DATA_DIR/venv-fuzz with the pinned schemathesis (test_y_fuzz.py
#     runs it against the server suite's server; kept apart from the SDK
#     venvs so their dependencies cannot clash)
#   - nss-myhostname, so *.localhost resolves to loopback (domain mode)
#   - $TINE_DATA_DIR/venv-e2b-245 with 2.45.0 (the whole server suite)
#   - the pinned E2B JS SDKs in tests/e2e/js/node_modules and
#     tests/e2e/js-2.45/node_modules (npm ci)
#   - the account `user` (E2B images have it; it is the SDKs' default user)
#   - docker-registry, the OCI registry the image tests run on loopback
#
# Idempotent: each step is skipped when already done.
set -euo pipefail

E2B_PY_VERSION=2.63.0
PYTEST_PACKAGES=("pytest==9.2.0" "pytest-asyncio==1.5.0")
PY_PACKAGES=("e2b==${E2B_PY_VERSION}" "${PYTEST_PACKAGES[@]}")
# The oldest 2.x release that installs. It reads neither E2B_API_URL nor
# E2B_SANDBOX_URL (2.3 and 2.7 added them): it runs the agent suite (debug
# mode) and the domain-mode suite (E2B_DOMAIN over HTTPS).
E2B_PY_OLDEST=2.0.0
# A version between, with its own quirks: it checks the key's shape on the
# client (2.25 to 2.45) and sends no E2b-Sandbox-Id after Sandbox.connect
# (2.7 to 2.2x). It runs the fidelity, sandbox and list files.
E2B_PY_BETWEEN=2.25.0
# The release that the whole server suite also runs under (2.45 is where
# the SDKs' kill-while-waiting and error mapping last changed).
E2B_PY_245=2.45.0

TINE_DATA_DIR="${TINE_DATA_DIR:-/var/lib/tine}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$TINE_DATA_DIR/venv"
VENV_OLDEST="$TINE_DATA_DIR/venv-e2b-oldest"
VENV_BETWEEN="$TINE_DATA_DIR/venv-e2b-between"
VENV_245="$TINE_DATA_DIR/venv-e2b-245"
VENV_FUZZ="$TINE_DATA_DIR/venv-fuzz"
# The REST API fuzzer (tests/e2e/server/python/test_y_fuzz.py): schemathesis
# and all its dependencies, pinned.
FUZZ_REQUIREMENTS="$HERE/fuzz-requirements.txt"

log() { printf '==> %s\n' "$*" >&2; }
info() { printf '    %s\n' "$*" >&2; }

apt_install() {
    if [[ ${EUID:-$(id -u)} -ne 0 ]]; then
        echo "error: missing $*; install it (as root: apt-get install $*)" >&2
        exit 1
    fi
    info "apt-get install $*"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# ---- Python SDKs: the newest, and the oldest 2.x (run by .ci/run too) ----
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    apt_install python3-venv
fi
# py_venv DIR PACKAGE==VERSION...: a venv holding exactly those versions.
# py_venv DIR -r FILE: the same for every NAME==VERSION line of FILE (a
# requirements file as `pip freeze` writes it), installed from FILE.
py_venv() {
    local venv="$1"
    shift
    local install=("$@")
    if [[ "${1:-}" == -r ]]; then
        local pins
        mapfile -t pins < <(grep -Ev '^[[:space:]]*(#|$)' "$2")
        set -- "${pins[@]}"
    fi
    if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - "$@" <<'PY' >/dev/null 2>&1; then
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    assert version(name) == want, spec
PY
        info "already installed"
    else
        mkdir -p "$TINE_DATA_DIR"
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install --disable-pip-version-check -q "${install[@]}"
        info "installed: ${install[*]}"
    fi
}
log "Python E2B SDK ${E2B_PY_VERSION} in ${VENV}"
# PyJWT and cryptography: the relying party of the workload identity tests.
# selenium: drives Debian's chromium through the console tests.
py_venv "$VENV" "${PY_PACKAGES[@]}" "mcp==2.3.0" "PyJWT==2.15.1" "cryptography==51.0.1" "selenium==4.45.0"
log "Python E2B SDK ${E2B_PY_OLDEST} (the oldest 2.x) in ${VENV_OLDEST}"
py_venv "$VENV_OLDEST" "e2b==${E2B_PY_OLDEST}" "${PY_PACKAGES[@]:1}"
log "Python E2B SDK ${E2B_PY_BETWEEN} in ${VENV_BETWEEN}"
py_venv "$VENV_BETWEEN" "e2b==${E2B_PY_BETWEEN}" "${PY_PACKAGES[@]:1}"
log "Python E2B SDK ${E2B_PY_245} in ${VENV_245}"
py_venv "$VENV_245" "e2b==${E2B_PY_245}" "${PY_PACKAGES[@]:1}"
log "$(grep -m1 '^schemathesis==' "$FUZZ_REQUIREMENTS") (the REST API fuzzer) in ${VENV_FUZZ}"
py_venv "$VENV_FUZZ" -r "$FUZZ_REQUIREMENTS"

# ---- an OCI registry for the image tests ----
log "docker-registry (Debian's distribution 2.8, run on loopback by the image tests)"
if command -v docker-registry >/dev/null 2>&1; then
    info "already installed"
else
    apt_install docker-registry
    # The package's service would listen on :5000 for every interface; the
    # tests start their own on loopback.
    if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
        systemctl disable --now docker-registry >/dev/null 2>&1 || true
    fi
fi

# ---- a browser for the console tests ----
log "chromium and chromium-driver (headless, driven by Selenium in test_y_console.py)"
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    info "already installed ($(chromium --version 2>/dev/null | head -1))"
else
    apt_install chromium chromium-driver
fi

# ---- promtool: checks deploy/prometheus's rules ----
# From Debian's prometheus package, unpacked into the data dir: only the
# tool, not the server the package would start.
PROMTOOL="$TINE_DATA_DIR/tools/prometheus/usr/bin/promtool"
log "promtool (deploy/prometheus/alerts.yml is checked with it)"
if [[ -x "$PROMTOOL" ]]; then
    info "already unpacked: $("$PROMTOOL" --version 2>&1 | head -1)"
else
    tmp="$(mktemp -d)"
    chmod 0755 "$tmp" # (apt's _apt user downloads into it)
    apt-get update -qq >/dev/null 2>&1 || true
    (cd "$tmp" && apt-get download -qq prometheus >/dev/null) || { echo "error: apt-get download prometheus failed" >&2; exit 1; }
    mkdir -p "$TINE_DATA_DIR/tools/prometheus"
    dpkg-deb -x "$tmp"/prometheus_*.deb "$TINE_DATA_DIR/tools/prometheus"
    rm -rf "$tmp"
    [[ -x "$PROMTOOL" ]] || { echo "error: no promtool in Debian's prometheus package" >&2; exit 1; }
    info "unpacked: $("$PROMTOOL" --version 2>&1 | head -1)"
fi

# ---- names under *.localhost (the domain-mode tests) ----
# The SDKs in domain mode reach https://api.tine.localhost:PORT and
# https://<port>-<id>.tine.localhost:PORT; nss-myhostname resolves every
# name under localhost to loopback (as systemd-resolved does elsewhere).
log "nss-myhostname (*.localhost resolves to loopback, for the domain-mode tests)"
if getent hosts api.tine.localhost >/dev/null 2>&1; then
    info "already resolving"
else
    dpkg -s libnss-myhostname >/dev/null 2>&1 || apt_install libnss-myhostname
    if ! grep -Eq '^hosts:.*\bmyhostname\b' /etc/nsswitch.conf; then
        sed -i -E 's/^(hosts:[[:space:]]+files)/\1 myhostname/' /etc/nsswitch.conf
    fi
    getent hosts api.tine.localhost >/dev/null || { echo "error: api.tine.localhost does not resolve after installing libnss-myhostname" >&2; exit 1; }
    info "installed"
fi

# ---- JS SDK ----
log "JS E2B SDK (tests/e2e/js, pinned by package-lock.json)"
if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
    apt_install nodejs npm
fi
# js/ holds the newest pinned SDK, js-2.45/ an older one that the
# fidelity suite also runs under.
for dir in js js-2.45; do
    lock="$HERE/$dir/package-lock.json"
    stamp="$HERE/$dir/node_modules/.tine-lock.sha256"
    want="$(sha256sum "$lock" | cut -d' ' -f1)"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        info "$dir: already installed"
    else
        (cd "$HERE/$dir" && npm ci --no-audit --no-fund --loglevel=error)
        echo "$want" >"$stamp"
        info "$dir: installed e2b $(node -p "require('$HERE/$dir/node_modules/e2b/package.json').version" 2>/dev/null || echo '?')"
    fi
done

# ---- the newest released SDKs (not pinned) ----
# Installed here, at every setup (so at every CI run), and run on the
# fidelity files by tests/e2e/server/newest-sdk.sh: a new SDK release that
# breaks tine shows up at the next CI run. A registry that cannot be
# reached is a warning: the job then says it tested nothing.
log "the newest released E2B SDKs (Python in $TINE_DATA_DIR/venv-e2b-newest, JS in $TINE_DATA_DIR/js-e2b-newest)"
NEWEST_VENV="$TINE_DATA_DIR/venv-e2b-newest"
[[ -x "$NEWEST_VENV/bin/python" ]] || python3 -m venv "$NEWEST_VENV"
if "$NEWEST_VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade \
    e2b "${PYTEST_PACKAGES[@]}"; then
    info "Python: e2b $("$NEWEST_VENV/bin/python" -c 'from importlib.metadata import version; print(version("e2b"))')"
else
    info "WARNING: could not install the newest e2b from PyPI (the job will use what is there, if anything)"
fi
NEWEST_JS="$TINE_DATA_DIR/js-e2b-newest"
mkdir -p "$NEWEST_JS"
[[ -f "$NEWEST_JS/package.json" ]] || echo '{"name":"tine-e2e-js-newest","private":true,"type":"module"}' >"$NEWEST_JS/package.json"
if (cd "$NEWEST_JS" && npm install --no-audit --no-fund --loglevel=error e2b@latest >/dev/null); then
    info "JS: e2b $(node -p "require('$NEWEST_JS/node_modules/e2b/package.json').version")"
else
    info "WARNING: could not install e2b@latest from npm (the job will use what is there, if anything)"
fi

# ---- the default sandbox user ----
log "account 'user'"
if id user >/dev/null 2>&1; then
    info "exists (uid $(id -u user))"
elif [[ ${EUID:-$(id -u)} -ne 0 ]]; then
    echo "error: the account 'user' is missing; create it as root: useradd -m -s /bin/bash user" >&2
    exit 1
else
    uid_opt=()
    if ! getent passwd 1000 >/dev/null && ! getent group 1000 >/dev/null; then
        uid_opt=(-u 1000)
    fi
    useradd -m -d /home/user -s /bin/bash "${uid_opt[@]}" user
    info "created (uid $(id -u user), home /home/user)"
fi
