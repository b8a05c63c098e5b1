"""Schemathesis hooks for test_y_fuzz.py.

Loaded by `st run` (in $TINE_DATA_DIR/venv-fuzz, through SCHEMATHESIS_HOOKS),
not by pytest: it imports nothing of the suite. It

  - adds the check `e2b_error_shape`: every error response (4xx and 5xx)
    has the E2B body {"code": <the HTTP status>, "message": <string>};
  - records every exchange (the request as sent, the status and the start of
    the body) to $TINE_FUZZ_LOG, one JSON object a line, for the test's own
    pass over them and for the cleanup;
  - keeps at most $TINE_FUZZ_MAX_LIVE of the sandboxes the fuzzer made
    alive, killing the oldest through the API, so that a run cannot fill the
    server (or the machine) with VMs;
  - keeps it off what it did not make: a path parameter naming a sandbox,
    snapshot or template that existed before the run ($TINE_FUZZ_PROTECT:
    other tests' sandboxes, which a list response or an inferred link could
    hand it) is replaced by an unknown id;
  - drops schemathesis' "deleted resource still available" (ST301) for a
    killed sandbox's events, which are kept on purpose;
  - drops schemathesis' "created resource not found" (ST302) for a sandbox
    that is gone for a reason it cannot see: killed by DELETE
    /sandboxes/{id} (it only links that to /sandboxes/{id}/..., not to
    /v2/sandboxes/{id}/connect), by the reaper above, or given a timeout
    shorter than SHORT_LIFE.

Every request goes to $TINE_FUZZ_API, which the test sets to the suite's
server on loopback.
"""

import collections
import json
import os
import threading
from urllib.parse import urlsplit

import requests
import schemathesis

API = os.environ["TINE_FUZZ_API"].rstrip("/")
KEY = os.environ["E2B_API_KEY"]
LOG = os.environ["TINE_FUZZ_LOG"]
MAX_LIVE = int(os.environ.get("TINE_FUZZ_MAX_LIVE", "4"))
# The fixtures' sandboxes: the fuzzer may use (and kill) them, but they are
# not its own to reap.
SEEDS = set(filter(None, os.environ.get("TINE_FUZZ_SEEDS", "").split(",")))
# What existed before the run, but the seeds: never a target.
PROTECT = set(filter(None, os.environ.get("TINE_FUZZ_PROTECT", "").split(","))) - SEEDS
UNKNOWN = "fuzz-protected-0"
BODY_KEEP = 2000
# A sandbox asked to live less than this may be gone by the next step.
SHORT_LIFE = 60

_host = urlsplit(API).hostname
if _host not in ("127.0.0.1", "localhost", "::1"):
    raise RuntimeError(f"TINE_FUZZ_API must be on loopback, not {API}")

_lock = threading.Lock()
_live = collections.deque()
# Sandboxes that were killed, or may have ended by their timeout.
_gone = set()


def _text(data):
    if data is None:
        return None
    if isinstance(data, bytes):
        return data[:BODY_KEEP].decode("utf-8", "backslashreplace")
    return str(data)[:BODY_KEEP]


def _header(response, name):
    for k, v in response.headers.items():
        if k.lower() == name:
            return v[0] if isinstance(v, list) and v else v
    return None


# The operations that make sandboxes (a create returns one Sandbox).
CREATES = ("POST /v2/sandboxes", "POST /sandboxes")


def _made(case, response):
    """Ids of the sandboxes a create made: the fuzzer's own, to reap."""
    if f"{case.method.upper()} {case.path}" not in CREATES or response.status_code not in (200, 201):
        return []
    try:
        doc = json.loads(response.content)
    except ValueError:
        return []
    sid = doc.get("sandboxID") if isinstance(doc, dict) else None
    return [sid] if isinstance(sid, str) else []


def _reap(keep):
    """Kill the oldest of the fuzzer's sandboxes beyond `keep`."""
    while True:
        with _lock:
            if len(_live) <= keep:
                return
            sid = _live.popleft()
            _gone.add(sid)
        try:
            requests.delete(f"{API}/sandboxes/{sid}", headers={"X-API-KEY": KEY}, timeout=120,
                            allow_redirects=False)
        except requests.RequestException:
            pass


@schemathesis.hook
def before_call(context, case, kwargs):
    params = case.path_parameters or {}
    for name, value in params.items():
        if isinstance(value, str) and value in PROTECT:
            params[name] = UNKNOWN


@schemathesis.hook
def after_call(context, case, response):
    req = response.request
    url = urlsplit(req.url)
    record = {
        "operation": f"{case.method.upper()} {case.path}",
        "method": req.method,
        "path": url.path + (f"?{url.query}" if url.query else ""),
        "headers": {k: v for k, v in req.headers.items()
                    if k.lower() not in ("x-api-key", "authorization", "user-agent", "accept",
                                         "accept-encoding", "connection", "content-length")},
        "auth": "x-api-key" in {k.lower() for k in req.headers},
        "body": _text(req.body),
        "status": response.status_code,
        "content_type": _header(response, "content-type"),
        "response": _text(response.content),
        # What is wrong with an error's body (None: nothing, or no error).
        "error_shape": error_shape_problem(response.status_code, response.content)
        if response.status_code >= 400 else None,
    }
    with _lock:
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
        for sid in _made(case, response):
            if sid not in SEEDS and sid not in PROTECT and sid not in _live:
                _live.append(sid)
        _note_gone(case, response)
    _reap(MAX_LIVE)


def _short(body, field):
    value = body.get(field) if isinstance(body, dict) else None
    return type(value) is int and value < SHORT_LIFE


def _note_gone(case, response):
    if not 200 <= response.status_code < 300:
        return
    op = f"{case.method.upper()} {case.path}"
    sid = (case.path_parameters or {}).get("id")
    body = case.body
    if op == "DELETE /sandboxes/{id}":
        _gone.add(sid)
    elif op in ("POST /sandboxes/{id}/timeout", "POST /v2/sandboxes/{id}/connect") and _short(body, "timeout"):
        _gone.add(sid)
    elif op == "POST /sandboxes/{id}/refreshes" and _short(body, "duration"):
        _gone.add(sid)
    elif op in CREATES and _short(body, "timeout"):
        _gone.update(_made(case, response))


# A killed sandbox's lifecycle stays readable (docs/api.md): not a
# "deleted resource still available" (ST301).
KEPT_AFTER_DELETE = ("/sandboxes/{id}/events",)


@schemathesis.hook
def filter_failure(context, failure, case, response):
    code = getattr(failure, "code", None)
    if code == "ST302":
        with _lock:
            return (case.path_parameters or {}).get("id") not in _gone
    if code == "ST301" and case.path in KEPT_AFTER_DELETE:
        return False
    return True


def error_shape_problem(status, body):
    """What is wrong with an error response's body (None: nothing)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "the body is not JSON"
    if not isinstance(doc, dict):
        return "the body is not a JSON object"
    code, message = doc.get("code"), doc.get("message")
    if type(code) is not int:
        return f"`code` is {code!r}, not an integer"
    if code != status:
        return f"`code` is {code}, not the HTTP status {status}"
    if not isinstance(message, str):
        return f"`message` is {message!r}, not a string"
    return None


@schemathesis.check
def e2b_error_shape(ctx, response, case):
    """An error response has the E2B body {"code": <status>, "message": <string>}."""
    if response.status_code < 400:
        return None
    problem = error_shape_problem(response.status_code, response.content)
    if problem:
        raise AssertionError(
            f"{response.status_code} without the E2B error body: {problem}: {_text(response.content)[:300]!r}")
    return None
