"""Pure tensor functions: no parameters, no buffers. Layers own those and call these.

Shape vocabulary, used in every docstring of the package:

====  =========================================================
B     batch
H     heads
N     tokens (queries); ``Nk`` keys where it differs
D     query/key head dimension
Dv    value head dimension
P     position dimension (1 text, 2 image patches, 3 atoms, K graph anchors)
R     number of random frequencies of a spectrum; features have ``2R`` entries
m     number of kernel features
====  =========================================================

Layouts: queries, keys and values ``[B, H, N, D]``; positions ``[B, N, P]``; kernel
features ``[B, H, N, m]``; spectral features ``[B or 1, H, N, 2R]``.
"""

from flt.ops.features import (
    elu_features,
    favor_plus_features,
    gaussian_orthogonal_random_matrix,
    hedgehog_features,
    relu_features,
    relu_kernel,
    taylor_features,
    taylor_kernel,
)
from flt.ops.linear import (
    RecurrentState,
    flt_attention,
    kronecker_condition,
    linear_attention,
    recurrent_step,
)
from flt.ops.mesh import mesh_sum, mesh_sum_reference
from flt.ops.reference import (
    flt_attention_reference,
    linear_attention_reference,
    rpe_attention_reference,
)
from flt.ops.softmax import (
    BACKENDS as SOFTMAX_BACKENDS,
    flex_attention_available,
    softmax_attention,
)
from flt.ops.toeplitz import (
    fft_length,
    toeplitz_attention,
    toeplitz_attention_reference,
    toeplitz_matrix,
    toeplitz_matvec,
)

__all__ = [
    "SOFTMAX_BACKENDS",
    "RecurrentState",
    "elu_features",
    "favor_plus_features",
    "fft_length",
    "flex_attention_available",
    "flt_attention",
    "flt_attention_reference",
    "gaussian_orthogonal_random_matrix",
    "hedgehog_features",
    "kronecker_condition",
    "linear_attention",
    "linear_attention_reference",
    "mesh_sum",
    "mesh_sum_reference",
    "recurrent_step",
    "relu_features",
    "relu_kernel",
    "rpe_attention_reference",
    "softmax_attention",
    "taylor_features",
    "taylor_kernel",
    "toeplitz_attention",
    "toeplitz_attention_reference",
    "toeplitz_matrix",
    "toeplitz_matvec",
]
