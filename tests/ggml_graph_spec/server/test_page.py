"""The chat page in a real headless browser (Debian's chromium and chromium-driver through
selenium): send a message, see the streamed text appear, stop it; the page loads nothing from
elsewhere. Skipped, with its reason, where the browser is not installed (.ci/run installs it under
CI)."""
from __future__ import annotations

import shutil

import pytest

from tests.support.server import WAIT_S, LiveServer, wait_for

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="the browser test needs Debian's chromium and chromium-driver "
                                       "(apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def server(k3_tiny_gguf):
    s = LiveServer(k3_tiny_gguf, "-np", 1, "-c", 4096)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


def _until(browser, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(condition, what)


def test_send_see_the_stream_and_stop_it(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    for name, value in (("temperature", "0"), ("max_tokens", "3000")):
        field = browser.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)
    server.gate.close()
    browser.find_element(By.ID, "input").send_keys("Tell me about the lighthouse")
    browser.find_element(By.ID, "send").click()
    server.gate.step(4)  # the prompt, then three tokens: the text streams in while the reply goes on
    reply = _until(browser, lambda b: b.find_element(By.CSS_SELECTOR, ".message.assistant .text").text or None,
                   "streamed text in the assistant's bubble")
    assert browser.find_element(By.CSS_SELECTOR, ".message.assistant").get_attribute("data-state") == "streaming"
    assert not browser.find_element(By.ID, "send").is_enabled()
    (job,) = server.engine._running.values()
    browser.find_element(By.ID, "stop").click()
    _until(browser, lambda b: b.find_element(By.CSS_SELECTOR, ".message.assistant").get_attribute("data-state")
           == "stopped", "the reply marked stopped")
    wait_for(job.cancel_requested.is_set, "the server to see the stop")
    server.gate.open()
    wait_for(server.idle, "the slot to be freed")
    assert job.tokens < 3000 and reply in browser.find_element(By.CSS_SELECTOR, ".message.assistant .text").text
    assert browser.find_element(By.ID, "send").is_enabled()


def test_a_second_message_streams_to_its_end_with_the_prompt_cache_noted(server, browser):
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, "max_tokens")
    field.clear()
    field.send_keys("4")
    browser.find_element(By.ID, "input").send_keys("And then?")
    browser.find_element(By.ID, "send").click()
    done = _until(browser, lambda b: [m for m in b.find_elements(By.CSS_SELECTOR, ".message.assistant")
                                      if m.get_attribute("data-state") == "done"] or None, "the second reply")
    note = done[0].find_element(By.CSS_SELECTOR, ".note").text
    assert note.startswith("4 tokens,") and "from the cache" in note and "(0 from the cache)" not in note


def test_the_page_loads_nothing_from_elsewhere(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    urls = [e.get_attribute("src") or e.get_attribute("href")
            for e in browser.find_elements(By.CSS_SELECTOR, "script[src], link[href], img[src]")]
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls
    assert browser.find_element(By.ID, "model").text == "k3-tiny.gguf"
