#!/usr/bin/env bash
# build-agent.sh: build the guest agent as a static musl binary and pack it
# into the initramfs (published as $TINE_DATA_DIR/current/initramfs.cpio).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$TINE_SCRIPTS_DIR/.."

log "building tine-agent (static, x86_64-unknown-linux-musl)"
start=$(now)
# The guest binaries have a target dir of their own (target/guest), so
# their build runs while the host's holds the lock of target/.
cargo build --release --locked --target x86_64-unknown-linux-musl --target-dir target/guest -p tine-agent
info "built in $(elapsed "$start")"
"$TINE_SCRIPTS_DIR/build-initramfs.sh" "$TINE_AGENT_BUILT"
