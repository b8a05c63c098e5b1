#!/usr/bin/env bash
# build-agent.sh: build the guest agent as a static musl binary and pack it
# into the initramfs (published as $TINE_DATA_DIR/current/initramfs.cpio).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$TINE_SCRIPTS_DIR/.."

log "building tine-agent (static, x86_64-unknown-linux-musl)"
start=$(now)
cargo build --release --locked --target x86_64-unknown-linux-musl -p tine-agent
info "built in $(elapsed "$start")"
"$TINE_SCRIPTS_DIR/build-initramfs.sh" target/x86_64-unknown-linux-musl/release/tine-agent
