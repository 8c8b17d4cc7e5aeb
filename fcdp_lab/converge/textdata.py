"""Real text that ships with Python, split deterministically, as byte-level language-model windows.

The corpus is ``pydoc_data.topics`` (Python's own help texts, about 465K characters of English
technical prose in CPython 3.11): no download at run time, the same bytes on every machine with the same
Python release (the results record its SHA-256, so runs on another release are not silently compared).

[Note: the split] The UTF-8 bytes of the topics (sorted by name, joined by blank lines) are cut into
chunks of ``chunk`` bytes; every ``heldout_every``-th chunk is held out, the rest is training text. Chunks
rather than whole topics: 79 topics of very different lengths would make a 10% split lumpy, and chunks
spread the held-out part over every topic. A training window never crosses into a held-out chunk,
because each side is its own concatenation.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def corpus_bytes() -> bytes:
    """The corpus: every ``pydoc_data.topics`` entry, sorted by name, as UTF-8."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


@dataclass(frozen=True)
class Split:
    train: bytes
    heldout: bytes
    sha256: str
    """SHA-256 of the whole corpus (which Python release's help texts these are)."""


def split_corpus(data: bytes, chunk: int = 2048, heldout_every: int = 10) -> Split:
    """Deterministic train/held-out split by chunk (see [Note: the split])."""
    if chunk < 1 or heldout_every < 2:
        raise ValueError("chunk must be >= 1 and heldout_every >= 2")
    chunks = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    held = b"".join(c for i, c in enumerate(chunks) if i % heldout_every == heldout_every - 1)
    train = b"".join(c for i, c in enumerate(chunks) if i % heldout_every != heldout_every - 1)
    return Split(train, held, hashlib.sha256(data).hexdigest())


def as_tokens(text: bytes) -> torch.Tensor:
    """Byte-level tokens (vocabulary 256) as int64."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)


def train_batch(tokens: torch.Tensor, context: int, batch: int, *, seed: int, step: int, rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``context + 1`` tokens (inputs, next-token targets) for one rank and
    micro-step: a function of ``(seed, step, rank)`` alone, so every setting sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + rank)
    starts = torch.randint(0, tokens.numel() - context - 1, (batch,), generator=g)
    rows = torch.stack([tokens[s:s + context + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def heldout_windows(tokens: torch.Tensor, context: int, limit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping held-out windows (inputs, targets), in order; the first ``limit`` if ``limit`` > 0."""
    n = (tokens.numel() - 1) // context
    if limit:
        n = min(n, limit)
    x = tokens[:n * context].view(n, context)
    y = tokens[1:n * context + 1].view(n, context)
    return x, y


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's strided share of the held-out windows: every window evaluated by exactly one rank, the
    same number on every rank (the remainder of ``len(x) // world`` is dropped), because a ZeRO-3 forward
    is collective and every rank must run as many as the others."""
    n = x.shape[0] // world * world
    return x[rank:n:world], y[rank:n:world]
