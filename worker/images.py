"""Decoding one image input, bounded: bytes, format and pixel count are checked before the
pixels are decoded (the decompression-bomb guard), and every failure is ``invalid_input``."""

from __future__ import annotations

import io

from PIL import Image, ImageFile, ImageOps

from ..schemas.inputs import AnyInput, InputLimits, image_bytes
from .runner import InvalidInput

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is an error, never half an image


def decode_image(item: AnyInput, limits: InputLimits, where: str = "input") -> Image.Image:
    """The RGB image of an image input; :class:`InvalidInput` if it is missing, too big,
    of a format not allowed, corrupt or truncated."""
    data = image_bytes(item)
    if data is None:
        raise InvalidInput(f"{where}: its image key does not exist (expired, or never written)")
    if not data:
        raise InvalidInput(f"{where}: the image is empty")
    if len(data) > limits.max_image_bytes:
        raise InvalidInput(
            f"{where}: image of {len(data)} bytes > max_image_bytes {limits.max_image_bytes}"
        )
    try:
        # reads the header only; Pillow's own bomb check (DecompressionBombError) also applies
        img = Image.open(io.BytesIO(data), formats=limits.image_formats)
    except Image.DecompressionBombError as exc:
        raise InvalidInput(f"{where}: {exc}; not decoded (decompression-bomb guard)") from None
    except Exception as exc:
        raise InvalidInput(
            f"{where}: not an image in an allowed format ({', '.join(limits.image_formats)}): "
            f"{type(exc).__name__}"
        ) from None
    width, height = img.size
    if width < 1 or height < 1 or width * height > limits.max_image_pixels:
        raise InvalidInput(
            f"{where}: image of {width}x{height} pixels > max_image_pixels "
            f"{limits.max_image_pixels}; not decoded (decompression-bomb guard)"
        )
    try:
        img.load()  # the first frame of an animation
        return ImageOps.exif_transpose(img).convert("RGB")
    except Exception as exc:
        raise InvalidInput(
            f"{where}: corrupt or truncated {img.format} image: {type(exc).__name__}: {exc}"
        ) from None
