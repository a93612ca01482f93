"""What ``flt bench speed`` times: named problem shapes, the timed variants (attention
entries with fixed options, peers, ops) and the presets that combine them
(:mod:`flt.bench.speed` describes the whole benchmark)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """A named problem shape; ``N`` is swept separately. Model width is ``H * D``."""

    B: int
    H: int
    D: int


SHAPES = {
    "tiny": Shape(1, 2, 16),
    "lm": Shape(1, 4, 64),  # the targets' shape: B = 1, H = 4, D = 64
    "batch": Shape(4, 8, 64),
    "wide": Shape(1, 8, 64),  # width 512 in one sequence: the GPU comparison at N = 65,536
}


@dataclass(frozen=True)
class Variant:
    """A timed mechanism: an ``ATTENTION`` entry with fixed options, a peer, or an op.

    ``time_order`` / ``memory_order``: exponent of N that predicts the next size (2 for
    the exact layers' time and for a materialised ``[B, H, N, N]`` bias).
    """

    mechanism: str
    options: tuple = ()
    time_order: float = 1.0
    memory_order: float = 1.0
    kind: str = "layer"  # "layer", "peer" or "op"
    note: str = ""
    compile: bool = False  # wrap the module in torch.compile (inductor); the first call's time is reported
    autocast: str = ""  # "bfloat16": timed under torch.autocast; accuracy against float64 reported

    @property
    def kwargs(self) -> dict:
        return dict(self.options)

    @property
    def exact(self) -> bool:
        """An attention layer whose mechanism is exact: every call forms all ``N^2`` pairs
        (its :data:`flt.layers.registry.COSTS` entry says so; ops and peers are not)."""
        from flt.layers.registry import COSTS

        return self.kind == "layer" and COSTS[self.mechanism].exact


def _flt(coupling: str, m: int, R: int) -> Variant:
    return Variant("flt", (("coupling", coupling), ("num_features", m), ("num_frequencies", R)))


VARIANTS: dict[str, Variant] = {
    "softmax": Variant("softmax", time_order=2, note="exact, SDPA without bias: nothing N x N is materialised"),
    "softmax+t5": Variant("softmax", (("relative_bias", "t5"),), 2, 2, note="exact, learned T5 bias materialised as [B, H, N, N]"),
    "softmax+alibi": Variant("softmax", (("relative_bias", "alibi"),), 2, 2, note="exact, ALiBi bias materialised as [B, H, N, N]"),
    "softmax+spectrum": Variant("softmax", (("relative_bias", "spectrum"),), 2, 2, note="exact, FLT's exact f materialised (logit)"),
    "performer/m64": Variant("performer", (("num_features", 64),)),
    "performer/m256": Variant("performer", (("num_features", 256),)),
    "flt-logit/m64/R8": _flt("logit", 64, 8),
    "flt-logit/m128/R16": _flt("logit", 128, 16),
    "flt-logit/m256/R32": _flt("logit", 256, 32),
    "flt-logit/m256/R64": _flt("logit", 256, 64),
    "flt-mult/m32/R4": _flt("multiplicative", 32, 4),
    "flt-mult/m64/R8": _flt("multiplicative", 64, 8),
    "flt-mult/m128/R16": _flt("multiplicative", 128, 16),
    "flt-mult/m256/R32": _flt("multiplicative", 256, 32),
    "toeplitz/m16": Variant("toeplitz", (("num_features", 16),), 1.2),
    "toeplitz/m64": Variant("toeplitz", (("num_features", 64),), 1.2),
    "toeplitz/m256": Variant("toeplitz", (("num_features", 256),), 1.2),
    "performer-pytorch/m32": Variant("performer-pytorch", (("num_features", 32),), kind="peer", note="peer: lucidrains FAVOR+"),
    "performer-pytorch/m256": Variant("performer-pytorch", (("num_features", 256),), kind="peer", note="peer: lucidrains FAVOR+"),
}
_HEAD = _flt("logit", 256, 32)
VARIANTS["flt-logit/m256/R32+compile"] = Variant(_HEAD.mechanism, _HEAD.options, compile=True, note="torch.compile (inductor) of the layer")
VARIANTS["flt-logit/m256/R32+bf16"] = Variant(_HEAD.mechanism, _HEAD.options, autocast="bfloat16",
                                               note="bf16 autocast; exponentials and normalisers in float32")
VARIANTS["flt-logit/m256/R32+compile+bf16"] = Variant(_HEAD.mechanism, _HEAD.options, compile=True, autocast="bfloat16",
                                                      note="torch.compile and bf16 autocast")
VARIANTS["flt-logit/m256/R32/near16"] = Variant(_HEAD.mechanism, (*_HEAD.options, ("near_neighbors", 16)),
                                                note="nearest-keys estimator: exact on the 16 nearest keys")
VARIANTS["flt-logit/m256/R32/band8"] = Variant(_HEAD.mechanism, (*_HEAD.options, ("near_field", 8)),
                                               note="near field: exact on the band of offsets -8..8")
VARIANTS["flt-mult/m64/R8/near16"] = Variant("flt", (*_flt("multiplicative", 64, 8).options, ("near_neighbors", 16)),
                                             note="multiplicative coupling, exact on the 16 nearest keys")
VARIANTS["flt-mult-hedgehog/m32/R256"] = Variant(
    "flt", (("coupling", "multiplicative"), ("feature_map", "hedgehog"), ("num_features", 32), ("num_frequencies", 256), ("sampler", "qmc")),
    note="the catalysis estimator: learned hedgehog features, multiplicative coupling, 256 QMC frequencies")
VARIANTS["flt-mult/m64/R8+compile"] = Variant("flt", _flt("multiplicative", 64, 8).options, compile=True, note="torch.compile (inductor) of the layer")
VARIANTS["performer/m256+compile"] = Variant("performer", (("num_features", 256),), compile=True, note="torch.compile (inductor) of the layer")
for _m, _R in ((16, 4), (32, 4), (64, 8), (64, 32), (128, 16), (256, 32)):
    VARIANTS[f"op:kronecker/m{_m}/R{_R}"] = Variant(
        "kronecker", (("num_features", _m), ("num_frequencies", _R)), kind="op", note="flt_attention (multiplicative), op level"
    )


@dataclass(frozen=True)
class Run:
    """A variant in a preset: causal or not, which modes, up to which N (None: all)."""

    variant: str
    causal: bool = False
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    max_n: int | None = None


@dataclass(frozen=True)
class Preset:
    """What one ``flt bench speed`` run measures; see :data:`PRESETS` for run times."""

    shapes: tuple[str, ...]
    lengths: tuple[int, ...]
    runs: tuple[Run, ...]
    kronecker: tuple[str, ...] = ()  # op-level Kronecker variants for the cost model
    kronecker_lengths: tuple[int, ...] = ()
    warmup: int = 1
    repeats: int = 5
    min_repeats: int = 3
    min_repeats_long: int = 2
    budget_s: float = 6.0  # stop repeating after this much timed time (at least min_repeats)
    long_call_s: float = 10.0
    max_call_s: float = 90.0
    matmul_n: int = 2048
    target_n: int = 16384
    fit_min_n: int = 1024
    headline: tuple[str, str, str] = ("flt-logit/m256/R32", "softmax+t5", "performer/m256")  # FLT, exact, FAVOR+


def _both(*names: str, **kw: Any) -> tuple[Run, ...]:
    return tuple(Run(n, causal, **kw) for n in names for causal in (False, True))


PRESETS: dict[str, Preset] = {
    # flt bench speed --preset quick: CI smoke, ~20 s on 2 cores. Timings meaningless.
    "quick": Preset(
        shapes=("tiny",),
        lengths=(64, 256),
        runs=(Run("softmax"), Run("softmax+t5"), Run("performer/m64"), *_both("flt-logit/m64/R8"), Run("flt-mult/m32/R4"),
              Run("flt-logit/m256/R32+bf16", modes=("fwd+bwd",)),
              Run("toeplitz/m16"), Run("performer-pytorch/m32")),
        kronecker=("op:kronecker/m16/R4",),
        kronecker_lengths=(256,),
        repeats=3, min_repeats=2, budget_s=1.0, matmul_n=256, target_n=256, fit_min_n=64,
        headline=("flt-logit/m64/R8", "softmax+t5", "performer/m64"),
    ),
    # flt bench speed: the targets' shape (B=1, H=4, D=64) up to N = 16384; 10-11 min measured
    # on a 2-core machine shared with other jobs, ~3 min of it the exact layers at N = 16384,
    # before the compiled, bf16 and near-set variants were added (each compiled
    # configuration compiles in its own process: about a minute more per row).
    # Expect at N = 16384: FLT-logit fwd ~0.5-1 s against ~25-40 s for exact softmax with a
    # materialised T5 bias (ratio ~35-50), fwd+bwd ~2 s.
    "default": Preset(
        shapes=("lm",),
        lengths=(256, 1024, 4096, 16384),
        runs=(
            Run("softmax+t5"), Run("softmax+alibi", modes=("fwd+bwd",)), Run("softmax", max_n=4096),
            *_both("performer/m256", "flt-logit/m256/R32", "flt-mult/m64/R8"),
            Run("toeplitz/m64", modes=("fwd",)), Run("toeplitz/m64", modes=("fwd+bwd",), max_n=4096),
            Run("performer-pytorch/m256"), Run("performer-pytorch/m256", causal=True, max_n=4096),
            *_both("flt-logit/m256/R32+compile"), Run("flt-logit/m256/R32+bf16"), Run("flt-logit/m256/R32+compile+bf16"),
            Run("performer/m256+compile"), *_both("flt-mult/m64/R8+compile"), Run("flt-mult-hedgehog/m32/R256"),
            Run("flt-logit/m256/R32/near16"), Run("flt-logit/m256/R32/band8"), Run("flt-mult/m64/R8/near16"),
        ),
        kronecker=("op:kronecker/m64/R8", "op:kronecker/m64/R32", "op:kronecker/m256/R32"),
        kronecker_lengths=(16384,),
        max_call_s=60.0,
    ),
    # flt bench speed --preset full: more variants, N up to 65536, a batched shape; over 1 h.
    "full": Preset(
        shapes=("lm", "batch"),
        lengths=(256, 1024, 4096, 16384, 65536),
        runs=(
            Run("softmax"), Run("softmax", causal=True), Run("softmax+t5"), Run("softmax+alibi"), Run("softmax+spectrum"),
            *_both("performer/m64", "performer/m256", "flt-logit/m64/R8", "flt-logit/m128/R16", "flt-logit/m256/R32"),
            *_both("flt-logit/m256/R64", "flt-mult/m64/R8", "flt-mult/m128/R16", "flt-mult/m256/R32"),
            *_both("toeplitz/m64"), Run("toeplitz/m256"), *_both("performer-pytorch/m256"),
        ),
        kronecker=tuple(n for n in VARIANTS if n.startswith("op:kronecker/") and not n.endswith(("m16/R4", "m32/R4"))),
        kronecker_lengths=(4096, 16384, 65536),
        max_call_s=180.0,
    ),
}
