"""Images for the ViT-style classifier: bundled digits, CIFAR-10 batches, image folders.

Every loader returns :class:`ImageSplits` whose images are float32 ``[N, C, H, W]``,
scaled to ``[0, 1]`` and then standardised per channel with the *training* split's mean
and standard deviation (stored on the result, so test data can be treated the same way),
and whose labels are int64 ``[N]`` in ``[0, num_classes)``.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import IO, Any, NoReturn

import numpy as np
import torch

from ._files import check_file_memory, one_line, open_regular, read_regular, regular_files
from ._split import carve_test, split_indices
from .errors import DataError, require_dir

CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_META = "batches.meta"
_CIFAR_PIXELS = 3 * 32 * 32

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class ImageData:
    """In-memory images ``[N, C, H, W]`` float32 and labels ``[N]`` int64."""

    images: torch.Tensor
    labels: torch.Tensor
    class_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"images must be [N, C, H, W] and labels [N], got {tuple(self.images.shape)} and {tuple(self.labels.shape)}"
            )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image [C, H, W], label [])``."""
        return self.images[i], self.labels[i]


@dataclass(frozen=True)
class ImageSplits:
    """Train, validation and (when asked for) test :class:`ImageData`, all standardised by
    the training split's per-channel ``mean``/``std`` ``[C]``."""

    train: ImageData
    valid: ImageData
    mean: torch.Tensor
    std: torch.Tensor
    test: ImageData | None = None


def _standardize(train: np.ndarray, *others: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Per-channel standardisation of ``[N, C, H, W]`` arrays in ``[0, 1]`` by train statistics:
    ``(train, *others, mean, std)``."""
    mean = np.empty(train.shape[1], dtype=np.float64)
    std = np.empty(train.shape[1], dtype=np.float64)
    # One channel at a time with float64 accumulators: sums over millions of pixels lose
    # digits in float32, and a whole-array float64 copy of CIFAR would need 1.2 GB.
    for c in range(train.shape[1]):
        xc = train[:, c]
        mean[c] = xc.mean(dtype=np.float64)
        std[c] = np.sqrt(np.square(xc - xc.dtype.type(mean[c])).mean(dtype=np.float64))
    # A constant channel (std 0) is only centred, not divided by zero.
    std = np.where(std > 0, std, 1.0)
    m = mean.astype(np.float32).reshape(1, -1, 1, 1)
    s = std.astype(np.float32).reshape(1, -1, 1, 1)

    def apply(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x.astype(np.float32, copy=False) - m) / s).astype(np.float32, copy=False))

    return (apply(train), *(apply(x) for x in others), torch.from_numpy(mean.astype(np.float32)),
            torch.from_numpy(std.astype(np.float32)))


def _make_splits(train_x: np.ndarray, train_y: np.ndarray, valid_x: np.ndarray, valid_y: np.ndarray, class_names: Sequence[str],
                 test_fraction: float = 0.0, seed: int = 0) -> ImageSplits:
    """Standardised splits; ``test_fraction > 0`` first carves a test set of that fraction of
    all images from the training images (:func:`carve_test`), so validation is untouched."""
    names = tuple(class_names)
    if not test_fraction:
        tx, vx, mean, std = _standardize(train_x, valid_x)
        return ImageSplits(
            train=ImageData(tx, torch.as_tensor(train_y, dtype=torch.int64), names),
            valid=ImageData(vx, torch.as_tensor(valid_y, dtype=torch.int64), names),
            mean=mean,
            std=std,
        )
    tr, te = carve_test(np.arange(len(train_y)), len(train_y) + len(valid_y), test_fraction, seed)
    tx, vx, ex, mean, std = _standardize(train_x[tr], valid_x, train_x[te])
    return ImageSplits(
        train=ImageData(tx, torch.as_tensor(train_y[tr], dtype=torch.int64), names),
        valid=ImageData(vx, torch.as_tensor(valid_y, dtype=torch.int64), names),
        mean=mean,
        std=std,
        test=ImageData(ex, torch.as_tensor(train_y[te], dtype=torch.int64), names),
    )


def load_digits(*, valid_fraction: float = 0.2, seed: int = 0, test_fraction: float = 0.0) -> ImageSplits:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes; no download).

    Images ``[N, 1, 8, 8]``: the 0..16 grey levels divided by 16, then standardised.
    The split is a seeded permutation (:func:`split_indices`): 1438 train / 359 valid by default;
    ``test_fraction`` carves a test set from the training images (:func:`_make_splits`).
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        from flt._extras import install_hint

        raise ImportError(f"load_digits needs scikit-learn: {install_hint('train')}") from e
    bunch = sk_load_digits()
    x = (np.asarray(bunch.images, dtype=np.float64) / 16.0)[:, None]
    y = np.asarray(bunch.target, dtype=np.int64)
    tr, va = split_indices(len(y), valid_fraction, seed)
    return _make_splits(x[tr], y[tr], x[va], y[va], [str(c) for c in range(10)], test_fraction, seed)


def _latin1_encode(obj: object, encoding: str = "latin1") -> bytes:
    # Python 3 writes bytes into protocol-2 pickles as _codecs.encode(text, "latin1");
    # only that exact use is let through.
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is only allowed as str -> latin-1 bytes")
    return obj.encode("latin-1")


def _empty_bytes(*args: object) -> bytes:
    # Protocol-2 pickles write an empty bytes object (the buffer of an array of 0 images) as
    # a call of bytes() with no argument; only that call is let through.
    if args:
        raise pickle.UnpicklingError("bytes(...) is only allowed without arguments (an empty bytes object)")
    return b""


def _safe_dtype(*args: Any) -> np.dtype:
    dtype = np.dtype(*args)
    if dtype.hasobject:
        # Object arrays unpickle their elements as arbitrary objects; plain data only.
        raise pickle.UnpicklingError(f"object dtype {dtype} is not allowed")
    return dtype


def _allowed_globals() -> dict[tuple[str, str], object]:
    # Take numpy's reconstructors from numpy itself, so the table follows the installed
    # version (numpy 1.x pickles name numpy.core, 2.x numpy._core) without touching the
    # deprecated numpy.core shim.
    reconstruct = np.zeros(1).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    scalar = np.int64(0).__reduce__()[0]
    allowed: dict[tuple[str, str], object] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): _safe_dtype,
        ("_codecs", "encode"): _latin1_encode,
        ("__builtin__", "bytes"): _empty_bytes,
        ("builtins", "bytes"): _empty_bytes,
    }
    for pkg in ("numpy.core", "numpy._core"):
        allowed[(f"{pkg}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{pkg}.multiarray", "scalar")] = scalar
        allowed[(f"{pkg}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals plain numpy arrays need.

    A pickle is a program: ``pickle.load`` calls whatever importable callable the file
    names (``os.system`` included). CIFAR-10's batches are pickles of dicts of bytes, ints,
    lists and one uint8 array, so every other global is refused before it is imported.
    """

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise DataError(
                f"refusing to load {self._path}: the pickle references {module}.{name}, which is not "
                "a plain data type (the file may be malicious or not a CIFAR batch)"
            ) from None

    def persistent_load(self, pid: object) -> NoReturn:
        raise DataError(f"refusing to load {self._path}: the pickle uses persistent ids")


def safe_unpickle(path: str | os.PathLike, what: str = "pickle file") -> Any:
    """Load a pickle of plain data (dicts, lists, str, bytes, numbers, numpy arrays) safely.

    Raises :class:`DataError` naming ``path`` for a forbidden global, or a truncated or
    corrupt stream, and :class:`MissingDataError` if the file does not exist.
    """
    path = os.fspath(path)
    # The objects of a plain-data pickle take about what the file does (CIFAR: one bytes
    # object, then the array made from it), read whole first.
    data = read_regular(path, what, bytes_per_byte=3)
    _check_declared_lengths(data, path, what)
    try:
        return _RestrictedUnpickler(io.BytesIO(data), path).load()
    except DataError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, OverflowError, UnicodeDecodeError) as e:
        raise DataError(f"{what} {path} is truncated or corrupt: {type(e).__name__}: {one_line(e)}") from None


def _check_declared_lengths(data: bytes, path: str, what: str) -> None:
    """Refuse a pickle whose opcodes declare more bytes than the file holds. The unpickler
    allocates a counted bytes or string object at its declared length before it reads it,
    so a 20-byte file declaring 15 GB would allocate 15 GB; :mod:`pickletools` reads the
    same opcodes without allocating what they declare."""
    stream = io.BytesIO(data)
    try:
        for op, arg, _ in pickletools.genops(stream):
            if op.name == "FRAME" and isinstance(arg, int) and arg > len(data) - stream.tell():
                raise DataError(f"{what} {path} is truncated or corrupt: a frame declares {arg:,} bytes, "
                                f"but only {len(data) - stream.tell():,} follow")
    except DataError:
        raise
    except ValueError as e:  # genops: a length beyond the data, an unknown opcode, a bad argument
        raise DataError(f"{what} {path} is truncated or corrupt: {one_line(e)}") from None


def _key(d: dict, name: str, path: str) -> Any:
    for k in (name.encode(), name):
        if k in d:
            return d[k]
    raise DataError(f"CIFAR file {path} has no {name!r} entry (keys: {sorted(map(str, d))})")


def _read_cifar_batch(path: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    d = safe_unpickle(path, "CIFAR batch file")
    if not isinstance(d, dict):
        raise DataError(f"CIFAR batch file {path} holds a {type(d).__name__}, expected a dict")
    data, labels = _key(d, "data", path), _key(d, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
        got = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"CIFAR batch file {path}: 'data' must be a uint8 array [n, {_CIFAR_PIXELS}], got {got}")
    # Checked before np.asarray: a few hundred bytes of pickle can nest shared references
    # to one list into 2^30 labels, which asarray would allocate.
    if isinstance(labels, np.ndarray):
        if labels.ndim != 1:
            raise DataError(f"CIFAR batch file {path}: 'labels' must be one label per image, got an array of shape {labels.shape}")
    elif not isinstance(labels, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        raise DataError(f"CIFAR batch file {path}: 'labels' must be a list of integers, one per image")
    if len(labels) != data.shape[0]:
        raise DataError(f"CIFAR batch file {path}: {data.shape[0]} images but {len(labels)} labels")
    labels = np.asarray(labels)
    if labels.size and labels.dtype.kind not in "iu":
        raise DataError(f"CIFAR batch file {path}: 'labels' must be integers, got {labels.dtype} values")
    labels = labels.astype(np.int64)
    if data.shape[0] == 0:
        raise DataError(f"CIFAR batch file {path} holds 0 images; every batch of the CIFAR-10 release holds 10000")
    if labels.shape != (data.shape[0],):
        raise DataError(f"CIFAR batch file {path}: {data.shape[0]} images but labels of shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"CIFAR batch file {path}: labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
    # Rows are 1024 red, then 1024 green, then 1024 blue values of a row-major 32x32 image.
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(root: str | os.PathLike, *, test_fraction: float = 0.0, seed: int = 0) -> ImageSplits:
    """CIFAR-10 from its local "python version" directory; nothing is downloaded.

    ``root`` holds ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and
    ``batches.meta`` (or is the folder that contains ``cifar-10-batches-py``). The five
    data batches are the train split (50000 images) and ``test_batch`` the validation
    split (10000); ``test_fraction`` carves a test set from the training images
    (:func:`_make_splits`), since ``test_batch`` is already validation. Images
    ``[N, 3, 32, 32]``: bytes / 255, then standardised. The pickles
    are read with :func:`safe_unpickle`, which cannot execute code.
    """
    root = require_dir(root, "CIFAR-10 directory")
    nested = os.path.join(root, "cifar-10-batches-py")
    if not os.path.exists(os.path.join(root, CIFAR10_META)) and os.path.isdir(nested):
        root = nested
    meta_path = os.path.join(root, CIFAR10_META)
    meta = safe_unpickle(meta_path, "CIFAR meta file")
    if not isinstance(meta, dict):
        raise DataError(f"CIFAR meta file {meta_path} holds a {type(meta).__name__}, expected a dict")
    raw_names = _key(meta, "label_names", meta_path)
    if not isinstance(raw_names, list) or not raw_names or not all(isinstance(n, (bytes, str)) for n in raw_names):
        raise DataError(f"CIFAR meta file {meta_path}: 'label_names' must be a non-empty list of strings")
    names = [n.decode("utf-8", errors="replace") if isinstance(n, bytes) else n for n in raw_names]
    batches = [os.path.join(root, b) for b in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH)]
    _check_cifar_memory(root, batches)
    parts = [_read_cifar_batch(b, len(names)) for b in batches[:-1]]
    test_x, test_y = _read_cifar_batch(batches[-1], len(names))
    train_x = np.concatenate([p[0] for p in parts])
    train_y = np.concatenate([p[1] for p in parts])
    if len(train_y) == 0 or len(test_y) == 0:
        raise DataError(f"CIFAR directory {root} has an empty split ({len(train_y)} train, {len(test_y)} test images)")
    return _make_splits(train_x / np.float32(255), train_y, test_x / np.float32(255), test_y, names, test_fraction, seed)


#: Bytes a CIFAR pixel takes once loaded: the uint8 batches and their concatenation, then
#: float32 three times (scaled, centred, standardised; :func:`_make_splits`).
_CIFAR_PIXEL_BYTES = 2 + 3 * 4


def _check_cifar_memory(root: str, batches: list[str]) -> None:
    """Refuse CIFAR batches whose images cannot all be held, from the files' sizes (a
    batch's pixels take about its size), before any is read."""
    sizes = [os.path.getsize(b) for b in batches if os.path.isfile(b)]
    check_file_memory(root, sum(sizes) * _CIFAR_PIXEL_BYTES, "CIFAR-10 directory",
                      detail=f"{len(sizes)} batch files of {sum(sizes):,} bytes", hint="use fewer or smaller batch files")


def _import_pil() -> ModuleType:
    try:
        from PIL import Image
    except ImportError as e:
        from flt._extras import install_hint

        raise ImportError(f"load_image_folder needs Pillow: {install_hint('train')} (or pip install pillow)") from e
    return Image


def _scan_folder(root: str, what: str) -> dict[str, list[str]]:
    """``{class name: sorted image paths}`` for the class subfolders of ``root``."""
    root = require_dir(root, what)
    with os.scandir(root) as entries:
        classes = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"{what} {root} has no class subfolders")
    files = {}
    for c in classes:
        folder = os.path.join(root, c)
        found = regular_files(folder, IMAGE_EXTENSIONS, "image")
        if not found:
            raise DataError(f"class folder {folder} contains no images ({', '.join(IMAGE_EXTENSIONS)})")
        files[c] = found
    return files


def _read_image(Image: ModuleType, path: str, mode: str, size: tuple[int, int] | None) -> np.ndarray:
    """One image as uint8 ``[C, H, W]``."""
    # Opened here, not by Pillow: a FIFO or a directory named like an image is refused
    # (open_regular) instead of blocking or failing without a clear cause.
    with open_regular(path, "image") as fh:
        return _decode_image(Image, fh, path, mode, size)


def _decode_image(Image: ModuleType, fh: IO[bytes], path: str, mode: str, size: tuple[int, int] | None) -> np.ndarray:
    try:
        with Image.open(fh) as img:
            img = img.convert(mode)
            if size is not None:
                img = img.resize((size[1], size[0]), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
    # Pillow reports unreadable files as OSError (UnidentifiedImageError, truncated data),
    # SyntaxError (broken PNG chunks), ValueError or DecompressionBombError.
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read image {path}: {type(e).__name__}: {one_line(e)}") from None
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _read_folder(Image: ModuleType, files: dict[str, list[str]], class_index: dict[str, int], mode: str,
                 size: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...] | None]:
    images, labels, shape, first = [], [], None, None
    for c, paths in files.items():
        for p in paths:
            arr = _read_image(Image, p, mode, size)
            if shape is None:
                shape, first = arr.shape, p
            elif arr.shape != shape:
                raise DataError(
                    f"image {p} has size {arr.shape[1]}x{arr.shape[2]} but {first} has {shape[1]}x{shape[2]}; "
                    "pass size=(H, W) to resize all images"
                )
            images.append(arr)
            labels.append(class_index[c])
    return np.stack(images), np.asarray(labels, dtype=np.int64), shape


def _check_folder_memory(files: dict[str, list[str]], channels: int, size: tuple[int, int], root: str) -> None:
    """Refuse a ``size`` whose images cannot all be held: each takes ``C H W`` bytes as read,
    then float32 twice (scaled, standardised)."""
    from flt._limits import check_memory

    count = sum(len(paths) for paths in files.values())
    h, w = size
    check_memory(f"image folder {root}: {count} images resized to size={list(size)} ({channels} channels)",
                 count * channels * h * w * 9, hint="pass a smaller size")


def load_image_folder(
    train_dir: str | os.PathLike,
    valid_dir: str | os.PathLike | None = None,
    *,
    size: tuple[int, int] | None = None,
    channels: int = 3,
    valid_fraction: float = 0.1,
    seed: int = 0,
    test_fraction: float = 0.0,
) -> ImageSplits:
    """Images in class subfolders (``train_dir/<class>/*.png|jpg|jpeg``), held in memory.

    Classes are the sorted subfolder names of ``train_dir``. With ``valid_dir`` (same
    layout, a subset of the train classes) it is the validation split; otherwise a seeded
    ``valid_fraction`` of the train images is held out. ``channels`` is 3 (RGB) or 1
    (grey). Without ``size = (H, W)`` every image must already have the same size.
    Images ``[N, C, H, W]``: bytes / 255, then standardised. Needs Pillow.
    """
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels!r}")
    if size is not None and (len(size) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size)):
        raise ValueError(f"size must be None or two positive integers (H, W), got {size!r}")
    Image = _import_pil()
    mode = "RGB" if channels == 3 else "L"
    train_files = _scan_folder(os.fspath(train_dir), "image folder")
    class_names = list(train_files)
    class_index = {c: i for i, c in enumerate(class_names)}
    if size is not None:
        _check_folder_memory(train_files, channels, size, os.fspath(train_dir))
    x, y, shape = _read_folder(Image, train_files, class_index, mode, size)
    if valid_dir is None:
        tr, va = split_indices(len(y), valid_fraction, seed)
        x, y, vx, vy = x[tr], y[tr], x[va], y[va]
    else:
        valid_files = _scan_folder(os.fspath(valid_dir), "validation image folder")
        unknown = sorted(set(valid_files) - set(class_index))
        if unknown:
            raise DataError(f"validation folder {os.fspath(valid_dir)} has classes missing from {os.fspath(train_dir)}: {unknown}")
        vx, vy, vshape = _read_folder(Image, valid_files, class_index, mode, size)
        if vshape != shape:
            raise DataError(f"validation images in {os.fspath(valid_dir)} have shape {vshape}, train images {shape}")
    return _make_splits(x / np.float32(255), y, vx / np.float32(255), vy, class_names, test_fraction, seed)
