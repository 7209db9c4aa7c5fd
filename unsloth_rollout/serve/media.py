"""Images in chat messages: resolve ``image_url`` parts to PIL images under the server's media policy.

``data:`` URLs are always accepted. Local files (``file://`` URLs or absolute paths) only under
``allowed_local_media_path``; remote ``http(s)`` URLs only when ``allow_remote_images`` is on. Every
refusal is a 400 naming the part (``messages[0].content[1].image_url``). A part with a ``uuid`` (vLLM's
multimodal uuid) caches its image under it: a later part with that uuid and no url reuses the image.

Example::

    policy = MediaPolicy(None, allow_remote_images=False, max_images=4, max_image_pixels=1 << 24)
    messages, images = await policy.resolve_messages(messages)   # parts become {"type": "image"}
"""

from __future__ import annotations

import base64
import binascii
import collections
import copy
import os
import urllib.parse
from dataclasses import dataclass

from ..engine.config import InvalidRequestError
from ..engine.inputs import decode_image
from .protocol import APIError

IMAGE_PART_TYPES = ("image_url", "image", "input_image")
UUID_CACHE_SIZE = 64  # images kept by their request-given uuid



@dataclass
class MediaPolicy:
    """Where images may come from and how many / how large (the server's settings: ``ServerSettings``)."""

    allowed_local_media_path: str | None
    allow_remote_images: bool
    max_images: int
    max_image_pixels: int
    max_image_bytes: int = 20 << 20
    fetch_timeout_s: float = 10.0

    def __post_init__(self):
        self._by_uuid: collections.OrderedDict = collections.OrderedDict()  # uuid -> image, most recent last
        if self.allowed_local_media_path is not None:
            self.allowed_local_media_path = os.path.realpath(self.allowed_local_media_path)

    async def resolve_messages(self, messages: list[dict], accept_images: bool = True) -> tuple[list[dict], list]:
        """Copy ``messages`` with image parts replaced by ``{"type": "image"}``; return them and the images.

        ``accept_images=False`` (a text-only model): any image part is a 400.
        """
        out, images = [], []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                out.append(m)
                continue
            m = copy.copy(m)
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in IMAGE_PART_TYPES:
                    where = f"messages[{i}].content[{j}].{kind}"
                    if not accept_images:
                        raise APIError(f"{where}: this model takes no images", param=where)
                    src = part.get(kind) if kind != "input_image" else part.get("image_url")
                    if kind == "image_url" and src is not None and not isinstance(src, dict):
                        # OpenAI's and vLLM's schema: image_url is an object {"url": ...}, never a bare string.
                        raise APIError(f"{where}: must be an object {{\"url\": ...}}, got {type(src).__name__}",
                                       param=where)
                    url = src.get("url") if isinstance(src, dict) else src
                    uid = part.get("uuid")
                    if uid is not None and not isinstance(uid, str):
                        raise APIError(f"messages[{i}].content[{j}].uuid must be a string", param=where)
                    if len(images) >= self.max_images:
                        raise APIError(f"At most {self.max_images} image(s) may be given in one request.",
                                       param="messages")
                    if (url is None or url == "") and uid is not None:
                        img = self._by_uuid.get(uid)
                        if img is None:
                            raise APIError(f"{where}: no image is cached under uuid {uid!r}; send it with its url "
                                           "once first", param=where)
                        self._by_uuid.move_to_end(uid)
                        images.append(img)
                        parts.append({"type": "image"})
                        continue
                    if not isinstance(url, str) or not url:
                        raise APIError(f"{where}: expected an image URL string or {{\"url\": ...}}", param=where)
                    img = await self.load(url, where)
                    if uid is not None:  # vLLM's multimodal uuid: later requests may name the image alone
                        self._by_uuid[uid] = img
                        while len(self._by_uuid) > UUID_CACHE_SIZE:
                            self._by_uuid.popitem(last=False)
                    images.append(img)
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            m["content"] = parts
            out.append(m)
        return out, images

    async def load(self, url: str, where: str):
        """A PIL RGB image from a data URL, an allowed local file or (when enabled) an http(s) URL."""
        scheme = url.split(":", 1)[0].lower() if ":" in url[:12] else ""
        if scheme == "data":
            data = _decode_data_url(url, where)
        elif scheme in ("http", "https"):
            if not self.allow_remote_images:
                raise APIError(f"{where}: remote image URLs are disabled on this server (start it with "
                               "--allow-remote-images); send the image as a data: URL", param=where)
            data = await self._fetch(url, where)
        elif scheme == "file" or url.startswith("/"):
            data = self._read_local(url, where)
        else:
            raise APIError(f"{where}: unsupported image URL {url[:40]!r}; use a data: URL, file:// path or "
                           "http(s) URL", param=where)
        if len(data) > self.max_image_bytes:
            raise APIError(f"{where}: image of {len(data)} bytes exceeds the limit of {self.max_image_bytes}",
                           param=where)
        return self._decode(data, where)

    def _read_local(self, url: str, where: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise APIError(f"{where}: local image paths are disabled on this server (start it with "
                           "--allowed-local-media-path DIR)", param=where)
        path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file:") else url
        real = os.path.realpath(path)
        root = self.allowed_local_media_path
        if os.path.commonpath([real, root]) != root:
            raise APIError(f"{where}: {path!r} is outside the allowed media directory", param=where)
        if not os.path.isfile(real):
            raise APIError(f"{where}: no such image file {path!r}", param=where)
        with open(real, "rb") as f:
            return f.read(self.max_image_bytes + 1)

    async def _fetch(self, url: str, where: str) -> bytes:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=self.fetch_timeout_s, follow_redirects=True) as client:
                async with client.stream("GET", url) as r:
                    r.raise_for_status()
                    buf = bytearray()
                    async for chunk in r.aiter_bytes():
                        buf += chunk
                        if len(buf) > self.max_image_bytes:
                            break
                    return bytes(buf)
        except httpx.HTTPError as e:
            raise APIError(f"{where}: cannot fetch image: {type(e).__name__}: {e}", param=where) from None

    def _decode(self, data: bytes, where: str):
        try:
            return decode_image(data, where, self.max_image_pixels)
        except InvalidRequestError as e:
            raise APIError(str(e), param=where) from None


def _decode_data_url(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise APIError(f"{where}: a data URL must look like data:image/png;base64,<data>", param=where)
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{where}: invalid base64 data in the image data URL", param=where) from None
