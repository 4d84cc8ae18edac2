"""The chat page: `GET /` and its files under `/ui/`, shipped in core/server/web/ and served as they are.

Plain HTML, CSS and JavaScript modules: no build step, no CDN, nothing fetched from elsewhere at run time.
The page holds no data, so it is served without the API key; every API call it makes sends the key the
user typed (kept in the browser only). A Content-Security-Policy allows scripts, styles and connections
to this origin alone, a second line of defence behind the page's escaping Markdown renderer.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.exceptions import HTTPException

WEB_DIR = Path(__file__).with_name("web")
ASSET_PREFIX = "/ui/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
# (An install without the files still starts: the page is then a 404.)
ASSETS = {p.name: CONTENT_TYPES[p.suffix] for p in sorted(WEB_DIR.glob("*")) if p.suffix in CONTENT_TYPES}
#: The paths the API key does not guard (the page and its files).
PATHS = frozenset({"/", *(ASSET_PREFIX + name for name in ASSETS)})
CSP = ("default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"no file {name!r} in the chat page")
    return Response((WEB_DIR / name).read_bytes(), media_type=ASSETS[name], headers=HEADERS)


@router.get("/")
async def index() -> Response:
    """The chat page."""
    return _file("index.html")


@router.get(ASSET_PREFIX + "{name}")
async def asset(name: str) -> Response:
    """One of the page's scripts or its style sheet."""
    return _file(name)
