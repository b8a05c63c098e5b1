#!/usr/bin/env bash
# run.sh: `tine serve` with real VMs against the real E2B SDKs.
#
# Builds tine, starts `tine serve` on 127.0.0.1:$TINE_E2E_PORT (3999) with a
# small config (1 vCPU, 256 MiB per sandbox), creates a fresh API key, runs
# the Python suite (pytest; the newest SDK on every file, 2.45.0 on the
# files of the SDK's surface, 2.25.0 on three files) and the JS suite
# (node --test; the fidelity file also under JS 2.45.0), restarts the server in domain mode over HTTPS
# for domain/ (newest Python, 2.0.0 and JS; TINE_E2E_SKIP_DOMAIN=1 skips
# it), then kills every
# sandbox the run made (through the API), stops the server and checks that
# no QEMU process of the run is left. Exits non-zero if anything failed.
# Run tests/e2e/setup.sh first. Idempotent. Arguments go to pytest (e.g.
# `-k list`); TINE_BIN=/path/to/tine skips the build; TINE_E2E_PORT
# changes the port.
#
# Shards: TINE_E2E_SHARD=b runs only the pinned SDK's SHARD_B files (below)
# against a second server of its own (data dir e2e-server-b, port
# TINE_E2E_PORT or 3998, its own veth pool and jail uids), so that
# scripts/test.sh runs it side by side with TINE_E2E_SHARD=a: everything
# else, on the first server. No shard: everything on one server.
#
# State: the server gets its own data dir, $TINE_DATA_DIR/e2e-server (kept
# between runs so the template snapshot is captured once), whose `current`
# is a link to $TINE_DATA_DIR/current (the guest artifacts). It must not
# share tine.db with another server: at start a server adopts (or marks
# dead) every sandbox in its database, and the restart test restarts it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
BASE_DATA_DIR="${TINE_DATA_DIR:-/var/lib/tine}"
VENV="$BASE_DATA_DIR/venv"
VENV_OLDEST="$BASE_DATA_DIR/venv-e2b-oldest"
VENV_BETWEEN="$BASE_DATA_DIR/venv-e2b-between"
VENV_245="$BASE_DATA_DIR/venv-e2b-245"
# schemathesis, which test_y_fuzz.py runs against the server.
VENV_FUZZ="$BASE_DATA_DIR/venv-fuzz"
SHARD="${TINE_E2E_SHARD:-}"
case "$SHARD" in
    "" | a) PORT="${TINE_E2E_PORT:-3999}" INSTANCE=e2e-server ;;
    b) PORT="${TINE_E2E_PORT:-3998}" INSTANCE=e2e-server-b ;;
    *) echo "error: TINE_E2E_SHARD is a or b, not $SHARD" >&2; exit 2 ;;
esac
# The pinned SDK's files of shard b: about 430 of the pinned suite's 1130 s
# (pytest --durations), none of them needing the mcp-gateway template.
# (The other stream of scripts/test.sh runs the cluster suite first.)
SHARD_B=(
    test_y_capture.py test_y_fuzz.py test_y_build.py test_y_secrets.py
    test_volumes.py test_volume_mounts.py
)

# (each line with the seconds since this script started: where its time goes)
log() { printf '==> [%4ss] %s\n' "$SECONDS" "$*" >&2; }

[[ -x "$VENV/bin/python" ]] || { echo "error: no venv at $VENV: run tests/e2e/setup.sh" >&2; exit 1; }
for v in "$VENV_OLDEST" "$VENV_BETWEEN" "$VENV_245" "$VENV_FUZZ"; do
    [[ -x "$v/bin/python" ]] || { echo "error: no venv at $v: run tests/e2e/setup.sh" >&2; exit 1; }
done
for d in js js-2.45; do
    [[ -d "$ROOT/tests/e2e/$d/node_modules/e2b" ]] || { echo "error: JS SDK missing in tests/e2e/$d: run tests/e2e/setup.sh" >&2; exit 1; }
done
[[ -e "$BASE_DATA_DIR/current/vmlinuz" ]] || { echo "error: no guest artifacts in $BASE_DATA_DIR/current (scripts/test.sh builds them)" >&2; exit 1; }

if [[ -n "${TINE_BIN:-}" ]]; then
    log "using $TINE_BIN (TINE_BIN is set: not building)"
else
    log "building tine"
    (cd "$ROOT" && cargo build --locked -p tine-cli 2>&1)
    TINE_BIN="$ROOT/target/debug/tine"
fi
export TINE_BIN

if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
    echo "error: something already listens on 127.0.0.1:$PORT (set TINE_E2E_PORT)" >&2
    exit 1
fi

export TINE_DATA_DIR="$BASE_DATA_DIR/$INSTANCE"
export TINE_SHM_DIR="${TINE_E2E_SHM_DIR:-/dev/shm/tine-$INSTANCE}"
mkdir -p "$TINE_DATA_DIR"
ln -sfn "$BASE_DATA_DIR/current" "$TINE_DATA_DIR/current"
# The files of the pinned run, and whether the other SDKs' runs follow.
pinned=() rest=1
case "$SHARD" in
    a)
        for f in "$HERE"/python/test_*.py; do
            f=${f##*/}
            [[ " ${SHARD_B[*]} " == *" $f "* ]] || pinned+=("$f")
        done
        ;;
    b) pinned=("${SHARD_B[@]}") rest=0 ;;
esac
# Files named on the command line are the run's own choice.
[[ $# -eq 0 ]] || pinned=()
if [[ "${TINE_E2E_SKIP_MCP:-0}" != 1 && $rest -eq 1 ]]; then
    log "template mcp-gateway (scripts/build-mcp-gateway.sh: once per recipe)"
    TINE_BIN="$TINE_BIN" "$ROOT/scripts/build-mcp-gateway.sh" || { echo "error: building the mcp-gateway template failed" >&2; exit 1; }
fi

export TINE_E2E_STATE
TINE_E2E_STATE="$(mktemp -d -t tine-e2e-server.XXXXXX)"
export TINE_E2E_PORT="$PORT"
export TINE_E2E_MAX_BODY=65536
export TINE_FUZZ_VENV="$VENV_FUZZ"
# Checks deploy/prometheus/alerts.yml (test_y_console.py); setup.sh unpacks it.
export TINE_PROMTOOL="$BASE_DATA_DIR/tools/prometheus/usr/bin/promtool"
cat >"$TINE_E2E_STATE/config.toml" <<EOF
default_cpu_count = 1
default_memory_mb = 256
default_timeout_secs = 600
max_cpu_count = 4
max_memory_mb = 4096
max_sandboxes = 64
max_body_bytes = $TINE_E2E_MAX_BODY
build_ready_timeout_secs = 20
max_concurrent_builds = 1
build_context_max_bytes = 8388608
volume_max_bytes = 16777216

[registries]
# The suites' registries run on loopback (builds through the API reach only
# the internet and what is listed here).
allow_private = ["127.0.0.1/32"]

[network]
# The stand-in internet's "operator mirror" and its DNS server
# (tests/e2e/net/inet.sh).
allow_private = ["10.99.1.0/24"]
dns = "203.0.113.10"
# The stand-in's test CA: destinations of header transforms verify with it.
upstream_ca_file = "/run/tine-e2e-inet/ca.pem"
$([[ $SHARD == b ]] && echo 'veth_pool = "10.234.0.0/16"  # (shard b: not the first server'"'"'s)')

[jail]
# Small, so a test can fill and rotate it quickly.
console_max_bytes = 65536
$([[ $SHARD == b ]] && echo 'uid_base = 2000000  # (shard b: not the first server'"'"'s)')

# Short-lived workload identity tokens, so a test sees one expire.
[identity]
token_ttl_secs = 8

# test_isolation.py's team with limits (the default team has none).
[teams.limited]
max_sandboxes = 1
max_vcpus = 1
max_memory_mb = 512
max_snapshot_bytes = 1

# test_volumes.py's other team: its volumes hold at most 1 MiB.
[teams.vol-other]
max_volume_bytes = 1048576
EOF

export E2B_API_URL="http://127.0.0.1:$PORT" E2B_SANDBOX_URL="http://127.0.0.1:$PORT" E2B_VOLUME_API_URL="http://127.0.0.1:$PORT"
unset E2B_DEBUG E2B_DOMAIN
E2B_API_KEY="$("$TINE_BIN" keys create --name "e2e-server-$(date +%s)" 2>/dev/null)"
export E2B_API_KEY
[[ -n "$E2B_API_KEY" ]] || { echo "error: tine keys create printed no key" >&2; exit 1; }

# Kill what the run made: every sandbox this server knows (its database is
# the run's own), then the server, then any QEMU of this data dir.
cleanup() {
    set +e
    # (If the server died, start it again: its API is how sandboxes die.)
    "$HERE/server.sh" start >/dev/null 2>&1
    "$VENV/bin/python" "$HERE/cleanup.py"
    "$HERE/server.sh" stop TERM
    "$ROOT/tests/e2e/net/inet.sh" down
    sleep 0.5
    local left
    left="$(pgrep -f "qemu-system.*$TINE_DATA_DIR/vms/" || true)"
    if [[ -n "$left" ]]; then
        echo "error: QEMU processes of this run are still alive: $left; killing them" >&2
        for pid in $left; do kill -KILL "$pid" 2>/dev/null; done
        return 1
    fi
    return 0
}

status=0
finish() {
    cleanup || status=1
    if [[ $status -ne 0 ]]; then
        echo "server end-to-end tests FAILED (server log: $TINE_E2E_STATE/server.log)" >&2
        tail -40 "$TINE_E2E_STATE/server.log" >&2
    else
        log "server end-to-end tests passed"
        rm -rf "$TINE_E2E_STATE"
    fi
    exit $status
}
trap finish EXIT
trap 'status=130; exit' INT TERM

log "the stand-in internet: namespace e2e-inet (203.0.113.10/.20, 10.99.0.10, 10.99.1.10)"
"$ROOT/tests/e2e/net/inet.sh" up
log "starting tine serve on 127.0.0.1:$PORT (data dir $TINE_DATA_DIR, log $TINE_E2E_STATE/server.log)"
"$HERE/server.sh" start
# Sandboxes left by an earlier, interrupted run.
"$VENV/bin/python" "$HERE/cleanup.py"

sdk_version() { "$1/bin/python" -c 'from importlib.metadata import version; print(version("e2b"))'; }
log "Python SDK suite (e2b $(sdk_version "${TINE_E2E_VENV:-$VENV}"))"
(cd "$HERE/python" && "${TINE_E2E_VENV:-$VENV}/bin/python" -m pytest -q -p no:cacheprovider "${pinned[@]}" "$@") || status=1
if [[ $# -eq 0 && -z "${TINE_E2E_VENV:-}" && $rest -eq 1 ]]; then
    # Under 2.45 again, the files whose calls go through the SDK's whole
    # surface (sandbox, commands, files, PTY, watches, list, pause and
    # snapshots, the Template builder, bad input), so the next difference
    # between SDK versions shows up here. The files about the server's own
    # machinery (images, lazy disks, networking, capacity, restarts, full
    # disks, the CLI, the fuzzer) run once, above.
    # Not the tests marked `machinery` (full disks, a GiB capture, hostile
    # guests, 20 creates at once): the server's own checks, which no SDK
    # version changes, run once above.
    log "Python SDK $(sdk_version "$VENV_245"): the files of the SDK's surface"
    (cd "$HERE/python" && "$VENV_245/bin/python" -m pytest -q -p no:cacheprovider -m "not machinery" \
        test_e2b_fidelity.py test_sandbox.py test_list.py test_concurrent.py \
        test_bad_input.py test_isolation.py test_y_capture.py test_y_template.py) || status=1
    # A version with other quirks (see setup.sh), on the files that meet them.
    log "Python SDK $(sdk_version "$VENV_BETWEEN"): the fidelity, sandbox and list files"
    (cd "$HERE/python" && "$VENV_BETWEEN/bin/python" -m pytest -q -p no:cacheprovider \
        test_e2b_fidelity.py test_sandbox.py test_list.py) || status=1
fi

if [[ $rest -eq 0 ]]; then
    log "shard $SHARD: the pinned SDK's files only"
elif [[ "${TINE_E2E_SKIP_JS:-0}" == 1 ]]; then
    log "JS SDK suite skipped (TINE_E2E_SKIP_JS=1)"
else
    log "JS SDK suite (e2b $(node -p "require('$ROOT/tests/e2e/js/node_modules/e2b/package.json').version"))"
    ln -sfn ../../js/node_modules "$HERE/js/node_modules"
    (cd "$HERE/js" && node --test --test-concurrency=1) || status=1
    log "JS SDK $(node -p "require('$ROOT/tests/e2e/js-2.45/node_modules/e2b/package.json').version"): the fidelity file"
    ln -sfn ../../js-2.45/node_modules "$HERE/js/node_modules"
    (cd "$HERE/js" && node --test --test-concurrency=1 fidelity.test.mjs) || status=1
    ln -sfn ../../js/node_modules "$HERE/js/node_modules"
fi

# The newest released SDKs (not pinned), on the fidelity files: a new SDK
# release that breaks tine fails here (docs/compatibility.md).
if [[ ( $# -eq 0 || "${TINE_E2E_NEWEST:-0}" == 1 ) && "${TINE_E2E_SKIP_NEWEST:-0}" != 1 && $rest -eq 1 ]]; then
    TINE_BASE_DATA_DIR="$BASE_DATA_DIR" "$HERE/newest-sdk.sh" || status=1
fi

if [[ $rest -eq 0 ]]; then
    :
elif [[ "${TINE_E2E_SKIP_DOMAIN:-0}" == 1 ]]; then
    log "domain mode skipped (TINE_E2E_SKIP_DOMAIN=1)"
else
    # The same server, restarted as `tine serve --domain tine.localhost:PORT
    # --tls`: the SDKs get only E2B_DOMAIN and tine's CA. Names under
    # tine.localhost resolve to loopback through nss-myhostname (setup.sh).
    log "domain mode over HTTPS: E2B_DOMAIN=tine.localhost:$PORT only"
    "$HERE/server.sh" stop TERM
    TINE_E2E_TLS=1 "$HERE/server.sh" start || status=1
    ca="$TINE_DATA_DIR/tls/ca.crt"
    domain_env=(env -u E2B_API_URL -u E2B_SANDBOX_URL E2B_DOMAIN="tine.localhost:$PORT"
        SSL_CERT_FILE="$ca" NODE_EXTRA_CA_CERTS="$ca")
    # Both SDK versions: the oldest 2.x reaches a server only this way.
    for venv in "$VENV" "$VENV_OLDEST"; do
        log "domain mode, Python SDK $(sdk_version "$venv")"
        (cd "$HERE/domain" && "${domain_env[@]}" "$venv/bin/python" -m pytest -q -p no:cacheprovider) || status=1
    done
    if [[ "${TINE_E2E_SKIP_JS:-0}" != 1 ]]; then
        ln -sfn ../../js/node_modules "$HERE/domain/node_modules"
        (cd "$HERE/domain" && "${domain_env[@]}" node --test --test-concurrency=1) || status=1
    fi
    "$HERE/server.sh" stop TERM
    "$HERE/server.sh" start || status=1
fi

if ! (cd "$HERE" && "$VENV/bin/python" -c "import urllib.request,sys; urllib.request.urlopen('$E2B_API_URL/health', timeout=5)"); then
    echo "error: the server does not answer /health after the suites" >&2
    status=1
fi
