"""OpenAPI docs at /docs with Swagger UI 5 served from the package's own files (offline; see static/swagger-ui),
and what the document says of streamed answers."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles

SWAGGER_UI = Path(__file__).parent / "static" / "swagger-ui"


# A route that always streams (documented with response_class=Response, so that its error responses stay JSON).
EVENTS = {200: {"description": "server-sent events: each event's data is a JSON object",
                "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
# A route that answers JSON, or server-sent events when the request asks to stream: both listed for its 200.
JSON_OR_EVENTS = {200: {"description": "JSON; server-sent events when the request sets `stream`",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def mount_docs(app: FastAPI) -> None:
    app.mount("/docs-static", StaticFiles(directory=SWAGGER_UI), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title="loraplex API",
            swagger_js_url="/docs-static/swagger-ui-bundle.js",
            swagger_css_url="/docs-static/swagger-ui.css",
            swagger_favicon_url="/docs-static/favicon-32x32.png",
        )
