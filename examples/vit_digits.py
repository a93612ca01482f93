"""FLTAttention inside a small Vision Transformer, trained on scikit-learn's 8x8 digits.

Patches are points at 2-D coordinates (``pos_dim=2``): FLT attends exactly to each patch's
4 nearest patches and estimates a learned Gaussian-mixture relative term beyond them with
random features, in time linear in the number of patches. Needs the train extra
(``pip install "flt-attention[train]"``: scikit-learn).

    python examples/vit_digits.py            # about 0.95 test accuracy in a few minutes on a CPU
    python examples/vit_digits.py --smoke    # seconds
"""

from __future__ import annotations

import argparse

import torch
from einops import rearrange
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

from flt.layers import FLTAttention, Neighbors


class ViT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, patch: int = 2, image: int = 8):
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(patch * patch, dim)
        side = image // patch
        # One coordinate pair per patch, in patch units: the positions FLT's relative term reads.
        grid = torch.cartesian_prod(torch.arange(side), torch.arange(side)).float()
        self.register_buffer("pos", grid.unsqueeze(0))  # [1, N, 2]
        self.layers = nn.ModuleList(
            nn.ModuleDict({
                "norm1": nn.LayerNorm(dim),
                "attn": FLTAttention(dim, heads, pos_dim=2, relative="gaussian_mixture", near=Neighbors(4)),
                "norm2": nn.LayerNorm(dim),
                "mlp": nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
            })
            for _ in range(depth)
        )
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 10))

    def forward(self, images):  # [B, 8, 8] -> logits [B, 10]
        x = self.embed(rearrange(images, "b (h p) (w q) -> b (h w) (p q)", p=self.patch, q=self.patch))
        pos = self.pos.expand(x.shape[0], -1, -1)
        for layer in self.layers:
            x = x + layer["attn"](layer["norm1"](x), pos)
            x = x + layer["mlp"](layer["norm2"](x))
        return self.head(x.mean(dim=1))  # mean over patches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few steps")
    args = parser.parse_args()
    torch.manual_seed(0)

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:1500], order[1500:]

    model = ViT(dim=32, depth=1) if args.smoke else ViT()
    steps = 20 if args.smoke else 1000
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, steps + 1):
        batch = train[torch.randint(0, len(train), (64,))]
        loss = F.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % max(1, steps // 5) == 0:
            print(f"step {step}: loss {loss.item():.3f}")

    model.eval()
    with torch.no_grad():
        accuracy = (model(images[test]).argmax(-1) == labels[test]).float().mean().item()
    print(f"test accuracy {accuracy:.3f} on {len(test)} images")


if __name__ == "__main__":
    main()
