"""A headless browser for the console tests: Debian's chromium, driven by
Selenium through Debian's chromedriver (tests/e2e/setup.sh installs both).

The browser reaches nothing but loopback: every host name other than
127.0.0.1 fails to resolve (--host-resolver-rules), Chromium's background
services are off, and Selenium is told not to look for a driver online.
"""

import os

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By  # noqa: F401 (for the tests)
from selenium.webdriver.support.ui import WebDriverWait

FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--window-size=1280,900", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--disable-features=Translate,OptimizationHints,MediaRouter",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)


def chromium():
    os.environ["SE_OFFLINE"] = "true"
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in FLAGS:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    d.set_page_load_timeout(30)
    return d


def wait(d, cond, timeout=30, what="the page"):
    return WebDriverWait(d, timeout, poll_frequency=0.2).until(lambda _: cond(), f"waiting for {what}")


def sign_in(d, console_url, key):
    """Open the console at `console_url` with a fresh tab state and sign in."""
    d.get(console_url + "/")
    d.execute_script("sessionStorage.clear()")
    d.get(console_url + "/#/")
    box = wait(d, lambda: d.find_elements(By.ID, "api-key"), what="the sign-in form")[0]
    box.send_keys(key)
    d.find_element(By.ID, "sign-in").click()
    wait(d, lambda: d.find_elements(By.ID, "sandboxes"), what="the sandbox table")


def go(d, hash_):
    d.execute_script("location.hash = arguments[0]", hash_)
