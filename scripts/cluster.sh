#!/usr/bin/env bash
# cluster.sh: a tine cluster on this one machine: PostgreSQL (Debian's), N
# nodes (`tine serve`, each with its own data dir, port, veth pool, uid
# range and cgroup) and M gateways (`tine gateway`). The tests and a person
# trying cluster mode use the same script (docs/cluster.md).
#
#   scripts/cluster.sh up [--nodes N] [--gateways M]   (default 3 and 2)
#   scripts/cluster.sh down            stop everything; the nodes' sandboxes
#                                      are killed
#   scripts/cluster.sh stop-node I     SIGKILL node I's server (its VMs live on)
#   scripts/cluster.sh term-node I     SIGTERM node I's server (as a service
#                                      manager stops it)
#   scripts/cluster.sh start-node I    start node I again (it adopts its VMs)
#   scripts/cluster.sh stop-gateway J  SIGKILL gateway J
#   scripts/cluster.sh start-gateway J
#   scripts/cluster.sh stop-postgres | start-postgres | restart-postgres
#
# `up` installs what is missing as scripts/run.sh does (skipped with
# TINE_CLUSTER_SKIP_SETUP=1, as the tests do after their own setup) and
# ends by printing E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY for the
# first gateway.
#
# Environment: TINE_DATA_DIR (/var/lib/tine), TINE_CLUSTER_DIR
# ($TINE_DATA_DIR/cluster), TINE_BIN (default: build target/release/tine),
# TINE_CLUSTER_PG_PORT (5433), TINE_CLUSTER_NODE_PORT (3100: node I listens
# on 3100+I), TINE_CLUSTER_GATEWAY_PORT (3200: gateway J on 3200+J),
# TINE_CLUSTER_NODE_CONFIG (top-level TOML keys added to every node's config),
# TINE_CLUSTER_DNS (the nodes' `[network] dns`: the sandboxes' resolver),
# TINE_CLUSTER_LAZY_PULL (true: nodes read pulled captures lazily; false:
# they fetch them whole first),
# TINE_CLUSTER_DOMAIN (the domain sandboxes are addressed under, the same
# for nodes and gateways; default localhost:<first gateway's port>),
# TINE_CLUSTER_TLS_GATEWAYS (gateway numbers served over HTTPS for that
# domain, e.g. "2"; their CA: $TINE_CLUSTER_DIR/gateway-data/tls/ca.crt),
# TINE_CLUSTER_REGISTRY_PORT (5055: the registry captures travel through,
# Debian's docker-registry on loopback, its data in $TINE_CLUSTER_DIR/registry).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ROOT="$(cd "$TINE_SCRIPTS_DIR/.." && pwd)"
need_root

CLUSTER_DIR="${TINE_CLUSTER_DIR:-$TINE_DATA_DIR/cluster}"
PG_PORT="${TINE_CLUSTER_PG_PORT:-5433}"
NODE_PORT="${TINE_CLUSTER_NODE_PORT:-3100}"
GATEWAY_PORT="${TINE_CLUSTER_GATEWAY_PORT:-3200}"
PG_URL="postgresql://postgres@127.0.0.1:$PG_PORT/tine"
REGISTRY_PORT="${TINE_CLUSTER_REGISTRY_PORT:-5055}"
REGISTRY="127.0.0.1:$REGISTRY_PORT"
DOMAIN="${TINE_CLUSTER_DOMAIN:-localhost:$((GATEWAY_PORT + 1))}"
TLS_GATEWAYS=" ${TINE_CLUSTER_TLS_GATEWAYS:-} "
# PostgreSQL's own files, where its user can reach them (the data dir is
# 0700 root).
PG_DIR="${TINE_CLUSTER_PG_DIR:-/var/lib/postgresql/tine-cluster-$PG_PORT}"

cmd="${1:-}"
shift || true
NODES=3
GATEWAYS=2
while [[ $# -gt 0 ]]; do
    case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --gateways) GATEWAYS="$2"; shift 2 ;;
    *) break ;;
    esac
done

tine_bin() {
    if [[ -z ${TINE_BIN:-} ]]; then
        log "building the tine CLI"
        (cd "$ROOT" && cargo build --release --locked -p tine-cli >&2)
        TINE_BIN="$ROOT/target/release/tine"
    fi
}

# registry_up: Debian's docker-registry on loopback (installed if missing),
# the repository captures travel through.
registry_up() {
    if ! command -v docker-registry >/dev/null; then
        apt_update_once
        log "apt-get install docker-registry"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker-registry >&2 ||
            die "apt-get install docker-registry failed"
    fi
    local dir="$CLUSTER_DIR/registry"
    mkdir -p "$dir/data"
    cat >"$dir/config.yml" <<EOF
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: $dir/data}, delete: {enabled: true}}
http: {addr: '$REGISTRY'}
EOF
    if ! curl -sf -o /dev/null "http://$REGISTRY/v2/"; then
        log "registry on $REGISTRY (log $dir/registry.log)"
        setsid docker-registry serve "$dir/config.yml" >>"$dir/registry.log" 2>&1 </dev/null &
        echo $! >"$dir/registry.pid"
        local i
        for i in $(seq 1 100); do
            curl -sf -o /dev/null "http://$REGISTRY/v2/" && return 0
            sleep 0.1
        done
        die "the registry did not start: $(tail -3 "$dir/registry.log")"
    fi
}

pg_bin() {
    local d
    d="$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -1)"
    [[ -n $d ]] || die "PostgreSQL is not installed (apt-get install postgresql)"
    printf '%s\n' "$d"
}

pg_ctl_() { runuser -u postgres -- "$(pg_bin)/pg_ctl" -D "$PG_DIR/data" "$@"; }

postgres_up() {
    if ! find /usr/lib/postgresql -maxdepth 3 -name initdb 2>/dev/null | grep -q .; then
        apt_update_once
        log "apt-get install postgresql"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >&2 ||
            die "apt-get install postgresql failed"
    fi
    mkdir -p "$CLUSTER_DIR"
    install -d -o postgres -g postgres -m 0700 "$PG_DIR"
    if [[ ! -f $PG_DIR/data/PG_VERSION ]]; then
        log "PostgreSQL: a new database cluster in $PG_DIR/data"
        rm -rf "$PG_DIR/data"
        # Trust on loopback only: this cluster is the machine's own (a
        # production catalog uses a password or TLS: docs/cluster.md).
        runuser -u postgres -- "$(pg_bin)/initdb" -D "$PG_DIR/data" -U postgres \
            --auth-local=trust --auth-host=trust --no-sync >/dev/null
    fi
    if ! pg_ctl_ status >/dev/null 2>&1; then
        log "PostgreSQL on 127.0.0.1:$PG_PORT (log $PG_DIR/postgres.log)"
        pg_ctl_ -l "$PG_DIR/postgres.log" -w -t 60 \
            -o "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
    fi
    local psql=(runuser -u postgres -- "$(pg_bin)/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -tAq)
    if [[ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'tine'")" != 1 ]]; then
        "${psql[@]}" -c "CREATE DATABASE tine" >/dev/null
    fi
}

secret() {
    if [[ ! -s $CLUSTER_DIR/secret ]]; then
        (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CLUSTER_DIR/secret")
    fi
}

# wait_http URL: until it answers (any status), at most 120 s.
wait_http() {
    local i
    for i in $(seq 1 240); do
        # -k: a TLS gateway's certificate is for its domain's names.
        curl -sk -o /dev/null "$1" && return 0
        sleep 0.5
    done
    return 1
}

node_start() {
    local i=$1 dir="$CLUSTER_DIR/node-$1" port=$((NODE_PORT + $1))
    mkdir -p "$dir"
    ln -sfn "$TINE_DATA_DIR/current" "$dir/current"
    cat >"$dir/config.toml" <<EOF
listen = "127.0.0.1:$port"
# Sandboxes are addressed through the gateways.
domain = "$DOMAIN"
default_cpu_count = 1
default_memory_mb = 256
${TINE_CLUSTER_NODE_CONFIG:-}
# One key for the cluster's secrets (in the catalog): the same on every node.
secrets_key_file = "$CLUSTER_DIR/secrets.key"

[registries]
# The cluster's registry (and the tests' images) on loopback.
allow_private = ["127.0.0.1/32"]

[network]
veth_pool = "10.$((240 + i)).0.0/16"
${TINE_CLUSTER_DNS:+dns = \"$TINE_CLUSTER_DNS\"}

[jail]
uid_base = $((1100000 + i * 100000))
uid_count = 65536
cgroup_parent = "tine-node-$i"

[cluster]
postgres_url = "$PG_URL"
node_id = "node-$i"
advertise_url = "http://127.0.0.1:$port"
secret_file = "$CLUSTER_DIR/secret"
heartbeat_secs = 1
registry = "$REGISTRY/tine/captures"
# Changes are published when they happen; the full list every 5 minutes
# heals what a lost write missed.
publish_secs = 300
lazy_pull = ${TINE_CLUSTER_LAZY_PULL:-true}
EOF
    log "node $i: tine serve on 127.0.0.1:$port (data dir $dir, log $dir/server.log)"
    TINE_DATA_DIR="$dir" TINE_SHM_DIR="/dev/shm/tine-cluster-node-$i" \
        setsid "$TINE_BIN" serve -c "$dir/config.toml" >>"$dir/server.log" 2>&1 </dev/null &
    echo $! >"$dir/server.pid"
}

gateway_start() {
    local j=$1 port=$((GATEWAY_PORT + $1))
    cat >"$CLUSTER_DIR/gateway-$j.toml" <<EOF
listen = "127.0.0.1:$port"
postgres_url = "$PG_URL"
secret_file = "$CLUSTER_DIR/secret"
domain = "$DOMAIN"
node_grace_secs = 10
data_dir = "$CLUSTER_DIR/gateway-data"

# A team with a cluster-wide limit (tests/e2e/cluster).
[teams.limited]
max_sandboxes = 2
EOF
    if [[ $TLS_GATEWAYS == *" $j "* ]]; then
        printf '\n[tls]\nenabled = true\n' >>"$CLUSTER_DIR/gateway-$j.toml"
    fi
    log "gateway $j: tine gateway on $(gateway_url "$j") (log $CLUSTER_DIR/gateway-$j.log)"
    setsid "$TINE_BIN" gateway -c "$CLUSTER_DIR/gateway-$j.toml" >>"$CLUSTER_DIR/gateway-$j.log" 2>&1 </dev/null &
    echo $! >"$CLUSTER_DIR/gateway-$j.pid"
}

# gateway_url J: where gateway J answers (https for the domain if it is a
# TLS gateway).
gateway_url() {
    if [[ $TLS_GATEWAYS == *" $1 "* ]]; then
        echo "https://api.${DOMAIN%:*}:$((GATEWAY_PORT + $1))"
    else
        echo "http://127.0.0.1:$((GATEWAY_PORT + $1))"
    fi
}

kill_pidfile() {
    local f=$1 sig=${2:-TERM}
    [[ -f $f ]] || return 0
    local pid
    pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null; then
        kill "-$sig" "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$f"
}

up() {
    if [[ ${TINE_CLUSTER_SKIP_SETUP:-0} != 1 ]]; then
        "$TINE_SCRIPTS_DIR/setup-host.sh"
        "$TINE_SCRIPTS_DIR/build-agent.sh"
    fi
    tine_bin
    postgres_up
    registry_up
    secret
    printf '%s\n' "$NODES" >"$CLUSTER_DIR/nodes"
    printf '%s\n' "$GATEWAYS" >"$CLUSTER_DIR/gateways"
    local i j
    for i in $(seq 1 "$NODES"); do node_start "$i"; done
    for i in $(seq 1 "$NODES"); do
        wait_http "http://127.0.0.1:$((NODE_PORT + i))/health" ||
            die "node $i did not start: $(tail -5 "$CLUSTER_DIR/node-$i/server.log")"
    done
    for j in $(seq 1 "$GATEWAYS"); do gateway_start "$j"; done
    for j in $(seq 1 "$GATEWAYS"); do
        wait_http "$(gateway_url "$j")/health" ||
            die "gateway $j did not start: $(tail -5 "$CLUSTER_DIR/gateway-$j.log")"
    done
    local key
    key="$("$TINE_BIN" cluster create-key --postgres-url "$PG_URL" --name "cluster.sh $(date -u +%FT%TZ)")"
    cat >&2 <<MSG

==> a cluster of $NODES nodes and $GATEWAYS gateways is up (state: $CLUSTER_DIR;
    stop it with: scripts/cluster.sh down). Point the SDKs at the first gateway:

export E2B_API_URL=http://127.0.0.1:$((GATEWAY_PORT + 1))
export E2B_SANDBOX_URL=http://127.0.0.1:$((GATEWAY_PORT + 1))
export E2B_API_KEY=$key
export TINE_POSTGRES_URL=$PG_URL
MSG
}

down() {
    local f
    for f in "$CLUSTER_DIR"/gateway-*.pid; do kill_pidfile "$f"; done
    for f in "$CLUSTER_DIR"/node-*/server.pid; do kill_pidfile "$f"; done
    kill_pidfile "$CLUSTER_DIR/registry/registry.pid"
    # The nodes' VMs and image daemons, which outlive a stopped server.
    pkill -KILL -f "qemu-system.*$CLUSTER_DIR/node-" 2>/dev/null || true
    pkill -TERM -f "nbd-daemon --data-dir $CLUSTER_DIR/node-" 2>/dev/null || true
    if [[ -f $PG_DIR/data/PG_VERSION ]] && pg_ctl_ status >/dev/null 2>&1; then
        pg_ctl_ -m fast -w stop >/dev/null
    fi
    log "cluster in $CLUSTER_DIR stopped"
}

case "$cmd" in
up) up ;;
down) down ;;
stop-node) kill_pidfile "$CLUSTER_DIR/node-$1/server.pid" KILL ;;
start-node)
    tine_bin
    node_start "$1"
    wait_http "http://127.0.0.1:$((NODE_PORT + $1))/health" || die "node $1 did not start"
    ;;
term-node) kill_pidfile "$CLUSTER_DIR/node-$1/server.pid" TERM ;;
stop-gateway) kill_pidfile "$CLUSTER_DIR/gateway-$1.pid" KILL ;;
start-gateway)
    tine_bin
    gateway_start "$1"
    wait_http "$(gateway_url "$1")/health" || die "gateway $1 did not start"
    ;;
stop-postgres) pg_ctl_ -m fast -w stop >/dev/null ;;
start-postgres) postgres_up ;;
restart-postgres)
    pg_ctl_ -m fast -w stop >/dev/null
    postgres_up
    ;;
*)
    echo "usage: $0 up [--nodes N] [--gateways M] | down | stop-node I | term-node I | start-node I | stop-gateway J | start-gateway J | stop-postgres | start-postgres | restart-postgres" >&2
    exit 2
    ;;
esac
