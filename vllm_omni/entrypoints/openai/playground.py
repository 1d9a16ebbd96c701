"""`GET /playground`: one static page that drives the server's public routes from a browser.

The page holds no server state and gets no special access: it calls `/v1/models`, `/v1/chat/completions`,
`/v1/images/generations`, `/v1/videos` and `WS /v1/realtime/video` exactly as any client would (with the API
key the user types in, when the server has one). `--disable-playground` leaves the route out.
"""

from __future__ import annotations

import functools
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@functools.cache
def _page() -> str:
    return files("vllm_omni.entrypoints.openai").joinpath("static/playground.html").read_text(encoding="utf-8")


@router.get("/playground", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(_page())
