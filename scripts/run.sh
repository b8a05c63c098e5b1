#!/usr/bin/env bash
# run.sh: install what is missing, then run tine: boot the base template in a
# microVM and run a command in it (default: show the kernel, the user and
# Python). Arguments, if any, are the command to run.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$TINE_SCRIPTS_DIR/.."
need_root

"$TINE_SCRIPTS_DIR/setup-host.sh"
"$TINE_SCRIPTS_DIR/build-agent.sh"
log "building the tine CLI"
cargo build --release --locked -p tine-cli
log "booting the base template and running a command in it"
exec target/release/tine run "$@"
