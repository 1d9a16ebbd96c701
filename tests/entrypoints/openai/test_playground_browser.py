"""The playground page in headless Chromium against a live tiny Qwen-Image server started with `--api-key`:
the page loads without the key, lists the model once the key is typed in, and the image form yields a PNG the
browser decodes at the asked size through the public route. The video form is tested on the Wan server of
test_videos_live.py and the chat form (text and spoken reply) on the Qwen3-Omni server of
tests/models/qwen3_omni/test_serve_e2e.py, so no extra server starts for them."""

from __future__ import annotations

import httpx
import pytest
from selenium.webdriver.common.by import By

from tests.entrypoints.openai.browser import chromium, fill, screenshot, wait_for
from tests.entrypoints.openai.live_server import LiveServer

KEY = "playground-secret"


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("tiny/qwen-image", "--api-key", KEY)
    yield srv
    srv.close()


def test_image_form_through_the_public_route_with_the_api_key(server):
    assert httpx.post(server.url + "/v1/images/generations", json={"prompt": "x"}, timeout=30).status_code == 401
    with chromium() as driver:
        driver.get(server.url + "/playground")
        assert "vllm-omni playground" in driver.title
        fill(driver, "api-key", KEY)
        driver.execute_script("document.getElementById('api-key').dispatchEvent(new Event('change'));")
        wait_for(driver, "document.getElementById('model-name').textContent.includes('qwen-image')", 30)
        fill(driver, "image-prompt", "a red square")
        fill(driver, "image-size", "64x48")
        fill(driver, "image-steps", "2")
        driver.find_element(By.ID, "image-send").click()
        size = wait_for(driver, "(() => { const i = document.getElementById('image-output');"
                                " return !i.hidden && i.complete && i.naturalWidth ? [i.naturalWidth, i.naturalHeight]"
                                " : null; })()")
        screenshot(driver, "playground_image")
        assert size == [64, 48]
        assert "done in" in driver.find_element(By.ID, "image-info").text


def test_a_refused_request_shows_the_servers_message(server):
    with chromium() as driver:
        driver.get(server.url + "/playground")
        fill(driver, "api-key", KEY)
        fill(driver, "image-size", "64x")
        driver.find_element(By.ID, "image-send").click()
        message = wait_for(driver, "(() => { const i = document.getElementById('image-info');"
                                   " return i.classList.contains('error') ? i.textContent : null; })()", 30)
        assert "size" in message
