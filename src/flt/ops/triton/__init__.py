"""FAVOR+ linear attention, FLT's couplings and its band as Triton kernels, with the features
made inside the kernels: fast paths of :mod:`flt.ops.linear` and :mod:`flt.ops.band`
(the optional extra ``triton``). This package's face; the work is in its modules:

* :mod:`~flt.ops.triton.dispatch`: :func:`favor_attention`, the entry;
* :mod:`~flt.ops.triton.favor`: the one-program kernel's launch and :func:`favor_attention_torch`;
* :mod:`~flt.ops.triton.split`: the feature-split kernels; :mod:`~flt.ops.triton.band`: the band;
* :mod:`~flt.ops.triton.launch`: what every launcher shares (triton there, devices, segments, tiles);
* :mod:`~flt.ops.triton.kernels`, :mod:`~flt.ops.triton.split_kernels`: the kernels themselves.
"""

from flt.ops.triton.dispatch import favor_attention
from flt.ops.triton.favor import favor_attention_torch
from flt.ops.triton.launch import (
    NO_KEY,
    TRITON_CHUNK,
    check_device,
    combine_segments,
    interpreted,
    launch_fitted,
    segment_count,
    tile_candidates,
    triton_available,
)

__all__ = ["NO_KEY", "TRITON_CHUNK", "check_device", "combine_segments", "favor_attention", "favor_attention_torch",
           "interpreted", "launch_fitted", "segment_count", "tile_candidates", "triton_available"]
