#!/usr/bin/env bash
# run.sh: cluster mode end to end: scripts/cluster.sh up (PostgreSQL, 3
# nodes, 2 gateways, real VMs), then the cluster suite (test_cluster.py,
# the newest Python SDK) and a part of the server suite through a gateway,
# then scripts/cluster.sh down and a check that no process of the cluster
# is left. Run tests/e2e/setup.sh first. Arguments go to pytest.
#
# State: $TINE_DATA_DIR/e2e-cluster (each node's data dir under it; the
# template snapshots are kept between runs). TINE_BIN skips the build.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
BASE_DATA_DIR="${TINE_DATA_DIR:-/var/lib/tine}"
VENV="$BASE_DATA_DIR/venv"
# (each line with the seconds since this script started: where its time goes)
log() { printf '==> [%4ss] %s\n' "$SECONDS" "$*" >&2; }

[[ -x "$VENV/bin/python" ]] || { echo "error: no venv at $VENV: run tests/e2e/setup.sh" >&2; exit 1; }
if [[ -z "${TINE_BIN:-}" ]]; then
    log "building tine (release)"
    (cd "$ROOT" && cargo build --release --locked -p tine-cli)
    TINE_BIN="$ROOT/target/release/tine"
fi
export TINE_BIN TINE_DATA_DIR="$BASE_DATA_DIR"
export TINE_CLUSTER_DIR="$BASE_DATA_DIR/e2e-cluster"
export TINE_CLUSTER_PG_PORT="${TINE_E2E_CLUSTER_PG_PORT:-5433}"
export TINE_CLUSTER_NODE_PORT="${TINE_E2E_CLUSTER_NODE_PORT:-3100}"
export TINE_CLUSTER_GATEWAY_PORT="${TINE_E2E_CLUSTER_GATEWAY_PORT:-3200}"
export TINE_CLUSTER_SKIP_SETUP=1
# As tests/e2e/server/run.sh configures its server (the server suite's
# body-size test expects it).
export TINE_E2E_MAX_BODY=65536
export TINE_CLUSTER_NODE_CONFIG="max_body_bytes = $TINE_E2E_MAX_BODY"
CLUSTER="$ROOT/scripts/cluster.sh"

status=0
finish() {
    # Ended by a failed command (set -e), not by the tests' verdict.
    local rc=$?
    set +e
    [[ $rc -ne 0 ]] && status=1
    "$CLUSTER" down
    "$ROOT/tests/e2e/net/inet.sh" down
    sleep 0.5
    local left
    left="$(pgrep -f "$TINE_CLUSTER_DIR" || true)"
    if [[ -n "$left" ]]; then
        echo "error: processes of the cluster are still alive: $(ps -o pid,args -p "${left//$'\n'/,}" | tail -n +2)" >&2
        pkill -KILL -f "$TINE_CLUSTER_DIR"
        status=1
    fi
    if [[ $status -ne 0 ]]; then
        echo "cluster end-to-end tests FAILED (logs: $TINE_CLUSTER_DIR/node-*/server.log, $TINE_CLUSTER_DIR/gateway-*.log)" >&2
        for f in "$TINE_CLUSTER_DIR"/gateway-1.log "$TINE_CLUSTER_DIR"/node-1/server.log; do
            echo "--- $f" >&2
            tail -15 "$f" >&2
        done
    else
        log "cluster end-to-end tests passed"
    fi
    exit $status
}
trap finish EXIT
trap 'status=130; exit' INT TERM

# A cluster left by an interrupted run goes first (its sandboxes too).
"$CLUSTER" down >/dev/null 2>&1 || true
# The registry starts empty (a run damages a chunk in it on purpose).
rm -rf "$TINE_CLUSTER_DIR/registry"
# The stand-in internet (tests/e2e/net/inet.sh): the secrets test's
# destination.
"$ROOT/tests/e2e/net/inet.sh" up
# Its DNS (every name is 203.0.113.10) is the sandboxes' resolver: the
# secrets test's transform names its host.
export TINE_CLUSTER_DNS=203.0.113.10
"$CLUSTER" up --nodes 3 --gateways 2
# The catalog's captures name what the emptied registry held.
psql -h 127.0.0.1 -p "$TINE_CLUSTER_PG_PORT" -U postgres -d tine -tAqc "DELETE FROM tine_captures" >/dev/null

export TINE_POSTGRES_URL="postgresql://postgres@127.0.0.1:$TINE_CLUSTER_PG_PORT/tine"
key() { "$TINE_BIN" cluster create-key --postgres-url "$TINE_POSTGRES_URL" --name e2e-cluster --team "$1" 2>/dev/null; }
E2B_API_KEY="$(key default)"
TINE_E2E_OTHER_KEY="$(key other)"
TINE_E2E_LIMITED_KEY="$(key limited)"
export E2B_API_KEY TINE_E2E_OTHER_KEY TINE_E2E_LIMITED_KEY
export TINE_E2E_REGISTRY="127.0.0.1:${TINE_CLUSTER_REGISTRY_PORT:-5055}" TINE_POSTGRES_URL
export TINE_E2E_GATEWAYS="http://127.0.0.1:$((TINE_CLUSTER_GATEWAY_PORT + 1)),http://127.0.0.1:$((TINE_CLUSTER_GATEWAY_PORT + 2))"
export TINE_E2E_NODES="http://127.0.0.1:$((TINE_CLUSTER_NODE_PORT + 1)),http://127.0.0.1:$((TINE_CLUSTER_NODE_PORT + 2)),http://127.0.0.1:$((TINE_CLUSTER_NODE_PORT + 3))"
export E2B_API_URL="http://127.0.0.1:$((TINE_CLUSTER_GATEWAY_PORT + 1))" E2B_SANDBOX_URL="http://127.0.0.1:$((TINE_CLUSTER_GATEWAY_PORT + 1))"
# Volume content calls go through the gateway too (nothing an SDK sends
# may fall back to E2B's hosts).
export E2B_VOLUME_API_URL="$E2B_API_URL"
unset E2B_DEBUG E2B_DOMAIN

log "cluster suite (e2b $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("e2b"))'))"
(cd "$HERE" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider test_cluster.py "$@") || status=1

# The bulk of the single-server suite, through the gateway. Left out: what
# reads one server's own files, config, metrics or restarts it
# (test_isolation, test_y_*, test_zz_*), the Prometheus test, and key
# revocation through the node's CLI (TINE_BIN unset: test_cluster.py
# revokes a key of the cluster instead).
log "server suite through gateway 1"
(cd "$ROOT/tests/e2e/server/python" && env -u TINE_BIN TINE_E2E_PORT="$((TINE_CLUSTER_GATEWAY_PORT + 1))" \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    test_sandbox.py test_list.py test_concurrent.py test_e2b_fidelity.py test_bad_input.py \
    --deselect test_bad_input.py::test_prometheus_metrics_count_what_happened) || status=1

# Domain mode over HTTPS: the nodes restarted (SIGTERM, as a service
# manager stops them; they adopt their VMs again) for the domain
# tine.localhost:<gateway 2>, gateway 2 restarted with [tls] and tine's
# local CA. The SDK gets only E2B_DOMAIN and the CA.
G2=$((TINE_CLUSTER_GATEWAY_PORT + 2))
export TINE_CLUSTER_DOMAIN="tine.localhost:$G2" TINE_CLUSTER_TLS_GATEWAYS=2
log "domain mode over HTTPS: E2B_DOMAIN=$TINE_CLUSTER_DOMAIN only (gateway 2 with [tls])"
for i in 1 2 3; do
    "$CLUSTER" term-node "$i"
    "$CLUSTER" start-node "$i"
done
"$CLUSTER" stop-gateway 2
"$CLUSTER" start-gateway 2
ca="$TINE_CLUSTER_DIR/gateway-data/tls/ca.crt"
(cd "$HERE/domain" && env -u E2B_API_URL -u E2B_SANDBOX_URL E2B_DOMAIN="$TINE_CLUSTER_DOMAIN" \
    SSL_CERT_FILE="$ca" "$VENV/bin/python" -m pytest -q -p no:cacheprovider) || status=1

# A node stopped with no sandboxes left leaves no process behind: its
# sandboxes are killed through its own API (as a gateway asks), then its
# server gets SIGTERM; the image daemon must leave by itself.
log "node 3 emptied and stopped: no process of it may stay"
n3="http://127.0.0.1:$((TINE_CLUSTER_NODE_PORT + 3))"
secret="$(cat "$TINE_CLUSTER_DIR/secret")"
for team in default other limited; do
    hdr=(-H "x-tine-cluster-secret: $secret" -H "x-tine-team: $team")
    for id in $(curl -sf "${hdr[@]}" "$n3/v2/sandboxes?state=running,paused" |
        "$VENV/bin/python" -c 'import json,sys; print(" ".join(x["sandboxID"] for x in json.load(sys.stdin)))'); do
        curl -sf -X DELETE "${hdr[@]}" "$n3/sandboxes/$id" >/dev/null || status=1
    done
done
"$CLUSTER" term-node 3
for _ in $(seq 1 60); do
    pgrep -f "$TINE_CLUSTER_DIR/node-3" >/dev/null || break
    sleep 1
done
if left="$(pgrep -af "$TINE_CLUSTER_DIR/node-3")"; then
    echo "error: 60 s after node 3 stopped with no sandboxes, its processes remain: $left" >&2
    status=1
fi
