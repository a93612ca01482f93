"""FLT's near set (``near_neighbors=k``) on the molecule tasks: the pairs it holds and the masks.

Why the small catalysis preset trains worse with an exact near set than without one
(docs/results.md, "Catalysis: a near set does not approach the target"). Two modes:

* Initialisation (default): for the small preset of ``molecule`` (the generated catalysis
  set) and ``qm9``, with and without the near set, same seed: structure sizes, the
  distances of near-set pairs and of the pairs beyond, how often the ``k``-th and
  ``(k+1)``-th nearest atoms tie (the set then splits an equidistant shell), and in the
  first layer the mask each pair gets: the spectrum's exact ``f``, ``f_near`` and the
  random-feature estimate ``f^ = a_i.c_j``; then the first batch's loss and gradients of
  both models with the same weights.
* ``--runs DIR ...``: trained runs (or checkpoint directories) on their validation split:
  the error's spread, how much exact attention's predictions move when the atoms are
  permuted or the structures rotated, and, per layer, the learned amplitudes and lengths of ``f`` and
  ``f_near``, the share of pairs whose exact mask is negative, the row cancellation
  ``sum_j |w_ij| / |sum_j w_ij|`` of the exact weights ``w = mask * phi(q).phi(k)``, and
  the near set's share of each row's weight.

    PYTHONPATH=src python scripts/near_set_mask_check.py --tasks molecule qm9 --k 16
    PYTHONPATH=src python scripts/near_set_mask_check.py --runs runs/mol-near16 runs/mol-flt

Reads the cached data sets (the catalysis set is generated on first use, about 1 min).
"""

from __future__ import annotations

import argparse

import torch

from flt.data import collate_molecules
from flt.tasks import TASKS, load_task
from flt.train import get_preset
from flt.train.checkpoint import load_checkpoint_model
from flt.train.rng import seed_everything


def quantiles(x: torch.Tensor) -> str:
    """Mean and the 5 / 50 / 95% quantiles of ``x``, on one line."""
    q = torch.quantile(x.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
    return f"{float(x.double().mean()):.2f} (5/50/95%: {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f})"


def flt_layers(model) -> list:
    """The model's FLT layers (those with a spectrum and a near-set slot), in order."""
    layers = [m for m in model.modules() if hasattr(m, "spectrum") and hasattr(m, "near_spectrum")]
    if not layers:
        raise ValueError("the model has no FLT layer")
    return layers


def load(task_name: str, data: dict):
    """The task with its data, without a progress bar where the task has one."""
    quiet = {"progress": False} if "progress" in TASKS[task_name].options else {}
    return load_task(task_name, {**data, **quiet})


def centred_batch(data, count: int):
    """The first ``count`` structures, padded, positions centred on each structure's atoms as the model does."""
    batch = collate_molecules([data[i] for i in range(min(count, len(data)))])
    valid = ~batch.key_padding_mask
    keep = valid.unsqueeze(-1).to(batch.pos.dtype)
    pos = (batch.pos - (batch.pos * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True)) * keep
    return pos, valid


@torch.no_grad()
def check_init(task_name: str, k: int, seed: int, structures: int) -> None:
    """The near set's pairs and the first layer's masks at initialisation (module docstring)."""
    preset = get_preset(task_name, "small", "flt", "none")
    task = load(task_name, preset.data)
    cfg = task.configure(preset.model)
    seed_everything(seed)
    near_model = task.build_model(type(cfg)(**{**cfg.__dict__, "attention_options": {**cfg.attention_options, "near_neighbors": k}}))
    layer = flt_layers(near_model)[0]
    seed_everything(seed)
    plain_model = task.build_model(cfg)
    plain = flt_layers(plain_model)[0]
    pos, valid = centred_batch(task.train, structures)
    atoms = valid.sum(1)
    print(f"== {task_name}: atoms per structure (first {len(atoms)} training structures) {quantiles(atoms.float())}; "
          f"at most k = {k} atoms in {float((atoms <= k).float().mean()):.0%}")
    B, N, _ = pos.shape
    delta = pos.unsqueeze(2) - pos.unsqueeze(1)  # [B, N, N, 3]
    dist = delta.norm(dim=-1)
    pair_ok = valid.unsqueeze(2) & valid.unsqueeze(1)
    in_set = torch.zeros(B, N, N, dtype=torch.bool).scatter(-1, layer.near.keys(pos, valid), True)
    near_pairs, far_pairs = in_set & pair_ok, ~in_set & pair_ok
    off_diagonal = ~torch.eye(N, dtype=torch.bool).unsqueeze(0)
    print(f"  near-set pairs: {float(near_pairs.sum() / pair_ok.sum()):.0%} of all, distance (self excluded) "
          f"{quantiles(dist[near_pairs & off_diagonal])} A")
    if far_pairs.any():
        print(f"  pairs beyond it: distance {quantiles(dist[far_pairs])} A")
    ordered = dist.masked_fill(~valid[:, None, :], float("inf")).sort(-1).values  # self first
    rows = valid & (atoms > k).unsqueeze(1)
    if rows.any():
        gap = (ordered[..., k] - ordered[..., k - 1])[rows]
        print(f"  atoms of structures with more than k atoms whose k-th and (k+1)-th nearest atoms tie (< 1e-3 A): "
              f"{float((gap < 1e-3).float().mean()):.1%}")
    f = layer.spectrum.mask(delta)  # [B, N, N, H]
    f_near = layer.near_spectrum.of_offsets(delta)
    a, c = layer.spectrum.features(pos)  # [B|1, H, N, 2R]
    f_hat = torch.einsum("bhir,bhjr->bijh", a.expand(B, -1, -1, -1), c.expand(B, -1, -1, -1))
    print(f"  layer 0: f equal with and without the near set: {torch.equal(f, plain.spectrum.mask(delta))}; "
          f"f_near amplitudes {[round(float(x), 2) for x in layer.near_spectrum.amplitude]}")
    for name, pairs in (("near", near_pairs & off_diagonal), ("far", far_pairs)):
        if pairs.any():
            sel = pairs.unsqueeze(-1).expand_as(f)
            err = (f_hat - f)[sel]
            print(f"  {name:4s} pairs: f {quantiles(f[sel])}, f_near {quantiles(f_near[sel])}, "
                  f"f^ - f: mean {float(err.mean()):+.3f}, rms {float(err.square().mean().sqrt()):.3f}")
    compare_gradients(task, plain_model, near_model)


def compare_gradients(task, plain, near) -> None:
    """The first training batch's loss and gradients with the plain model's weights copied
    into the near-set model (its ``f_near`` stays 0)."""
    near.load_state_dict(plain.state_dict(), strict=False)
    batch = collate_molecules([task.train[i] for i in range(32)])
    grads, losses = [], []
    for model in (plain, near):
        model.train()
        model.zero_grad()
        with torch.enable_grad():
            loss = task.loss(model, batch)
            loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    gaps = {n: float((g - grads[1][n]).norm() / g.norm()) for n, g in grads[0].items() if g.norm() > 1e-6}
    worst = max(gaps, key=gaps.get)
    print(f"  first batch, same weights: loss {losses[0]:.5f} without the near set, {losses[1]:.5f} with it; largest "
          f"relative gradient difference {gaps[worst]:.3f} ({worst}; parameters with a gradient norm above 1e-6)")


def layer_inputs(model, batch) -> list:
    """``(layer, x, pos, key_padding_mask)`` of every FLT layer in one forward pass of ``batch``."""
    captured = []

    def keep(module, args, kwargs, _out):
        merged = dict(zip(("x", "pos", "key_padding_mask"), args, strict=False)) | kwargs
        captured.append((module, merged["x"], merged.get("pos"), merged.get("key_padding_mask")))

    hooks = [m.register_forward_hook(keep, with_kwargs=True) for m in flt_layers(model)]
    try:
        model(batch.z, batch.pos, batch.key_padding_mask)
    finally:
        for h in hooks:
            h.remove()
    return captured


def describe_layer(i: int, layer, x, pos, pad) -> None:
    """One layer's learned terms and its exact weights' signs and row cancellation."""
    p = layer.prepare(x, pos, pad)
    xq, xk = layer.scaled_qk(p.q, p.k, p.pos)
    kernel = layer.feature_map.exact_kernel(xq, xk)  # [B, H, N, N]
    delta = p.pos.unsqueeze(2) - p.pos.unsqueeze(1)
    mask = layer.far_mask(delta).permute(0, 3, 1, 2)
    valid = torch.ones(x.shape[:2], dtype=torch.bool) if p.pad is None else ~p.pad
    keys = valid[:, None, None, :].expand_as(kernel)
    rows = valid[:, None, :].expand(-1, layer.heads, -1)
    terms = (f"f: amplitude {[round(float(a), 2) for a in layer.spectrum.amplitude]}, "
             f"length {[round(float(v), 2) for v in layer.spectrum.log_length.exp()[:, 0]]}")
    in_set = torch.zeros_like(keys)
    if layer.near is not None:
        in_set = layer.near.pairs(layer, p, kernel.dtype).expand_as(kernel) & keys
        mask = mask + torch.where(in_set, layer.near_spectrum.of_offsets(delta).permute(0, 3, 1, 2), torch.zeros_like(mask))
        terms += (f"; f_near: amplitude {[round(float(a), 2) for a in layer.near_spectrum.amplitude]}, "
                  f"length {[round(float(v), 2) for v in layer.near_spectrum.log_length.exp()[:, 0]]}")
    w = torch.where(keys, kernel * mask, torch.zeros_like(mask))
    cancel = (w.abs().sum(-1) / w.sum(-1).abs())[rows].double()
    near_share = (torch.where(in_set, w, torch.zeros_like(w)).sum(-1) / w.sum(-1))[rows]
    print(f"  layer {i}: {terms}")
    print(f"    pairs with mask < 0: {float(((mask < 0) & keys).sum() / keys.sum()):.1%}; row sum|w| / |sum w| "
          f"50/99/max {float(cancel.quantile(0.5)):.2f} / {float(cancel.quantile(0.99)):.2f} / {float(cancel.max()):.3g}; "
          f"near set's share of the row weight {quantiles(near_share)}")


@torch.no_grad()
def probe_run(run_dir: str, structures: int) -> None:
    """A trained run's validation errors and its layers (module docstring)."""
    model, meta = load_checkpoint_model(run_dir, report=lambda _: None)
    task = load(meta["preset"]["task"], meta["preset"]["data"])
    batch = collate_molecules([task.valid[i] for i in range(min(structures, len(task.valid)))])
    err = (model(batch.z, batch.pos, batch.key_padding_mask) - batch.y).abs()
    err_exact = (model(batch.z, batch.pos, batch.key_padding_mask, exact=True) - batch.y).abs()
    print(f"== {run_dir}: {len(err)} validation structures, MAE {float(err.mean()):.3f} (exact attention "
          f"{float(err_exact.mean()):.3f}); |error| 50/90/99%/max "
          f"{' / '.join(f'{float(err.double().quantile(q)):.3f}' for q in (0.5, 0.9, 0.99))} / {float(err.max()):.3f}")
    permuted, rotated = symmetry_changes(model, batch)
    print(f"  exact attention's prediction change (eV): atoms permuted mean {permuted.mean():.4f}, max {permuted.max():.4f}; "
          f"structures rotated mean {rotated.mean():.4f}, max {rotated.max():.4f}")
    for i, inputs in enumerate(layer_inputs(model, batch)):
        describe_layer(i, *inputs)


def symmetry_changes(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``|change|`` of the exact-attention predictions when every structure's atoms are
    permuted, and when all are rotated (both leave plain FLT's exact attention unchanged;
    a near set's choice among equidistant atoms can change)."""
    generator = torch.Generator().manual_seed(0)
    z, pos, pad = batch.z, batch.pos, batch.key_padding_mask
    base = model(z, pos, pad, exact=True)
    order = torch.arange(z.shape[1]).repeat(z.shape[0], 1)
    for i, n in enumerate((~pad).sum(1).tolist()):
        order[i, :n] = torch.randperm(n, generator=generator)
    permuted = model(z.gather(1, order), pos.gather(1, order.unsqueeze(-1).expand_as(pos)), pad, exact=True)
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, generator=generator, dtype=pos.dtype))
    rotated = model(z, pos @ rotation.T, pad, exact=True)
    return (permuted - base).abs(), (rotated - base).abs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["molecule", "qm9"], help="tasks to check at initialisation")
    parser.add_argument("--k", type=int, default=16, help="near_neighbors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--structures", type=int, default=256, help="structures to look at")
    parser.add_argument("--runs", nargs="*", default=[], help="trained run directories to probe instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs:
        probe_run(run, args.structures)
    if not args.runs:
        for name in args.tasks:
            check_init(name, args.k, args.seed, args.structures)


if __name__ == "__main__":
    main()
