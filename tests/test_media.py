"""Images a request sends: data: URIs, allowed local files and allowed hosts are read and decoded; everything else
(corrupt base64, a payload that is not an image, too many pixels or bytes, a path out of the allowed folder, a
scheme or host not allowed, a redirect, more images than allowed) is refused naming the request's field."""

from __future__ import annotations

import asyncio
import base64
import io
import os

import httpx
import pytest
from PIL import Image

from pagerail.cluster.frontend.media import MediaError, MediaPolicy, load_image, load_images


def png_bytes(width: int = 8, height: int = 6, color=(200, 30, 60)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def load(url: str, policy: MediaPolicy | None = None, client: httpx.AsyncClient | None = None):
    return asyncio.run(load_image(url, "messages[0].content[1]", policy or MediaPolicy(), client))


def refused(url: str, policy: MediaPolicy | None = None, client=None) -> str:
    with pytest.raises(MediaError) as error:
        load(url, policy, client)
    assert error.value.field == "messages[0].content[1]"
    return str(error.value)


def test_a_data_uri_image_is_decoded_to_rgb():
    image = load(data_uri(png_bytes(8, 6, (200, 30, 60))))
    assert image.mode == "RGB" and image.size == (8, 6) and image.getpixel((3, 3)) == (200, 30, 60)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("data:image/png;base64,@@not-base64@@", "not valid base64"),
        (data_uri(b"hello, not an image"), "not an image"),
        (data_uri(png_bytes(64, 64)[:-30]), "could not be decoded"),  # a PNG cut short
        (data_uri(png_bytes(), "text/plain"), "not an image"),
        ("data:image/png," + "abc", "must be base64"),
        ("ftp://example.com/a.png", "not 'ftp'"),
        ("/etc/passwd", "bare path"),
        ("https://example.com/a.png", "not fetched from 'example.com'"),
        ("file:///etc/hostname", "not served here"),
    ],
)
def test_bad_images_are_refused_naming_the_part(url, said):
    assert said in refused(url)


def test_the_pixel_and_byte_limits_hold():
    assert "over the limit of 100 pixels" in refused(data_uri(png_bytes(20, 20)), MediaPolicy(max_pixels=100))
    assert "over the limit of 64 bytes" in refused(data_uri(png_bytes(20, 20)), MediaPolicy(max_bytes=64))


def test_local_files_only_under_the_allowed_folder_and_never_through_a_link_out(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(5, 4))
    (outside / "secret.png").write_bytes(png_bytes(5, 4))
    os.symlink(outside / "secret.png", allowed / "link.png")
    policy = MediaPolicy(allowed_local_media_path=allowed)
    assert load(f"file://{allowed}/cat.png", policy).size == (5, 4)
    assert "outside" in refused(f"file://{allowed}/../private/secret.png", policy)
    assert "outside" in refused(f"file://{allowed}/link.png", policy)
    assert "no readable file" in refused(f"file://{allowed}/missing.png", policy)
    assert "this machine's files only" in refused(f"file://other-host{allowed}/cat.png", policy)


def test_allowed_hosts_are_fetched_without_redirects_and_within_the_byte_limit():
    image = png_bytes(7, 3)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/cat.png":
            return httpx.Response(200, content=image)
        if request.url.path == "/moved.png":
            return httpx.Response(302, headers={"location": "https://elsewhere.test/cat.png"})
        return httpx.Response(404)

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    policy = MediaPolicy(allowed_media_domains=frozenset({"Images.Test"}))
    assert load("https://images.test/cat.png", policy, client).size == (7, 3)
    assert "HTTP 302" in refused("https://images.test/moved.png", policy, client)
    assert "HTTP 404" in refused("https://images.test/none.png", policy, client)
    assert "not fetched from 'elsewhere.test'" in refused("https://elsewhere.test/cat.png", policy, client)
    small = MediaPolicy(allowed_media_domains=frozenset({"images.test"}), max_bytes=32)
    assert "over the limit of 32 bytes" in refused("https://images.test/cat.png", small, client)


def test_more_images_than_the_limit_are_refused_before_any_is_read():
    urls = [(f"messages[0].content[{n}]", data_uri(png_bytes())) for n in range(3)]
    assert len(asyncio.run(load_images(urls[:2], MediaPolicy(max_images=2)))) == 2
    with pytest.raises(MediaError) as error:
        asyncio.run(load_images(urls, MediaPolicy(max_images=2)))
    assert error.value.field == "messages[0].content[2]" and "at most 2" in str(error.value)
