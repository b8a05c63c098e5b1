"""Checks of deploy/ that a schema validator cannot make (run by validate.sh).

- Every TOML config (deploy/systemd/*.toml and the ConfigMaps' templates)
  parses, has the keys cluster mode needs, and has no key tine would refuse
  (its config structs are `deny_unknown_fields`; their field names are read
  from the Rust source, so this follows the code).
- The Kubernetes manifests agree with each other: every ConfigMap, Secret
  and key a pod names exists, selectors match pod labels, the cluster secret
  is mounted with a mode tine accepts, kustomization.yaml lists every file.
- The node and gateway pods name the image deploy/image/build.sh tags.
- The init containers' render scripts are run here on temporary
  directories, and what they write is checked as tine would read it.
- The systemd units have what the deployment relies on.

Usage: check_deploy.py REPO_ROOT. Prints one line per check; exits 1 on
any failure.
"""

import atexit
import configparser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(sys.argv[1]).resolve()
K8S = ROOT / "deploy" / "kubernetes"
SYSTEMD = ROOT / "deploy" / "systemd"

failures = []
checks = 0


def check(ok, what):
    global checks
    what = re.sub(r" ?(\(\)|\[\]|'')?$", "", what)
    checks += 1
    if ok:
        print(f"  ok   {what}")
    else:
        print(f"  FAIL {what}")
        failures.append(what)
    return ok


def rust_fields(path, struct):
    """The field names of `pub struct <struct> { ... }` in a Rust file."""
    text = (ROOT / path).read_text()
    m = re.search(r"^pub struct %s \{\n(.*?)^\}" % struct, text, re.M | re.S)
    if not m:
        raise SystemExit(f"no struct {struct} in {path}: update check_deploy.py")
    return set(re.findall(r"^\s+pub (\w+):", m.group(1), re.M))


NODE_KEYS = rust_fields("crates/server/src/config.rs", "Config")
CLUSTER_KEYS = rust_fields("crates/server/src/cluster/mod.rs", "ClusterConfig")
GATEWAY_KEYS = rust_fields("crates/server/src/gateway/mod.rs", "GatewayConfig")
TEAM_KEYS = rust_fields("crates/server/src/config.rs", "TeamLimits")

NODE_REQUIRED = ["listen", "domain"]
CLUSTER_REQUIRED = [
    "postgres_url",
    "node_id",
    "advertise_url",
    "secret_file",
    "heartbeat_secs",
    "publish_secs",
]
GATEWAY_REQUIRED = [
    "listen",
    "postgres_url",
    "secret_file",
    "domain",
    "node_grace_secs",
    "max_body_bytes",
]


def is_socket_addr(v):
    return isinstance(v, str) and re.fullmatch(r"(\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]):\d{1,5}", v)


def check_teams(name, teams):
    check(isinstance(teams, dict), f"{name}: [teams] is a table")
    for team, limits in (teams or {}).items():
        extra = set(limits) - TEAM_KEYS
        check(not extra, f"{name}: [teams.{team}] has only known keys {sorted(extra) if extra else ''}")
        for k, v in limits.items():
            check(isinstance(v, int) and v >= 0, f"{name}: teams.{team}.{k} is a count")


def check_node_toml(name, text):
    try:
        c = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        check(False, f"{name}: TOML parses ({e})")
        return None
    check(True, f"{name}: TOML parses")
    for k in NODE_REQUIRED:
        check(k in c, f"{name}: has {k}")
    extra = set(c) - NODE_KEYS
    check(not extra, f"{name}: only keys tine's Config knows {sorted(extra) if extra else ''}")
    check(is_socket_addr(c.get("listen")), f"{name}: listen is an address:port")
    cl = c.get("cluster", {})
    for k in CLUSTER_REQUIRED:
        check(k in cl, f"{name}: has cluster.{k}")
    extra = set(cl) - CLUSTER_KEYS
    check(not extra, f"{name}: only keys tine's [cluster] knows {sorted(extra) if extra else ''}")
    for k in ("heartbeat_secs", "publish_secs"):
        check(isinstance(cl.get(k), int) and cl.get(k) >= 1, f"{name}: cluster.{k} >= 1")
    check(
        str(cl.get("advertise_url", "")).startswith("http://"),
        f"{name}: cluster.advertise_url is an http:// URL",
    )
    if "teams" in c:
        check_teams(name, c["teams"])
    return c


def check_gateway_toml(name, text):
    try:
        c = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        check(False, f"{name}: TOML parses ({e})")
        return None
    check(True, f"{name}: TOML parses")
    for k in GATEWAY_REQUIRED:
        check(k in c, f"{name}: has {k}")
    extra = set(c) - GATEWAY_KEYS
    check(not extra, f"{name}: only keys tine's GatewayConfig knows {sorted(extra) if extra else ''}")
    check(is_socket_addr(c.get("listen")), f"{name}: listen is an address:port")
    for k in ("node_grace_secs", "max_body_bytes"):
        check(isinstance(c.get(k), int) and c.get(k) > 0, f"{name}: {k} > 0")
    check(
        isinstance(c.get("teams", {}).get("default", {}).get("max_sandboxes"), int),
        f"{name}: has teams.default.max_sandboxes",
    )
    check_teams(name, c.get("teams", {}))
    return c


# --- systemd examples -------------------------------------------------------

print("TOML examples in deploy/systemd:")
sd_node = check_node_toml("systemd/node.toml", (SYSTEMD / "node.toml").read_text())
sd_gw = check_gateway_toml("systemd/gateway.toml", (SYSTEMD / "gateway.toml").read_text())
if sd_node and sd_gw:
    check(sd_node.get("domain") == sd_gw.get("domain"), "systemd: node and gateway domain are equal")

print("systemd units (content):")


def unit(path):
    p = configparser.ConfigParser(strict=False, interpolation=None)
    p.optionxform = str
    try:
        p.read_string(path.read_text())
    except configparser.Error as e:
        check(False, f"{path.name}: parses as INI ({e})")
        return None, ""
    check(True, f"{path.name}: parses as INI")
    for s in ("Unit", "Service", "Install"):
        check(p.has_section(s), f"{path.name}: has [{s}]")
    return p, path.read_text()


def values(text, key):
    """Every value of `key=` (systemd keys may repeat)."""
    return re.findall(r"^%s=(.*)$" % re.escape(key), text, re.M)


node_unit, node_text = unit(SYSTEMD / "tine-node.service")
if node_unit:
    svc = node_unit["Service"] if node_unit.has_section("Service") else {}
    check("serve -c /etc/tine/node.toml" in svc.get("ExecStart", ""), "tine-node.service: ExecStart runs tine serve -c /etc/tine/node.toml")
    check(svc.get("KillMode") == "process", "tine-node.service: KillMode=process (VMs outlive a restart)")
    check(svc.get("Restart") == "on-failure", "tine-node.service: Restart=on-failure")
    check(node_unit["Unit"].get("StartLimitIntervalSec") == "0", "tine-node.service: restarts without a limit (PostgreSQL may come later)")
    check(int(svc.get("LimitNOFILE", "0")) >= 65536, "tine-node.service: LimitNOFILE >= 65536")
    check(
        any("network-online.target" in v for v in values(node_text, "After")),
        "tine-node.service: After=network-online.target",
    )

gw_unit, gw_text = unit(SYSTEMD / "tine-gateway.service")
if gw_unit:
    svc = gw_unit["Service"] if gw_unit.has_section("Service") else {}
    check("gateway -c " in svc.get("ExecStart", ""), "tine-gateway.service: ExecStart runs tine gateway -c")
    for k, v in {
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "Restart": "on-failure",
    }.items():
        check(svc.get(k) == v, f"tine-gateway.service: {k}={v}")
    check(gw_unit["Unit"].get("StartLimitIntervalSec") == "0", "tine-gateway.service: restarts without a limit (PostgreSQL may come later)")
    creds = dict(c.split(":", 1) for c in values(gw_text, "LoadCredential"))
    check(
        "%d/gateway.toml" in svc.get("ExecStart", "") and "gateway.toml" in creds,
        "tine-gateway.service: its config comes in as the credential gateway.toml",
    )
    if sd_gw:
        want = "/run/credentials/tine-gateway.service/"
        sf = sd_gw.get("secret_file", "")
        check(
            sf.startswith(want) and sf[len(want):] in creds,
            "systemd/gateway.toml: secret_file is a credential the unit loads",
        )

# --- Kubernetes -------------------------------------------------------------

print("Kubernetes manifests (consistency):")
objects = []  # (file, object)
for f in sorted(K8S.glob("*.yaml")):
    if f.name == "kustomization.yaml":
        continue
    for doc in yaml.safe_load_all(f.read_text()):
        if doc:
            objects.append((f.name, doc))

kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
listed = kust.get("resources", [])
files = sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")
check(sorted(listed) == files, f"kustomization.yaml lists every manifest ({len(files)} files)")

ns = [o["metadata"]["name"] for _, o in objects if o["kind"] == "Namespace"]
check(ns == ["tine"], "one Namespace, tine")
for fname, o in objects:
    if o["kind"] != "Namespace":
        check(o["metadata"].get("namespace") == "tine", f"{fname}: {o['kind']}/{o['metadata']['name']} is in namespace tine")

by_kind = {}
for fname, o in objects:
    by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o


def secret_keys(name):
    s = by_kind.get("Secret", {}).get(name)
    if s is None:
        return None
    return set(s.get("stringData", {})) | set(s.get("data", {}))


workloads = [
    (fname, o)
    for fname, o in objects
    if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
]
pod_labels = []
for fname, w in workloads:
    name = f"{w['kind']}/{w['metadata']['name']}"
    spec = w["spec"]
    tmpl_labels = spec["template"]["metadata"]["labels"]
    pod_labels.append(tmpl_labels)
    sel = spec["selector"]["matchLabels"]
    check(sel.items() <= tmpl_labels.items(), f"{name}: selector matches its pod labels")
    pod = spec["template"]["spec"]
    for v in pod.get("volumes", []):
        if "configMap" in v:
            check(v["configMap"]["name"] in by_kind.get("ConfigMap", {}), f"{name}: ConfigMap {v['configMap']['name']} exists")
        if "secret" in v:
            sn = v["secret"]["secretName"]
            check(secret_keys(sn) is not None, f"{name}: Secret {sn} exists")
            if sn == "tine-cluster-secret":
                mode = v["secret"].get("defaultMode", 0o644)
                check(mode & 0o077 == 0, f"{name}: the cluster secret's mode {mode:o} is private")
    for c in pod.get("initContainers", []) + pod["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                keys = secret_keys(ref["name"])
                check(keys is not None and ref["key"] in keys, f"{name}/{c['name']}: Secret {ref['name']} has key {ref['key']}")
        mounts = {m["name"] for m in c.get("volumeMounts", [])}
        vols = {v["name"] for v in pod.get("volumes", [])} | {
            t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])
        }
        check(mounts <= vols, f"{name}/{c['name']}: every mount has a volume")
        for p in ("readinessProbe", "livenessProbe"):
            if c in pod["containers"]:
                check(p in c, f"{name}/{c['name']}: has a {p}")

for sname, s in by_kind.get("Service", {}).items():
    sel = s["spec"]["selector"]
    check(any(sel.items() <= l.items() for l in pod_labels), f"Service/{sname}: selects a workload's pods")

node = by_kind["DaemonSet"]["tine-node"]["spec"]["template"]["spec"]
check(node.get("nodeSelector") == {"tine.dev/sandbox-host": "true"}, "node DaemonSet: nodeSelector tine.dev/sandbox-host=true")
tine_c = [c for c in node["containers"] if c["name"] == "tine"][0]
check(tine_c.get("securityContext", {}).get("privileged") is True, "node DaemonSet: privileged")
node_paths = {v["name"]: v.get("hostPath", {}).get("path") for v in node["volumes"]}
for p in ("/var/lib/tine", "/dev/kvm", "/dev/net/tun", "/sys/fs/cgroup", "/dev/shm/tine"):
    check(p in node_paths.values(), f"node DaemonSet: hostPath {p}")
check(not node.get("hostNetwork"), "node DaemonSet: no hostNetwork")

gw = by_kind["Deployment"]["tine-gateway"]
check(gw["spec"]["replicas"] == 2, "gateway Deployment: 2 replicas")
gw_c = [c for c in gw["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"][0]
sc = gw_c.get("securityContext", {})
check(
    sc.get("runAsNonRoot") is True and sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False,
    "gateway Deployment: non-root, read-only root, no privilege escalation",
)
svc = by_kind["Service"]["tine-gateway"]["spec"]["ports"][0]
check(svc["port"] == 80, "gateway Service: port 80 to the pods' http (3000)")

# The image deploy/image/build.sh tags (its TINE_IMAGE_REPO default plus
# :latest), in every container of the node and gateway pods; a :latest
# image that exists only on the host must not be pulled.
m = re.search(r'^REPO="\$\{TINE_IMAGE_REPO:-([^}]+)\}"', (ROOT / "deploy/image/build.sh").read_text(), re.M)
built = f"{m.group(1)}:latest" if m else None
check(built is not None, f"deploy/image/build.sh: its image name is {built}")
for wname in ("DaemonSet/tine-node", "Deployment/tine-gateway"):
    kind, name = wname.split("/")
    pod = by_kind[kind][name]["spec"]["template"]["spec"]
    for c in pod.get("initContainers", []) + pod["containers"]:
        check(
            c.get("image") == built and c.get("imagePullPolicy") == "IfNotPresent",
            f"{wname}/{c['name']}: image {c.get('image')} is build.sh's, imagePullPolicy IfNotPresent",
        )

print("Kubernetes ConfigMaps (TOML templates):")
cms = by_kind.get("ConfigMap", {})
k_node = check_node_toml("ConfigMap tine-node-config node.toml", cms["tine-node-config"]["data"]["node.toml"])
k_gw = check_gateway_toml("ConfigMap tine-gateway-config gateway.toml", cms["tine-gateway-config"]["data"]["gateway.toml"])
if k_node and k_gw:
    check(k_node.get("domain") == k_gw.get("domain"), "ConfigMaps: node and gateway domain are equal")

print("Kubernetes init containers (render scripts run here):")
# A URL whose password has what sed's replacement would take as special.
PG_URL = "postgresql://tine:p&ss|w0rd@tine-postgres:5432/tine"
SECRET = "0123456789abcdef-test-secret"


def render(workload, env):
    """Run `workload`'s render-config script with its paths under a
    temporary directory; returns that directory's config dir."""
    pod = workload["spec"]["template"]["spec"]
    init = [c for c in pod["initContainers"] if c["name"] == "render-config"][0]
    script = init["args"][0]
    tmp = Path(tempfile.mkdtemp(prefix="tine-render-"))
    atexit.register(shutil.rmtree, tmp, True)
    (tmp / "template").mkdir()
    (tmp / "secret").mkdir()
    (tmp / "config").mkdir(mode=0o777)
    cm_name = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v][0]
    for k, v in cms[cm_name]["data"].items():
        (tmp / "template" / k).write_text(v)
    (tmp / "secret" / "cluster.secret").write_text(SECRET)
    os.chmod(tmp / "secret" / "cluster.secret", 0o400)
    for mount, sub in (("/etc/tine-template", "template"), ("/etc/tine-secret", "secret"), ("/etc/tine", "config")):
        script = script.replace(mount, str(tmp / sub))
    r = subprocess.run(["/bin/sh", "-c", script], env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True)
    check(r.returncode == 0, f"{workload['metadata']['name']}: render script runs ({r.stderr.strip()})")
    return tmp / "config"


def private(path, uid):
    st = path.stat()
    return st.st_mode & 0o077 == 0 and st.st_uid == uid


for pod_ip, want in (("10.1.2.3", "http://10.1.2.3:3000"), ("fd00::5", "http://[fd00::5]:3000")):
    out = render(by_kind["DaemonSet"]["tine-node"], {"POD_IP": pod_ip, "NODE_NAME": "worker-7", "TINE_POSTGRES_URL": PG_URL})
    text = (out / "node.toml").read_text() if (out / "node.toml").exists() else ""
    c = check_node_toml(f"rendered node.toml (pod IP {pod_ip})", text)
    if c:
        cl = c["cluster"]
        check("__" not in text, "rendered node.toml: no placeholder left")
        check(cl["postgres_url"] == PG_URL, "rendered node.toml: postgres_url is the Secret's, & and | intact")
        check(cl["advertise_url"] == want, f"rendered node.toml: advertise_url {want}")
        check(cl["node_id"] == "worker-7", "rendered node.toml: node_id is the node name")
        sf = Path(str(out) + cl["secret_file"][len("/etc/tine"):])
        check(sf.exists() and sf.read_text().strip() == SECRET and private(sf, 0), "rendered node: cluster.secret copied, root's, private")

gw_out = render(by_kind["Deployment"]["tine-gateway"], {"TINE_POSTGRES_URL": PG_URL})
gw_text = (gw_out / "gateway.toml").read_text() if (gw_out / "gateway.toml").exists() else ""
gw_cfg = check_gateway_toml("rendered gateway.toml", gw_text)
uid = gw_c["securityContext"]["runAsUser"]
if gw_cfg:
    check(gw_cfg["postgres_url"] == PG_URL, "rendered gateway.toml: postgres_url is the Secret's, & and | intact")
    check(private(gw_out / "gateway.toml", uid), f"rendered gateway.toml: owned by the gateway's uid {uid}, private")
    sf = Path(str(gw_out) + gw_cfg["secret_file"][len("/etc/tine"):])
    check(sf.exists() and sf.read_text().strip() == SECRET and private(sf, uid), f"rendered gateway: cluster.secret owned by uid {uid}, private")

# --- the real parser --------------------------------------------------------
# tine's own binary, when there is one, reads each gateway config: with the
# catalog pointed at a closed loopback port, getting as far as connecting
# means the file parsed (unknown keys included) and the secret file was
# accepted. Node configs are not run: `tine serve` sets up the host's
# firewall before it connects.
TINE = os.environ.get("TINE_BIN") or str(ROOT / "target" / "release" / "tine")
UNREACHABLE = "postgresql://tine:x@127.0.0.1:1/tine"


def run_gateway(name, text, secret_path, user=None):
    text = re.sub(r"^postgres_url = .*$", f'postgres_url = "{UNREACHABLE}"', text, flags=re.M)
    text = re.sub(r"^listen = .*$", 'listen = "127.0.0.1:0"', text, flags=re.M)
    text = re.sub(r"^secret_file = .*$", f'secret_file = "{secret_path}"', text, flags=re.M)
    d = Path(tempfile.mkdtemp(prefix="tine-gw-"))
    atexit.register(shutil.rmtree, d, True)
    cfg = d / "gateway.toml"
    cfg.write_text(text)
    cmd = [TINE, "gateway", "-c", str(cfg)]
    if user is not None:
        os.chown(d, user, user)
        os.chown(cfg, user, user)
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "RUST_BACKTRACE": "0"})
    ok = "connecting to the cluster catalog" in r.stderr
    check(ok, f"{name}: tine gateway reads it{' as uid %d' % user if user else ''}" + ("" if ok else f" ({r.stderr.strip().splitlines()[:3]})"))


have_tine = os.access(TINE, os.X_OK) and subprocess.run([TINE, "gateway", "--help"], capture_output=True).returncode == 0
if have_tine:
    print(f"gateway configs read by {TINE}:")
    s_dir = Path(tempfile.mkdtemp(prefix="tine-secret-"))
    atexit.register(shutil.rmtree, s_dir, True)
    (s_dir / "cluster.secret").write_text(SECRET + "\n")
    os.chmod(s_dir / "cluster.secret", 0o600)
    run_gateway("systemd/gateway.toml", (SYSTEMD / "gateway.toml").read_text(), s_dir / "cluster.secret")
    if gw_cfg:
        # As the pod runs it: its user, the secret the init container wrote.
        os.chmod(gw_out.parent, 0o755)
        os.chmod(gw_out, 0o755)
        run_gateway("rendered gateway.toml", gw_text, gw_out / "cluster.secret", user=uid)
else:
    print(f"(no tine binary with `gateway` at {TINE}: set TINE_BIN to have it read the gateway configs)")

print(f"{checks - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
