"""A QM9 model with FLT attention next to SchNet, on the same molecules, loop and budget.

Atoms are points in 3-D: FLT's relative term is a Gaussian of interatomic distance (a
multiplicative mask on learned ``hedgehog`` kernel features, estimated with 256 QMC
frequencies), over all atoms of a molecule. SchNet is torch_geometric's. Both predict the
HOMO-LUMO gap; the test MAE is in meV. Needs the qm9 extra
(``pip install "flt-attention[qm9]"``: the QM9 set ships in the qm9pack wheel).

    python examples/qm9_flt_vs_schnet.py            # 10k molecules, 1500 steps each
    python examples/qm9_flt_vs_schnet.py --smoke    # a few steps on 256 molecules
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch_geometric.nn.models import SchNet

from flt.data.qm9 import load_qm9
from flt.layers import FLTAttention, Hedgehog, Term


class FLTMolecule(nn.Module):
    """Atom embeddings, FLT blocks over atom coordinates, a mean over atoms (the gap is intensive)."""

    def __init__(self, dim: int = 64, depth: int = 3, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(10, dim)  # atomic numbers H..F
        self.attn = nn.ModuleList(
            FLTAttention(dim, heads, pos_dim=3, coupling="multiplicative", features=Hedgehog(num_features=32),
                         relative=Term("gaussian", num_frequencies=256, sampler="qmc", length_scale=3.0))
            for _ in range(depth)
        )
        self.mlp = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, z, pos, pad):  # z [B, N], pos [B, N, 3], pad [B, N] (True: no atom)
        x = self.embed(z)
        for attn, norm, mlp in zip(self.attn, self.norm, self.mlp, strict=True):
            x = x + attn(norm(x), pos, key_padding_mask=pad)
            x = x + mlp(x)
        return self.out(x).squeeze(-1).masked_fill(pad, 0).sum(-1) / (~pad).sum(-1)  # mean over atoms, as SchNet below


def radius_graph(pos, batch, cutoff=10.0):
    """SchNet's graph in plain torch: every pair of atoms of one molecule within ``cutoff``
    Angstrom (torch_geometric's own needs the compiled pyg-lib)."""
    distance = torch.cdist(pos, pos)
    near = (batch[:, None] == batch[None, :]) & (distance < cutoff)
    near.fill_diagonal_(False)
    i, j = near.nonzero(as_tuple=True)
    return torch.stack([j, i]), distance[i, j]


def batch_of(data, idx):
    """Padded ``z [B, N]``, ``pos [B, N, 3]``, ``pad [B, N]`` and flat ``z, pos, molecule index`` (SchNet's form)."""
    starts, ends = data.offsets[idx], data.offsets[idx + 1]
    n = int((ends - starts).max())
    z, pos = torch.zeros(len(idx), n, dtype=torch.long), torch.zeros(len(idx), n, 3)
    pad = torch.ones(len(idx), n, dtype=torch.bool)
    for row, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        z[row, : e - s], pos[row, : e - s], pad[row, : e - s] = data.z[s:e], data.pos[s:e], False
    flat = torch.arange(len(idx)).repeat_interleave(ends - starts)
    return z, pos, pad, (z[~pad], pos[~pad], flat)


def train_and_test(name, model, splits, steps, mean, std):
    predict = (lambda b: model(*b[:3])) if name == "FLT" else (lambda b: model(*b[3]).squeeze(-1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(0, len(splits.train.y), (32,))
        loss = F.mse_loss(predict(batch_of(splits.train, idx)), (splits.train.y[idx] - mean) / std)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        chunks = torch.arange(len(splits.test.y)).split(256)
        predicted = torch.cat([predict(batch_of(splits.test, idx)) for idx in chunks]) * std + mean
        mae = (predicted - splits.test.y).abs().mean().item()
    print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters, test MAE {mae:.1f} meV after {steps} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps on 256 molecules")
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = {"num_train": 256, "num_valid": 64, "num_test": 64} if args.smoke else {"num_train": 10_000, "num_valid": 2_000, "num_test": 10_831}
    splits = load_qm9(target="gap", **sizes)  # meV; the same seeded split as `flt train qm9`
    mean, std = splits.train.y.mean(), splits.train.y.std()
    steps = 5 if args.smoke else 1500
    dim = 32 if args.smoke else 64
    train_and_test("FLT", FLTMolecule(dim=dim, depth=1 if args.smoke else 3), splits, steps, mean, std)
    schnet = SchNet(hidden_channels=dim, num_filters=dim, num_interactions=1 if args.smoke else 3,
                    interaction_graph=radius_graph, readout="mean")
    train_and_test("SchNet", schnet, splits, steps, mean, std)


if __name__ == "__main__":
    main()
