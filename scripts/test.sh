#!/usr/bin/env bash
# test.sh: install what is missing, then run every test of tine.
#
#   1. host setup (packages, kernel, base rootfs)   scripts/setup-host.sh
#   2. the guest agent and its initramfs            scripts/build-agent.sh
#   3. the E2B SDKs used by end-to-end tests        tests/e2e/setup.sh
#   4. Rust tests (unit + real QEMU VMs)            cargo test --workspace
#   5. the agent against the real E2B SDKs          tests/e2e/agent/run.sh
#   6. the server against the real E2B SDKs         tests/e2e/server/run.sh
#   7. cluster mode (PostgreSQL, nodes, gateways)   tests/e2e/cluster/run.sh
#   8. deploy/ manifests and units                  tests/deploy/validate.sh
#      the container image, and a node in podman    deploy/image/build.sh,
#      behind gateways (real VMs, E2B SDK)          tests/deploy/podman-node.sh
#
# Must run as root (network namespaces, tap devices, QEMU).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$TINE_SCRIPTS_DIR/.."
need_root

"$TINE_SCRIPTS_DIR/setup-host.sh"
"$TINE_SCRIPTS_DIR/build-agent.sh"
if [[ -x tests/e2e/setup.sh ]]; then
    tests/e2e/setup.sh
fi

disk_report
log "cargo test --workspace"
start=$(now)
cargo test --workspace --locked 2>&1
info "cargo tests passed in $(elapsed "$start")"

if [[ -x tests/e2e/agent/run.sh ]]; then
    log "end-to-end: the agent with the real E2B SDKs"
    disk_report
    tests/e2e/agent/run.sh
fi
if [[ -x tests/e2e/server/run.sh ]]; then
    log "end-to-end: the server with the real E2B SDKs"
    disk_report
    tests/e2e/server/run.sh
fi
if [[ -x tests/e2e/cluster/run.sh ]]; then
    log "end-to-end: cluster mode (3 nodes, 2 gateways, PostgreSQL)"
    disk_report
    tests/e2e/cluster/run.sh
fi
if [[ -x tests/deploy/validate.sh ]]; then
    log "deploy/: Kubernetes manifests (kubernetes-validate), systemd units, configs"
    tests/deploy/validate.sh
fi
if [[ -x deploy/image/build.sh && -x tests/deploy/podman-node.sh ]]; then
    # build.sh installs podman, runc and mmdebstrap where they are missing.
    log "deploy/: the container image (deploy/image/build.sh: mmdebstrap base + tine)"
    cargo build --release --locked -p tine-cli 2>&1
    start=$(now)
    image="$(TINE_BIN="$PWD/target/release/tine" deploy/image/build.sh)"
    info "$image ready in $(elapsed "$start")"
    log "deploy/: a node in a privileged podman container behind gateways"
    TINE_BIN="$PWD/target/release/tine" TINE_IMAGE="$image" tests/deploy/podman-node.sh
fi
disk_report
log "all tests passed"
