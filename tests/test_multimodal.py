"""Media intake (limits, allow-lists, bad data) and the multimodal helpers of the core.

No test reaches the network: URL rejections happen before any connection, and the allowed-domain tests
fetch from a local http.server on 127.0.0.1.
"""

from __future__ import annotations

import base64
import http.server
import io
import os
import subprocess
import sys
import threading
import time

import pytest

from core.errors import InvalidRequestError
from core.media import ImageSource, MediaPolicy, extract_images, load_image, load_images
from core.testing.vision import decode_position, prepare_chat
from core.vision import MultiModalInputs, PlaceholderRange, VisionProcessor, image_hash

Image = pytest.importorskip("PIL.Image")


def _png(size=(8, 6), color=(200, 10, 10), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _rejects(source, policy: MediaPolicy | None = None, match: str = "") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        load_image(source, policy or MediaPolicy(), where="messages[0].content[0].image_url.url")
    assert info.value.param == "messages[0].content[0].image_url.url"
    assert info.value.http_status == 400
    return info.value


def test_import_is_torch_and_pil_free():
    code = "import sys, core.media, core.vision; assert not {'torch', 'PIL'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- data URIs, base64 and decoding -----------------------------------------------------------------


def test_data_uri_loads():
    image = load_image(_data_uri(_png()), MediaPolicy())
    assert image.size == (8, 6) and image.getpixel((0, 0)) == (200, 10, 10)


@pytest.mark.parametrize("uri, match", [
    ("data:image/png;base64,@@not-base64@@", "not valid base64"),
    ("data:image/png,rawbytes", "only base64"),
    ("data:image/png;base64", "not a valid data URI"),
])
def test_invalid_data_uri(uri, match):
    _rejects(uri, match=match)


def test_not_an_image():
    _rejects(_data_uri(b"hello, world"), match="cannot be decoded")


def test_truncated_image():
    noisy = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    buffer = io.BytesIO()
    noisy.save(buffer, format="PNG")
    data = buffer.getvalue()
    _rejects(_data_uri(data[: len(data) // 2]), match="cannot be decoded")


def test_byte_limit():
    _rejects(_data_uri(_png(size=(64, 64))), MediaPolicy(max_image_bytes=50), match="larger than 50 bytes")


def test_pixel_limit_stops_decompression_bombs():
    bomb = _png(size=(3000, 3000), color=(0, 0, 0))  # a few KiB that decode to 27 MB
    assert len(bomb) < 100_000
    _rejects(_data_uri(bomb), MediaPolicy(max_image_pixels=1_000_000), match="3000x3000 pixels")


def test_images_per_request_limit():
    sources = [ImageSource(_data_uri(_png()), f"messages[0].content[{i}]") for i in range(3)]
    assert len(load_images(sources, MediaPolicy(max_images_per_request=3))) == 3
    with pytest.raises(InvalidRequestError, match="3 images; at most 2"):
        load_images(sources, MediaPolicy(max_images_per_request=2))


def test_anthropic_blocks():
    block = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(_png()).decode()}
    assert load_image(block, MediaPolicy()).size == (8, 6)
    with pytest.raises(InvalidRequestError, match="not valid base64") as info:
        load_image({"type": "base64", "data": "@@"}, MediaPolicy(), where="messages[0].content[0].source")
    assert info.value.param == "messages[0].content[0].source.data"
    with pytest.raises(InvalidRequestError, match="allowed-media-domains"):
        load_image({"type": "url", "url": "https://example.com/cat.png"}, MediaPolicy())
    with pytest.raises(InvalidRequestError, match="'base64' or 'url'"):
        load_image({"type": "file", "file_id": "x"}, MediaPolicy())


def test_unsupported_scheme():
    _rejects("ftp://example.com/cat.png", match="unsupported URL scheme 'ftp'")


# -- remote URLs ------------------------------------------------------------------------------------


def test_remote_urls_refused_by_default():
    error = _rejects("https://example.com/cat.png", match="allowed-media-domains example.com")
    assert "no domains" in error.message


@pytest.mark.parametrize("url", ["https://evil.com/x.png", "https://notexample.com/x.png",
                                 "https://example.com.evil.com/x.png", "http://user@evil.com/x.png"])
def test_domain_allow_list(url):
    _rejects(url, MediaPolicy(allowed_media_domains=("example.com",)), match="is not allowed")


class _Handler(http.server.BaseHTTPRequestHandler):
    body = _png()

    def do_GET(self):  # noqa: N802 (the http.server API)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://evil.invalid/cat.png")
            self.end_headers()
            return
        if self.path == "/slow":
            time.sleep(1.0)
        body = self.body * 100 if self.path == "/big" else self.body
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


ALLOW_LOCALHOST = MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=5.0)


def test_allowed_domain_is_fetched(server):
    assert load_image(f"{server}/cat.png", ALLOW_LOCALHOST).size == (8, 6)


def test_redirect_to_a_disallowed_domain_is_refused(server):
    _rejects(f"{server}/redirect", ALLOW_LOCALHOST, match="'evil.invalid' is not allowed")


def test_fetch_byte_limit(server):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=len(_Handler.body) * 10)
    _rejects(f"{server}/big", policy, match="larger than")


def test_fetch_timeout(server):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=0.2)
    started = time.monotonic()
    _rejects(f"{server}/slow", policy, match="longer than 0.2 s")
    assert time.monotonic() - started < 1.0


# -- local files ------------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png(color=(0, 0, 0)))
    return root


def test_local_files_refused_by_default(media_dir):
    _rejects(str(media_dir / "cat.png"), match="allowed-local-media-path")


def test_local_file_under_the_allowed_path(media_dir):
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    assert load_image(str(media_dir / "cat.png"), policy).size == (8, 6)
    assert load_image((media_dir / "cat.png").as_uri(), policy).size == (8, 6)
    assert load_image("cat.png", policy).size == (8, 6)  # relative to the allowed directory


@pytest.mark.parametrize("path", ["../secret.png", "sub/../../secret.png", "{root}/../secret.png", "/etc/passwd"])
def test_dot_dot_escapes(media_dir, path):
    (media_dir / "sub").mkdir(exist_ok=True)
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    _rejects(path.format(root=media_dir), policy, match="outside the allowed media directory")


def test_symlink_escape(media_dir):
    (media_dir / "link.png").symlink_to(media_dir.parent / "secret.png")
    (media_dir / "linkdir").symlink_to(media_dir.parent)
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    _rejects(str(media_dir / "link.png"), policy, match="outside")
    _rejects(str(media_dir / "linkdir" / "secret.png"), policy, match="outside")


def test_missing_and_oversize_local_files(media_dir):
    _rejects("nope.png", MediaPolicy(allowed_local_media_path=str(media_dir)), match="cannot read")
    policy = MediaPolicy(allowed_local_media_path=str(media_dir), max_image_bytes=10)
    _rejects("cat.png", policy, match="larger than 10 bytes")


# -- messages, hashes and helpers -------------------------------------------------------------------


def test_extract_images_from_openai_and_anthropic_messages():
    uri = _data_uri(_png())
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": uri}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"}},
        ]},
    ]
    rendered, sources = extract_images(messages)
    assert rendered[0] == messages[0]
    assert rendered[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}]
    assert [s.field for s in sources] == ["messages[1].content[1].image_url.url", "messages[1].content[2].source"]
    assert sources[0].source == uri
    assert messages[1]["content"][1]["type"] == "image_url"  # the request itself is not modified


def test_extract_images_requires_a_url():
    with pytest.raises(InvalidRequestError) as info:
        extract_images([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert info.value.param == "messages[0].content[0].image_url.url"


def test_image_hash_follows_pixels_not_files():
    a = load_image(_data_uri(_png()), MediaPolicy())
    buffer = io.BytesIO()
    a.save(buffer, format="BMP")
    same = load_image(_data_uri(buffer.getvalue(), "image/bmp"), MediaPolicy())
    different = load_image(_data_uri(_png(color=(200, 10, 11))), MediaPolicy())
    assert image_hash(a) == image_hash(same) != image_hash(different)
    assert image_hash(a) != image_hash(a.convert("RGBA"))


class _RecordingProcessor(VisionProcessor):
    def preprocess(self, prompt, images):
        self.seen = (prompt, images)
        return MultiModalInputs([5, 9, 9, 6], image_token_id=9, placeholder_ranges=[PlaceholderRange(1, 2)],
                                image_hashes=[image_hash(i) for i in images])

    def encode(self, inputs):
        import torch

        return [torch.ones(2, 3)]


def test_prepare_chat_and_merge():
    torch = pytest.importorskip("torch")
    from core.testing.vision import merge_image_embeddings

    processor = _RecordingProcessor()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(_png())}}]}]
    inputs = prepare_chat(processor, messages, MediaPolicy())
    assert processor.seen[0][0]["content"] == [{"type": "image"}]
    assert inputs.embedding_positions(0) == [1, 2]
    merged = merge_image_embeddings(torch.zeros(4, 3), inputs, processor.encode(inputs))
    assert merged.sum(dim=1).tolist() == [0.0, 3.0, 3.0, 0.0]
    assert decode_position(inputs, 4) == 4


def test_engine_loads_media_off_the_event_loop(server):
    """A slow image URL keeps only its own request waiting: the event loop runs on meanwhile, and the
    images come back decoded, in place of their parts, so that generate fetches nothing."""
    import asyncio

    from core.engine import AsyncEngine
    from core.media import extract_images, is_decoded_image
    from core.testing.fake import FakeBackend

    engine = AsyncEngine(FakeBackend(), vision=_RecordingProcessor(), media_policy=ALLOW_LOCALHOST)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{server}/slow"}},
                                             {"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": _data_uri(_png())}}]}]

    async def load_while_ticking():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            return await engine.load_media(messages), ticks
        finally:
            ticker.cancel()
            await engine.close()

    loaded, ticks = asyncio.run(load_while_ticking())
    assert ticks >= 5  # /slow answers after 1 s; a blocked event loop would not have ticked at all
    first, text, second = loaded[0]["content"]
    assert first["type"] == second["type"] == "image" and first["image"].size == second["image"].size == (8, 6)
    assert text == {"type": "text", "text": "hi"}
    assert messages[0]["content"][0]["type"] == "image_url"  # the caller's messages are left as they were
    assert all(is_decoded_image(s.source) for s in extract_images(loaded)[1])


def test_engine_load_media_errors_name_the_field():
    import asyncio

    from core.engine import AsyncEngine
    from core.testing.fake import FakeBackend

    engine = AsyncEngine(FakeBackend(), vision=_RecordingProcessor())
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": "http://far.example/x.png"}}]}]

    async def load(inputs):
        try:
            return await engine.load_media(inputs)
        finally:
            await engine.close()

    with pytest.raises(InvalidRequestError, match="--allowed-media-domains") as caught:
        asyncio.run(load(messages))
    assert caught.value.param == "messages[0].content[1].image_url.url"
    assert asyncio.run(load("a prompt")) == "a prompt"
