"""/docs (server/docs_page.py): Swagger UI's page and assets served by the server itself, from
the swagger-ui-bundle package, under a Content-Security-Policy that allows nothing from another
origin; and, where a headless Chromium is installed, the page rendering the served schema with
no network and no CSP violation. In process (and a live server for the browser)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.docs_page import BUNDLE_ASSETS, START, bundle_dir

from .live import STORIES_HF, LiveServer


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), "stories")) as c:
        yield c


def referenced(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]+)"', html)


def test_docs_page_loads_only_this_servers_assets(client):
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    refs = referenced(r.text)
    assert "://" not in r.text and not any(ref.startswith("//") for ref in refs)   # nothing from elsewhere
    assert set(refs) == {f"/docs/assets/{n}" for n in (*BUNDLE_ASSETS, START)}
    csp = r.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'" and directives["script-src"] == "'self'"
    assert directives["connect-src"] == "'self'" and directives["img-src"] == "'self' data:"
    assert "unsafe" not in csp and "http" not in csp
    assert "<script>" not in r.text and "style=" not in r.text        # no inline script or style


def test_assets_are_the_packages_bytes(client):
    folder = bundle_dir()
    for name, kind in BUNDLE_ASSETS.items():
        r = client.get(f"/docs/assets/{name}")
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] == kind.split(";")[0]
        assert r.content == (folder / name).read_bytes()
        assert r.headers["content-security-policy"]
    start = client.get(f"/docs/assets/{START}")
    assert start.status_code == 200 and '"/docs/openapi-3.0.json"' in start.text and "validatorUrl: null" in start.text
    assert "://" not in start.text
    for bad in ("index.html", "swagger-initializer.js", "..%2Fpage.py", "nope.js"):
        assert client.get(f"/docs/assets/{bad}").status_code == 404
    assert client.get("/openapi.json").status_code == 200


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no headless Chromium on this machine")
def test_the_page_renders_the_schema_in_a_browser_without_network(tmp_path):
    """Chromium with every other host unreachable (--host-resolver-rules): Swagger UI renders the
    served operations, and the console reports no CSP violation."""
    server = LiveServer()
    try:
        proc = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--virtual-time-budget=15000",
             "--enable-logging=stderr", "--v=0", "--dump-dom", server.base_url + "/docs"],
            capture_output=True, text=True, timeout=120)
    finally:
        assert server.stop() == 0, server.log()
    dom, log = proc.stdout, proc.stderr
    assert "/v1/chat/completions" in dom and "/completion" in dom, (dom[:2000], log[-3000:])
    assert 'class="swagger-ui' in dom
    assert "Content Security Policy" not in log and "Refused to" not in log, log[-3000:]
    assert "ERR_NAME_NOT_RESOLVED" not in log and "Failed to load resource" not in log, log[-3000:]


def test_the_page_reads_the_schema_as_openapi_3_0(client):
    """Swagger UI 4 (swagger-ui-bundle) renders 3.0 only: the page's copy says the same in 3.0."""
    full = client.get("/openapi.json").json()
    r = client.get("/docs/openapi-3.0.json")
    assert r.status_code == 200
    doc = r.json()
    assert full["openapi"].startswith("3.1") and doc["openapi"] == "3.0.3"
    assert doc["paths"].keys() == full["paths"].keys()
    assert doc["components"]["schemas"].keys() == full["components"]["schemas"].keys()
    text = json.dumps(doc)
    for spelling in ('{"type": "null"}', '"const":', '"if":', '"prefixItems"', '"type": ["'):
        assert spelling not in text, spelling
    mirostat = doc["components"]["schemas"]["LlamaCompletionRequest"]["properties"]["mirostat"]
    assert mirostat["enum"] == [0] and mirostat["type"] == "integer"
    top_p = doc["components"]["schemas"]["CompletionRequest"]["properties"]["top_p"]
    assert top_p["nullable"] is True and top_p["exclusiveMinimum"] is True and top_p["minimum"] == 0
    assert top_p["type"] == "number" and top_p["maximum"] == 1
