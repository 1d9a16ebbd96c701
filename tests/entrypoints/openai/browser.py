"""Headless Debian Chromium driven through its ChromeDriver (Selenium), for the playground page tests.

`tools/setup_env.sh` installs the `chromium` and `chromium-driver` packages. Screenshots go to
`$VLLM_OMNI_TEST_ARTIFACTS` (default /tmp/vllm_omni_test_artifacts), one per test that asks for it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("VLLM_OMNI_TEST_ARTIFACTS", "/tmp/vllm_omni_test_artifacts"))


@contextlib.contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        raise RuntimeError("the browser tests need Debian's chromium and chromium-driver: run tools/setup_env.sh "
                           "as root, or `apt-get install chromium chromium-driver`")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--autoplay-policy=no-user-gesture-required", "--window-size=1100,1600"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def fill(driver: webdriver.Chrome, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def wait_for(driver: webdriver.Chrome, script: str, timeout: float = 120) -> object:
    """Until the JavaScript expression `script` is truthy; returns its value."""
    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: d.execute_script(f"return {script};"))


def screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path
