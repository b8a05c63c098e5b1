#!/usr/bin/env bash
# podman-node.sh: a tine node in a privileged podman container, serving
# sandboxes through gateways, end to end:
#
#   1. the image from deploy/image/build.sh (or TINE_IMAGE);
#   2. PostgreSQL and gateway 1 on the host: scripts/cluster.sh up
#      --nodes 0 --gateways 1 (own ports and dir, see below);
#   3. the node "podman-1": `podman run --privileged --network host IMAGE
#      serve`, as deploy/kubernetes/node.yaml runs it: its data dir, the
#      guest artifacts that $TINE_DATA_DIR/current points to (read-only),
#      the cluster secret (read-only), a host directory for guest RAM,
#      /dev/net/tun and the host's /sys/fs/cgroup mounted at the same paths;
#   4. gateway 2 in a container of the same image, unprivileged as in
#      deploy/kubernetes/gateway.yaml (uid 65532, read-only root, no
#      capabilities);
#   5. tests/deploy/test_podman_node.py with the real E2B SDK (the venv of
#      tests/e2e/setup.sh): create through gateway 1, nodeID "podman-1"
#      from both gateways, the VM's QEMU inside the container's PID
#      namespace and jailed (uid range, cgroup leaf), commands, files, the
#      same sandbox through gateway 2, kill; then one more sandbox, left
#      running;
#   6. `podman stop` (SIGTERM) with that sandbox running: tine must exit 0
#      by itself and no process of the node (tine, QEMU, image daemon:
#      anything naming its data dir) may be left on the host; then
#      everything is stopped.
#
# A trap removes the containers and stops the cluster on any failure, after
# printing the node's log. Run as root after tests/e2e/setup.sh.
#
# Environment: TINE_DATA_DIR (/var/lib/tine; state in $TINE_DATA_DIR/e2e-podman,
# the node's template snapshots kept between runs), TINE_BIN (default
# target/release/tine), TINE_IMAGE (default: deploy/image/build.sh's),
# TINE_E2E_PODMAN_PG_PORT (5436), TINE_E2E_PODMAN_GATEWAY_PORT (3250:
# gateways on 3251 and 3252), TINE_E2E_PODMAN_NODE_PORT (3261).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BASE_DATA_DIR="${TINE_DATA_DIR:-/var/lib/tine}"
VENV="$BASE_DATA_DIR/venv"
STATE="$BASE_DATA_DIR/e2e-podman"
PG_PORT="${TINE_E2E_PODMAN_PG_PORT:-5436}"
GATEWAY_PORT="${TINE_E2E_PODMAN_GATEWAY_PORT:-3250}"
NODE_PORT="${TINE_E2E_PODMAN_NODE_PORT:-3261}"
NODE_ID=podman-1
NODE_DIR="$STATE/node-$NODE_ID"
SHM_DIR="/dev/shm/tine-e2e-$NODE_ID"
NODE_CT="tine-e2e-$NODE_ID"
GW_CT="tine-e2e-podman-gateway-2"
GW1="http://127.0.0.1:$((GATEWAY_PORT + 1))"
GW2="http://127.0.0.1:$((GATEWAY_PORT + 2))"
NODE_URL="http://127.0.0.1:$NODE_PORT"
PG_URL="postgresql://postgres@127.0.0.1:$PG_PORT/tine"
VETH_POOL="10.250.0.0/16"
HOST_TABLE="tine_host_10_250_0_0_16"
CGROUP_PARENT="tine-$NODE_ID"
UID_BASE=2000000

# (each line with the seconds since this script started: where its time goes)
log() { printf '==> [%4ss] %s\n' "$SECONDS" "$*" >&2; }
info() { printf '    %s\n' "$*" >&2; }
fail() {
    printf 'podman-node.sh: FAILED: %s\n' "$*" >&2
    exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v s="$1" -v e="$(now)" 'BEGIN { printf "%.1fs", e - s }'; }

[[ $(id -u) -eq 0 ]] || fail "run as root"
[[ -x $VENV/bin/python ]] || fail "no venv at $VENV: run tests/e2e/setup.sh"
export TINE_BIN="${TINE_BIN:-$ROOT/target/release/tine}"
[[ -x $TINE_BIN ]] || fail "no tine binary at $TINE_BIN (cargo build --release -p tine-cli, or set TINE_BIN)"
export TINE_DATA_DIR="$BASE_DATA_DIR"
export TINE_CLUSTER_DIR="$STATE/cluster"
export TINE_CLUSTER_PG_PORT="$PG_PORT"
export TINE_CLUSTER_GATEWAY_PORT="$GATEWAY_PORT"
export TINE_CLUSTER_NODE_PORT="$((NODE_PORT - 1))"
export TINE_CLUSTER_SKIP_SETUP=1
unset TINE_CLUSTER_NODE_CONFIG TINE_CLUSTER_DOMAIN TINE_CLUSTER_TLS_GATEWAYS E2B_DEBUG E2B_DOMAIN
CLUSTER="$ROOT/scripts/cluster.sh"
t0=$(now)

IMAGE="${TINE_IMAGE:-}"
if [[ -z $IMAGE ]]; then
    IMAGE="$("$ROOT/deploy/image/build.sh" | tail -n1)" || fail "deploy/image/build.sh"
fi
podman image exists "$IMAGE" || fail "no image $IMAGE"
# shellcheck source=deploy/image/podman-compat.sh
. "$ROOT/deploy/image/podman-compat.sh"
podman_compat || fail "podman cannot run containers here"
PODMAN=(podman "${PODMAN_GLOBAL[@]}")

node_pids() { pgrep -f -- "$NODE_DIR" || true; }
# The host ends of the node's veths: links with an address of its pool.
pool_veths() {
    ip -o -4 addr show | awk -v p="${VETH_POOL%.0.0/16}." 'index($4, p) == 1 { print $2 }' | sort -u
}

# Everything this test may have left (also from an interrupted run).
teardown() {
    "${PODMAN[@]}" rm -f "$NODE_CT" "$GW_CT" >/dev/null 2>&1 || true
    local p
    for p in $(node_pids); do kill -KILL "$p" 2>/dev/null || true; done
    "$CLUSTER" down >/dev/null 2>&1 || true
    nft delete table inet "$HOST_TABLE" 2>/dev/null || true
    local v
    for v in $(pool_veths); do ip link del "$v" 2>/dev/null || true; done
    local c
    for c in /sys/fs/cgroup/*/"$CGROUP_PARENT" /sys/fs/cgroup/"$CGROUP_PARENT"; do
        [[ -d $c ]] || continue
        find "$c" -mindepth 1 -depth -type d -exec rmdir {} + 2>/dev/null || true
        rmdir "$c" 2>/dev/null || true
    done
    rm -rf "$SHM_DIR"
}

# One run at a time on a host (same ports, containers and dirs).
mkdir -p "$STATE"
exec {lock_fd}>"$STATE/.lock"
flock -n "$lock_fd" || { info "waiting for another run of this test"; flock "$lock_fd"; }

status=1
finish() {
    set +e
    if [[ $status -ne 0 ]]; then
        echo "podman-node.sh: FAILED (state: $STATE)" >&2
        if "${PODMAN[@]}" container exists "$NODE_CT"; then
            "${PODMAN[@]}" logs "$NODE_CT" >"$STATE/node.log" 2>&1
            echo "--- the node's log, last 40 lines (all of it: $STATE/node.log)" >&2
            tail -n 40 "$STATE/node.log" >&2
        fi
        if "${PODMAN[@]}" container exists "$GW_CT"; then
            echo "--- gateway 2's log (container)" >&2
            "${PODMAN[@]}" logs --tail 15 "$GW_CT" >&2
        fi
        echo "--- gateway 1's log ($TINE_CLUSTER_DIR/gateway-1.log)" >&2
        tail -n 15 "$TINE_CLUSTER_DIR/gateway-1.log" >&2
    fi
    teardown
    [[ $status -eq 0 ]] && log "podman node test passed in $(elapsed "$t0")"
    exit $status
}
trap finish EXIT
trap 'exit 130' INT TERM

# wait_health URL SECONDS [CONTAINER]: until URL/health answers 200; fails
# at once if CONTAINER stops.
wait_health() {
    local url=$1 secs=$2 ct=${3:-} end
    end=$(($(date +%s) + secs))
    while [[ $(date +%s) -lt $end ]]; do
        curl -sf -o /dev/null --max-time 2 "$url/health" && return 0
        if [[ -n $ct && $("${PODMAN[@]}" inspect -f '{{.State.Running}}' "$ct" 2>/dev/null) != true ]]; then
            fail "container $ct stopped: $("${PODMAN[@]}" inspect -f 'exit code {{.State.ExitCode}} {{.State.Error}}' "$ct" 2>&1)"
        fi
        sleep 0.5
    done
    fail "$url/health did not answer in ${secs}s"
}

log "image $IMAGE; podman ${PODMAN_GLOBAL[*]:-(default runtime)} ${PODMAN_LIMITS[*]:-}"
teardown

# ---- PostgreSQL and gateway 1 on the host ----
t=$(now)
"$CLUSTER" up --nodes 0 --gateways 1 2>&1 | sed 's/^/    /' >&2 ||
    fail "scripts/cluster.sh up --nodes 0 --gateways 1"
curl -sf -o /dev/null "$GW1/health" || fail "gateway 1 is not up"
SECRET_FILE="$TINE_CLUSTER_DIR/secret"
[[ -s $SECRET_FILE ]] || fail "no cluster secret at $SECRET_FILE"
info "PostgreSQL on 127.0.0.1:$PG_PORT and gateway 1 on $GW1 in $(elapsed "$t")"

# ---- the node in a privileged container ----
mkdir -p "$NODE_DIR" "$SHM_DIR"
ln -sfn "$BASE_DATA_DIR/current" "$NODE_DIR/current"
cat >"$NODE_DIR/config.toml" <<EOF
listen = "127.0.0.1:$NODE_PORT"
domain = "localhost:$((GATEWAY_PORT + 1))"
default_cpu_count = 1
default_memory_mb = 256
# No warm pool: the test tells its sandbox's QEMU apart by there being no
# other, and the 2 cores of CI stay free.
pool_size = 0

[network]
veth_pool = "$VETH_POOL"

[jail]
uid_base = $UID_BASE
uid_count = 65536
cgroup_parent = "$CGROUP_PARENT"

[cluster]
postgres_url = "$PG_URL"
node_id = "$NODE_ID"
advertise_url = "$NODE_URL"
secret_file = "$SECRET_FILE"
heartbeat_secs = 1
publish_secs = 5
EOF
# The guest artifacts: current/ and what its links point to, read-only at
# the same paths (the node's current/ is a link to $BASE_DATA_DIR/current,
# as scripts/cluster.sh gives each node).
mounts=(-v "$BASE_DATA_DIR/current:$BASE_DATA_DIR/current:ro")
for f in "$BASE_DATA_DIR"/current/*; do
    [[ -L $f ]] || continue
    target="$(readlink -f "$f")"
    [[ -e $target ]] || fail "$f points to $target, which does not exist"
    mounts+=(-v "$target:$target:ro")
done
t=$(now)
log "node $NODE_ID: podman run --privileged --network host $IMAGE serve (data dir $NODE_DIR)"
"${PODMAN[@]}" run -d --name "$NODE_CT" \
    --privileged --network host "${PODMAN_LIMITS[@]}" \
    -e TINE_DATA_DIR="$NODE_DIR" -e TINE_SHM_DIR="$SHM_DIR" -e TINE_LOG=info \
    -v "$NODE_DIR:$NODE_DIR" \
    -v "$SHM_DIR:$SHM_DIR" \
    "${mounts[@]}" \
    -v "$SECRET_FILE:$SECRET_FILE:ro" \
    -v /sys/fs/cgroup:/sys/fs/cgroup \
    --device /dev/net/tun \
    "$IMAGE" serve -c "$NODE_DIR/config.toml" >/dev/null ||
    fail "podman run (node)"
wait_health "$NODE_URL" 600 "$NODE_CT"
info "the node answers /health after $(elapsed "$t")"

# ---- gateway 2 in an unprivileged container ----
GW_ETC="$STATE/gateway-2-etc"
rm -rf "$GW_ETC"
install -d -m 0700 -o 65532 -g 65532 "$GW_ETC"
cat >"$GW_ETC/gateway.toml" <<EOF
listen = "127.0.0.1:$((GATEWAY_PORT + 2))"
postgres_url = "$PG_URL"
secret_file = "/etc/tine/cluster.secret"
domain = "localhost:$((GATEWAY_PORT + 1))"
node_grace_secs = 10
EOF
install -m 0400 -o 65532 -g 65532 "$SECRET_FILE" "$GW_ETC/cluster.secret"
chown 65532:65532 "$GW_ETC/gateway.toml"
chmod 0400 "$GW_ETC/gateway.toml"
log "gateway 2: podman run --user 65532 --read-only --cap-drop all $IMAGE gateway on $GW2"
"${PODMAN[@]}" run -d --name "$GW_CT" \
    --network host --user 65532:65532 --read-only --cap-drop all \
    --security-opt no-new-privileges "${PODMAN_LIMITS[@]}" \
    -v "$GW_ETC:/etc/tine:ro" \
    "$IMAGE" gateway -c /etc/tine/gateway.toml >/dev/null ||
    fail "podman run (gateway)"
wait_health "$GW2" 60 "$GW_CT"

# The gateways place creates on nodes whose heartbeat they have seen.
for _ in $(seq 1 60); do
    "$TINE_BIN" cluster nodes --postgres-url "$PG_URL" 2>/dev/null | grep -qw "$NODE_ID" && break
    sleep 0.5
done
nodes="$("$TINE_BIN" cluster nodes --postgres-url "$PG_URL" 2>&1)" || fail "tine cluster nodes: $nodes"
grep -qw "$NODE_ID" <<<"$nodes" || fail "$NODE_ID is not in the catalog: $nodes"
while IFS= read -r l; do info "$l"; done <<<"$nodes"

# ---- the SDK test ----
E2B_API_KEY="$("$TINE_BIN" cluster create-key --postgres-url "$PG_URL" --name e2e-podman)" ||
    fail "tine cluster create-key"
export E2B_API_KEY E2B_API_URL="$GW1" E2B_SANDBOX_URL="$GW1"
export TINE_E2E_GATEWAY2="$GW2" TINE_E2E_NODE_ID="$NODE_ID" TINE_E2E_NODE_DIR="$NODE_DIR"
export TINE_E2E_CGROUP_PARENT="$CGROUP_PARENT" TINE_E2E_UID_BASE="$UID_BASE"
export TINE_E2E_SURVIVOR_FILE="$STATE/survivor"
rm -f "$TINE_E2E_SURVIVOR_FILE"
TINE_E2E_PODMAN_EXEC="$("$VENV/bin/python" -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \
    "${PODMAN[@]}" exec "$NODE_CT")"
export TINE_E2E_PODMAN_EXEC
t=$(now)
log "SDK test (e2b $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("e2b"))')) through $GW1 and $GW2"
(cd "$HERE" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:asyncio test_podman_node.py) ||
    fail "the SDK test"
info "SDK test passed in $(elapsed "$t")"

# ---- podman stop: tine exits by itself and leaves nothing ----
# The last test left a sandbox running: its QEMU must end with the
# container (the pid namespace's init, tine, exits; the kernel kills the
# rest), as deploy/kubernetes/README.md says of a node pod.
[[ -s $TINE_E2E_SURVIVOR_FILE ]] || fail "the SDK test left no running sandbox"
before="$(pgrep -af -- "$NODE_DIR" || true)"
grep -q "tine serve -c $NODE_DIR/config.toml" <<<"$before" ||
    fail "the node's tine process is not visible on the host before the stop: ${before:-none}"
grep -q "qemu-system" <<<"$before" ||
    fail "sandbox $(cat "$TINE_E2E_SURVIVOR_FILE") has no QEMU on the host before the stop: $before"
info "before the stop: $(grep -c . <<<"$before") processes name $NODE_DIR (tine, QEMU of sandbox $(cat "$TINE_E2E_SURVIVOR_FILE"), ...)"
t=$(now)
log "podman stop $NODE_CT (SIGTERM, 30 s before SIGKILL)"
"${PODMAN[@]}" stop -t 30 "$NODE_CT" >/dev/null || fail "podman stop"
code="$("${PODMAN[@]}" inspect -f '{{.State.ExitCode}}' "$NODE_CT")"
"${PODMAN[@]}" logs "$NODE_CT" >"$STATE/node.log" 2>&1 || true
[[ $code == 0 ]] || fail "tine exited $code on SIGTERM (137: it was killed after the 30 s)"
info "stopped in $(elapsed "$t"), exit code 0"
left=""
for _ in $(seq 1 20); do
    left="$(pgrep -af -- "$NODE_DIR" || true)"
    [[ -z $left ]] && break
    sleep 0.5
done
[[ -z $left ]] || fail "processes of the node are left on the host after podman stop: $left"
info "no process naming $NODE_DIR is left on the host"
# Not processes, and by design in the host's network namespace (--network
# host; a pod has its own): the node's nftables table, kept for VMs across
# a restart of tine, and veths whose VM namespace the kernel has not freed
# yet. Reported here; the teardown removes them.
if nft list table inet "$HOST_TABLE" >/dev/null 2>&1; then
    info "left in the host's network namespace: nftables table inet $HOST_TABLE"
fi
veths="$(pool_veths)"
if [[ -n $veths ]]; then
    info "left in the host's network namespace: veth(s) ${veths//$'\n'/ } of $VETH_POOL (their VM namespaces not freed yet)"
fi

"${PODMAN[@]}" stop -t 10 "$GW_CT" >/dev/null || fail "podman stop (gateway 2)"
code="$("${PODMAN[@]}" inspect -f '{{.State.ExitCode}}' "$GW_CT")"
[[ $code == 0 ]] || fail "the gateway container exited $code on SIGTERM"
"$CLUSTER" down 2>&1 | sed 's/^/    /' >&2
left="$(pgrep -af -- "$TINE_CLUSTER_DIR" || true)"
[[ -z $left ]] || fail "processes of the cluster are left: $left"
status=0
