"""Schema fuzzing of the REST API: schemathesis (in $TINE_DATA_DIR/../venv-fuzz,
installed by tests/e2e/setup.sh) generates requests from docs/openapi.yaml
for every operation and sends them to the suite's server on loopback.

It fails on
  - any 5xx response,
  - any error response (4xx, 5xx) whose body is not the E2B error
    {"code": <the HTTP status>, "message": <string>} (fuzz_hooks.py),
  - responses that do not conform to the spec: undocumented status codes or
    content types, bodies that do not match the documented schema, auth that
    is ignored, unsupported methods that are not 405, a killed sandbox that
    is still there or a created one that is not.
Not checked (they flag where the spec's schemas are looser or stricter than
the server, which the spec cannot say exactly, e.g. the config's cpuCount
and memoryMB bounds): positive_data_acceptance and negative_data_rejection.
TINE_FUZZ_ALL_CHECKS=1 turns them on, to look.

The fuzzer is seeded with a running and a paused sandbox and a snapshot made
by the suite's fixtures (it may pause, resume or kill them), and "base". It
keeps at most a few sandboxes of its own alive, and never touches what
existed before it started (other tests' sandboxes, snapshots, templates:
fuzz_hooks.py swaps their ids for an unknown one). Everything it made
(sandboxes, snapshots, base template shapes, template builds) is removed
afterwards through the API, so the rest of the suite is unaffected. It
talks to $E2B_API_URL only, which must be on loopback.

Knobs: TINE_FUZZ_MAX_EXAMPLES (cases per operation and phase, default 40),
TINE_FUZZ_SEED (schemathesis' random seed, to replay a run; under CI=true a
fixed one, CI_SEED, unless set),
TINE_FUZZ_VENV (another venv with `st`). The full schemathesis output, its
JUnit report and every exchange are kept in pytest's tmp_path (printed on
failure).
"""

import json
import os
import re
import shlex
import subprocess
import time
import xml.etree.ElementTree as ET
from urllib.parse import quote, urlsplit

import pytest

from conftest import API, API_KEY, HERE, RUN, http

ROOT = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
SPEC = os.path.join(ROOT, "docs", "openapi.yaml")
BASE = os.path.dirname(os.environ.get("TINE_DATA_DIR", "/var/lib/tine/e2e-server"))
VENV = os.environ.get("TINE_FUZZ_VENV") or os.path.join(BASE, "venv-fuzz")
MAX_EXAMPLES = int(os.environ.get("TINE_FUZZ_MAX_EXAMPLES", "40"))
# The seed CI uses (with CI set): one run of 3058 cases that passed.
CI_SEED = "281691631257961898871201831058971517605"
# The fuzzer's own sandboxes alive at once (fuzz_hooks.py kills the oldest).
MAX_LIVE = 4
# A hard bound on the run; the expected time is well under it.
RUN_TIMEOUT = 900
LOOPBACK = ("127.0.0.1", "localhost", "::1")


# ---- the server's state, through the API ----


def _json(method, path, body=None):
    status, headers, data = http(method, path, body)
    assert status == 200, f"{method} {path}: {status} {data[:300]!r}"
    return json.loads(data), headers


def sandbox_ids():
    ids, token = set(), ""
    while True:
        page, headers = _json("GET", "/v2/sandboxes?state=running,paused&limit=1000"
                              + (f"&nextToken={quote(token)}" if token else ""))
        ids |= {s["sandboxID"] for s in page}
        token = headers.get("x-next-token") or ""
        if not token:
            return ids


def snapshot_ids():
    ids, token = set(), ""
    while True:
        page, headers = _json("GET", "/snapshots?limit=1000" + (f"&nextToken={quote(token)}" if token else ""))
        ids |= {s["snapshotID"] for s in page}
        token = headers.get("x-next-token") or ""
        if not token:
            return ids


def templates():
    return _json("GET", "/templates")[0]


def base_shapes():
    """The snapshots of `base`, one per machine shape asked for."""
    return {t["buildID"] for t in templates() if t.get("templateID") == "base"}


def state():
    return {"sandboxes": sandbox_ids(), "snapshots": snapshot_ids(), "shapes": base_shapes(),
            "templates": {t["templateID"] for t in templates()} - {"base"}}


# ---- seeds ----


@pytest.fixture
def seeds(fresh):
    """What the fuzzer starts from: a running and a paused sandbox and a
    snapshot, made through the suite's fixtures (on loopback)."""
    running = fresh(timeout=1800, metadata={"group": "fuzz-seed"})
    paused = fresh(timeout=1800, metadata={"group": "fuzz-seed"})
    status, _, body = http("POST", f"/sandboxes/{paused.sandbox_id}/pause", {})
    assert status == 204, body[:300]
    status, _, body = http("POST", f"/sandboxes/{running.sandbox_id}/snapshots", {"name": f"fuzz-seed-{RUN}"})
    assert status == 201, body[:300]
    snapshot = json.loads(body)["snapshotID"]
    yield {"sandboxes": [running.sandbox_id, paused.sandbox_id], "snapshot": snapshot}
    http("DELETE", f"/templates/{snapshot}")


# ---- the run ----


def toml_str(s):
    return json.dumps(s)  # a TOML basic string (JSON escapes are TOML's)


def toml_list(values):
    return "[" + ", ".join(toml_str(v) for v in values) + "]"


def write_config(path, seeds, all_checks):
    templates = ["base", seeds["snapshot"]]
    lines = [
        f"base-url = {toml_str(API)}",
        # One at a time: the machine has 2 cores, and every create is a VM.
        "workers = 1",
        "max-redirects = 0",
        "request-timeout = 180",
        "continue-on-failure = true",
        "",
        "[auth.openapi.apiKey]",
        'api_key = "${E2B_API_KEY}"',
        "",
        "[output.sanitization]",
        # Hide the key, not nextToken (the default hides anything with
        # "token" or "key" in its name).
        'keys-to-sanitize = ["x-api-key", "authorization"]',
        'sensitive-markers = ["x-api-key"]',
        "",
        "[generation]",
        f"max-examples = {MAX_EXAMPLES}",
        'database = "none"',
        "",
        "[checks]",
        f"positive_data_acceptance.enabled = {str(all_checks).lower()}",
        f"negative_data_rejection.enabled = {str(all_checks).lower()}",
        "",
        "[dictionaries.sandboxes]",
        f"values = {toml_list(seeds['sandboxes'])}",
        "[dictionaries.templates]",
        f"values = {toml_list(templates)}",
        "[dictionaries.base]",
        'values = ["base"]',
        "",
        # Half the ids are the seeds', the rest generated.
        "[parameters]",
        '"path.id" = { dictionary = "sandboxes", probability = 0.5 }',
        '"body.templateID" = { dictionary = "templates", probability = 0.5 }',
        "",
    ]
    for regex in ("^/templates/", "^/v2/templates/"):
        lines += [
            "[[operations]]",
            f"include-path-regex = {toml_str(regex)}",
            'parameters = { "path.id" = { dictionary = "templates", probability = 0.5 }, '
            '"path.alias" = { dictionary = "base", probability = 0.5 } }',
            "",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def junit_failures(path):
    """One entry per failing case of schemathesis' JUnit report: what it
    found, how to reproduce it, and the response (shortened)."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for failure in list(case.findall("failure")) + list(case.findall("error")):
            text = failure.text or ""
            blocks = re.split(r"^\d+\. Test Case ID: ", text, flags=re.M)
            if len(blocks) == 1:
                out.append(f"{case.get('name')}: {text.strip()[:1000]}")
                continue
            for block in blocks[1:]:
                out.append(f"{case.get('name')} (case {block.split(chr(10), 1)[0].strip()}): "
                           + summarize_case(block))
    return out


def summarize_case(block):
    checks, response, repro = [], "", []
    lines = block.splitlines()[1:]
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("- "):
            details = []
            i += 1
            while i < len(lines) and not lines[i].startswith(("- ", "[")):
                if lines[i].strip():
                    details.append(lines[i].strip())
                i += 1
            checks.append(line[2:].strip() + (f" ({'; '.join(details)})" if details else ""))
            continue
        if re.match(r"^\[\d{3}\]", line):
            body = next((l.strip() for l in lines[i + 1:] if l.strip()), "")
            response = f"{line.strip()} {body[:300]}"
        elif line.startswith("Reproduce with:"):
            repro = [l.strip().replace("'X-API-KEY: [Filtered]'", '"X-API-KEY: $E2B_API_KEY"')
                     for l in lines[i + 1:] if l.strip().startswith("curl ")]
        i += 1
    return "; ".join(checks) + "".join(f"\n    {c}" for c in repro) + (f"\n    -> {response}" if response else "")


def curl(record):
    """A curl reproducing a recorded request (the key from $E2B_API_KEY)."""
    parts = ["curl", "-sS", "-X", record["method"]]
    for k, v in record["headers"].items():
        if k.lower() != "x-schemathesis-testcaseid":
            parts += ["-H", f"{k}: {v}"]
    if record["body"] is not None:
        parts += ["--data-binary", record["body"]]
    parts.append(API + record["path"])
    key = ' -H "X-API-KEY: $E2B_API_KEY"' if record["auth"] else ""
    return shlex.join(parts[:4]) + key + " " + shlex.join(parts[4:])


def bad_responses(log):
    """Our own pass over every exchange: each distinct 5xx or error body not
    in the E2B shape, with a curl that reproduces it."""
    seen, bad = set(), []
    for r in log:
        problems = []
        if r["status"] >= 500:
            problems.append(f"server error {r['status']}")
        if r["error_shape"]:
            problems.append(f"{r['status']} not in the E2B error shape: {r['error_shape']}")
        if not problems:
            continue
        key = (r["operation"], r["status"], r["error_shape"])
        if key in seen:
            continue
        seen.add(key)
        case = next((v for k, v in r["headers"].items() if k.lower() == "x-schemathesis-testcaseid"), None)
        bad.append(f"{r['operation']}{f' (case {case})' if case else ''}: {'; '.join(problems)}\n"
                   f"    {curl(r)}\n"
                   f"    -> {r['status']} {r['content_type']}: {(r['response'] or '')[:300]!r}")
    return bad


def cleanup(before, seeds, log):
    """Remove what the fuzzer made; return what could not be removed."""
    problems = []
    keep = set(seeds["sandboxes"])
    for sid in sorted(sandbox_ids() - before["sandboxes"] - keep):
        status, _, body = http("DELETE", f"/sandboxes/{sid}", timeout=180)
        if status not in (204, 404):
            problems.append(f"killing sandbox {sid}: {status} {body[:200]!r}")
    # Template builds it started: wait for them to end, then delete them.
    builds = []
    for r in log:
        if r["operation"] == "POST /v2/templates/{id}/builds/{buildID}" and r["status"] == 202:
            parts = urlsplit(r["path"]).path.split("/")
            builds.append((parts[3], parts[5]))
    for template, build in builds:
        deadline = time.time() + 300
        while time.time() < deadline:
            status, _, body = http("GET", f"/templates/{template}/builds/{build}/status")
            if status != 200 or json.loads(body).get("status") not in ("waiting", "building"):
                break
            time.sleep(1)
        http("DELETE", f"/templates/{template}")
    # Templates it registered (POST /v3/templates) but did not build: a
    # build that never started cannot be deleted (404), so this may leave
    # their rows behind.
    for r in log:
        if r["operation"] == "POST /v3/templates" and r["status"] == 202:
            name = json.loads(r["response"]).get("templateID")
            if isinstance(name, str) and name not in before["templates"]:
                http("DELETE", f"/templates/{quote(name, safe='')}")
    for snap in sorted(snapshot_ids() - before["snapshots"] - {seeds["snapshot"]}):
        status, _, body = http("DELETE", f"/templates/{snap}")
        if status not in (204, 404):
            problems.append(f"deleting snapshot {snap}: {status} {body[:200]!r}")
    for shape in sorted(base_shapes() - before["shapes"]):
        status, _, body = http("DELETE", f"/templates/{shape}")
        if status not in (204, 404):
            problems.append(f"deleting base shape {shape}: {status} {body[:200]!r}")
    left = sandbox_ids() - before["sandboxes"] - keep
    if left:
        problems.append(f"sandboxes of the fuzzer still listed: {sorted(left)}")
    return problems


def test_schema_fuzz(seeds, tmp_path):
    host = urlsplit(API).hostname
    assert host in LOOPBACK, f"the fuzzer only runs against a server on loopback, not {API}"
    st = os.path.join(VENV, "bin", "st")
    if not os.access(st, os.X_OK):
        pytest.fail(f"no schemathesis at {st}: run tests/e2e/setup.sh")
    all_checks = os.environ.get("TINE_FUZZ_ALL_CHECKS") == "1"
    config = tmp_path / "schemathesis.toml"
    write_config(config, seeds, all_checks)
    log_path = tmp_path / "exchanges.ndjson"
    out_path = tmp_path / "schemathesis.txt"
    junit = tmp_path / "junit.xml"
    env = dict(
        os.environ,
        PYTHONPATH=HERE,
        SCHEMATHESIS_HOOKS="fuzz_hooks",
        TINE_FUZZ_API=API,
        TINE_FUZZ_LOG=str(log_path),
        TINE_FUZZ_MAX_LIVE=str(MAX_LIVE),
        TINE_FUZZ_SEEDS=",".join(seeds["sandboxes"]),
        E2B_API_KEY=API_KEY,
        NO_COLOR="1",
        # No proxy, whatever the environment says: loopback only.
        NO_PROXY="*",
        no_proxy="*",
    )
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    cmd = [st, "--config-file", str(config), "run", SPEC, "--no-color",
           "--report", "junit", "--report-junit-path", str(junit)]
    # CI replays one seed (a run that must land is not a lottery); by hand
    # every run explores anew unless TINE_FUZZ_SEED is set.
    seed = os.environ.get("TINE_FUZZ_SEED") or (CI_SEED if os.environ.get("CI") else None)
    if seed:
        cmd += ["--seed", seed]

    before = state()
    # Other tests' sandboxes, snapshots and templates are not the fuzzer's
    # to touch (fuzz_hooks.py swaps them for an unknown id).
    protect = (before["sandboxes"] - set(seeds["sandboxes"])) | (before["snapshots"] - {seeds["snapshot"]}) \
        | before["shapes"] | before["templates"]
    env["TINE_FUZZ_PROTECT"] = ",".join(sorted(protect))
    started = time.monotonic()
    try:
        with open(out_path, "w") as out:
            p = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                               timeout=RUN_TIMEOUT)
        code = p.returncode
    finally:
        elapsed = time.monotonic() - started
        log = [json.loads(line) for line in open(log_path)] if log_path.exists() else []
        left = cleanup(before, seeds, log)
    output = out_path.read_text()
    tail = "\n".join(output.splitlines()[-40:])
    summary = next((l.strip() for l in output.splitlines() if " generated" in l), "?")
    stats = f"schemathesis: {len(log)} requests, {summary}, {elapsed:.0f} s; output in {out_path}"
    print(stats)

    assert code in (0, 1), f"schemathesis did not run (exit {code}):\n{tail}"
    assert log, f"schemathesis sent nothing:\n{tail}"

    bad = bad_responses(log)
    failures = junit_failures(junit) if junit.exists() else []
    report = []
    if left:
        report.append("cleanup: " + "; ".join(left))
    if bad:
        report.append(f"{len(bad)} distinct 5xx or misshapen error responses:\n" + "\n".join(bad))
    if failures:
        report.append(f"{len(failures)} schemathesis failures (full output: {out_path}):\n" + "\n".join(failures))
    if code != 0 and not failures:
        report.append(f"schemathesis exited {code}:\n{tail}")
    if report:
        pytest.fail("\n\n".join([stats] + report), pytrace=False)
