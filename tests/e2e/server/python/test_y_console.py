"""The web console (`/console`) in a real browser: Debian's chromium,
headless, driven by Selenium through chromedriver.

The browser reaches nothing but the server: every host name other than
127.0.0.1 fails to resolve (--host-resolver-rules) and Chromium's
background services are off. A screenshot of each page goes to
$TINE_E2E_ARTIFACTS (default target/e2e-artifacts/console).

Also here: the Grafana dashboard and Prometheus rules in deploy/ name only
metrics that /metrics exports, and promtool accepts the rules.
"""

import datetime
import json
import os
import re
import subprocess
import sys
import time

import pytest
from e2b import Template
from e2b.exceptions import BuildException

from conftest import API, HERE, RUN, assert_error, http, team_key

sys.path.insert(0, os.path.join(HERE, "..", ".."))
from browser import chromium, go, sign_in as open_console, wait  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
ARTIFACTS = os.environ.get("TINE_E2E_ARTIFACTS") or os.path.join(ROOT, "target", "e2e-artifacts", "console")
CONSOLE = API + "/console"


@pytest.fixture(scope="module")
def browser():
    d = chromium()
    os.makedirs(ARTIFACTS, exist_ok=True)
    yield d
    d.quit()


def shot(d, name):
    path = os.path.join(ARTIFACTS, f"{name}.png")
    d.save_screenshot(path)
    assert os.path.getsize(path) > 1000, path


def sign_in(d, key):
    open_console(d, CONSOLE, key)


def no_csp_violations(d):
    bad = [e for e in d.get_log("browser") if "Content Security Policy" in e.get("message", "")]
    assert not bad, bad


@pytest.fixture(scope="module")
def other_team_key():
    return team_key("console-other", "console-other")


def test_the_page_its_headers_and_bad_requests():
    status, headers, body = http("GET", "/console", key=None)
    assert status == 200 and b"/console/assets/console.js" in body
    csp = headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    status, headers, body = http("GET", "/console/assets/xterm.js", key=None)
    assert status == 200 and headers["content-type"].startswith("text/javascript") and len(body) > 100_000
    assert_error(http("GET", "/console/assets/nothing.js", key=None), 404)
    assert_error(http("GET", "/console/assets/../../metrics", key=None), 404)
    assert_error(http("POST", "/console", key=None), 405)
    status, headers, _ = http("TRACE", "/console", key=None)
    assert status == 405 and headers["allow"] == "GET, HEAD"
    # The page is public; what it shows needs a key, sent as a header.
    assert_error(http("GET", "/v2/sandboxes", key=None), 401)
    assert_error(http("GET", "/hosts", key="e2b_nope"), 401)
    assert_error(http("GET", "/builds", key=None), 401)
    assert_error(http("GET", "/sandboxes/inope/events"), 404)


def test_a_wrong_key_is_refused(browser):
    d = browser
    d.get(CONSOLE + "/")
    d.execute_script("sessionStorage.clear()")
    d.get(CONSOLE + "/#/")
    wait(d, lambda: d.find_elements(By.ID, "api-key"))[0].send_keys("e2b_" + "0" * 40)
    d.find_element(By.ID, "sign-in").click()
    wait(d, lambda: "not valid" in d.find_element(By.ID, "sign-in-error").text, what="the refusal")
    assert d.execute_script("return sessionStorage.getItem('tine.apiKey')") is None
    shot(d, "sign-in")


def row_state(d, sid):
    # (Read in one script: the table is redrawn every few seconds.)
    return d.execute_script(
        "const r = document.querySelector(`tr[data-sandbox='${arguments[0]}']`);"
        "return r ? r.children[1].textContent : null", sid)


def click(d, css):
    """Click what `css` finds, again if a redraw replaced it meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException
    for _ in range(10):
        try:
            d.find_element(By.CSS_SELECTOR, css).click()
            return
        except StaleElementReferenceException:
            time.sleep(0.1)
    raise AssertionError(f"{css} kept being redrawn")


def test_sandboxes_of_the_team_pause_and_kill(browser, fresh, other_team_key):
    d = browser
    tag = f"console-{RUN}"
    a = fresh(metadata={"console": tag})
    b = fresh(metadata={"console": tag})
    # Another team's sandbox with the same metadata: the filter would
    # match it if the list were not the team's.
    status, _, body = http("POST", "/sandboxes", {"templateID": "base", "metadata": {"console": tag}},
                           key=other_team_key)
    assert status == 201, body
    other = json.loads(body)["sandboxID"]
    try:
        sign_in(d, os.environ["E2B_API_KEY"])
        go(d, f"#/sandboxes?metadata=console%3D{tag}")
        wait(d, lambda: row_state(d, a.sandbox_id) == "running" and row_state(d, b.sandbox_id) == "running",
             what="both sandboxes in the table")
        assert row_state(d, other) is None
        assert other not in d.page_source
        shot(d, "sandboxes")
        click(d, f'button[data-action="pause"][data-sandbox="{a.sandbox_id}"]')
        wait(d, lambda: row_state(d, a.sandbox_id) == "paused", timeout=90, what="the paused state")
        assert json.loads(http("GET", f"/sandboxes/{a.sandbox_id}")[2])["state"] == "paused"
        click(d, f'button[data-action="resume"][data-sandbox="{a.sandbox_id}"]')
        wait(d, lambda: row_state(d, a.sandbox_id) == "running", timeout=90, what="the resumed state")
        # Fork 2: the children carry the source's metadata, so they join the table.
        click(d, f'button[data-action="fork"][data-sandbox="{a.sandbox_id}"]')
        prompt = d.switch_to.alert
        prompt.send_keys("2")
        prompt.accept()
        wait(d, lambda: d.execute_script("return document.querySelectorAll('#sandboxes tr[data-sandbox]').length") == 4,
             timeout=120, what="two fork children in the table")
        # A timeout set from the page is the sandbox's end.
        click(d, f'button[data-action="timeout"][data-sandbox="{a.sandbox_id}"]')
        prompt = d.switch_to.alert
        prompt.send_keys("1234")
        prompt.accept()
        wait(d, lambda: "timeout" in d.find_element(By.ID, "action-status").text
             and "done" in d.find_element(By.ID, "action-status").text, what="the timeout to be set")
        end = json.loads(http("GET", f"/sandboxes/{a.sandbox_id}")[2])["endAt"]
        left = datetime.datetime.fromisoformat(end.replace("Z", "+00:00")).timestamp() - time.time()
        assert 1100 < left < 1300, left
        click(d, f'button[data-action="snapshot"][data-sandbox="{a.sandbox_id}"]')
        wait(d, lambda: "snapshot" in d.find_element(By.ID, "action-status").text
             and "done" in d.find_element(By.ID, "action-status").text, timeout=90, what="the snapshot")
        snap = re.search(r"\(([^)]+)\)", d.find_element(By.ID, "action-status").text).group(1)
        assert http("DELETE", f"/templates/{snap}")[0] in (200, 204)
        click(d, f'button[data-action="kill"][data-sandbox="{b.sandbox_id}"]')
        d.switch_to.alert.accept()
        wait(d, lambda: row_state(d, b.sandbox_id) is None, timeout=60, what="the killed sandbox to leave")
        assert_error(http("GET", f"/sandboxes/{b.sandbox_id}"), 404)
        # Still there for its own team.
        assert http("GET", f"/sandboxes/{other}", key=other_team_key)[0] == 200
        no_csp_violations(d)
    finally:
        http("DELETE", f"/sandboxes/{other}", key=other_team_key)
        listed = json.loads(http("GET", f"/v2/sandboxes?metadata=console%3D{tag}&limit=100")[2])
        for x in listed:
            http("DELETE", f"/sandboxes/{x['sandboxID']}")


def screen(d):
    return d.execute_script(
        "const b = window.tineTerminal.buffer.active; const out = [];"
        "for (let i = 0; i < b.length; i++) out.push(b.getLine(i).translateToString(true));"
        "return out.join('\\n');")


def type_in(d, text):
    area = d.find_element(By.CSS_SELECTOR, "#terminal .xterm-helper-textarea")
    area.send_keys(text)


def test_a_terminal_echoes_unicode_and_follows_resizes(browser, fresh):
    d = browser
    s = fresh()
    sign_in(d, os.environ["E2B_API_KEY"])
    go(d, f"#/sandbox/{s.sandbox_id}/terminal")
    wait(d, lambda: d.find_element(By.ID, "terminal-status").text == "Connected.", what="the shell")
    wait(d, lambda: "$" in screen(d) or "#" in screen(d), what="a prompt")
    type_in(d, "echo hello-$RANDOM\n")
    wait(d, lambda: re.search(r"^hello-\d+\s*$", screen(d), re.M), what="hello-<number> on the screen")
    type_in(d, "echo \"ünï-$((6*7))-✓\"\n")
    wait(d, lambda: re.search(r"^ünï-42-✓\s*$", screen(d), re.M), what="the Unicode line")
    shot(d, "terminal")
    before = d.execute_script("return [window.tineTerminal.rows, window.tineTerminal.cols]")
    d.set_window_size(900, 640)
    wait(d, lambda: d.execute_script("return [window.tineTerminal.rows, window.tineTerminal.cols]") != before,
         what="the terminal to follow the window")
    rows, cols = d.execute_script("return [window.tineTerminal.rows, window.tineTerminal.cols]")
    time.sleep(0.5)  # (the resize reaches the guest as its own call)
    type_in(d, "clear; stty size\n")
    wait(d, lambda: re.search(rf"^{rows} {cols}\s*$", screen(d), re.M),
         what=f"stty size to say {rows} {cols}")
    d.set_window_size(1280, 900)
    no_csp_violations(d)


def test_a_sandbox_page_plots_its_cpu(browser, fresh):
    d = browser
    s = fresh()
    s.commands.run("timeout 12 sh -c 'while :; do :; done'; echo busy-done", timeout=60)
    deadline = time.time() + 60
    while len(json.loads(http("GET", f"/sandboxes/{s.sandbox_id}/metrics")[2])) < 2:
        assert time.time() < deadline, "fewer than two metric samples after a minute"
        time.sleep(1)
    sign_in(d, os.environ["E2B_API_KEY"])
    go(d, f"#/sandbox/{s.sandbox_id}")
    wait(d, lambda: len(d.find_elements(By.CSS_SELECTOR, "#plot-cpu circle.pt")) >= 2, what="two CPU points")
    heights = d.execute_script(
        "return [...document.querySelectorAll('#plot-cpu circle.pt')].map(c => +c.getAttribute('cy'))")
    assert len(set(heights)) >= 1
    assert d.find_elements(By.CSS_SELECTOR, "#plot-mem circle.pt")
    wait(d, lambda: "create" in d.find_element(By.ID, "events").text, what="the create event")
    wait(d, lambda: d.find_element(By.ID, "console-log").text not in ("", "(empty)"), what="the console log")
    assert '"allowInternetAccess": true' in d.find_element(By.ID, "network-policy").text
    shot(d, "sandbox")


def test_a_failed_build_shows_its_step_and_output(browser):
    d = browser
    name = f"e2e-console-fail-{RUN}"
    t = Template().from_template("base").run_cmd(f"echo fine-{RUN}").run_cmd("echo console-broken >&2; exit 5")
    with pytest.raises(BuildException):
        Template.build(t, name, cpu_count=1, memory_mb=256)
    sign_in(d, os.environ["E2B_API_KEY"])
    go(d, "#/templates")
    link = wait(d, lambda: d.find_elements(By.CSS_SELECTOR, f'#recent-builds a[href^="#/build/{name}/"]'),
                what="the failed build in the list")[0]
    row = link.find_element(By.XPATH, "./ancestor::tr")
    assert "error" in row.text and "exited with 5" in row.text, row.text
    shot(d, "templates")
    link.click()
    failed = wait(d, lambda: d.find_elements(By.ID, "failed-step"), what="the failing step")[0]
    assert "RUN echo console-broken" in failed.text and "console-broken" in failed.find_element(By.TAG_NAME, "pre").text
    assert "exited with 5" in d.find_element(By.ID, "build-reason").text
    assert d.find_element(By.ID, "build-state").text == "error"
    # The step before it is there and not marked.
    ok = [e for e in d.find_elements(By.CSS_SELECTOR, ".step") if f"fine-{RUN}" in e.text]
    assert ok and all("failed-step" not in e.get_attribute("class") for e in ok)
    shot(d, "build")


def test_the_hosts_page(browser):
    d = browser
    sign_in(d, os.environ["E2B_API_KEY"])
    go(d, "#/hosts")
    row = wait(d, lambda: d.find_elements(By.CSS_SELECTOR, 'tr[data-host="local"]'), what="the host")[0]
    hosts = json.loads(http("GET", "/hosts")[2])
    assert len(hosts) == 1 and hosts[0]["capacity"] > 0 and hosts[0]["up"] is True
    assert f"/ {hosts[0]['capacity']}" in row.text and "up" in row.text
    shot(d, "hosts")


# ---- deploy/: the Grafana dashboard and the Prometheus rules ----

def exported_names():
    status, _, body = http("GET", "/metrics", key=None)
    assert status == 200
    names = set()
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def named_metrics(text):
    return set(re.findall(r"\btine_[a-z0-9_]+", text))


def test_dashboards_and_alerts_name_only_exported_metrics(fresh):
    # Every series the dashboard reads exists once a create failed, one
    # succeeded and one sandbox was paused.
    assert http("POST", "/sandboxes", {"templateID": f"no-such-{RUN}"})[0] >= 400
    s = fresh()
    assert http("POST", f"/sandboxes/{s.sandbox_id}/pause")[0] == 204
    names = exported_names()
    dash = open(os.path.join(ROOT, "deploy", "grafana", "tine.json")).read()
    json.loads(dash)
    rules = open(os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")).read()
    wanted = named_metrics(dash) | named_metrics(rules)
    assert len(wanted) >= 8, wanted
    missing = sorted(n for n in wanted if n not in names)
    assert not missing, f"named in deploy/ but not in /metrics: {missing}"
    promtool = os.environ.get("TINE_PROMTOOL")
    assert promtool and os.access(promtool, os.X_OK), "TINE_PROMTOOL (tests/e2e/setup.sh unpacks it)"
    out = subprocess.run([promtool, "check", "rules", os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
