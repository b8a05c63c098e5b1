#!/usr/bin/env bash
# Build the default template rootfs `base`: Debian bookworm (mmdebstrap
# --variant=minbase) with the tools E2B's base image offers and a user `user`
# (uid/gid 1000, /home/user, bash, passwordless sudo).
#
# Produces, keyed by a hash of this script (which holds the package list and
# every customization) and the suite:
#
#   $TINE_DATA_DIR/rootfs/base-<hash>.tar    the rootfs as a tarball
#   $TINE_DATA_DIR/rootfs/base-<hash>.ext4   4 GiB sparse ext4, label tine-root,
#                                            made by `mkfs.ext4 -d` (no mount)
#
# and publishes current/rootfs-base.ext4. Nothing is rebuilt while the recipe
# is unchanged. Every artifact is written under a temporary name and renamed,
# so an interrupted build never leaves a file that looks complete.
#
# Environment: TINE_DATA_DIR (default /var/lib/tine),
#              TINE_MIRROR (default: the host apt's Debian mirror).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

NAME="base"
IMAGE_SIZE="4G"
LABEL="tine-root"
# Kept sorted; changing it changes the recipe hash.
PACKAGES=(
    bash
    ca-certificates
    coreutils
    curl
    git
    iproute2
    less
    netbase
    procps
    python-is-python3
    python3
    python3-pip
    sudo
)

need_root
need_cmd mmdebstrap mkfs.ext4 tar sha256sum

hash="$(recipe_hash "${BASH_SOURCE[0]}" -- "suite=$TINE_DEBIAN_SUITE" "packages=${PACKAGES[*]}" "size=$IMAGE_SIZE")"
dir="$TINE_DATA_DIR/rootfs"
image="$dir/$NAME-$hash.ext4"
tarball="$dir/$NAME-$hash.tar"

take_lock "rootfs-$NAME"

if [[ -f $image ]]; then
    log "rootfs $NAME (recipe $hash): present"
    set_current "rootfs-$NAME.ext4" "$image"
    exit 0
fi

start=$(now)
log "building $NAME rootfs (recipe $hash)"
mkdir -p "$dir"
work="$(mktemp -d "$dir/.tmp-$NAME-$hash.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if [[ -f $tarball ]]; then
    info "reusing $tarball"
else
    mirror="${TINE_MIRROR:-$(debian_mirror)}"
    security="$(debian_security_mirror)"
    [[ -n ${TINE_MIRROR:-} ]] && security="${TINE_MIRROR%/}-security"
    suite=$TINE_DEBIAN_SUITE
    info "mmdebstrap $suite from $mirror: ${PACKAGES[*]}"
    include="$(
        IFS=,
        printf '%s' "${PACKAGES[*]}"
    )"
    # mmdebstrap stages the tree under TMPDIR; keep it on the data disk.
    # Hooks run with the chroot directory as "$1".
    # shellcheck disable=SC2016 # the hooks are expanded by mmdebstrap's shell
    TMPDIR="$work" mmdebstrap \
        --quiet \
        --variant=minbase \
        --components=main \
        --include="$include" \
        --aptopt='Acquire::Languages "none"' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='chroot "$1" groupadd --gid 1000 user' \
        --customize-hook='chroot "$1" useradd --uid 1000 --gid 1000 --create-home --home-dir /home/user --shell /bin/bash user' \
        --customize-hook='printf "user ALL=(ALL:ALL) NOPASSWD: ALL\n" > "$1/etc/sudoers.d/user" && chmod 0440 "$1/etc/sudoers.d/user"' \
        --customize-hook='printf "tine\n" > "$1/etc/hostname"' \
        --customize-hook='printf "127.0.0.1\tlocalhost\n127.0.1.1\ttine\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n" > "$1/etc/hosts"' \
        --customize-hook='printf "# written by the tine agent at boot\n" > "$1/etc/resolv.conf"' \
        --customize-hook=': > "$1/etc/machine-id" && rm -f "$1/var/lib/dbus/machine-id"' \
        --customize-hook='printf "LANG=C.UTF-8\n" > "$1/etc/default/locale"' \
        --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin && mkdir -p "$1/var/lib/apt/lists/partial"' \
        "$suite" "$work/rootfs.tar" \
        "deb $mirror $suite main" \
        "deb $mirror $suite-updates main" \
        "deb $security $suite-security main" >&2 ||
        die "mmdebstrap failed"
    chmod 0644 "$work/rootfs.tar"
    mv -f "$work/rootfs.tar" "$tarball"
    info "tarball $(du -h --apparent-size "$tarball" | cut -f1) after $(elapsed "$start")"
fi

# mkfs.ext4 in bookworm's e2fsprogs (1.47.0) reads -d from a directory only
# (tarballs came in 1.47.1), so unpack the tarball as root, keeping owners,
# modes and extended attributes (file capabilities).
info "unpacking for mkfs.ext4 -d"
mkdir "$work/tree"
tar -C "$work/tree" --numeric-owner --xattrs --xattrs-include='*' -xpf "$tarball"

info "mkfs.ext4 -d -L $LABEL ($IMAGE_SIZE, sparse)"
mkfs.ext4 -q -F -t ext4 -L "$LABEL" -m 0 -E root_owner=0:0 \
    -d "$work/tree" "$work/image.ext4" "$IMAGE_SIZE" >/dev/null ||
    die "mkfs.ext4 failed"
e2fsck -fn "$work/image.ext4" >/dev/null 2>&1 || die "e2fsck reports errors in the new image"
chmod 0644 "$work/image.ext4"
mv -f "$work/image.ext4" "$image"
info "image uses $(du -h "$image" | cut -f1) of $IMAGE_SIZE; built in $(elapsed "$start")"
set_current "rootfs-$NAME.ext4" "$image"
