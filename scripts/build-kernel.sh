#!/usr/bin/env bash
# Fetch Debian's cloud kernel (the package that `linux-image-cloud-amd64`
# currently depends on) with apt, unpack it -- never install it on the host --
# and store it under $TINE_DATA_DIR/kernel/<package>_<version>/:
#
#   vmlinuz   config   release (uname -r)   lib/modules/<release>/...
#
# Guest modules are loaded by our agent with finit_module(2) and no
# decompression flags, so compressed .ko files are decompressed here.
# An unpacked kernel is reused; the result is published as
# current/{vmlinuz,kernel-modules,kernel-release}.
#
# Environment: TINE_DATA_DIR (default /var/lib/tine),
#              TINE_KERNEL_PACKAGE (default: resolved from the metapackage).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

META_PACKAGE="linux-image-cloud-amd64"

need_root
need_cmd apt-cache apt-get dpkg-deb sha256sum depmod

# resolve_kernel -> "<package> <version>" of the kernel image to use.
resolve_kernel() {
    local pkg ver line
    if [[ -n ${TINE_KERNEL_PACKAGE:-} ]]; then
        pkg=$TINE_KERNEL_PACKAGE
    else
        # The candidate metapackage's Depends names the exact image package
        # and version, e.g. "linux-image-6.1.0-48-cloud-amd64 (= 6.1.172-1)".
        line="$(apt-cache show --no-all-versions "$META_PACKAGE" 2>/dev/null |
            awk '/^Depends:/ { sub(/^Depends:[ \t]*/, ""); print; exit }')" || true
        [[ -n $line ]] || return 1
        pkg="$(printf '%s\n' "$line" | tr ',' '\n' | grep -oE 'linux-image-[^ (|]+' | head -n1)"
        ver="$(printf '%s\n' "$line" | tr ',' '\n' | grep -F "$pkg" | grep -oE '\(= [^)]+\)' | head -n1 | sed -E 's/^\(= (.*)\)$/\1/')" || true
    fi
    [[ -n $pkg ]] || return 1
    if [[ -z ${ver:-} ]]; then
        ver="$(apt-cache show --no-all-versions "$pkg" 2>/dev/null | awk '/^Version:/ { print $2; exit }')" || true
    fi
    [[ -n ${ver:-} ]] || return 1
    printf '%s %s\n' "$pkg" "$ver"
}

publish() {
    local kdir=$1 release
    release="$(<"$kdir/release")"
    set_current vmlinuz "$kdir/vmlinuz"
    set_current kernel-modules "$kdir/lib/modules/$release"
    set_current_file kernel-release "$release"
}

# Signature of apt's package lists: the resolution only changes with them.
# (apt-cache takes ~1 s here because the binary cache is disabled, so the
# answer is remembered per list state.)
lists_sig() {
    {
        printf '%s\n' "${TINE_KERNEL_PACKAGE:-}"
        stat -c '%n %s %Y' /var/lib/apt/lists/*_Packages* 2>/dev/null || true
    } | sha256sum | cut -c1-16
}

take_lock kernel

memo="$TINE_DATA_DIR/kernel/.resolved"
sig="$(lists_sig)"
resolved=""
if [[ -f $memo ]]; then
    read -r memo_sig memo_pkg memo_ver <"$memo" || true
    if [[ ${memo_sig:-} == "$sig" && -n ${memo_ver:-} ]]; then
        resolved="$memo_pkg $memo_ver"
    fi
fi
if [[ -z $resolved ]] && ! resolved="$(resolve_kernel)"; then
    apt_update_once
    sig="$(lists_sig)"
    resolved="$(resolve_kernel)" || die "cannot resolve the kernel package behind $META_PACKAGE with apt-cache"
fi
mkdir -p "$TINE_DATA_DIR/kernel"
if [[ ! -f $memo || "$(<"$memo")" != "$sig $resolved" ]]; then
    printf '%s %s\n' "$sig" "$resolved" >"$memo.tmp.$$" && mv -f "$memo.tmp.$$" "$memo"
fi
read -r pkg ver <<<"$resolved"
key="${pkg}_${ver//:/%}"
kdir="$TINE_DATA_DIR/kernel/$key"

if [[ -f $kdir/vmlinuz && -f $kdir/release ]]; then
    log "kernel $key: present"
    publish "$kdir"
    exit 0
fi

start=$(now)
log "fetching kernel $pkg $ver (unpacked into $kdir, not installed)"
mkdir -p "$TINE_DATA_DIR/kernel"
work="$(mktemp -d "$TINE_DATA_DIR/kernel/.tmp-$key.XXXXXX")"
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"

# apt-get download writes into the current directory; the _apt sandbox user
# must be able to write there.
mkdir -p "$work/deb"
chmod 0777 "$work/deb"
if ! (cd "$work/deb" && apt-get download -q "$pkg=$ver" >&2); then
    # A stale list may name a version the mirror has dropped.
    apt_update_once
    resolved="$(resolve_kernel)" || die "cannot resolve the kernel package after apt-get update"
    printf '%s %s\n' "$(lists_sig)" "$resolved" >"$memo.tmp.$$" && mv -f "$memo.tmp.$$" "$memo"
    read -r pkg ver <<<"$resolved"
    key="${pkg}_${ver//:/%}"
    kdir="$TINE_DATA_DIR/kernel/$key"
    if [[ -f $kdir/vmlinuz && -f $kdir/release ]]; then
        log "kernel $key: present"
        publish "$kdir"
        exit 0
    fi
    (cd "$work/deb" && apt-get download -q "$pkg=$ver" >&2) || die "apt-get download $pkg=$ver failed"
fi
deb="$(find "$work/deb" -maxdepth 1 -name '*.deb' -print -quit)"
[[ -n $deb ]] || die "apt-get download produced no .deb for $pkg"

info "unpacking $(basename "$deb")"
dpkg-deb -x "$deb" "$work/x"

vmlinuz="$(find "$work/x/boot" -maxdepth 1 -name 'vmlinuz-*' -print -quit)"
[[ -n $vmlinuz ]] || die "$pkg contains no /boot/vmlinuz-*"
release="${vmlinuz##*/vmlinuz-}"
[[ -d $work/x/lib/modules/$release ]] || die "$pkg contains no /lib/modules/$release"
[[ -f $work/x/boot/config-$release ]] || die "$pkg contains no /boot/config-$release"

out="$work/out"
mkdir -p "$out/lib/modules"
mv "$vmlinuz" "$out/vmlinuz"
mv "$work/x/boot/config-$release" "$out/config"
mv "$work/x/lib/modules/$release" "$out/lib/modules/$release"
printf '%s\n' "$release" >"$out/release"
printf '%s\n' "$pkg $ver" >"$out/package"
mdir="$out/lib/modules/$release"

# Decompress modules if this kernel ships them compressed.
ncomp="$(find "$mdir" -type f \( -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' \) | wc -l)"
if [[ $ncomp -gt 0 ]]; then
    info "decompressing $ncomp kernel modules"
    find "$mdir" -type f -name '*.ko.xz' -exec xz -d {} +
    find "$mdir" -type f -name '*.ko.zst' -exec zstd -q -d --rm {} +
    find "$mdir" -type f -name '*.ko.gz' -exec gzip -d {} +
    sed -i -E 's/\.ko\.(xz|zst|gz)$/.ko/' "$mdir/modules.order"
else
    info "modules are uncompressed .ko files ($(find "$mdir" -type f -name '*.ko' | wc -l))"
fi
# The package leaves modules.dep & co. to its postinst (depmod); make them
# here, against the unpacked tree only.
depmod -b "$out" "$release"
[[ -s $mdir/modules.dep ]] || die "depmod produced no modules.dep for $release"
# The build/source links point into linux-headers, which we do not fetch.
rm -f "$mdir/build" "$mdir/source"

# Publish atomically: a directory rename either happens or not.
if [[ -e $kdir ]]; then
    rm -rf "$kdir" # an incomplete leftover without vmlinuz/release
fi
mv -T "$out" "$kdir"
info "kernel $release: $(du -sh "$kdir" | cut -f1) in $(elapsed "$start")"
publish "$kdir"
