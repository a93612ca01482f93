"""A byte-level language model over long contexts with banded FLT, then generation from a
state whose size does not grow with the text.

Each layer is FLT with an exact band of 16 bytes (a learned weight per offset) and the
random-feature estimate beyond it; ``far_field="near"`` drops that estimate, which on long
byte contexts measured better (docs/long_context.md). Training reads this project's own
Python source as bytes.

    python examples/long_byte_lm.py                  # 1024-byte contexts, a few minutes on a CPU
    python examples/long_byte_lm.py --smoke          # seconds: a tiny model, a few steps
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from flt.layers import Band, FLTAttention, Term


class Block(nn.Module):
    """Pre-norm Transformer block around one causal FLT layer."""

    def __init__(self, dim: int, heads: int, far_field: bool | str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = FLTAttention(dim, heads, causal=True, relative=Term("local", num_frequencies=16),
                                 near=Band(16, term="clipped"), far_field=far_field)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))  # positions default to token indices 0..N-1
        return x + self.mlp(self.norm2(x))

    def step(self, x, state):
        """One token ``x [B, dim]`` from the layer's decoding state (None to start)."""
        y, state = self.attn.step(self.norm1(x), state)
        x = x + y
        return x + self.mlp(self.norm2(x)), state


class ByteLM(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, far_field: bool | str = "near"):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # also the output head: keep first logits small
        self.blocks = nn.ModuleList(Block(dim, heads, far_field) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens):  # [B, N] -> logits [B, N, 256]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """Greedy continuation of ``prompt [B, T]`` token by token; also the bytes each
        layer's state holds after every step (constant: a ring buffer of the band's keys
        and values, and the far field's running sums)."""
        states, sizes, out = [None] * len(self.blocks), [], prompt
        for t in range(prompt.shape[1] + new_tokens - 1):
            x = self.embed(out[:, t])
            for i, block in enumerate(self.blocks):
                x, states[i] = block.step(x, states[i])
            if t >= prompt.shape[1] - 1:
                out = torch.cat([out, (self.norm(x) @ self.embed.weight.T).argmax(-1, keepdim=True)], dim=1)
                sizes.append(sum(state_bytes(s) for s in states))
        return out, sizes


def state_bytes(state) -> int:
    """Bytes of every tensor inside a decoding state (a dataclass of tensors)."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(s) for s in state)
    return sum(state_bytes(v) for v in vars(state).values()) if hasattr(state, "__dict__") else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few steps")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    context, dim, depth, steps = (128, 32, 1, 5) if args.smoke else (1024, 128, 4, 600)
    steps = args.steps or steps

    source = Path(__file__).resolve().parents[1] / "src" / "flt"
    files = sorted(source.rglob("*.py")) or [Path(__file__)]  # an installed copy: read this file alone
    data = torch.tensor(list(b"\n".join(f.read_bytes() for f in files)), dtype=torch.long)

    model = ByteLM(dim, depth, heads=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(data) - context - 1, (8,))
        batch = torch.stack([data[s : s + context + 1] for s in starts])
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % max(1, steps // 5) == 0 or step == steps:
            print(f"step {step}: {loss.item() / 0.6931:.3f} bits per byte")

    model.eval()
    prompt = torch.tensor([list(b"def ")])
    text, sizes = model.generate(prompt, new_tokens=32 if args.smoke else 200)
    print(repr(bytes(text[0].tolist()).decode("utf-8", errors="replace")))
    print(f"decoding state: {sizes[0]} bytes after the first new token, {sizes[-1]} after the last")
    assert sizes[0] == sizes[-1], "the state of banded FLT does not grow with the text"


if __name__ == "__main__":
    main()
