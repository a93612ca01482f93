"""How to install an optional extra of ``pyproject.toml`` (``graph``, ``mol``, ``plot``, ...),
as the one command that works for this installation: ``pip install -e "CHECKOUT[graph]"``
when flt runs from a source checkout (an editable install or ``PYTHONPATH=src``), where
installing from the package index would fetch another copy, and
``pip install "flt-attention[graph]"`` otherwise."""

from __future__ import annotations

from pathlib import Path

#: Optional modules and the extra that provides each (``pyproject.toml``).
EXTRA_OF_MODULE = {
    "numpy": "train", "matplotlib": "plot", "networkx": "graph", "torch_geometric": "graph", "ase": "mol", "sklearn": "train",
    "skimage": "vision", "tqdm": "train", "PIL": "train", "safetensors": "train", "triton": "triton",
    "qm9pack": "qm9", "transformers": "hf",
}


def checkout_root() -> Path | None:
    """The source checkout flt is imported from (the folder holding ``pyproject.toml`` above
    ``src/flt``), or None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent.parent
    project = root / "pyproject.toml"
    if project.is_file() and 'name = "flt-attention"' in project.read_text(encoding="utf-8", errors="replace"):
        return root
    return None


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra`` into this installation of flt."""
    root = checkout_root()
    if root is not None:
        return f'pip install -e "{root}[{extra}]"'
    return f'pip install "flt-attention[{extra}]"'
