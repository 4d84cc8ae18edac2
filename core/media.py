"""Images in requests: where they may come from, and how they are found, fetched and decoded.

1. `extract_images(messages)` finds OpenAI ``image_url`` parts and Anthropic ``image`` blocks, replaces
   each with the ``{"type": "image"}`` part that Hugging Face chat templates expect, and returns the
   sources in order.
2. `load_images(sources, policy)` fetches and decodes them under a `MediaPolicy` (safe by default: no
   remote domains, no local files, bounded bytes, pixels, count and fetch time). Every violation is an
   `InvalidRequestError` naming the field, never a server error.

What a model does with the decoded images is the vision processor's business (core.vision). PIL is
imported lazily, inside the functions that decode.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL.Image import Image

Message = Mapping[str, Any]
DOMAINS_FLAG = "--allowed-media-domains"
LOCAL_PATH_FLAG = "--allowed-local-media-path"


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be. The defaults refuse all remote domains
    and all local files; data URIs and base64 blocks are always accepted within the limits."""

    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images_per_request: int = 16
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        domains = self.allowed_media_domains
        if isinstance(domains, str) or not all(isinstance(d, str) and d.strip(".") for d in domains):
            raise InvalidRequestError(f"allowed_media_domains must be a list of domain names, got {domains!r}",
                                      param="allowed_media_domains")
        object.__setattr__(self, "allowed_media_domains", tuple(domains))
        path = self.allowed_local_media_path
        if path is not None and not os.path.isdir(path):
            raise InvalidRequestError(f"allowed_local_media_path {path!r} is not a directory",
                                      param="allowed_local_media_path")
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        if isinstance(self.fetch_timeout_s, bool) or not isinstance(self.fetch_timeout_s, (int, float)) \
                or not self.fetch_timeout_s > 0:
            raise InvalidRequestError(f"fetch_timeout_s must be a positive number, got {self.fetch_timeout_s!r}",
                                      param="fetch_timeout_s")


@dataclass(frozen=True)
class ImageSource:
    """One image reference found in a request and the request field it came from."""

    source: str | Mapping[str, Any] | Image
    field: str


def extract_images(messages: Sequence[Message]) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """Replace image parts with ``{"type": "image"}`` and return the new messages and image sources.

    Understands OpenAI ``{"type": "image_url", "image_url": {"url": ...}}`` parts, Anthropic
    ``{"type": "image", "source": {...}}`` blocks and Hugging Face ``{"type": "image", "url"|"image": ...}``.
    """
    return _replace_image_parts(messages, lambda source: {"type": "image"})


def with_loaded_images(messages: Sequence[Message], images: Sequence[Image]) -> list[dict[str, Any]]:
    """``messages`` with their image parts, in order, replaced by ``images`` (already decoded), so
    that nothing is left to fetch."""
    loaded = iter(images)
    out, sources = _replace_image_parts(messages, lambda source: {"type": "image", "image": next(loaded)})
    if len(sources) != len(images):
        raise ValueError(f"{len(images)} images for {len(sources)} image parts")
    return out


def _replace_image_parts(messages: Sequence[Message], replace: Callable[[ImageSource], dict[str, Any]],
                         ) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    out: list[dict[str, Any]] = []
    sources: list[ImageSource] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for j, part in enumerate(content):
                found = _image_part_source(part, f"messages[{i}].content[{j}]")
                if found is not None:
                    sources.append(found)
                parts.append(replace(found) if found is not None else part)
            message = {**message, "content": parts}
        out.append(dict(message))
    return out, sources


def _image_part_source(part: Any, where: str) -> ImageSource | None:
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, Mapping) else ref
        return ImageSource(_require_str(url, f"{where}.image_url.url"), f"{where}.image_url.url")
    if kind == "image" and isinstance(part.get("source"), Mapping):
        return ImageSource(part["source"], f"{where}.source")
    if kind == "image" and isinstance(part.get("url") or part.get("image"), str):
        key = "url" if part.get("url") else "image"
        return ImageSource(part[key], f"{where}.{key}")
    if kind == "image" and is_decoded_image(part.get("image")):
        return ImageSource(part["image"], f"{where}.image")
    return None


def is_decoded_image(value: Any) -> bool:
    """A decoded PIL image (only Python callers can pass one; PIL is not imported to check)."""
    return hasattr(value, "getdata") and hasattr(value, "size") and hasattr(value, "mode")


def _require_str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where} must be a non-empty string", param=where)
    return value


def load_images(sources: Sequence[ImageSource], policy: MediaPolicy) -> list[Image]:
    """Load every image of a request under `policy` (the count limit included)."""
    if len(sources) > policy.max_images_per_request:
        raise InvalidRequestError(
            f"the request has {len(sources)} images; at most {policy.max_images_per_request} are allowed",
            param="messages",
        )
    return [load_image(s.source, policy, where=s.field) for s in sources]


def load_image(source: str | Mapping[str, Any] | Image, policy: MediaPolicy, *, where: str = "image") -> Image:
    """Fetch and decode one image: an http(s) URL, a data URI, a local path or file:// URL, an already
    decoded PIL image (Python callers), or an Anthropic source block (``{"type": "base64", "media_type", "data"}`` or ``{"type": "url", "url"}``)."""
    if isinstance(source, Mapping):
        return _load_anthropic_source(source, policy, where)
    if is_decoded_image(source):
        _check_pixels(*source.size, policy, where)
        return source
    source = _require_str(source, where)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme == "data":
        return decode_image(_decode_data_uri(source, where), policy, where)
    if scheme in ("http", "https"):
        return decode_image(_fetch(source, policy, where), policy, where)
    if scheme in ("file", ""):
        return decode_image(_read_local(source, policy, where), policy, where)
    raise InvalidRequestError(f"{where}: unsupported URL scheme {scheme!r}; use http(s), data or file",
                              param=where)


def _load_anthropic_source(source: Mapping[str, Any], policy: MediaPolicy, where: str) -> Image:
    kind = source.get("type")
    if kind == "base64":
        data = _b64decode(_require_str(source.get("data"), f"{where}.data"), f"{where}.data")
        return decode_image(data, policy, f"{where}.data")
    if kind == "url":
        return load_image(_require_str(source.get("url"), f"{where}.url"), policy, where=f"{where}.url")
    raise InvalidRequestError(f"{where}.type must be 'base64' or 'url', got {kind!r}", param=f"{where}.type")


def _b64decode(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"{where} is not valid base64: {exc}", param=where) from exc


def _decode_data_uri(uri: str, where: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma or not header.lower().startswith("data:"):
        raise InvalidRequestError(f"{where} is not a valid data URI (expected data:<type>;base64,<data>)",
                                  param=where)
    if not header.lower().endswith(";base64"):
        raise InvalidRequestError(f"{where}: only base64 data URIs are supported", param=where)
    return _b64decode(payload.strip(), where)


def _fetch(url: str, policy: MediaPolicy, where: str) -> bytes:
    _check_domain(url, policy, where)
    opener = urllib.request.build_opener(_AllowListRedirects(policy, where))
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        with opener.open(url, timeout=policy.fetch_timeout_s) as response:
            chunks, size = [], 0
            while chunk := response.read(64 * 1024):
                size += len(chunk)
                _check_bytes(size, policy, where)
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunks.append(chunk)
    except InvalidRequestError:
        raise
    except (TimeoutError, urllib.error.URLError) as exc:
        if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            raise InvalidRequestError(f"{where}: fetching the image took longer than {policy.fetch_timeout_s} s",
                                      param=where) from exc
        raise InvalidRequestError(f"{where}: the image could not be fetched: {exc}", param=where) from exc
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"{where}: the image could not be fetched: {exc}", param=where) from exc
    return b"".join(chunks)


def _check_domain(url: str, policy: MediaPolicy, where: str) -> None:
    host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
    allowed = [d.lower().lstrip(".").rstrip(".") for d in policy.allowed_media_domains]
    if not any(host == d or host.endswith("." + d) for d in allowed):
        raise InvalidRequestError(
            f"{where}: fetching images from {host or url!r} is not allowed; the server allows "
            f"{', '.join(allowed) or 'no domains'} (start it with {DOMAINS_FLAG} {host or 'DOMAIN'} to allow it)",
            param=where,
        )


class _AllowListRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to an allowed domain (else the allow-list is one redirect away)."""

    def __init__(self, policy: MediaPolicy, where: str) -> None:
        self.policy, self.where = policy, where

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        _check_domain(newurl, self.policy, self.where)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _read_local(source: str, policy: MediaPolicy, where: str) -> bytes:
    if policy.allowed_local_media_path is None:
        raise InvalidRequestError(
            f"{where}: local image files are not allowed (start the server with {LOCAL_PATH_FLAG} DIR "
            "to allow files under DIR)", param=where)
    path = urllib.request.url2pathname(urllib.parse.urlsplit(source).path) if source.startswith("file:") else source
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(os.path.join(root, path))  # follows symlinks and resolves `..`
    if os.path.commonpath([root, real]) != root:
        raise InvalidRequestError(f"{where}: {path!r} is outside the allowed media directory", param=where)
    try:
        size = os.path.getsize(real)
        _check_bytes(size, policy, where)
        with open(real, "rb") as f:
            return f.read(policy.max_image_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(f"{where}: cannot read {path!r}: {exc.strerror}", param=where) from exc


def _check_bytes(size: int, policy: MediaPolicy, where: str) -> None:
    if size > policy.max_image_bytes:
        raise InvalidRequestError(
            f"{where}: the image is larger than {policy.max_image_bytes} bytes", param=where)


def _check_pixels(width: int, height: int, policy: MediaPolicy, where: str) -> None:
    if width * height > policy.max_image_pixels:
        raise InvalidRequestError(
            f"{where}: the image has {width}x{height} pixels; at most {policy.max_image_pixels} are allowed",
            param=where)


def decode_image(data: bytes, policy: MediaPolicy, where: str = "image") -> Image:
    """Decode image bytes fully, refusing oversize, decompression-bomb and truncated images."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    _check_bytes(len(data), policy, where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_pixels(*image.size, policy, where)
            image.load()
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequestError(f"{where}: the image cannot be decoded ({exc})", param=where) from exc
    return image


def image_prompt_messages(text: str, images: Any) -> list[dict[str, Any]]:
    """One user message with `images` (one image or a list: PIL images, URLs, paths) then `text`:
    what a ``(prompt, image)`` pair means to the Pipeline."""
    pictures = list(images) if isinstance(images, (list, tuple)) else [images]
    if not pictures:
        raise InvalidRequestError("a (prompt, images) pair needs at least one image", param="images")
    parts: list[dict[str, Any]] = [{"type": "image", "image": p} for p in pictures]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
