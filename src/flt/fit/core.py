"""Coordinate networks fitted to signals and images (docs/fit.md).

A *problem* is ``S`` signals sampled at the same ``N`` coordinates in ``[0, 1)^P``:
coordinates ``[N, P]``, targets ``[S, N, C]`` and a training mask ``[N]`` (the even
samples; the odd ones are never seen). Every signal gets its own network (and its own
copy of a learnable encoding); the ``S`` networks are trained together, their weights
stacked (:class:`StackedNetwork`; learnable encodings through ``torch.func.vmap``), which,
since the loss is the sum of the per-signal losses and Adam acts elementwise, is the same
as ``S`` separate fits (tested in float64).

An encoding without parameters is evaluated once, before training, and shared by every
signal: the same draw of random frequencies for all of them.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from flt.fit.config import FitConfig
from flt.fit.encodings import axis_encoding, build_encoding, default_dim


@dataclass(frozen=True)
class Problem:
    """``coords [N, P]`` in ``[0, 1)^P``, ``targets [S, N, C]`` in ``[0, 1]``, ``train [N]``
    (bool) and ``shape``: the grid ``(N,)`` or ``(H, W)`` the ``N`` samples lie on."""

    coords: torch.Tensor
    targets: torch.Tensor
    train: torch.Tensor
    shape: tuple[int, ...]
    labels: tuple[str, ...]


def grid_coords(shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Coordinates ``i_p / n_p`` of a regular grid ``shape = (n_1, ..., n_P)``, row-major: ``[prod(shape), P]``."""
    axes = [torch.arange(n, dtype=dtype) / n for n in shape]
    mesh = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], dim=-1)


def even_mask(shape: tuple[int, ...]) -> torch.Tensor:
    """``[prod(shape)]`` bool: samples whose every grid index is even (1/2 of a 1-D signal,
    1/4 of an image)."""
    axes = [torch.arange(n) % 2 == 0 for n in shape]
    mesh = torch.meshgrid(*axes, indexing="ij")
    out = mesh[0]
    for m in mesh[1:]:
        out = out & m
    return out.reshape(-1)


def signal_problem(image: np.ndarray, rows: list[int]) -> Problem:
    """Rows of a grey image ``[H, W]`` as ``S = len(rows)`` 1-D signals of ``W`` samples."""
    if image.ndim != 2:
        raise ValueError(f"signals are rows of a grey image [H, W], got shape {image.shape}")
    height, width = image.shape
    bad = [r for r in rows if not 0 <= r < height]
    if bad:
        raise ValueError(f"--rows: rows {bad} are outside the image's {height} rows")
    targets = torch.as_tensor(image[rows], dtype=torch.float64).unsqueeze(-1)
    return Problem(grid_coords((width,)), targets, even_mask((width,)), (width,), tuple(f"row {r}" for r in rows))


def image_problem(image: np.ndarray) -> Problem:
    """One image ``[H, W]`` or ``[H, W, C]`` as one 2-D signal of ``H W`` samples."""
    height, width = image.shape[:2]
    pixels = torch.as_tensor(image, dtype=torch.float64).reshape(1, height * width, -1)
    return Problem(grid_coords((height, width)), pixels, even_mask((height, width)), (height, width), ("image",))


def psnr(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB for intensities in ``[0, 1]``: ``10 log10(1 / MSE)``,
    the MSE over every axis but the first: ``[S, ...] -> [S]``."""
    mse = (prediction.double() - target.double()).pow(2).flatten(1).mean(1)
    return 10.0 * torch.log10(1.0 / mse)


class StackedNetwork(nn.Module):
    """``S`` networks of one architecture (linear layers with ReLU between them), their
    weights stacked: layer ``l`` holds ``weight [S, in, out]`` and ``bias [S, 1, out]``.

    Built from ``S`` ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU`` (whose initial
    values it copies), so network ``s`` is exactly the ``s``-th module, evaluated side by side.

    Shapes: ``forward(h [N, D] shared by every network, or [S, N, D]) -> [S, N, C]``.
    """

    def __init__(self, nets: list[nn.Sequential], output: str):
        super().__init__()
        layers = [[m for m in net if isinstance(m, nn.Linear)] for net in nets]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.stack([ls[i].weight.detach().T for ls in layers]).contiguous()) for i in range(len(layers[0]))
        )
        self.biases = nn.ParameterList(
            nn.Parameter(torch.stack([ls[i].bias.detach() for ls in layers]).unsqueeze(1)) for i in range(len(layers[0]))
        )
        self.output = output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            if h.ndim == 2:
                # Inputs shared by the S networks: one [N, D] x [D, S out] product rather
                # than S products with copies of the inputs (and the same for the gradient).
                num, size = w.shape[0], w.shape[2]
                h = (h @ w.permute(1, 0, 2).reshape(w.shape[1], num * size)).reshape(h.shape[0], num, size).transpose(0, 1) + b
            else:
                h = torch.baddbmm(b, h, w)
            if i < last:
                h = torch.relu(h)
        return torch.sigmoid(h) if self.output == "sigmoid" else h


def build_net(config: FitConfig, in_dim: int, out_dim: int, *, dtype: torch.dtype | None = None) -> nn.Sequential:
    """``linear``: one layer ``D -> C``; ``mlp``: ``depth`` layers, ``depth - 1`` hidden
    ReLU layers of ``width`` (the paper's 4 x 256)."""
    if config.model == "linear":
        return nn.Sequential(nn.Linear(in_dim, out_dim, dtype=dtype))
    sizes = [in_dim] + [config.width] * (config.depth - 1)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b, dtype=dtype), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], out_dim, dtype=dtype))


def diagnostics(encoder: nn.Module, config: FitConfig, problem: Problem) -> dict[str, float]:
    """Stable rank and distance preservation (:mod:`flt.posenc.shifted_basis`) of the
    encoding's 1-D (per-axis) form on ``[0, 1]``, in float64:

    * ``stable_rank_train``: of ``Psi`` at the training coordinates of one axis;
    * ``stable_rank_dense``: of ``Psi`` at 2000 points covering ``[0, 1]`` (the continuum
      value the theory speaks of);
    * ``distance_preservation`` and ``product = stable_rank_dense * distance_preservation``
      (``sqrt(ln 10 / pi) = 0.856`` for a dense Gaussian basis, whatever its width).
    """
    from flt.posenc import distance_preservation, embedding_matrix, stable_rank

    enc = axis_encoding(encoder, config.posenc, config.posenc_options, seed=config.seed)
    n_axis = problem.shape[0]
    train_x = (torch.arange(0, n_axis, 2, dtype=torch.float64) / n_axis).reshape(1, -1, 1)
    with torch.no_grad():
        psi_train = enc(train_x)[0].double()
        sr_train = stable_rank(psi_train) if psi_train.abs().max() > 0 else 0.0
        sr_dense = stable_rank(embedding_matrix(enc, 2000, (0.0, 1.0)))
        dp = distance_preservation(enc, domain=(0.0, 1.0))
    return {"stable_rank_train": sr_train, "stable_rank_dense": sr_dense, "distance_preservation": dp, "product": sr_dense * dp}


@dataclass
class FitResult:
    """What :func:`fit_problem` returns: the final metrics (means over signals, and per
    signal), the predictions ``[S, N, C]``, the PSNR history and the encoding's diagnostics."""

    final: dict[str, float]
    per_signal: dict[str, list[float]]
    prediction: torch.Tensor
    history: list[dict[str, float]]
    diagnostics: dict[str, float]
    parameters: int
    dim: int


def _metrics(pred: torch.Tensor, problem: Problem) -> dict[str, torch.Tensor]:
    t, m = problem.targets, problem.train
    return {"psnr_train": psnr(pred[:, m], t[:, m]), "psnr_test": psnr(pred, t), "psnr_odd": psnr(pred[:, ~m], t[:, ~m])}


def fit_problem(problem: Problem, config: FitConfig, *, device: str | torch.device = "cpu", progress: bool = False,
                desc: str = "fit") -> FitResult:
    """Fit one network per signal of ``problem`` as ``config`` says and evaluate it.

    Training: full batch on the training samples, Adam at ``config.lr``, loss the sum over
    signals of each signal's mean squared error. Evaluation every ``config.eval_every``
    epochs and at the end: ``psnr_train`` (training samples), ``psnr_test`` (all samples,
    the paper's test set) and ``psnr_odd`` (the held-out samples only), each the mean over
    signals of the per-signal PSNR.
    """
    dtype = getattr(torch, config.dtype)
    device = torch.device(device)
    num_signals, _, channels = problem.targets.shape
    pos_dim = problem.coords.shape[1]
    dim = default_dim(config.posenc, pos_dim, config.dim, config.axes)
    encoder = build_encoding(config.posenc, dim, pos_dim, config.posenc_options, axes=config.axes, seed=config.seed, dtype=dtype)
    diag = diagnostics(encoder, config, problem)
    encoder = encoder.to(device)
    coords = problem.coords.to(device=device, dtype=dtype)
    learnable = any(True for _ in encoder.parameters())
    if learnable:
        inputs = coords
    else:
        with torch.no_grad():
            inputs = encoder(coords.unsqueeze(0))[0].to(dtype)  # [N, D], once for every signal
    nets = []
    for s in range(num_signals):
        torch.manual_seed(config.seed + s)
        nets.append(build_net(config, cast(int, encoder.dim) if learnable else inputs.shape[-1], channels, dtype=dtype))
    network = StackedNetwork(nets, config.resolved_output).to(device)
    trained = list(network.parameters())
    if learnable:
        # One copy of the encoding per signal (all start from the same draw), evaluated
        # side by side: features [S, N, D].
        enc_params, enc_buffers = stack_module_state([copy.deepcopy(encoder) for _ in range(num_signals)])
        base = copy.deepcopy(encoder).to("meta")
        encode = vmap(lambda p, b, x: functional_call(base, (p, b), (x.unsqueeze(0),))[0], in_dims=(0, 0, None))
        trained += list(enc_params.values())

        def forward(x: torch.Tensor) -> torch.Tensor:
            return network(encode(enc_params, enc_buffers, x))
    else:
        forward = network
    targets = problem.targets.to(device=device, dtype=dtype)
    train = problem.train.to(device)
    train_inputs, train_targets = inputs[train], targets[:, train]
    optimizer = torch.optim.Adam(trained, lr=config.lr)
    history: list[dict[str, float]] = []

    def evaluate(epoch: int) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.no_grad():
            pred = forward(inputs).double().cpu()
        values = {k: float(v.mean()) for k, v in _metrics(pred, problem).items()}
        history.append({"epoch": epoch, **values})
        return pred, values

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.epochs, desc=desc, dynamic_ncols=True, unit="epoch", leave=False)
    try:
        for epoch in range(1, config.epochs + 1):
            pred = forward(train_inputs)
            loss = (pred - train_targets).pow(2).flatten(1).mean(1).sum()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the training loss is {float(loss)} at epoch {epoch}; lower --lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if epoch % config.eval_every == 0 and epoch != config.epochs:
                _, values = evaluate(epoch)
                if bar is not None:
                    bar.set_postfix_str(f"train {values['psnr_train']:.2f} dB  test {values['psnr_test']:.2f} dB")
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    pred, final = evaluate(config.epochs)
    per_signal = {k: [float(x) for x in v] for k, v in _metrics(pred, problem).items()}
    final["loss"] = float(loss.detach()) / num_signals
    n_params = sum(p.numel() for p in trained) // num_signals
    return FitResult(final, per_signal, pred, history, diag, n_params, dim)
