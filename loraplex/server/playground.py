"""The playground page: one self-contained HTML file (inline CSS and JS, nothing fetched from elsewhere)."""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse

router = APIRouter()


@lru_cache(maxsize=1)
def page() -> str:
    return files("loraplex.server").joinpath("static/playground.html").read_text(encoding="utf-8")


@router.get("/playground", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(page())


@router.get("/", include_in_schema=False)  # POST / stays the native generate route
async def root() -> RedirectResponse:
    return RedirectResponse("/playground")
