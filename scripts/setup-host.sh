#!/usr/bin/env bash
# Prepare a Debian 12 host for tine, idempotently:
#
#   1. apt: bookworm-backports (for QEMU >= 10) and the host packages;
#   2. Rust: the x86_64-unknown-linux-musl target for the static guest agent;
#   3. the guest kernel (build-kernel.sh) and the base rootfs (build-rootfs.sh).
#
# The initramfs needs the agent binary and is built separately:
#   scripts/build-initramfs.sh target/guest/x86_64-unknown-linux-musl/release/tine-agent
#
# A second run changes nothing and only reports what is present.
# `setup-host.sh packages` does steps 1 and 2 only (what a build needs).
# Environment: TINE_DATA_DIR (default /var/lib/tine).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

QEMU_MIN_MAJOR=10
BACKPORTS="$TINE_DEBIAN_SUITE-backports"
BACKPORTS_FILE="/etc/apt/sources.list.d/tine-$BACKPORTS.sources"
RUST_MIN="1.80"
MUSL_TARGET="x86_64-unknown-linux-musl"

# From bookworm-backports, at version >= QEMU_MIN_MAJOR.
QEMU_PACKAGES=(qemu-system-x86 qemu-utils)
# From the default suites.
HOST_PACKAGES=(
    ca-certificates # https for registries, mmdebstrap
    cpio            # initramfs
    curl
    e2fsprogs      # mkfs.ext4 -d, e2fsck, dumpe2fs
    file           # checks that the agent is a static ELF
    iproute2       # netns, tap
    kmod           # depmod for the unpacked guest kernel
    libsqlite3-dev # tine's state (rusqlite links the system SQLite)
    libzstd-dev    # image chunks (the zstd crate links the system libzstd)
    mmdebstrap     # rootfs
    musl-tools     # musl-gcc for crates with C code in the static agent
    nftables       # egress policy
    openssl        # self-signed certificates for the network tests
    pkg-config     # finds libsqlite3 and libzstd for the build
    publicsuffix   # which wildcards a secret-bearing header transform may not use
    python3-venv   # E2B SDK tests
    tar
    util-linux     # flock
    xz-utils       # compressed kernel modules, if a kernel ships them
    zstd
)

need_root
setup_start=$(now)
log "host setup (data dir $TINE_DATA_DIR)"

# ---- 1. apt ----

has_backports_source() {
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        # one-line format "deb URI bookworm-backports ..." or deb822 "Suites: ... bookworm-backports"
        if grep -Eq "^[[:space:]]*(deb[[:space:]].*[[:space:]]|Suites:.*[[:space:]])$BACKPORTS([[:space:]]|$)" "$f"; then
            return 0
        fi
    done
    return 1
}

if has_backports_source; then
    log "apt source $BACKPORTS: present"
else
    mirror="$(debian_mirror)"
    log "adding apt source $BACKPORTS ($mirror) as $BACKPORTS_FILE"
    cat >"$BACKPORTS_FILE.tmp" <<EOF
# Added by tine's scripts/setup-host.sh: QEMU >= $QEMU_MIN_MAJOR comes from here.
Types: deb
URIs: $mirror
Suites: $BACKPORTS
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    mv -f "$BACKPORTS_FILE.tmp" "$BACKPORTS_FILE"
fi

# installed_version PKG -> version if installed, empty otherwise.
declare -A INSTALLED=()
while read -r pkg status ver; do
    [[ $status == ii ]] && INSTALLED[$pkg]=$ver
done < <(dpkg-query -W -f='${Package} ${db:Status-Abbrev} ${Version}\n' \
    "${HOST_PACKAGES[@]}" "${QEMU_PACKAGES[@]}" 2>/dev/null || true)

missing=()
for p in "${HOST_PACKAGES[@]}"; do
    [[ -n ${INSTALLED[$p]:-} ]] || missing+=("$p")
done
qemu_missing=()
for p in "${QEMU_PACKAGES[@]}"; do
    v=${INSTALLED[$p]:-}
    if [[ -z $v ]] || ! dpkg --compare-versions "$v" ge "1:$QEMU_MIN_MAJOR~"; then
        qemu_missing+=("$p")
    fi
done

if [[ ${#missing[@]} -eq 0 && ${#qemu_missing[@]} -eq 0 ]]; then
    log "apt packages: all present"
else
    apt_update_once
    export DEBIAN_FRONTEND=noninteractive
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "installing ${missing[*]}"
        apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 ||
            die "apt-get install ${missing[*]} failed"
    fi
    if [[ ${#qemu_missing[@]} -gt 0 ]]; then
        log "installing ${qemu_missing[*]} from $BACKPORTS"
        apt-get install -y -q --no-install-recommends -t "$BACKPORTS" "${QEMU_PACKAGES[@]}" >&2 ||
            die "apt-get install -t $BACKPORTS ${QEMU_PACKAGES[*]} failed"
    fi
fi

qemu_version="$(qemu-system-x86_64 --version 2>/dev/null | sed -nE 's/^QEMU emulator version ([0-9]+(\.[0-9]+)*).*/\1/p' | head -n1)" || true
[[ -n $qemu_version ]] || die "qemu-system-x86_64 is missing or does not report a version"
if [[ ${qemu_version%%.*} -lt $QEMU_MIN_MAJOR ]]; then
    die "qemu-system-x86_64 is $qemu_version; tine needs >= $QEMU_MIN_MAJOR (from $BACKPORTS: apt-get install -t $BACKPORTS ${QEMU_PACKAGES[*]})"
fi
info "qemu-system-x86_64 $qemu_version"

# ---- 2. Rust ----

if ! command -v rustup >/dev/null 2>&1 && [[ -f ${CARGO_HOME:-$HOME/.cargo}/env ]]; then
    # shellcheck disable=SC1091
    . "${CARGO_HOME:-$HOME/.cargo}/env"
fi
if ! command -v cargo >/dev/null 2>&1 || ! command -v rustup >/dev/null 2>&1; then
    die "a Rust toolchain >= $RUST_MIN installed with rustup is required (cargo and rustup on PATH)"
fi
rust_version="$(rustc --version | awk '{ print $2 }')"
if [[ "$(printf '%s\n%s\n' "$RUST_MIN" "$rust_version" | sort -V | head -n1)" != "$RUST_MIN" ]]; then
    die "rustc $rust_version is too old; tine needs >= $RUST_MIN (rustup update stable)"
fi
if rustup target list --installed 2>/dev/null | grep -qx "$MUSL_TARGET"; then
    log "rust $rust_version, target $MUSL_TARGET: present"
else
    log "rustup target add $MUSL_TARGET"
    rustup target add "$MUSL_TARGET" >&2 || die "rustup target add $MUSL_TARGET failed"
fi
if cargo clippy --version >/dev/null 2>&1; then
    log "clippy: present"
else
    log "rustup component add clippy (the lint CI runs)"
    rustup component add clippy >&2 || die "rustup component add clippy failed"
fi

if [[ ${1:-} == packages ]]; then
    log "host packages and Rust ready in $(elapsed "$setup_start") (steps 1-2 only)"
    exit 0
fi

# ---- 3. guest kernel and base rootfs ----

"$TINE_SCRIPTS_DIR/build-kernel.sh"
"$TINE_SCRIPTS_DIR/build-rootfs.sh"

log "host ready in $(elapsed "$setup_start")"
