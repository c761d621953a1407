"""The API reference at `/docs`: Swagger UI over /openapi.json, its assets served from the
`swagger-ui-bundle` package by this server (no CDN: the page works with no network).

    GET /docs                  the page (our HTML; Swagger UI's own index.html loads a demo spec)
    GET /docs/assets/{name}    swagger-ui-bundle.js, swagger-ui.css, index.css, the favicons,
                               and kvserve-docs.js (the page's start)
    GET /docs/openapi-3.0.json /openapi.json as OpenAPI 3.0, which the page reads

swagger-ui-bundle ships Swagger UI 4, which renders OpenAPI 3.0 only, and FastAPI writes 3.1:
`openapi_30` rewrites the document's 3.1 spellings as 3.0's (a null member of anyOf as
`nullable`, `const` as a one-value `enum`, numeric exclusive bounds as booleans, `examples` as
`example`) and drops what 3.0 cannot say (if/then rules between fields, prefixItems). Clients and
code generators keep reading /openapi.json, the full 3.1 document.

The page is public, as the chat page (server/page.py) and /openapi.json are, under page.py's
Content-Security-Policy with one addition: `img-src data:` (swagger-ui.css draws its icons as
data: URLs). No inline script: the start is a file of its own; the validator badge (an image
from validator.swagger.io) is off.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

from fastapi import Response
from fastapi.responses import JSONResponse

from kvserve.server.openai.protocol import APIError
from kvserve.server.page import CSP, HEADERS

DOCS_CSP = CSP.replace("img-src 'self'", "img-src 'self' data:")
DOCS_HEADERS = {**HEADERS, "Content-Security-Policy": DOCS_CSP}
ASSET_PATH = "/docs/assets/"

# name -> content type of each file served from the swagger-ui-bundle package
BUNDLE_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "index.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}
START = "kvserve-docs.js"
START_JS = """window.onload = function () {
  window.ui = SwaggerUIBundle({
    url: "/docs/openapi-3.0.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout"
  });
};
"""
PAGE = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kvserve API</title>
<link rel="stylesheet" type="text/css" href="{ASSET_PATH}swagger-ui.css">
<link rel="stylesheet" type="text/css" href="{ASSET_PATH}index.css">
<link rel="icon" type="image/png" href="{ASSET_PATH}favicon-32x32.png" sizes="32x32">
<link rel="icon" type="image/png" href="{ASSET_PATH}favicon-16x16.png" sizes="16x16">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{ASSET_PATH}swagger-ui-bundle.js" charset="utf-8"></script>
<script src="{ASSET_PATH}{START}" charset="utf-8"></script>
</body>
</html>
"""


def openapi_30(doc: dict) -> dict:
    """An OpenAPI 3.1 document (FastAPI's, pydantic's JSON Schema) as OpenAPI 3.0."""
    out = _schema_30(copy.deepcopy(doc))
    out["openapi"] = "3.0.3"
    return out


def _schema_30(node):
    if isinstance(node, list):
        return [_schema_30(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _schema_30(v) for k, v in node.items()}
    for key in ("anyOf", "oneOf"):
        members = node.get(key)
        if isinstance(members, list) and {"type": "null"} in members:
            rest = [m for m in members if m != {"type": "null"}]
            node.pop(key)
            node["nullable"] = True
            if len(rest) == 1 and isinstance(rest[0], dict) and "$ref" not in rest[0]:
                node = {**rest[0], **node}
            elif rest:
                node[key] = rest
    if isinstance(node.get("type"), list):
        types = [t for t in node["type"] if t != "null"]
        node["nullable"] = node.get("nullable", False) or len(types) < len(node["type"])
        node["type"] = types[0] if types else "string"
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if isinstance(node.get("examples"), list):
        examples = node.pop("examples")
        if examples:
            node["example"] = examples[0]
    node.pop("prefixItems", None)
    if isinstance(node.get("allOf"), list):
        kept = [m for m in node["allOf"] if not (isinstance(m, dict) and "if" in m)]
        if kept:
            node["allOf"] = kept
        else:
            node.pop("allOf")
    node.pop("if", None)
    node.pop("then", None)
    return node


def bundle_dir() -> Path:
    """The installed Swagger UI's folder, or a 503 saying how to install it."""
    try:
        import swagger_ui_bundle
    except ImportError:
        raise APIError("the API reference needs the swagger-ui-bundle package: pip install swagger-ui-bundle",
                       503, type="server_error", code="docs_not_installed") from None
    return Path(swagger_ui_bundle.swagger_ui_path)


@lru_cache(maxsize=len(BUNDLE_ASSETS))
def _bundle_bytes(name: str) -> bytes:
    return (bundle_dir() / name).read_bytes()


def install(app, state) -> None:
    converted: dict[str, dict] = {}       # the 3.0 document, made once (the schema does not change)

    def respond(body, media_type: str) -> Response:
        return Response(body, media_type=media_type, headers=DOCS_HEADERS)

    @app.get("/docs", include_in_schema=False)
    async def docs():
        bundle_dir()            # a 503 now, not a page of missing scripts
        return respond(PAGE, "text/html; charset=utf-8")

    @app.get("/docs/openapi-3.0.json", include_in_schema=False)
    async def openapi_3_0():
        if "3.0" not in converted:
            converted["3.0"] = openapi_30(app.openapi())
        return JSONResponse(converted["3.0"])

    @app.get(ASSET_PATH + "{name}", include_in_schema=False)
    async def asset(name: str):
        if name == START:
            return respond(START_JS, "text/javascript; charset=utf-8")
        if name not in BUNDLE_ASSETS:
            raise APIError("Not Found", 404, code="not_found")
        return respond(_bundle_bytes(name), BUNDLE_ASSETS[name])
