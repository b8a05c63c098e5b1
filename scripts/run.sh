#!/usr/bin/env bash
# run.sh: install what is missing, then run the tine server on loopback with
# the default template (`base`), and print the environment variables that
# point the E2B SDKs at it.
#
# Environment: TINE_LISTEN (default 127.0.0.1:3000), TINE_DATA_DIR,
# TINE_SKIP_MCP=1 (no mcp-gateway template).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$TINE_SCRIPTS_DIR/.."
need_root

listen="${TINE_LISTEN:-127.0.0.1:3000}"

"$TINE_SCRIPTS_DIR/setup-host.sh"
"$TINE_SCRIPTS_DIR/build-agent.sh"
log "building the tine CLI"
cargo build --release --locked -p tine-cli
tine=target/release/tine
# The template Sandbox.create(mcp=...) starts from (once per recipe;
# TINE_SKIP_MCP=1 skips it).
if [[ "${TINE_SKIP_MCP:-0}" != 1 ]]; then
    TINE_BIN="$PWD/$tine" "$TINE_SCRIPTS_DIR/build-mcp-gateway.sh"
fi

log "creating an API key for this run (list them: $tine keys list)"
key="$("$tine" keys create --name "run.sh $(date -u +%FT%TZ)" 2>/dev/null)"

cat >&2 <<MSG

==> tine is starting on http://$listen (Ctrl-C stops it; sandboxes keep
    running and are adopted again by the next start). In another shell:

export E2B_API_URL=http://$listen
export E2B_SANDBOX_URL=http://$listen
export E2B_VOLUME_API_URL=http://$listen
export E2B_API_KEY=$key

    then e.g.: python3 -c 'from e2b import Sandbox; s = Sandbox.create(); print(s.commands.run("uname -a").stdout)'
    The first create builds the template snapshot (one cold boot).

MSG
exec "$tine" serve --listen "$listen"
