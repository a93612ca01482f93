"""Datasets for the built-in tasks: text (causal LM), images (classifier), atoms (regressor).

Nothing is built or read at import time; every loader works on local files or on data
that ships with Python or an installed package, and never downloads anything.

Each task names its bundled loader (``flt.tasks.TASKS[name].dataset``: keyword arguments
only, all with defaults, returning an object with ``.train`` and ``.valid`` splits).
"""

from ._split import split_indices
from .errors import DataError, MissingDataError
from .images import (
    ImageData,
    ImageSplits,
    load_cifar10,
    load_digits,
    load_image_folder,
    safe_unpickle,
)
from .molecules import (
    MoleculeBatch,
    MoleculeData,
    MoleculeSplits,
    catalysis_cache_path,
    collate_molecules,
    default_cache_dir,
    generate_catalysis,
    load_ase,
    load_catalysis,
    split_molecules,
)
from .text import (
    TOKENIZERS,
    ByteTokenizer,
    CharTokenizer,
    LMDataset,
    TextSplits,
    load_python_docs,
    load_text_files,
)

__all__ = [
    "TOKENIZERS",
    "ByteTokenizer",
    "CharTokenizer",
    "DataError",
    "ImageData",
    "ImageSplits",
    "LMDataset",
    "MissingDataError",
    "MoleculeBatch",
    "MoleculeData",
    "MoleculeSplits",
    "TextSplits",
    "catalysis_cache_path",
    "collate_molecules",
    "default_cache_dir",
    "generate_catalysis",
    "load_ase",
    "load_catalysis",
    "load_cifar10",
    "load_digits",
    "load_image_folder",
    "load_python_docs",
    "load_text_files",
    "safe_unpickle",
    "split_indices",
    "split_molecules",
]
