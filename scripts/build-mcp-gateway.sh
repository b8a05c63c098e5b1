#!/usr/bin/env bash
# build-mcp-gateway.sh: build the template `mcp-gateway`, which E2B's
# Sandbox.create(mcp={...}) starts from, into $TINE_DATA_DIR's database.
#
#   1. `mcp-gateway` (crates/mcp-gateway), static (x86_64-unknown-linux-musl);
#   2. on the host: the npm MCP servers (npm install) and the PyPI ones
#      (pip install --target, wheels for CPython 3.11, the guest's Python),
#      packed into servers.tar, so the guest runs neither npm nor pip;
#   3. the host's `node` (nodejs is installed when missing) and the shared
#      libraries it needs that the base rootfs lacks, packed into node.tar;
#   4. `tine template build -f crates/mcp-gateway/template/Dockerfile`
#      (FROM base). The build VM needs no network. It runs without a
#      server; a server on the same data dir sees the template at once.
#
# Idempotent: keyed by a hash of this script (which pins the servers'
# versions), the Dockerfile, the gateway's sources and the guest artifacts
# (current/); nothing is done while they are unchanged and the template
# exists. Stages under $TINE_DATA_DIR/mcp-gateway/ (the servers' tarball
# is kept there by their versions).
#
# Environment: TINE_DATA_DIR (default /var/lib/tine), TINE_BIN (a built
# `tine`; default: build target/release/tine), TINE_MCP_VCPUS (2) and
# TINE_MCP_MEMORY_MIB (512): the template's machine shape.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ROOT="$(cd "$TINE_SCRIPTS_DIR/.." && pwd)"
cd "$ROOT"
need_root
need_cmd cargo python3 tar debugfs ldd
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    apt_update_once
    log "apt-get install nodejs npm (for the MCP servers)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nodejs npm >&2 ||
        die "apt-get install nodejs npm failed"
fi
node_bin="$(readlink -f "$(command -v node)")"

NAME=mcp-gateway
# The catalog's servers (crates/mcp-gateway/src/catalog.rs names the same).
NPM_PACKAGES=(
    @modelcontextprotocol/server-filesystem@2026.8.31
    @modelcontextprotocol/server-memory@2026.8.31
    @modelcontextprotocol/server-sequential-thinking@2026.8.31
)
PYPI_PACKAGES=(
    mcp-server-fetch==2026.10.24
    mcp-server-git==2026.10.19
    mcp-server-time==2026.10.19
)
VCPUS="${TINE_MCP_VCPUS:-2}"
MEMORY_MIB="${TINE_MCP_MEMORY_MIB:-512}"
DOCKERFILE=crates/mcp-gateway/template/Dockerfile

[[ -e $TINE_DATA_DIR/current/vmlinuz ]] || die "no guest artifacts in $TINE_DATA_DIR/current (run scripts/setup-host.sh)"
mapfile -t sources < <(find crates/mcp-gateway/src -name '*.rs' | sort)
artifacts="$(for a in vmlinuz initramfs.cpio rootfs-base.ext4; do readlink -f "$TINE_DATA_DIR/current/$a"; done)"
hash="$(recipe_hash "${BASH_SOURCE[0]}" "$DOCKERFILE" crates/mcp-gateway/Cargo.toml "${sources[@]}" "$node_bin" -- \
    "shape=$VCPUS/$MEMORY_MIB" "artifacts=$artifacts")"
dir="$TINE_DATA_DIR/mcp-gateway"
stage="$dir/stage-$hash"
mkdir -p "$dir"
take_lock "template-$NAME"

if [[ -z ${TINE_BIN:-} ]]; then
    log "building the tine CLI"
    cargo build --release --locked -p tine-cli
    TINE_BIN="$ROOT/target/release/tine"
fi
if [[ -f $dir/built-$hash ]] && "$TINE_BIN" template list 2>/dev/null | grep -qw "^$NAME"; then
    log "template $NAME (recipe $hash): present"
    exit 0
fi

start=$(now)
log "building template $NAME (recipe $hash) in $TINE_DATA_DIR"
log "mcp-gateway (static, x86_64-unknown-linux-musl)"
cargo build --release --locked --target x86_64-unknown-linux-musl --target-dir target/guest -p tine-mcp-gateway
rm -rf "$stage.tmp" && mkdir -p "$stage.tmp"
cp -p "$TINE_GUEST_TARGET_DIR/mcp-gateway" "$stage.tmp/mcp-gateway"
cp -p "$DOCKERFILE" "$stage.tmp/Dockerfile"

# The servers, kept by their versions (a change to the gateway alone does
# not fetch them again).
servers="$dir/servers-$(recipe_hash -- "${NPM_PACKAGES[@]}" -- "${PYPI_PACKAGES[@]}").tar"
if [[ -f $servers ]]; then
    info "servers: $servers"
else
    rm -rf "$dir/.servers.tmp" && mkdir -p "$dir/.servers.tmp/node" "$dir/.servers.tmp/python"
    log "npm: ${NPM_PACKAGES[*]}"
    printf '{"name":"tine-mcp-servers","private":true}\n' >"$dir/.servers.tmp/node/package.json"
    (cd "$dir/.servers.tmp/node" && npm install --no-audit --no-fund --omit=dev --loglevel=error "${NPM_PACKAGES[@]}" >&2) ||
        die "npm install failed"
    log "PyPI (wheels for CPython 3.11): ${PYPI_PACKAGES[*]}"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --no-cache-dir \
        --target "$dir/.servers.tmp/python" --only-binary=:all: \
        --python-version 3.11 --implementation cp --platform manylinux2014_x86_64 \
        "${PYPI_PACKAGES[@]}" >&2 || die "pip install failed"
    # Byte-code valid whatever the files' times (the guest cannot write it:
    # every sandbox would compile again).
    python3 -m compileall -q -j 0 --invalidation-mode unchecked-hash "$dir/.servers.tmp/python" >/dev/null || true
    tar -C "$dir/.servers.tmp" --owner=0 --group=0 -cf "$dir/.servers.tmp/servers.tar" node python
    mv "$dir/.servers.tmp/servers.tar" "$servers"
    rm -rf "$dir/.servers.tmp"
    info "servers: $(du -h "$servers" | cut -f1) after $(elapsed "$start")"
fi
ln "$servers" "$stage.tmp/servers.tar" 2>/dev/null || cp -p "$servers" "$stage.tmp/servers.tar"

# Node.js for the npm servers: the host's own `node` (Debian's or another
# package's) and those of the shared libraries it loads that the base rootfs
# lacks, packed into node.tar (files only, no directory entries). The build
# VM then needs no network: CI hosts give guests none.
rm -rf "$dir/.node.tmp" && mkdir -p "$dir/.node.tmp/usr/local/bin"
cp -pL "$node_bin" "$dir/.node.tmp/usr/local/bin/node"
while read -r lib; do
    # The rootfs is usr-merged: /lib/… lives at /usr/lib/….
    [[ $lib == /lib/* || $lib == /lib64/* ]] && lib="/usr$lib"
    if debugfs -R "stat $lib" "$TINE_DATA_DIR/current/rootfs-base.ext4" 2>/dev/null | grep -q '^Inode:'; then
        continue
    fi
    info "node needs $lib, which the rootfs lacks: copied"
    mkdir -p "$dir/.node.tmp$(dirname "$lib")"
    cp -L "$lib" "$dir/.node.tmp$lib"
done < <(ldd "$node_bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }')
(cd "$dir/.node.tmp" && find . -type f -print0 | tar --owner=0 --group=0 --null -T - -cf "$stage.tmp/node.tar")
rm -rf "$dir/.node.tmp"
info "node $("$node_bin" --version) from $node_bin"
rm -rf "$stage" && mv "$stage.tmp" "$stage"

log "tine template build -f $DOCKERFILE $NAME ($VCPUS vCPUs, $MEMORY_MIB MiB; a TCG guest takes minutes)"
"$TINE_BIN" template build -f "$stage/Dockerfile" --vcpus "$VCPUS" --memory-mib "$MEMORY_MIB" \
    --ready-timeout-secs 120 "$stage" "$NAME"
find "$dir" -maxdepth 1 \( -name 'stage-*' -o -name 'built-*' \) ! -name "*-$hash" -exec rm -rf {} +
find "$dir" -maxdepth 1 -name 'servers-*.tar' ! -samefile "$servers" -delete
rm -f "$stage/servers.tar" "$stage/node.tar"
touch "$dir/built-$hash"
log "template $NAME built in $(elapsed "$start")"
