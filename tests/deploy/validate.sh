#!/usr/bin/env bash
# validate.sh: checks the deployment artifacts under deploy/ without a
# Kubernetes cluster or a systemd boot:
#   1. every Kubernetes object against the API's JSON schemas
#      (kubernetes-validate --strict: unknown fields are errors too), for
#      each version in KUBE_VERSIONS;
#   2. tests/deploy/check_deploy.py: TOML configs (systemd examples and the
#      ConfigMaps' templates) against tine's config structs, the manifests
#      against each other, the init containers' render scripts run here;
#   3. the systemd units with `systemd-analyze verify` (and the gateway's
#      hardening score), or as INI files where systemd-analyze cannot run.
# Run as root from anywhere: tests/deploy/validate.sh. Needs python3 (3.11+,
# for tomllib) and PyPI, once, for kubernetes-validate.
#
# Environment: TINE_DATA_DIR (/var/lib/tine; the venv is
# $TINE_DATA_DIR/venv-deploy), KUBE_VERSIONS ("1.31.0 1.37.0").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
K8S=deploy/kubernetes
SYSTEMD=deploy/systemd
VENV="${TINE_DATA_DIR:-/var/lib/tine}/venv-deploy"
KV_VERSION=1.37.0
read -r -a KUBE_VERSIONS <<<"${KUBE_VERSIONS:-1.31.0 1.37.0}"

say() { printf '\n== %s\n' "$*"; }
die() { printf 'validate.sh: FAILED: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (the render checks chown files)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "python3 >= 3.11 is needed (tomllib)"

# --- the venv with kubernetes-validate --------------------------------------
if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "$KV_VERSION"; then
    say "installing kubernetes-validate==$KV_VERSION into $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$KV_VERSION"
fi
KV="$VENV/bin/kubernetes-validate"
PY="$VENV/bin/python"

# --- 1. Kubernetes schemas -------------------------------------------------
# kustomization.yaml is kustomize's file, not an API object: it has no schema
# (check_deploy.py checks that it lists every manifest).
mapfile -t MANIFESTS < <(find "$K8S" -maxdepth 1 -name '*.yaml' ! -name kustomization.yaml | sort)
[[ ${#MANIFESTS[@]} -gt 0 ]] || die "no manifests in $K8S"
objects="$("$PY" - "${MANIFESTS[@]}" <<'EOF'
import sys, yaml
print(sum(1 for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d))
EOF
)" || die "a manifest is not valid YAML"
say "Kubernetes: $objects objects in ${#MANIFESTS[@]} files, kubernetes-validate $KV_VERSION --strict, Kubernetes ${KUBE_VERSIONS[*]}"
kargs=()
for v in "${KUBE_VERSIONS[@]}"; do kargs+=(-k "$v"); done
set +e
out="$("$KV" --strict "${kargs[@]}" "${MANIFESTS[@]}" 2>&1)"
rc=$?
set -e
printf '%s\n' "$out" | sed 's/^/  /'
# A kind without a schema is only a WARN to kubernetes-validate (exit 0):
# here it fails, as does any object that did not pass.
passed="$(grep -c '^INFO .* passed for resource' <<<"$out" || true)"
want=$((objects * ${#KUBE_VERSIONS[@]}))
[[ $rc -eq 0 ]] || die "kubernetes-validate exited $rc"
! grep -qE '^(WARN|ERROR|FATAL)' <<<"$out" || die "kubernetes-validate reported problems"
[[ $passed -eq $want ]] || die "$passed of $want object validations passed"
echo "  $passed object validations passed ($objects objects x ${#KUBE_VERSIONS[@]} versions)"

# --- 2. configs and cross-checks --------------------------------------------
say "configs, cross-references and render scripts (tests/deploy/check_deploy.py)"
"$PY" tests/deploy/check_deploy.py "$ROOT" || die "check_deploy.py"

# --- 3. systemd units -------------------------------------------------------
UNITS=("$SYSTEMD"/*.service)
TOMLS=("$SYSTEMD"/*.toml)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# systemd-analyze works offline (no systemd as PID 1 needed) where it works
# at all: a unit known to be good tells whether it does here.
printf '[Unit]\nDescription=probe\n[Service]\nExecStart=/bin/true\n' >"$tmp/probe.service"
if command -v systemd-analyze >/dev/null &&
    [[ -z $(systemd-analyze verify "$tmp/probe.service" 2>&1) ]]; then
    unit_check="systemd-analyze verify"
    say "systemd: systemd-analyze verify ($(systemd-analyze --version | head -1))"
    # verify insists that ExecStart's binary exists: point the units at a
    # stand-in for the tine binary, in copies.
    printf '#!/bin/sh\nexit 0\n' >"$tmp/tine"
    chmod +x "$tmp/tine"
    copies=()
    for u in "${UNITS[@]}"; do
        sed "s|/usr/local/bin/tine|$tmp/tine|g" "$u" >"$tmp/$(basename "$u")"
        copies+=("$tmp/$(basename "$u")")
    done
    # Unknown keys and bad values are only logged (exit 0): any output fails.
    set +e
    out="$(systemd-analyze verify "${copies[@]}" 2>&1)"
    rc=$?
    set -e
    [[ $rc -eq 0 && -z $out ]] || { printf '%s\n' "$out" | sed 's/^/  /'; die "systemd-analyze verify"; }
    for u in "${UNITS[@]}"; do echo "  ok   $(basename "$u"): no errors or warnings"; done
    # The gateway runs unprivileged: hold its exposure score down.
    if systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
        out="$(systemd-analyze security --offline=yes --threshold=20 "$tmp/tine-gateway.service" 2>&1)" ||
            { printf '%s\n' "$out" | tail -3; die "tine-gateway.service's exposure is above 2.0"; }
        echo "  ok   $(grep -o 'Overall exposure level.*' <<<"$out") (must be <= 2.0)"
    fi
else
    unit_check="INI parse only (no working systemd-analyze)"
    say "systemd: systemd-analyze is missing or cannot run here; INI parse and required keys only"
    "$PY" - "${UNITS[@]}" <<'EOF' || die "systemd units"
import configparser, sys
bad = 0
for path in sys.argv[1:]:
    p = configparser.ConfigParser(strict=False, interpolation=None)
    p.optionxform = str
    try:
        p.read(path)
        ok = p.has_section("Service") and p["Service"].get("ExecStart")
    except configparser.Error as e:
        ok = False
    print(("  ok   " if ok else "  FAIL ") + path + ": parses, [Service] ExecStart=")
    bad += not ok
sys.exit(1 if bad else 0)
EOF
fi

say "deploy/ is valid: ${#MANIFESTS[@]} manifest files ($objects objects; schemas of Kubernetes ${KUBE_VERSIONS[*]}), ${#TOMLS[@]} systemd TOML examples, ${#UNITS[@]} units ($unit_check)"
