"""A tiny GPT-style causal language model in plain torch modules, for the convergence benchmark.

Byte-level (vocabulary 256), pre-LayerNorm blocks of causal self-attention and a 4x MLP, learned
position embeddings, an untied output head, no biases. The default size has 1.33M parameters in 28
tensors (4 blocks of width 160, 4 heads, context 128). Initialisation is deterministic: a function of
``seed`` alone (normal(0, 0.02) for every weight matrix and embedding, zeros for biases, ones for
LayerNorm gains), so every rank builds the same model and every setting of a sweep starts from the same
weights.

[Note: few tensors] On the CPU emulator part of a ZeRO-3 step's cost is per parameter tensor (hooks,
gathers, partitioning: the bench's 20-tensor MLP, whose arithmetic is negligible, costs about 0.08
CPU-seconds per rank and step), so the default has no biases (``bias=True`` puts them back) and four wide
blocks rather than six narrow ones: 28 tensors instead of 77 for about the same parameter count.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 256
    context: int = 128
    width: int = 160
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    bias: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} is not a multiple of heads {cfg.heads}")
        self.heads = cfg.heads
        self.qkv = torch.nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.proj = torch.nn.Linear(cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(torch.nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = torch.nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.fc = torch.nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width, bias=cfg.bias)
        self.out = torch.nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(torch.nn.Module):
    """Tokens ``(batch, time)`` -> logits ``(batch, time, vocab)``."""

    def __init__(self, cfg: LMConfig = LMConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = torch.nn.Embedding(cfg.vocab, cfg.width)
        self.pos = torch.nn.Embedding(cfg.context, cfg.width)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = torch.nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.head = torch.nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def build(cfg: LMConfig = LMConfig(), seed: int = 0) -> TinyLM:
    """A model whose weights are a function of ``(cfg, seed)`` alone."""
    gen = torch.Generator().manual_seed(seed)
    model = TinyLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm gains
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (nats per byte)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(cfg: LMConfig = LMConfig()) -> int:
    """Parameter count of a model of this size (builds it on the CPU)."""
    return sum(p.numel() for p in TinyLM(cfg).parameters())
