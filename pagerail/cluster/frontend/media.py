"""Images a request sends, read as the server allows: `data:` URIs, files under --allowed-local-media-path, and
http(s) URLs of --allowed-media-domains hosts; each within a byte and a pixel limit, decoded off the event loop.
Every refusal is a MediaError naming the request's field, for a 400."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

# vLLM's defaults: one image per prompt unless --limit-mm-per-prompt says more.
DEFAULT_IMAGES_PER_PROMPT = 1
MAX_IMAGE_BYTES = 20 << 20
# Width × height: a 4K image is 8.3 M pixels; past this a small file could still expand to gigabytes of RGB.
MAX_IMAGE_PIXELS = 32 << 20
FETCH_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """An image the server will not take; `field` names the part of the request that sent it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how many and how large they may be."""

    # Files are read only under this folder (its real path: a link out of it is refused); None: no files.
    allowed_local_media_path: Path | None = None
    # Hosts http(s) images are fetched from, exactly as named; empty: no fetching.
    allowed_media_domains: frozenset[str] = field(default_factory=frozenset)
    max_images: int = DEFAULT_IMAGES_PER_PROMPT
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    fetch_timeout_s: float = FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            root = Path(os.path.realpath(self.allowed_local_media_path))
            if not root.is_dir():
                raise ValueError(f"allowed_local_media_path must be a folder, got {str(root)!r}")
            object.__setattr__(self, "allowed_local_media_path", root)
        object.__setattr__(self, "allowed_media_domains", frozenset(d.lower() for d in self.allowed_media_domains))
        for name in ("max_images", "max_bytes", "max_pixels"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")


async def load_images(
    urls: Sequence[tuple[str, str]], policy: MediaPolicy, client: httpx.AsyncClient | None = None
) -> list:
    """The images of one request, in order: `urls` holds (field, url) pairs, the field naming where the request
    sent each; RGB PIL images. More than `policy.max_images` is refused before any is read."""
    if len(urls) > policy.max_images:
        raise MediaError(
            f"{len(urls)} images in one request; at most {policy.max_images} are allowed (--limit-mm-per-prompt)",
            urls[policy.max_images][0],
        )
    return list(await asyncio.gather(*(load_image(url, where, policy, client) for where, url in urls)))


async def load_image(url: str, where: str, policy: MediaPolicy, client: httpx.AsyncClient | None = None):
    """One image from `url` (a data: URI, a file:// URL or an http(s) URL), as an RGB PIL image."""
    if not isinstance(url, str) or not url:
        raise MediaError("an image URL must be a non-empty string", where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_uri_bytes(url, where, policy)
    elif scheme == "file":
        data = await asyncio.to_thread(_file_bytes, url, where, policy)
    elif scheme in ("http", "https"):
        data = await _fetched_bytes(url, where, policy, client)
    else:
        raise MediaError(f"images come as data:, file: or http(s): URLs, not {scheme or 'a bare path'!r}", where)
    return await asyncio.to_thread(decode_image, data, where, policy)


def decode_image(data: bytes, where: str, policy: MediaPolicy):
    """`data` as an RGB PIL image; refused if it is not an image PIL reads, or has more than max_pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise MediaError("the payload is not an image this server reads (PNG, JPEG, WebP, GIF, ...)", where) from None
    width, height = image.size
    if width * height > policy.max_pixels:
        raise MediaError(f"the image is {width}x{height}, over the limit of {policy.max_pixels} pixels", where)
    try:
        image.load()  # the header looked like an image; a truncated or corrupt body fails here
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise MediaError(f"the image could not be decoded ({error})", where) from None


def _data_uri_bytes(url: str, where: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise MediaError("a data: URI needs a comma before its payload", where)
    parts = header.split(";")
    if parts[-1].lower() != "base64":
        raise MediaError("a data: URI image must be base64 (data:image/png;base64,...)", where)
    media_type = parts[0].lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"a data: URI of type {media_type!r} is not an image", where)
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise MediaError(f"the image is over the limit of {policy.max_bytes} bytes", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URI's payload is not valid base64", where) from None


def _file_bytes(url: str, where: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError("local files are not served here (--allowed-local-media-path is not set)", where)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file: URL names this machine's files only, not host {parts.netloc!r}", where)
    # The real path: `..` and links that lead out of the allowed folder are refused like any path outside it.
    path = Path(os.path.realpath(unquote(parts.path)))
    if not path.is_relative_to(root):
        raise MediaError("the file is outside --allowed-local-media-path", where)
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise MediaError(f"the image is over the limit of {policy.max_bytes} bytes", where)
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise MediaError("no readable file at that path", where) from None


async def _fetched_bytes(url: str, where: str, policy: MediaPolicy, client: httpx.AsyncClient | None) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in policy.allowed_media_domains:
        raise MediaError(f"images are not fetched from {host or 'that URL'!r} (--allowed-media-domains)", where)
    own = client is None
    client = client or httpx.AsyncClient()
    try:
        # No redirects: one could lead to a host the list does not allow.
        async with client.stream("GET", url, timeout=policy.fetch_timeout_s, follow_redirects=False) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching the image answered HTTP {response.status_code}", where)
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
                raise MediaError(f"the image is over the limit of {policy.max_bytes} bytes", where)
            chunks, total = [], 0
            async for chunk in response.aiter_bytes():
                total += len(chunk)
                if total > policy.max_bytes:
                    raise MediaError(f"the image is over the limit of {policy.max_bytes} bytes", where)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.TimeoutException:
        raise MediaError(f"fetching the image took over {policy.fetch_timeout_s:g}s", where) from None
    except httpx.HTTPError as error:
        raise MediaError(f"the image could not be fetched ({type(error).__name__})", where) from None
    finally:
        if own:
            await client.aclose()
