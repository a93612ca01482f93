"""Atomistic data for the property regressor: a generated catalysis set and ASE file loaders.

A sample is ``(z [n], pos [n, 3], y [])``: atomic numbers (int64), Cartesian positions in
Angstrom (float32) and one scalar target (float32). :func:`collate_molecules` pads a list
of samples to ``z [B, Nmax]``, ``pos [B, Nmax, 3]``, ``mask [B, Nmax]`` (True = real atom)
and ``y [B]``.

The default dataset (:func:`load_catalysis`) imitates OC20's IS2RE task (Chanussot et al.,
2021, "The Open Catalyst 2020 dataset"): the input is the *initial* structure of an
adsorbate placed on a metal slab and the target is the adsorption energy after
relaxation. Energies come from ASE's EMT potential, which is cheap and crude (it is
fitted for Al, Ni, Cu, Pd, Ag, Pt, Au and only roughly for H, C, N, O): the data has
the shape of the real task, not its chemistry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from flt._checks import shown
from flt._io import atomic_write

from ._files import check_file_size, check_float32, load_npz, one_line, open_regular
from ._split import carve_test, split_indices
from .errors import DataError

if TYPE_CHECKING:
    from ase import Atoms

#: Bumped whenever the generator or the cache layout changes, so old caches are not read.
FORMAT_VERSION = 1

SLAB_METALS = ("Al", "Ni", "Cu", "Pd", "Ag", "Pt", "Au")
#: Facet -> adsorption sites that ``ase.build`` defines for it.
FACET_SITES = {"111": ("ontop", "bridge", "fcc", "hcp"), "100": ("ontop", "bridge", "hollow")}
#: Slab repeats (a, b, layers); the top layer and the adsorbate relax, deeper layers are fixed.
SLAB_SIZES = ((2, 2, 3), (3, 3, 3), (2, 2, 4))
#: Starting height (Angstrom) of the binding atom above the top layer, per site.
SITE_HEIGHTS = {"ontop": 1.9, "bridge": 1.6, "hollow": 1.2, "fcc": 1.3, "hcp": 1.3}
#: Adsorbates as (symbol, position) with the binding atom at the origin and the rest above.
ADSORBATES = {
    "H": (("H", (0.0, 0.0, 0.0)),),
    "C": (("C", (0.0, 0.0, 0.0)),),
    "N": (("N", (0.0, 0.0, 0.0)),),
    "O": (("O", (0.0, 0.0, 0.0)),),
    "OH": (("O", (0.0, 0.0, 0.0)), ("H", (0.0, 0.0, 0.97))),
    "CO": (("C", (0.0, 0.0, 0.0)), ("O", (0.0, 0.0, 1.15))),
    "NO": (("N", (0.0, 0.0, 0.0)), ("O", (0.0, 0.0, 1.16))),
    "N2": (("N", (0.0, 0.0, 0.0)), ("N", (0.0, 0.0, 1.12))),
    "CH": (("C", (0.0, 0.0, 0.0)), ("H", (0.0, 0.0, 1.09))),
    "NH": (("N", (0.0, 0.0, 0.0)), ("H", (0.0, 0.0, 1.03))),
    "CH2": (("C", (0.0, 0.0, 0.0)), ("H", (0.93, 0.0, 0.57)), ("H", (-0.93, 0.0, 0.57))),
    "NH2": (("N", (0.0, 0.0, 0.0)), ("H", (0.88, 0.0, 0.54)), ("H", (-0.88, 0.0, 0.54))),
}
_VACUUM = 6.0  # Angstrom each side; more than EMT's cutoff above the adsorbate
_LATERAL_JITTER = 0.15  # Angstrom, std of the adsorbate's in-plane displacement
_HEIGHT_JITTER = 0.15  # Angstrom, half-width of the uniform height perturbation
_MAX_TILT = 20.0  # degrees
_INFO_KEYS = ("metal", "facet", "site", "adsorbate", "steps", "converged")
#: Largest |coordinate| (Angstrom) a structure file may hold: far beyond any molecule or
#: periodic cell, far below where float32 positions lose their meaning.
MAX_COORDINATE = 1e6
#: Fewest bytes an atom's line of an XYZ file takes: an element, three numbers, separators.
XYZ_ATOM_BYTES = 7
#: Fewest bytes one column of an atom's line takes: a character and a separator.
XYZ_COLUMN_BYTES = 2
#: Bytes each byte of a structure file costs while ASE reads it: its lines as Python
#: strings, the split fields, then the arrays of every frame.
STRUCTURE_BYTES_PER_BYTE = 10


def _import_ase() -> None:
    try:
        import ase  # noqa: F401
    except ImportError as e:
        from flt._extras import install_hint

        raise ImportError(f"this loader needs ASE: {install_hint('mol')}") from e


class MoleculeBatch(NamedTuple):
    """Padded batch: ``z [B, Nmax]`` int64 (0 = padding), ``pos [B, Nmax, 3]``,
    ``key_padding_mask [B, Nmax]`` bool (True = padding, as in every attention layer), ``y [B]``."""

    z: torch.Tensor
    pos: torch.Tensor
    key_padding_mask: torch.Tensor
    y: torch.Tensor

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MoleculeBatch:
        """Move to ``device``; ``dtype`` applies to the floating tensors ``pos`` and ``y``."""
        return MoleculeBatch(self.z.to(device), self.pos.to(device, dtype), self.key_padding_mask.to(device), self.y.to(device, dtype))


def collate_molecules(samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> MoleculeBatch:
    """Pad ``[(z [n_i], pos [n_i, 3], y [])]`` into a :class:`MoleculeBatch` (for ``DataLoader``)."""
    if len(samples) == 0:
        raise ValueError("cannot collate an empty list of molecules")
    n_max = max(int(z.shape[0]) for z, _, _ in samples)
    b = len(samples)
    pos_dtype = samples[0][1].dtype
    z = torch.zeros(b, n_max, dtype=torch.int64)
    pos = torch.zeros(b, n_max, 3, dtype=pos_dtype)
    pad = torch.ones(b, n_max, dtype=torch.bool)
    for i, (zi, pi, _) in enumerate(samples):
        n = zi.shape[0]
        z[i, :n] = zi
        pos[i, :n] = pi
        pad[i, :n] = False
    y = torch.stack([torch.as_tensor(yi) for _, _, yi in samples])
    return MoleculeBatch(z, pos, pad, y)


class MoleculeData(torch.utils.data.Dataset):
    """Ragged structures stored flat: ``z [A]``, ``pos [A, 3]`` for all ``A`` atoms,
    ``offsets [M + 1]`` (structure ``i`` is atoms ``offsets[i]:offsets[i + 1]``), ``y [M]``.

    ``info`` maps names to per-structure numpy arrays ``[M]`` (e.g. metal, adsorbate).
    """

    def __init__(self, z: torch.Tensor | np.ndarray | Sequence, pos: torch.Tensor | np.ndarray | Sequence, offsets: torch.Tensor | np.ndarray | Sequence, y: torch.Tensor | np.ndarray | Sequence, *, name: str = "",
                 info: dict | None = None) -> None:
        self.z = torch.as_tensor(z, dtype=torch.int64)
        self.pos = torch.as_tensor(pos, dtype=torch.float32)
        self.offsets = torch.as_tensor(offsets, dtype=torch.int64)
        self.y = torch.as_tensor(y, dtype=torch.float32)
        self.name = name
        self.info = {k: np.asarray(v) for k, v in (info or {}).items()}
        m = self.y.shape[0]
        if (self.z.ndim != 1 or self.pos.shape != (self.z.shape[0], 3) or self.offsets.shape != (m + 1,)
                or self.y.ndim != 1 or int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.z.shape[0]
                or bool((self.offsets[1:] <= self.offsets[:-1]).any())):
            raise ValueError(
                f"inconsistent molecule arrays: z {tuple(self.z.shape)}, pos {tuple(self.pos.shape)}, "
                f"offsets {tuple(self.offsets.shape)}, y {tuple(self.y.shape)}"
            )
        for k, v in self.info.items():
            if v.shape[:1] != (m,):
                raise ValueError(f"info[{k!r}] has shape {v.shape}, expected [{m}]")
        # After the conversion to float32: a value finite in float64 (1e300) may not be here.
        for what, t in (("positions", self.pos), ("targets", self.y)):
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                first = int(bad.reshape(t.shape[0], -1).any(1).nonzero()[0])
                structure = int(torch.searchsorted(self.offsets, first, right=True)) - 1 if what == "positions" else first
                raise ValueError(f"molecule data {name or '(unnamed)'}: structure {structure} has {what} that are not finite "
                                 "in float32 (beyond 3.4e38, or NaN)")

    @classmethod
    def from_lists(cls, zs: Sequence, positions: Sequence, ys: Sequence, *, name: str = "", info: dict | None = None) -> MoleculeData:
        """Build from per-structure ``z [n_i]``, ``pos [n_i, 3]`` and scalar targets."""
        counts = [len(z) for z in zs]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        z = np.concatenate([np.asarray(v, dtype=np.int64) for v in zs]) if zs else np.zeros(0, np.int64)
        pos = np.concatenate([np.asarray(p, dtype=np.float64).reshape(-1, 3) for p in positions]) if zs else np.zeros((0, 3))
        return cls(z, pos, offsets, np.asarray(ys, dtype=np.float64), name=name, info=info)

    def __len__(self) -> int:
        return self.y.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(z [n], pos [n, 3], y [])``."""
        m = len(self)
        if not -m <= i < m:
            raise IndexError(f"structure {i} out of range for {m} structures")
        i %= m
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.z[a:b], self.pos[a:b], self.y[i]

    def num_atoms(self) -> torch.Tensor:
        """Atoms per structure ``[M]``."""
        return self.offsets[1:] - self.offsets[:-1]

    def subset(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> MoleculeData:
        """The structures at ``indices`` (a 1-D integer array), in that order."""
        idx = np.asarray(indices, dtype=np.int64)
        counts = self.num_atoms().numpy()[idx]
        starts = self.offsets[:-1].numpy()[idx]
        atom_idx = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)]) if idx.size else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        info = {k: v[idx] for k, v in self.info.items()}
        return MoleculeData(self.z[atom_idx], self.pos[atom_idx], offsets, self.y[idx], name=self.name, info=info)


@dataclass(frozen=True)
class MoleculeSplits:
    train: MoleculeData
    valid: MoleculeData
    #: Held out from training and validation (None when not asked for).
    test: MoleculeData | None = None


def split_molecules(data: MoleculeData, valid_fraction: float = 0.1, seed: int = 0, test_fraction: float = 0.0) -> MoleculeSplits:
    """Deterministic disjoint train/validation split of the structures (:func:`split_indices`);
    with ``test_fraction > 0`` a test set is carved from the training part
    (:func:`carve_test`), so validation is the same as without one."""
    tr, va = split_indices(len(data), valid_fraction, seed)
    if not test_fraction:
        return MoleculeSplits(train=data.subset(tr), valid=data.subset(va))
    tr, te = carve_test(tr, len(data), test_fraction, seed)
    return MoleculeSplits(train=data.subset(tr), valid=data.subset(va), test=data.subset(te))


def _atom_energy(symbol: str) -> float:
    from ase import Atoms
    from ase.calculators.emt import EMT

    atom = Atoms(symbol)
    atom.calc = EMT()
    return float(atom.get_potential_energy())


def _relax(atoms: Atoms, steps: int, fmax: float) -> tuple[float, int, bool]:
    """Relax in place with EMT and LBFGS; return (energy, steps taken, converged)."""
    from ase.calculators.emt import EMT
    from ase.optimize import LBFGS

    atoms.calc = EMT()
    if steps == 0:
        return float(atoms.get_potential_energy()), 0, False
    # LBFGS rather than BFGS: BFGS diagonalises its Hessian every step, and with a threaded
    # BLAS on a busy machine that eigh made relaxations ten times slower.
    opt = LBFGS(atoms, logfile=os.devnull)  # what ASE opens for logfile=None
    converged = bool(opt.run(fmax=fmax, steps=steps))
    return float(atoms.get_potential_energy()), int(opt.get_number_of_steps()), converged


def _slab(metal: str, facet: str, size: tuple[int, int, int]) -> Atoms:
    from ase.build import fcc100, fcc111
    from ase.constraints import FixAtoms

    build = fcc111 if facet == "111" else fcc100
    slab = build(metal, size=size, vacuum=_VACUUM)
    # ase.build tags layers 1 (top) .. n (bottom); keep all but the top one fixed, as OC20
    # fixes subsurface atoms.
    slab.set_constraint(FixAtoms(mask=slab.get_tags() > 1))
    return slab


def _generate_one(seed: int, index: int, relax_steps: int, fmax: float, clean: dict, atom_e: dict) -> dict:
    """One structure from its own generator ``default_rng([seed, index])``."""
    from ase import Atoms
    from ase.build import add_adsorbate

    # Per-sample generators make structure i independent of how many are generated.
    rng = np.random.default_rng([seed, index])
    metal = SLAB_METALS[rng.integers(len(SLAB_METALS))]
    facet = sorted(FACET_SITES)[rng.integers(len(FACET_SITES))]
    size = SLAB_SIZES[rng.integers(len(SLAB_SIZES))]
    site = FACET_SITES[facet][rng.integers(len(FACET_SITES[facet]))]
    ads_name = sorted(ADSORBATES)[rng.integers(len(ADSORBATES))]
    offset = (int(rng.integers(size[0])), int(rng.integers(size[1])))
    tilt, spin = rng.uniform(0.0, _MAX_TILT), rng.uniform(0.0, 360.0)
    shift = rng.normal(0.0, _LATERAL_JITTER, size=2)
    height = SITE_HEIGHTS[site] + rng.uniform(-_HEIGHT_JITTER, _HEIGHT_JITTER)

    symbols, coords = zip(*ADSORBATES[ads_name], strict=True)
    ads = Atoms(symbols, positions=coords)
    ads.rotate(tilt, "x", center=(0, 0, 0))
    ads.rotate(spin, "z", center=(0, 0, 0))
    slab = _slab(metal, facet, size)
    n_slab = len(slab)
    add_adsorbate(slab, ads, height, position=site, offset=offset, mol_index=0)
    slab.positions[n_slab:, :2] += shift
    initial = slab.get_positions()

    key = (metal, facet, size)
    if key not in clean:
        clean[key] = _relax(_slab(metal, facet, size), relax_steps, fmax)[0]
    energy, steps, converged = _relax(slab, relax_steps, fmax)
    for s in symbols:
        if s not in atom_e:
            atom_e[s] = _atom_energy(s)
    y = energy - clean[key] - sum(atom_e[s] for s in symbols)
    return {
        "z": slab.get_atomic_numbers().astype(np.int64), "pos": initial, "y": y,
        "metal": metal, "facet": facet, "site": site, "adsorbate": ads_name,
        "steps": steps, "converged": converged,
    }


def generate_catalysis(
    num_samples: int = 2000, *, seed: int = 0, relax_steps: int = 30, fmax: float = 0.05, progress: bool = False,
    first: int = 0,
) -> MoleculeData:
    """Generate the catalysis set in memory (no cache; see :func:`load_catalysis`).

    Each structure draws, from ``numpy.random.default_rng([seed, i])``: a metal from
    :data:`SLAB_METALS`, an fcc(111) or fcc(100) slab of size from :data:`SLAB_SIZES`,
    a site, an adsorbate from :data:`ADSORBATES`, a surface cell, a tilt (0-20 deg), a
    spin about z, an in-plane shift (std 0.15 A) and a height jitter (+-0.15 A).

    * ``pos``: the initial (unrelaxed, jittered) positions, as in IS2RE.
    * ``y`` (eV): the adsorption energy ``E(slab+ads) - E(clean slab) - sum_a E(atom a)``,
      with EMT energies after at most ``relax_steps`` LBFGS steps (to ``fmax`` eV/A) of the
      adsorbate and top layer (clean slabs relaxed the same way), referenced to isolated
      EMT atoms. ``relax_steps = 0`` gives the unrelaxed energy.
    * ``info``: ``metal``, ``facet``, ``site``, ``adsorbate``, ``steps``, ``converged``.

    ``first`` starts at structure ``first`` instead of 0 (structures ``first`` to ``first +
    num_samples - 1``): structure ``i`` is the same whatever the other arguments, so a set
    generated beyond another one is disjoint from it (the test split of :func:`load_catalysis`).

    Atoms are ordered slab first (as ``ase.build`` lays them out), adsorbate last. The
    default 2000 structures have 13-30 atoms (20 on average) and took about 105 s of CPU
    time with ASE 3.29 (one core; 62% of relaxations converge within 30 steps). ``y``
    has a std of 2.6 eV, mostly from the adsorbate's composition; the geometry-dependent
    rest (within one adsorbate) has a std of about 0.15 eV.
    """
    _import_ase()
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if isinstance(relax_steps, bool) or not isinstance(relax_steps, int) or relax_steps < 0:
        raise ValueError(f"relax_steps must be a non-negative integer, got {relax_steps!r}")
    if not fmax > 0:
        raise ValueError(f"fmax must be positive, got {fmax!r}")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"first must be a non-negative integer, got {first!r}")
    indices = range(first, first + num_samples)
    if progress:
        try:
            from tqdm import tqdm
        except ImportError as e:
            from flt._extras import install_hint

            raise ImportError(f"progress=True needs tqdm: {install_hint('train')}, or pass progress=False") from e
        indices = tqdm(indices, desc="generating catalysis structures (EMT)", unit="struct")
    clean: dict = {}
    atom_e: dict = {}
    rows = [_generate_one(seed, i, relax_steps, fmax, clean, atom_e) for i in indices]
    return MoleculeData.from_lists(
        [r["z"] for r in rows], [r["pos"] for r in rows], [r["y"] for r in rows],
        name="catalysis-emt", info={k: np.asarray([r[k] for r in rows]) for k in _INFO_KEYS},
    )


def default_cache_dir() -> str:
    """``$FLT_CACHE_DIR/molecules`` if the variable is set, else ``~/.cache/flt/molecules``."""
    root = os.environ.get("FLT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flt")
    return os.path.join(root, "molecules")


def _cache_params(num_samples: int, seed: int, relax_steps: int, fmax: float, first: int = 0) -> str:
    import ase

    # The ASE version is part of the key: a different EMT or optimiser gives other numbers.
    params = {
        "format_version": FORMAT_VERSION, "generator": "catalysis-emt", "num_samples": num_samples,
        "seed": seed, "relax_steps": relax_steps, "fmax": float(fmax), "ase_version": ase.__version__,
    }
    if first:  # only sets that start later carry the key, so existing caches stay valid
        params["first"] = first
    return json.dumps(params, sort_keys=True)


def catalysis_cache_path(
    num_samples: int = 2000, *, seed: int = 0, relax_steps: int = 30, fmax: float = 0.05, cache_dir: str | os.PathLike | None = None,
    first: int = 0,
) -> str:
    """Where :func:`load_catalysis` keeps the set for these parameters."""
    _import_ase()
    params = _cache_params(num_samples, seed, relax_steps, fmax, first)
    digest = hashlib.sha256(params.encode("utf-8")).hexdigest()[:16]
    folder = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    start = f"-from{first}" if first else ""
    return os.path.join(folder, f"catalysis-v{FORMAT_VERSION}-n{num_samples}{start}-{digest}.npz")


def _load_cache(path: str, params: str) -> MoleculeData:
    # The advice must work from the command line too, where refresh is not a data option.
    fix = "delete that file and run again to regenerate it (or pass refresh=True to load_catalysis)"
    arrays = load_npz(path, "cached molecule dataset", fix)
    required = ("params", "z", "pos", "offsets", "y", *(f"info_{k}" for k in _INFO_KEYS))
    missing = [k for k in required if k not in arrays]
    if missing:
        raise DataError(f"cached molecule dataset {path} lacks arrays {missing}; {fix}")
    if str(arrays["params"]) != params:
        raise DataError(f"cached molecule dataset {path} was made with other parameters ({arrays['params']}); {fix}")
    try:
        return MoleculeData(
            arrays["z"], arrays["pos"], arrays["offsets"], arrays["y"], name="catalysis-emt",
            info={k: arrays[f"info_{k}"] for k in _INFO_KEYS},
        )
    except ValueError as e:
        raise DataError(f"cached molecule dataset {path} is inconsistent ({e}); {fix}") from None


def load_catalysis(
    num_samples: int = 2000,
    *,
    seed: int = 0,
    relax_steps: int = 30,
    fmax: float = 0.05,
    valid_fraction: float = 0.1,
    test_samples: int = 0,
    cache_dir: str | os.PathLike | None = None,
    refresh: bool = False,
    progress: bool = True,
) -> MoleculeSplits:
    """The default molecule dataset: :func:`generate_catalysis`, cached, split by ``seed``.

    ``test_samples > 0`` adds a test split: the ``test_samples`` structures generated after
    the first ``num_samples`` (``first=num_samples``, cached on their own), so training and
    validation are exactly those of the same call without a test split.

    The set is cached as ``.npz`` (no pickles) under ``cache_dir`` (default
    :func:`default_cache_dir`), keyed by the parameters, :data:`FORMAT_VERSION` and the
    ASE version, and written atomically. A cache that exists but cannot be read raises
    :class:`DataError` naming the file instead of being silently replaced (a cache is
    never left half-written, so damage means something else is wrong); ``refresh=True``
    regenerates and overwrites it.
    """
    if isinstance(test_samples, bool) or not isinstance(test_samples, int) or test_samples < 0:
        raise ValueError(f"test_samples must be a non-negative integer, got {test_samples!r}")
    cached = functools.partial(_cached_catalysis, seed=seed, relax_steps=relax_steps, fmax=fmax, cache_dir=cache_dir,
                               refresh=refresh, progress=progress)
    splits = split_molecules(cached(num_samples, 0), valid_fraction, seed)
    if not test_samples:
        return splits
    return replace(splits, test=cached(test_samples, num_samples))


def _cached_catalysis(num_samples: int, first: int, *, seed: int, relax_steps: int, fmax: float,
                      cache_dir: str | os.PathLike | None, refresh: bool, progress: bool) -> MoleculeData:
    """Structures ``first`` to ``first + num_samples - 1``, from the cache or generated and cached."""
    path = catalysis_cache_path(num_samples, seed=seed, relax_steps=relax_steps, fmax=fmax, cache_dir=cache_dir, first=first)
    params = _cache_params(num_samples, seed, relax_steps, fmax, first)
    if os.path.exists(path) and not refresh:
        return _load_cache(path, params)
    data = generate_catalysis(num_samples, seed=seed, relax_steps=relax_steps, fmax=fmax, progress=progress, first=first)
    arrays: dict[str, Any] = {
        "params": np.asarray(params), "z": data.z.numpy(), "pos": data.pos.numpy(),
        "offsets": data.offsets.numpy(), "y": data.y.numpy(),
        **{f"info_{k}": data.info[k] for k in _INFO_KEYS},
    }
    # Readers never see a half-written cache, even if this process is killed mid-write.
    atomic_write(path, lambda f: np.savez(f, **arrays), binary=True)
    return data


def _scalar_target(value: object, path: str, where: str, target: str) -> float:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{path}: {where} property {target!r} is not a number: {shown(value)}") from None
    if arr.size != 1 or not np.isfinite(arr).all():
        raise DataError(f"{path}: {where} property {target!r} must be one finite number, got {shown(value)}")
    # The targets are float32 (MoleculeData): 1e300 is finite here and infinite there.
    return check_float32(float(arr.reshape(())), f"{path}: {where} property {target!r}")



def _atoms_target(atoms: Atoms, path: str, index: int, target: str) -> float:
    if target in atoms.info:
        return _scalar_target(atoms.info[target], path, f"structure {index}", target)
    results = atoms.calc.results if atoms.calc is not None else {}
    if target in results:
        return _scalar_target(results[target], path, f"structure {index}", target)
    keys = sorted(set(atoms.info) | set(results))
    raise DataError(f"{path}: structure {index} has no property {target!r} (info and calculator keys: {keys})")


def _read_db(path: str, target: str) -> tuple[list[np.ndarray], list[np.ndarray], list[float]]:
    import ase.db

    # Check read-only first: ase.db.connect would turn a non-ASE SQLite file (or an empty
    # file) into a new database by writing its tables.
    try:
        con = sqlite3.connect(pathlib.Path(path).resolve().as_uri() + "?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise DataError(f"ASE database {path} is not a readable SQLite file: {e}") from None
    if "systems" not in tables:
        raise DataError(f"{path} is not an ASE database (it has no 'systems' table)")
    zs, positions, ys = [], [], []
    try:
        for row in ase.db.connect(path, type="db").select():
            value = row.get(target)
            if value is None:
                keys = sorted(row.key_value_pairs) + (["energy"] if row.get("energy") is not None else [])
                raise DataError(f"{path}: row id={row.id} has no property {target!r} (available: {keys})")
            ys.append(_scalar_target(value, path, f"row id={row.id}", target))
            zs.append(np.asarray(row.numbers, dtype=np.int64))
            positions.append(np.asarray(row.positions, dtype=np.float64))
    except sqlite3.DatabaseError as e:
        raise DataError(f"ASE database {path} is corrupt: {e}") from None
    except RecursionError:  # a row's JSON columns nested deeper than the decoder recurses
        raise DataError(f"ASE database {path} is corrupt: a row's data nests too deeply") from None
    return zs, positions, ys


def load_ase(path: str | os.PathLike, target: str = "energy") -> MoleculeData:
    """Structures from an ASE database (``.db``) or any file ``ase.io.read`` knows
    (extended XYZ, trajectories, ...), with the scalar property ``target`` as ``y``.

    The target is looked up in a structure's ``info`` dict, then in its calculator
    results (extended XYZ puts ``energy`` there); for databases in the row's key-value
    pairs and columns (``energy``). This covers QM9 exports (``target="U0"`` etc.) and
    exported OC20 subsets. Missing files raise :class:`MissingDataError`; empty,
    truncated or corrupt files and a missing or non-scalar property raise
    :class:`DataError`; each names the file.
    """
    _import_ase()
    import ase.io
    from ase.io.formats import UnknownFileTypeError

    path = os.fspath(path)
    with open_regular(path, "structure file") as fh:  # a FIFO or a directory is refused, not read
        size = os.fstat(fh.fileno()).st_size
    if size == 0:
        raise DataError(f"structure file is empty: {path}")
    binary = path.lower().endswith(".db")  # SQLite rows hold binary arrays: about their size once read
    check_file_size(path, size, "structure file", bytes_per_byte=2 if binary else STRUCTURE_BYTES_PER_BYTE)
    if path.lower().endswith(".db"):
        zs, positions, ys = _read_db(path, target)
    else:
        if _is_xyz(path):
            check_xyz_headers(path)  # before ASE, which would allocate and parse what a header claims
        try:
            frames = ase.io.read(path, index=":")
        # ASE reports a bad file as XYZError (an OSError), ValueError, IndexError or KeyError
        # from its parsers, or UnknownFileTypeError when it cannot tell the format; some of
        # its parsers (xsf) fail on a malformed file with an AssertionError or a
        # StopIteration turned RuntimeError. A file that ASE cannot parse is bad input,
        # whatever the parser raises; running out of memory is not.
        except MemoryError:
            raise
        # Before RuntimeError, whose subclass it is: ASE's JSON database format nested deeper
        # than its decoder recurses.
        except RecursionError:
            raise DataError(f"cannot read structure file {path}: it nests too deeply to be a structure file") from None
        except (OSError, ValueError, IndexError, KeyError, UnknownFileTypeError, AssertionError, RuntimeError,
                TypeError, AttributeError, StopIteration) as e:
            raise DataError(f"cannot read structure file {path}: {type(e).__name__}: {one_line(e)}") from None
        ys = [_atoms_target(a, path, i, target) for i, a in enumerate(frames)]
        zs = [a.get_atomic_numbers().astype(np.int64) for a in frames]
        positions = [a.get_positions() for a in frames]
    if not ys:
        raise DataError(f"structure file {path} contains no structures")
    for i, (z, p) in enumerate(zip(zs, positions, strict=True)):
        if len(z) == 0:
            raise DataError(f"{path}: structure {i} has no atoms")
        if not np.isfinite(p).all():
            raise DataError(f"{path}: structure {i} has non-finite positions")
        if np.abs(p).max() > MAX_COORDINATE:
            atom = int(np.abs(p).max(axis=1).argmax())
            raise DataError(f"{path}: structure {i}, atom {atom} lies at {p[atom].tolist()} Å, beyond the "
                            f"{MAX_COORDINATE:g} Å that any structure spans (a unit error or a corrupt file?)")
        if int(z.min()) < 1:
            raise DataError(f"{path}: structure {i} has atomic number {int(z.min())}; atomic numbers start at 1 "
                            "(0, ASE's dummy atom 'X', is the padding id)")
    return MoleculeData.from_lists(zs, positions, ys, name=os.path.basename(path))



def _is_xyz(path: str) -> bool:
    """Whether ASE reads ``path`` as (extended) XYZ: by its extension, else ASE's guess."""
    if path.lower().endswith((".xyz", ".extxyz")):
        return True
    try:
        from ase.io.formats import filetype

        return filetype(path, guess=True) in ("xyz", "extxyz")
    except Exception:  # noqa: BLE001 (a file ASE cannot classify is reported by ase.io.read)
        return False


def check_xyz_headers(path: str) -> int:
    """Check every frame header of an (extended) XYZ file against the file's size and
    return the number of frames: a frame is a line with its atom count ``n``, a comment
    line and ``n`` atom lines of at least :data:`XYZ_ATOM_BYTES` bytes each, so a count
    that the bytes left cannot hold (a header claiming 10^9 atoms in a 3-line file) is
    refused here, before ASE tries to read that many; so is an extended-XYZ
    ``Properties=`` entry declaring more columns than the atom lines can hold
    (``pos:R:1000000000``). Lines that are not a count are left to ASE's parser to report."""
    size = os.path.getsize(path)
    frames = 0
    with open(path, "rb") as f:
        lineno = 0
        while True:
            line = f.readline()
            lineno += 1
            if not line:
                return frames
            text = line.strip()
            if not text:
                continue  # blank lines between or after frames
            try:
                count = int(text.split()[0])
            except ValueError:
                return frames  # not a count: ASE's error names what it expected
            if count < 0:
                raise DataError(f"{path}, line {lineno}: frame {frames} declares {count} atoms")
            left = size - f.tell()
            if count * XYZ_ATOM_BYTES > left:
                raise DataError(f"{path}, line {lineno}: frame {frames} declares {count:,} atoms, but only {left:,} bytes "
                                f"follow (an atom line takes at least {XYZ_ATOM_BYTES}): truncated, or a wrong atom count")
            comment = f.readline()
            if not comment:
                raise DataError(f"{path}: frame {frames} (header at line {lineno}) declares {count} atoms, "
                                "but the file ends before them")
            columns = _declared_columns(comment)
            left = size - f.tell()
            # ASE sizes its per-atom arrays from Properties= before reading an atom line.
            if columns is not None and (count * columns * XYZ_COLUMN_BYTES > left or columns * XYZ_COLUMN_BYTES > size):
                raise DataError(f"{path}, line {lineno + 1}: frame {frames} declares {columns:,} columns per atom line "
                                f"(Properties=) for {count:,} atoms, but only {left:,} bytes follow: a wrong Properties= entry")
            for _ in range(count):
                if not f.readline():
                    raise DataError(f"{path}: frame {frames} (header at line {lineno}) declares {count} atoms, "
                                    "but the file ends before them")
            lineno += count + 1
            frames += 1


_PROPERTIES = re.compile(r"""(?:^|\s)properties\s*=\s*(["']?)([^\s"']+)\1""", re.IGNORECASE)


def _declared_columns(comment: bytes) -> int | None:
    """The number of columns an extended-XYZ comment line's ``Properties=name:type:count:...``
    declares for each atom line; None without one, or when it is not that form (ASE reports it)."""
    match = _PROPERTIES.search(comment.decode("utf-8", errors="replace"))
    if match is None:
        return None
    fields = match.group(2).split(":")
    if len(fields) % 3:
        return None
    try:
        return sum(int(n) for n in fields[2::3])
    except ValueError:
        return None
