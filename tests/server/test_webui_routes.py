"""The chat page's routes without a browser: `/` and `/ui/*` (served without the API key, with a CSP),
`/info` (behind the key), `--no-web-ui`, and a guard that the page's scripts never parse HTML."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from conftest import FAKE, run_server

from core.cli import build_parser
from core.engine import AsyncEngine
from core.server.app import build_app
from core.server.webui import ASSETS, WEB_DIR
from core.testing.fake import FakeBackend

KEY = "page-key"
# What would turn untrusted text into markup or code.
HTML_SINKS = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|DOMParser"
                        r"|createContextualFragment|srcdoc")


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(FakeBackend())
    yield engine
    await engine.close()


def _client(engine: AsyncEngine, **options) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, **options)), base_url="http://t")


async def test_the_page_and_its_files_are_served_with_a_content_security_policy(engine):
    async with _client(engine) as http:
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for name in re.findall(r'/ui/([\w.]+)', page.text):
            assert name in ASSETS
        for name in ASSETS:
            response = await http.get(f"/ui/{name}")
            assert response.status_code == 200 and response.content == (WEB_DIR / name).read_bytes()
        assert (await http.get("/ui/app.js")).headers["content-type"].startswith("text/javascript")
        missing = await http.get("/ui/../app.py")
        assert missing.status_code == 404
        assert (await http.get("/ui/nothing.js")).json()["error"]["message"]


async def test_with_an_api_key_the_page_is_open_and_every_api_route_needs_the_key(engine):
    async with _client(engine, api_key=KEY) as http:
        assert (await http.get("/")).status_code == 200
        assert all([(await http.get(f"/ui/{name}")).status_code == 200 for name in ASSETS])
        assert (await http.get("/info")).status_code == 401
        assert (await http.get("/v1/models")).status_code == 401
        info = await http.get("/info", headers={"Authorization": f"Bearer {KEY}"})
        assert info.status_code == 200


async def test_info_reports_the_model_the_backend_and_the_gauges(engine):
    async with _client(engine) as http:
        info = (await http.get("/info")).json()
    assert info["model"] == engine.model_name and info["max_model_len"] == engine.model_info.max_model_len
    assert info["backend"] == "FakeBackend" and info["dtype"] == engine.model_info.dtype
    assert info["vision"] is False and info["is_sleeping"] is False
    assert info["requests"] == {"running": 0, "waiting": 0, "finished": 0}
    assert info["kv_cache"]["used_blocks"] == 0 and info["kv_cache"]["total_blocks"] > 0


async def test_info_says_when_the_server_sleeps(engine):
    async with _client(engine) as http:
        await engine.sleep(1)
        assert (await http.get("/info")).json()["is_sleeping"] is True
        await engine.wakeup()
        assert (await http.get("/info")).json()["is_sleeping"] is False


async def test_no_web_ui_turns_the_page_off_but_keeps_info(engine):
    async with _client(engine, web_ui=False) as http:
        assert (await http.get("/")).status_code == 404
        assert (await http.get("/ui/app.js")).status_code == 404
        assert (await http.get("/info")).status_code == 200
    assert not build_parser().parse_args(["serve"]).no_web_ui


def test_core_serve_no_web_ui():
    with run_server(FAKE, ("--no-web-ui",)) as server:
        assert httpx.get(server.url("/")).status_code == 404
        assert httpx.get(server.url("/info")).json()["model"]


async def test_the_page_is_not_in_the_openapi_document(engine):
    async with _client(engine) as http:
        paths = (await http.get("/openapi.json")).json()["paths"]
    assert "/info" in paths and "/" not in paths and not any(p.startswith("/ui/") for p in paths)


@pytest.mark.parametrize("name", sorted(n for n in ASSETS if n.endswith(".js")))
def test_no_script_parses_html(name):
    """Every text reaches the page as text nodes (markdown.js builds elements); no script has an HTML sink."""
    assert not HTML_SINKS.findall((WEB_DIR / name).read_text(encoding="utf-8"))


def test_the_page_loads_nothing_from_elsewhere():
    for name in ASSETS:
        text = (WEB_DIR / name).read_text(encoding="utf-8")
        assert not re.findall(r"""(?:src=|href=|url\(|from\s|import\(|fetch\()\s*["']?(?:https?:)?//""", text), name
