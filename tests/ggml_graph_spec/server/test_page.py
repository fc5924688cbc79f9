"""The chat page in a real headless browser (Debian's chromium and chromium-driver through
selenium): send a message, see the streamed think channel and answer apart, stop it; replies as
markdown, whose HTML never runs; conversations kept over a reload, edited, regenerated, copied;
images sent to a server with --mmproj; the page loads nothing from elsewhere. Skipped, with its
reason, where the browser is not installed (.ci/run installs it under CI).

The tiny models' replies are random text, which K3's template leaves in the think channel. Where a
test needs a reply of its own (markdown, HTML, the answer after the thinking), `Script` makes the
model say it: each decode's logits leave only the next token of the test's text, so the reply goes
through the server's real parser and stream. The gate decides when each step runs: no sleeps."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from gguf_arch.arch import xtml

from tests.ggml_graph_spec.vision.conftest import files
from tests.support.server import WAIT_S, LiveServer, wait_for

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="the browser test needs Debian's chromium and chromium-driver "
                                       "(apt-get install chromium chromium-driver)")
ANSWER = xtml.closing(xtml.THINK) + xtml.opening(xtml.RESPONSE)  # the think channel ends, the answer begins
IMG = '<img src=x onerror="window.__pwned=1">'
HTML = IMG + '<script>window.__pwned=1</script>[click](javascript:window.__pwned=1)'


class Script:
    """Wraps Model.decode (after the gate): while it holds tokens, each call's logits leave only
    the next one to sample, then the end of generation. A text prompt is one decode call, then
    there is one per sampled token."""

    def __init__(self, model) -> None:
        self._decode, self.tokenizer = model.decode, model.tokenizer
        model.decode = self._scripted
        self._tokens: list[int] = []

    def say(self, text: str) -> None:
        """The next reply is `text` (K3's markup in it is read as markup)."""
        self._tokens = self.tokenizer.encode(text, add_bos=False) + [self.tokenizer.eos_id]

    def _scripted(self, *args, **kwargs):
        out = self._decode(*args, **kwargs)
        if not self._tokens:
            return out
        token = self._tokens.pop(0)
        forced = {}
        for seq, logits in out.items():
            forced[seq] = np.full_like(logits, -1e9)
            forced[seq][token] = 0.0
        return forced


@pytest.fixture(scope="module")
def server(k3_tiny_gguf):
    s = LiveServer(k3_tiny_gguf, "-np", 1, "-c", 4096)
    s.script = Script(s.model)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


def _until(browser, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(condition, what)


def _css(browser, selector: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, selector)


def _fresh(browser, server) -> None:
    """The page with nothing kept in the browser (no conversations, the default settings)."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()


def _set(browser, **fields) -> None:
    for name, value in fields.items():
        field = _css(browser, "#" + name)[0]
        if isinstance(value, bool):
            if field.is_selected() != value:
                field.click()
            continue
        field.clear()
        field.send_keys(str(value))


def _send(browser, text: str) -> None:
    _css(browser, "#input")[0].send_keys(text)
    _css(browser, "#send")[0].click()


def _replies(browser, state: str = "done", n: int = 1):
    """The assistant bubbles in `state`, once there are `n` of them."""
    def ready(b):
        found = [m for m in _css(b, ".message.assistant") if m.get_attribute("data-state") == state]
        return found if len(found) >= n else None
    return _until(browser, ready, f"{n} reply(ies) {state}")


def _texts(browser) -> list[str]:
    """The messages shown: each user message's text and each reply's answer."""
    return [e.text for e in _css(browser, ".message .text, .message .answer")]


def _running_job(server):
    wait_for(lambda: server.engine._running, "the engine to start the request")
    (job,) = server.engine._running.values()
    return job


def test_send_see_the_stream_and_stop_it(server, browser):
    _fresh(browser, server)
    _set(browser, temperature=0, max_tokens=3000)
    server.gate.close()
    _send(browser, "Tell me about the lighthouse")
    server.gate.step(4)  # the prompt, then three tokens: the think channel streams in while the reply goes on
    thought = _until(browser, lambda b: "".join(e.text for e in _css(b, ".message.assistant .reasoning")) or None,
                     "streamed text in the assistant's think block")
    bubble = _css(browser, ".message.assistant")[0]
    assert bubble.get_attribute("data-state") == "streaming"
    assert _css(browser, ".thinking")[0].get_attribute("open") is not None  # open while the model thinks
    assert not _css(browser, "#send")[0].is_enabled()
    _send_enter(browser, "And now?")  # Enter during the reply: a note, and the text stays for later
    assert "still coming" in _css(browser, "#hint")[0].text
    assert _css(browser, "#input")[0].get_attribute("value") == "And now?"
    job = _running_job(server)
    _css(browser, "#stop")[0].click()
    _replies(browser, "stopped")
    wait_for(job.cancel_requested.is_set, "the server to see the stop")
    server.gate.open()
    wait_for(server.idle, "the slot to be freed")
    assert job.tokens < 3000 and thought in _css(browser, ".message.assistant .reasoning")[0].text
    assert _css(browser, "#send")[0].is_enabled() and not _css(browser, "#hint")[0].text
    _css(browser, "#input")[0].clear()


def _send_enter(browser, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    _css(browser, "#input")[0].send_keys(text + Keys.ENTER)


def test_a_second_message_streams_to_its_end_with_the_prompt_cache_noted(server, browser):
    _set(browser, max_tokens=4)
    _send(browser, "And then?")
    note = _replies(browser)[0].find_element("css selector", ".note").text
    assert note.startswith("4 tokens,") and "from the cache" in note and "(0 from the cache)" not in note


def test_markdown_renders_through_the_page_renderer(server, browser):
    _fresh(browser, server)
    html = browser.execute_script(
        "const d = document.createElement('div'); renderMarkdown(d, arguments[0]); return d.innerHTML",
        "Some **bold** and `x < y`.\n\n```python\nif a < b:\n    print('<b>')\n```\n\n- one\n- two\n\n"
        "| n | name |\n|--:|---|\n| 1 | one |")
    assert "<strong>bold</strong>" in html and "<code>x &lt; y</code>" in html and "<li>one</li>" in html
    assert '<td class="align-right">1</td>' in html and "style=" not in html  # the page's policy applies no style
    assert '<code class="language-python">if a &lt; b:\n    print(\'&lt;b&gt;\')\n</code>' in html
    unsafe = browser.execute_script(
        "const d = document.createElement('div'); renderMarkdown(d, arguments[0]);"
        "return [d.querySelectorAll('script, img, [onerror], a[href^=\"javascript\"]').length, d.textContent]", HTML)
    assert unsafe[0] == 0 and "<script>window.__pwned=1</script>" in unsafe[1] and "(javascript:" in unsafe[1]


def test_a_reply_in_markdown_end_to_end_with_thinking_off(server, browser):
    _fresh(browser, server)
    _set(browser, thinking=False, temperature=0)
    server.script.say("Here it is:\n\n```python\nprint(1 < 2)\n```\n\nand **done**.")
    _send(browser, "Write some code")
    (reply,) = _replies(browser)
    assert reply.find_element("css selector", "pre code.language-python").text == "print(1 < 2)"
    assert reply.find_element("css selector", "strong").text == "done"
    assert not reply.find_elements("css selector", ".thinking")  # thinking off: all of the reply is the answer


def test_the_thinking_block_apart_from_the_answer(server, browser):
    _fresh(browser, server)
    _set(browser, temperature=0)
    think = "Let me weigh <this> first."
    server.script.say(think + ANSWER + "The answer is *42*.")
    server.gate.close()
    _send(browser, "What is the answer?")
    server.gate.step(len(server.script.tokenizer.encode(think, add_bos=False)))
    _until(browser, lambda b: _css(b, ".reasoning") and _css(b, ".reasoning")[0].text == think, "the thinking")
    block = _css(browser, ".thinking")[0]
    assert block.get_attribute("open") is not None and "Thinking" in block.text
    assert _css(browser, ".message.assistant .answer")[0].text == ""
    server.gate.open()
    (reply,) = _replies(browser)
    assert reply.find_element("css selector", ".answer em").text == "42"
    assert reply.find_element("css selector", ".answer").text == "The answer is 42."
    assert block.get_attribute("open") is None  # collapsed once the answer began, and there to open
    block.find_element("css selector", "summary").click()
    assert block.get_attribute("open") is not None and block.find_element("css selector", ".reasoning").text == think


def test_the_reasoning_budget_and_the_thinking_switch_reach_the_server(server, browser):
    _fresh(browser, server)
    _set(browser, reasoning_budget=2, max_tokens=2)
    for thinking, start, budget in ((True, "think", 2), (False, "response", -1)):
        _set(browser, thinking=thinking)
        server.gate.close()
        _send(browser, "Think briefly")
        job = _running_job(server)
        assert job.request.reply.start == start
        assert job.request.reply.plan.budget == budget  # -1: none
        server.gate.open()
        _replies(browser, n=1 if thinking else 2)
        wait_for(server.idle, "the slot to be freed")


def test_a_reply_never_runs_the_html_it_holds(server, browser):
    _fresh(browser, server)
    _set(browser, temperature=0)
    server.script.say(IMG + ANSWER + HTML)  # in the think channel too
    _send(browser, "Say something dangerous")
    _replies(browser)
    for restored in (False, True):  # a restored conversation is rendered again, through the same path
        if restored:
            browser.refresh()
        (reply,) = _replies(browser)
        assert not reply.find_elements("css selector", "script, img, [onerror], a[href^='javascript']")
        assert "<script>window.__pwned=1</script>" in reply.find_element("css selector", ".answer").text
        assert reply.find_element("css selector", ".reasoning").get_attribute("textContent") == IMG
        assert browser.execute_script("return window.__pwned") is None


def test_regenerate_edit_and_copy(server, browser):
    _fresh(browser, server)
    _set(browser, thinking=False, temperature=0)
    server.script.say("First answer.")
    _send(browser, "A question")
    _replies(browser)
    server.script.say("Second answer.")
    _css(browser, ".message.assistant .regenerate")[0].click()
    _replies(browser)
    assert _texts(browser) == ["A question", "Second answer."]  # the reply replaced, not added
    _css(browser, ".message.user .edit")[0].click()
    edit = _css(browser, ".message.user textarea.edit")[0]
    edit.clear()
    edit.send_keys("Another question")
    server.script.say("Third answer.")
    _css(browser, ".message.user .resend")[0].click()
    _replies(browser)
    assert _texts(browser) == ["Another question", "Third answer."]  # what followed the old text is gone
    browser.execute_script("Object.defineProperty(navigator, 'clipboard', {value: {writeText: async (t) => {"
                           "window.__copied = t; }}})")
    _css(browser, ".message.assistant .actions .copy")[0].click()
    _until(browser, lambda b: b.execute_script("return window.__copied"), "the copied text")
    assert browser.execute_script("return window.__copied") == "Third answer."


def test_conversations_are_kept_over_a_reload(server, browser):
    _fresh(browser, server)
    _set(browser, thinking=False, temperature=0)
    for question, answer in (("The first conversation", "One."), ("The second conversation", "Two.")):
        _css(browser, "#new-chat")[0].click()
        server.script.say(answer)
        _send(browser, question)
        _replies(browser)
    browser.refresh()
    titles = [e.text for e in _css(browser, "#chat-list .open")]
    assert titles == ["The second conversation", "The first conversation"]
    assert _texts(browser) == ["The second conversation", "Two."]
    assert _css(browser, "#chat-list li[aria-current] .open")[0].text == "The second conversation"
    _css(browser, "#chat-list .open")[1].click()
    assert _texts(browser) == ["The first conversation", "One."]
    _css(browser, "#chat-list li[aria-current] .delete")[0].click()
    assert [e.text for e in _css(browser, "#chat-list .open")] == ["The second conversation"]
    assert not _css(browser, ".message")
    server.gate.close()  # a conversation deleted while its reply comes stays deleted
    _send(browser, "Soon deleted")
    job = _running_job(server)
    _css(browser, "#chat-list li[aria-current] .delete")[0].click()
    _until(browser, lambda b: _css(b, "#send")[0].is_enabled(), "the page to end the reply")
    server.gate.open()
    wait_for(job.cancel_requested.is_set, "the server to see the stop")
    wait_for(server.idle, "the slot to be freed")
    browser.refresh()
    assert [e.text for e in _css(browser, "#chat-list .open")] == ["The second conversation"]


def test_the_page_loads_nothing_from_elsewhere(server, browser):
    _fresh(browser, server)
    urls = [e.get_attribute("src") or e.get_attribute("href")
            for e in _css(browser, "script[src], link[href], img[src]")]
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    assert loaded and all(u.startswith(server.url + "/") for u in loaded), loaded
    assert _css(browser, "#model")[0].text == "k3-tiny.gguf"
    assert not _css(browser, "#attach")[0].is_displayed()  # no vision encoder: no image button
    for path in ("/favicon.ico", "/static/favicon.svg"):
        icon = server.http.get(path)
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml"), path


def test_an_image_is_sent_to_a_server_with_a_vision_encoder(browser, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    s = LiveServer(k31pro_tiny_gguf, "--mmproj", k31pro_tiny_mmproj, "-np", 1, "-c", 2048)
    try:
        _fresh(browser, s)
        _set(browser, max_tokens=2)
        attach = _until(browser, lambda b: _css(b, "#attach")[0].is_displayed() and _css(b, "#attach")[0],
                        "the image button (/props says the server sees images)")
        assert attach.text == "Image"
        _css(browser, "#file")[0].send_keys(str(files("img_48x32")[0]))
        _until(browser, lambda b: _css(b, "#attachments img"), "the image to be attached")
        s.gate.close()
        _send(browser, "What is in the picture?")
        job = _running_job(s)
        assert any(np.asarray(run).ndim == 2 for run in job.request.runs)  # the prompt holds the image's rows
        s.gate.open()
        _replies(browser)
        assert _css(browser, ".message.user img.image") and not _css(browser, "#attachments img")
    finally:
        s.close()
