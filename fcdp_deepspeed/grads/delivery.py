"""Delivery bookkeeping: which parameters' partitions DeepSpeed overwrites, adds to, or leaves alone."""
from __future__ import annotations

import threading
from typing import Iterable, Sequence

import torch


class DeliveryLedger:
    """The parameters delivered by the last reduction (bucket or flush batch) and those delivered in the
    current window (since the step started). Thread-safe: buckets are reduced on autograd threads."""

    def __init__(self) -> None:
        self._window: set[int] = set()  # ds_ids delivered to DeepSpeed in the current window
        self._last_delivered: set[int] = set()
        self._lock = threading.Lock()

    def delivered(self, ds_ids: Iterable[int]) -> None:
        """The last reduction handed these parameters' partitions to DeepSpeed."""
        with self._lock:
            self._last_delivered = set(ds_ids)

    def split(self, params: Sequence[torch.nn.Parameter]) -> tuple[list[int], list[int], list[int]]:
        """Indices of ``params`` whose partition DeepSpeed must overwrite (first delivery in this window),
        add to (delivered before in this window), or not touch (gradient went into the node buffer)."""
        with self._lock:
            delivered, self._last_delivered = self._last_delivered, set()
            copy, add, skip = [], [], []
            for i, p in enumerate(params):
                if p.ds_id not in delivered:
                    skip.append(i)
                elif p.ds_id in self._window:
                    add.append(i)
                else:
                    self._window.add(p.ds_id)
                    copy.append(i)
            return copy, add, skip

    def new_window(self) -> None:
        """A step started (or ``zero_grad``): the next delivery of every parameter overwrites."""
        with self._lock:
            self._window.clear()
