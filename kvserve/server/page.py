"""The chat page at `/`: one static HTML page with its script and style (server/ui/), served
from the package with no build step and nothing from another origin.

    GET /                 ui/index.html
    GET /ui/{name}        chat.js, chat.css, icon.svg (index.html too; any other name: 404)

The page is public (no API key): it is the same bytes for everyone, and its calls to /v1 send
the key the user types in. Every response carries a Content-Security-Policy that lets the page
load and fetch only from this server, and run no inline script or style. `--no-ui` installs
nothing, so `/` is a 404.
"""
from __future__ import annotations

from importlib import resources

from fastapi import Response

from kvserve.server.openai.protocol import APIError

# name -> content type of each asset of ui/ (the page itself is served at /)
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",          # a new kvserve's page shows up on the next load
}


def load_assets() -> dict[str, bytes]:
    """The bytes of every asset, read once from the installed package."""
    folder = resources.files("kvserve.server").joinpath("ui")
    return {name: folder.joinpath(name).read_bytes() for name in ASSETS}


def install(app, state) -> None:
    if not state.ui:
        return
    assets = load_assets()

    def respond(name: str) -> Response:
        return Response(assets[name], media_type=ASSETS[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def page():
        return respond("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in assets:
            raise APIError("Not Found", 404, code="not_found")
        return respond(name)
