"""Streaming DiLoCo's fragments (``fcdp.diloco.fragments``): which part of a rank's shard each fragment is, and
which fragment syncs at which step.

[Note: a fragment is a contiguous 1/F of each rank's shard] A rank's outer state is its flat fp32 partition of
each stage-3 sub-group, back to back; fragment ``f`` is the ``f``-th of ``F`` near-equal contiguous ranges of that
concatenation, cut into one :class:`Piece` per sub-group it overlaps. Stage 3 lays every parameter's partition out
in the sub-group's order, so a fragment covers this rank's slices of consecutive parameters (consecutive layers,
as Streaming DiLoCo's sequential fragments, arXiv 2501.18512); every rank of a node has the same partition sizes
and every node the same layout, so peers cut identical fragments and their messages have equal sizes. The outer
step is elementwise, so where a fragment ends changes only when each element is synced.

[Note: the schedule] Fragment ``f`` is issued after steps ``(f + 1) * H / F + k * H`` (so each fragment every
``H`` steps, one fragment every ``H / F``; with ``F = 1`` the whole shard every ``H``) and completed
``overlap_steps`` steps later (0: at once). ``overlap_steps <= H / F``, so at most one exchange is in flight, and
the one completing at a step completes before that step's new one is issued.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Piece:
    """The part of one stage-3 sub-group's flat partition that belongs to a fragment."""

    group: int
    start: int
    length: int


def plan_fragments(numels: Sequence[int], fragments: int) -> list[list[Piece]]:
    """The pieces of each of ``fragments`` contiguous near-equal ranges of the sub-groups ``numels`` back to back."""
    total = sum(numels)
    bounds = [total * f // fragments for f in range(fragments + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        pieces, offset = [], 0
        for i, n in enumerate(numels):
            a, b = max(lo, offset), min(hi, offset + n)
            if b > a:
                pieces.append(Piece(i, a - offset, b - a))
            offset += n
        out.append(pieces)
    return out


def piece_ranges(ranges: Sequence[tuple[int, int]], piece: Piece) -> list[tuple[int, int]]:
    """``ranges`` (the real elements of the piece's sub-group, ``(start, length)``) inside ``piece``, relative to
    the piece's start."""
    out = []
    for start, length in ranges:
        a, b = max(start, piece.start), min(start + length, piece.start + piece.length)
        if b > a:
            out.append((a - piece.start, b - a))
    return out


def fragment_due(steps: int, interval: int, fragments: int) -> Optional[int]:
    """The fragment issued after optimizer step ``steps`` (counted from 1), ``None`` between fragment syncs."""
    if steps % interval:
        return None
    return (steps // interval - 1) % fragments
