#!/usr/bin/env bash
# inet.sh up|down: the network tests' stand-in for the internet, entirely
# inside a namespace this script creates (`e2e-inet`), reached from the host
# through a veth: 203.0.113.10 and .20 (TEST-NET-3, "the internet"),
# 10.99.0.10 (a private network sandboxes must not reach) and 10.99.1.10 (a
# private network the test server's config opens). HTTP on 80, HTTPS on 443
# with a certificate for *.inet.test from a test CA ($STATE/ca.pem)
# (tests/e2e/net/inet_server.py).
# No traffic leaves this machine: the host gets routes for 203.0.113.0/24
# and 10.99.0.0/16 to the namespace only. Idempotent.
#
# Suites running at once share it (scripts/test.sh runs the server and
# cluster suites side by side): `up` from a process whose parent holds it
# already, or while another holder lives, keeps what is up (its CA
# included); `down` tears it down only when no other holder (the calling
# script's pid, in $STATE/holders) is alive. Both hold a lock.
set -euo pipefail
NS=e2e-inet
HOSTIF=e2e-inet0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE=/run/tine-e2e-inet

# The holder is the script that called this one.
HOLDER=$PPID

teardown() {
    if [[ -f $STATE/pid ]]; then kill "$(cat "$STATE/pid")" 2>/dev/null || true; fi
    ip netns delete "$NS" 2>/dev/null || true
    ip link delete "$HOSTIF" 2>/dev/null || true
    rm -rf "$STATE"
}

# Holders other than this one that are still alive.
others() {
    local h
    for h in "$STATE"/holders/*; do
        [[ -e $h ]] || continue
        h=${h##*/}
        [[ $h != "$HOLDER" ]] && kill -0 "$h" 2>/dev/null && echo "$h"
    done
    return 0
}

running() {
    [[ -f $STATE/pid ]] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null && ip netns list | grep -qw "$NS"
}

down() {
    rm -f "$STATE/holders/$HOLDER"
    if [[ -n "$(others)" ]]; then
        return 0
    fi
    teardown
}

up() {
    if running && [[ -n "$(others)" ]]; then
        touch "$STATE/holders/$HOLDER"
        return 0
    fi
    teardown
    mkdir -p "$STATE/holders"
    touch "$STATE/holders/$HOLDER"
    # A test CA (the server trusts it through `[network] upstream_ca_file`)
    # and the host's certificate from it, for *.inet.test and its addresses.
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=e2e-inet test CA" \
        -keyout "$STATE/ca.key" -out "$STATE/ca.pem" >/dev/null 2>&1
    openssl req -newkey rsa:2048 -nodes -subj "/CN=e2e-inet" \
        -keyout "$STATE/key.pem" -out "$STATE/leaf.csr" >/dev/null 2>&1
    printf '%s\n' "subjectAltName=DNS:inet.test,DNS:*.inet.test,IP:203.0.113.10,IP:203.0.113.20" \
        "basicConstraints=CA:FALSE" "extendedKeyUsage=serverAuth" >"$STATE/leaf.ext"
    openssl x509 -req -in "$STATE/leaf.csr" -CA "$STATE/ca.pem" -CAkey "$STATE/ca.key" \
        -CAcreateserial -days 2 -extfile "$STATE/leaf.ext" -out "$STATE/cert.pem" >/dev/null 2>&1
    ip netns add "$NS"
    ip link add "$HOSTIF" type veth peer name eth0 netns "$NS"
    ip addr add 203.0.113.1/24 dev "$HOSTIF"
    ip link set "$HOSTIF" up
    ip route add 10.99.0.0/16 via 203.0.113.10 dev "$HOSTIF"
    ip -n "$NS" link set lo up
    for a in 203.0.113.10/24 203.0.113.20/24 10.99.0.10/24 10.99.1.10/24; do
        ip -n "$NS" addr add "$a" dev eth0
    done
    ip -n "$NS" link set eth0 up
    ip -n "$NS" route add default via 203.0.113.1
    # (9>&-: the server must not hold this script's lock)
    ip netns exec "$NS" python3 "$HERE/inet_server.py" "$STATE/cert.pem" "$STATE/key.pem" \
        >"$STATE/log" 2>&1 9>&- &
    echo $! >"$STATE/pid"
    for _ in $(seq 100); do
        grep -q ready "$STATE/log" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "error: the stand-in internet server did not start: $(cat "$STATE/log")" >&2
    exit 1
}

case "${1:-}" in
    up | down) ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
exec 9>/run/tine-e2e-inet.lock
flock 9
"$1"
