"""flt: FourierLearner-Transformers, relative positional encodings in linear-time attention."""

from flt.layers import ATTENTION, FLTAttention, LongRangeBlock
from flt.perf import compile, keep_freed_memory  # noqa: A004
from flt.posenc import POSENC
from flt.relative.spectra import SPECTRA

__version__ = "0.2.0"

__all__ = ["ATTENTION", "POSENC", "SPECTRA", "FLTAttention", "LongRangeBlock", "__version__", "compile", "keep_freed_memory"]
