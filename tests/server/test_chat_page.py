"""The chat page at `/` (kvserve/server/page.py, kvserve/server/ui/): served without a key, with
its content types and a self-only Content-Security-Policy; and in a real browser -- Debian's
chromium driven by Playwright -- against a live server with --api-key: a 401 shows in the
page until the key is set, answers stream and equal the API's greedy answer turn by turn (the
whole history is sent), TTFT and tok/s are shown, Stop aborts the request on the server, and
--no-ui serves no page.

Browser tests skip when playwright or /usr/bin/chromium is missing, and fail instead with
KVSERVE_REQUIRE_BROWSER=1 (CI). Screenshots go to the test's tmp_path and, when set, to
$KVSERVE_TEST_ARTIFACTS.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, long_stories

CHROMIUM = "/usr/bin/chromium"
KEY = "page-test-key"
ASSETS = {"/": "text/html", "/ui/chat.js": "text/javascript", "/ui/chat.css": "text/css",
          "/ui/icon.svg": "image/svg+xml"}
STATS = re.compile(r"^TTFT \d+ ms · \d+\.\d tok/s · \d+ tokens · finish (length|stop)$")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # stories260K with room for 4,000 tokens (tests/server/live.py): the stop test's answer runs
    # for seconds, so the click never races its end. Same weights, same name, same answers.
    model = long_stories(tmp_path_factory.mktemp("long") / "stories260K-hf")
    srv = LiveServer("--api-key", KEY, model=model)
    yield srv
    srv.stop()


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; the browser is Debian's chromium)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no chromium at {CHROMIUM} (apt-get install chromium)"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get("KVSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"KVSERVE_REQUIRE_BROWSER=1, but {missing}")
        pytest.skip(f"the chat page's browser tests need a browser: {missing}")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        yield b
        b.close()


def expect(locator):
    """Playwright's web-first assertion (it waits without evaluating script text in the page,
    which the page's CSP forbids)."""
    from playwright.sync_api import expect as playwright_expect
    return playwright_expect(locator)


def api_answer(server, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(server.base_url + "/v1/chat/completions", trust_env=False, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "stories260K-hf", "messages": messages, "temperature": 0,
                         "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


class Page:
    """One browser tab on the chat page, with the actions of a user."""

    def __init__(self, browser, server, key: str | None = None):
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.console: list[str] = []
        self.page.on("console", lambda m: self.console.append(m.text))
        self.page.goto(server.base_url + "/")
        self.page.click("summary")                         # open the settings
        if key is not None:
            self.set_key(key)

    def set_key(self, key: str) -> None:
        self.page.fill("#api-key", key)
        self.page.press("#api-key", "Tab")                 # 'change': stored, models reloaded

    def settings(self, system: str = "", temperature: str = "0", max_tokens: str = "24") -> None:
        self.page.fill("#system", system)
        self.page.fill("#temperature", temperature)
        self.page.fill("#max-tokens", max_tokens)

    def send(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def answer(self, i: int) -> tuple[str, str]:
        """The i-th answer's text and stats line, once it has finished."""
        msg = self.page.locator(".message.assistant").nth(i)
        self.page.wait_for_function("m => !m.classList.contains('streaming') && "
                                    "m.querySelector('.stats').textContent !== ''", arg=msg.element_handle())
        return msg.locator(".content").text_content(), msg.locator(".stats").text_content()

    def screenshot(self, tmp_path: Path, name: str) -> None:
        path = tmp_path / name
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        if os.environ.get("KVSERVE_TEST_ARTIFACTS"):
            folder = Path(os.environ["KVSERVE_TEST_ARTIFACTS"])
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, folder / name)
            print(f"screenshot: {folder / name}")

    def close(self) -> None:
        assert not [m for m in self.console if "Content Security Policy" in m], self.console
        self.context.close()


def test_the_page_is_public_with_its_content_types_and_a_self_only_csp(server):
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=10) as c:
        assert c.get("/v1/models").status_code == 401           # the API needs the key ...
        for path, ctype in ASSETS.items():                      # ... the page does not
            r = c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(ctype), (path, r.headers)
            csp = r.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
            assert r.headers["x-content-type-options"] == "nosniff"
        html = c.get("/").text
        refs = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert sorted(refs) == ["/ui/chat.css", "/ui/chat.js", "/ui/icon.svg"]   # nothing external
        js = c.get("/ui/chat.js").text
        assert "innerHTML" not in js and "://" not in js
        missing = c.get("/ui/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        assert c.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"].get("/") is None


def test_a_401_shows_in_the_page_until_the_key_is_set(browser, server, tmp_path):
    p = Page(browser, server)
    try:
        alert = p.page.locator("#alert")
        alert.wait_for(state="visible")
        assert "401" in alert.text_content() and "API key" in alert.text_content()
        p.set_key("wrong-key")
        expect(p.page.locator("#model")).to_have_text("no model")
        assert "401" in alert.text_content()
        p.send("<b>Once</b> upon a time")                  # refused: no turn, the text kept
        p.page.wait_for_timeout(300)
        assert p.page.locator(".message").count() == 0 and "401" in alert.text_content()
        assert p.page.input_value("#input") == "<b>Once</b> upon a time"
        p.screenshot(tmp_path, "chat-page-401.png")
        p.set_key(KEY)
        expect(p.page.locator("#model")).to_have_text("stories260K-hf")
        assert alert.is_hidden()
        p.settings()
        p.send(p.page.input_value("#input"))
        text, stats = p.answer(0)
        assert STATS.match(stats), stats
        user = p.page.locator(".message.user .content")
        assert user.text_content() == "<b>Once</b> upon a time"       # text, never markup
        assert p.page.locator(".message b").count() == 0
        assert text == api_answer(server, [{"role": "user", "content": "<b>Once</b> upon a time"}], 24)
        # the key is kept in this browser: a reload needs no typing
        p.page.reload()
        expect(p.page.locator("#model")).to_have_text("stories260K-hf")
        assert p.page.input_value("#api-key") == KEY and p.page.locator("#alert").is_hidden()
    finally:
        p.close()


def test_answers_stream_and_equal_the_api_turn_by_turn(browser, server, tmp_path):
    p = Page(browser, server, key=KEY)
    try:
        system = {"role": "system", "content": "You tell short stories."}
        p.settings(system=system["content"])
        history = [system]
        for i, line in enumerate(["Once upon a time", "The cat"]):
            p.send(line)
            text, stats = p.answer(i)
            history.append({"role": "user", "content": line})
            assert text and text == api_answer(server, history, 24)   # the whole history was sent
            assert STATS.match(stats), stats
            history.append({"role": "assistant", "content": text})
        p.screenshot(tmp_path, "chat-page.png")
        p.page.click("#new-chat")
        assert p.page.locator(".message").count() == 0
        p.send("Once upon a time")
        assert p.answer(0)[0] == history[2]["content"]               # a fresh conversation
    finally:
        p.close()


def abort_count(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("kvserve:request_success_total{")
               and 'finished_reason="abort"' in k)


def test_stop_aborts_the_answer_on_the_server(browser, server, tmp_path):
    p = Page(browser, server, key=KEY)
    try:
        p.settings(max_tokens="4000")      # ~5 s of generation, stopped at its first delta
        server.wait_idle()
        before = abort_count(server.metrics())
        # Stop is clicked by the page itself the moment the first text is rendered (a mutation
        # observer runs before the next chunk is read), so the stop never races the answer.
        p.page.evaluate("""() => {
            const obs = new MutationObserver(() => {
                const c = document.querySelector('.message.assistant.streaming .content');
                if (c && c.textContent) { obs.disconnect(); document.getElementById('stop').click(); }
            });
            obs.observe(document.getElementById('messages'),
                        {subtree: true, childList: true, characterData: true});
        }""")
        p.send("Once upon a time")
        shown, stats = p.answer(0)
        assert stats.startswith("TTFT ") and stats.endswith("· stopped"), stats
        server.wait_for("the stopped request counted as aborted",
                        lambda m: abort_count(m) == before + 1, timeout=10)
        server.wait_idle()
        # the answer the page asked for (4,000 tokens); the page shows a prefix of it, well under a
        # quarter (a browser slow to act on the click still shows a few hundred tokens at most)
        full = api_answer(server, [{"role": "user", "content": "Once upon a time"}], 4000)
        assert shown and full.startswith(shown) and len(shown) < len(full) // 4, (shown, len(full))
        assert p.page.is_enabled("#send") and p.page.is_disabled("#stop")
        p.screenshot(tmp_path, "chat-page-stopped.png")
    finally:
        p.close()


def test_no_ui_serves_no_page():
    srv = LiveServer("--no-ui")
    try:
        with httpx.Client(base_url=srv.base_url, trust_env=False, timeout=10) as c:
            assert c.get("/v1/models").status_code == 200
            for path in ASSETS:
                r = c.get(path)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    finally:
        assert srv.stop() == 0
