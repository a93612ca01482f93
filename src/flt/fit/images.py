"""Images for the coordinate-MLP experiments: those scikit-image ships in its wheel, and
any PNG or JPEG file.

:func:`load_image` returns ``float64`` intensities in ``[0, 1]``, ``[H, W]`` (grey) or
``[H, W, 3]`` (RGB). Needs the ``vision`` extra (``pip install "flt-attention[vision]"``: scikit-image).

Only the images stored inside the scikit-image package are offered (:data:`SHIPPED`):
they are read from the package's own data folder, so nothing is ever downloaded; some of
``skimage.data``'s other images are fetched from the internet on first use and are left out.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

#: Name -> file in ``skimage/data`` (every one ships in the scikit-image wheel).
SHIPPED: dict[str, str] = {
    "camera": "camera.png",
    "astronaut": "astronaut.png",
    "coffee": "coffee.png",
    "chelsea": "chelsea.png",
    "rocket": "rocket.jpg",
    "moon": "moon.png",
    "coins": "coins.png",
    "text": "text.png",
    "page": "page.png",
    "brick": "brick.png",
    "grass": "grass.png",
    "gravel": "gravel.png",
    "retina": "retina.jpg",
    "hubble_deep_field": "hubble_deep_field.jpg",
    "immunohistochemistry": "ihc.png",
}

MODES = ("gray", "rgb")


def _skimage() -> ModuleType:
    try:
        import skimage
        import skimage.io
    except ImportError as e:
        from flt._extras import install_hint

        raise ImportError(f"images need scikit-image: {install_hint('vision')}") from e
    return skimage


def shipped_path(name: str) -> str:
    """Path of the shipped image ``name`` inside the installed scikit-image package."""
    if name not in SHIPPED:
        raise ValueError(f"{name!r} is not a shipped image; choose one of {', '.join(SHIPPED)} or give a file path")
    skimage = _skimage()
    assert skimage.__file__ is not None, "scikit-image is a regular package, with a file"
    path = os.path.join(os.path.dirname(skimage.__file__), "data", SHIPPED[name])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"scikit-image {skimage.__version__} does not ship {SHIPPED[name]} (looked for {path})")
    return path


def read_image(path: str) -> np.ndarray:
    """The pixels of an image file as stored (``uint8``, ``uint16``, ``bool`` or float), with
    errors that name the file: missing, a folder, or not a readable image."""
    skimage = _skimage()
    if not os.path.exists(path):
        raise FileNotFoundError(f"image {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"image {path!r} is not a file")
    try:
        pixels = skimage.io.imread(path)
    except (OSError, ValueError, SyntaxError) as err:
        # imageio's message for an undecodable file suggests installing other backends,
        # which would not help: say what is wrong with the file instead.
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"image {path!r} is not a readable PNG/JPEG image ({reason})") from err
    return np.asarray(pixels)


def to_unit_range(pixels: np.ndarray, where: str) -> np.ndarray:
    """Intensities as ``float64`` in ``[0, 1]``: integers divided by their type's maximum,
    booleans as 0/1, floats checked to lie in ``[0, 1]``."""
    if pixels.dtype == bool:
        return pixels.astype(np.float64)
    if np.issubdtype(pixels.dtype, np.integer):
        if np.issubdtype(pixels.dtype, np.signedinteger) and pixels.min() < 0:
            raise ValueError(f"image {where} has negative integer pixels")
        return pixels.astype(np.float64) / np.iinfo(pixels.dtype).max
    if np.issubdtype(pixels.dtype, np.floating):
        out = pixels.astype(np.float64)
        if not np.isfinite(out).all() or out.min() < 0 or out.max() > 1:
            raise ValueError(f"image {where} has float pixels outside [0, 1]")
        return out
    raise ValueError(f"image {where} has pixels of type {pixels.dtype}, not an image type")


def load_image(source: str, *, mode: str = "gray", size: int | None = None) -> np.ndarray:
    """A shipped image by name (:data:`SHIPPED`) or a PNG/JPEG file by path.

    Args:
        source: a name in :data:`SHIPPED`, or a path.
        mode: ``"gray"`` (RGB converted to luminance) -> ``[H, W]``, or ``"rgb"`` ->
            ``[H, W, 3]`` (a grey image is refused: there is no colour to fit).
        size: resize (with anti-aliasing) to ``size x size``; ``None`` keeps the image.

    An alpha channel is dropped when every pixel is opaque; transparent pixels, two-channel
    (grey + alpha) images and stacks (animations, multi-page files) are refused.

    Returns ``float64`` intensities in ``[0, 1]``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 2):
        raise ValueError(f"size must be an integer >= 2, got {size!r}")
    path = shipped_path(source) if source in SHIPPED else source
    if source not in SHIPPED and not os.path.exists(path) and os.sep not in source and "." not in source:
        raise ValueError(f"image {source!r} is neither a shipped image ({', '.join(SHIPPED)}) nor an existing file")
    where = repr(path)
    img = to_unit_range(read_image(path), where)
    if img.ndim == 3 and img.shape[-1] == 4:
        if (img[..., 3] < 1).any():
            raise ValueError(f"image {where} has transparent pixels (an alpha channel below 1); flatten it first")
        img = img[..., :3]
    if img.ndim == 3 and img.shape[-1] == 1:
        img = img[..., 0]
    if img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[-1] != 3):
        raise ValueError(f"image {where} has shape {img.shape}: expected [H, W] (grey) or [H, W, 3] (RGB)")
    if min(img.shape[:2]) < 2:
        raise ValueError(f"image {where} is {img.shape[0]} x {img.shape[1]} pixels; need at least 2 x 2")
    if mode == "gray" and img.ndim == 3:
        from skimage.color import rgb2gray

        img = rgb2gray(img)
    elif mode == "rgb" and img.ndim == 2:
        raise ValueError(f"image {where} is grey; it has no colour to fit in mode 'rgb' (use mode 'gray')")
    if size is not None and img.shape[:2] != (size, size):
        from skimage.transform import resize

        img = resize(img, (size, size, *img.shape[2:]), anti_aliasing=True, order=1)
    return np.clip(img, 0.0, 1.0)
