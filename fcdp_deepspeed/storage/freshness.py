"""Freshness: the one record of when each parameter's partition was last written, and the check every copy of a
parameter passes when it is read.

[Note: freshness by construction]
Besides DeepSpeed's partition (``param.ds_tensor``), FCDP holds copies of a parameter's value: node-cache slots
(``storage/cache.py``), run-ahead groups in flight and their pinned stashes (``runtime/runahead.py``,
``runtime/staged.py``). A copy kept correct only by an invalidation that every write path of DeepSpeed delivers to it
is as correct as the least complete listener. So correctness does not rest on listeners:

- every write path stamps the parameters it writes (:func:`written`): a number from one process-wide counter, kept
  on the parameter itself, so every engine over the same model sees every other engine's writes;
- every copy records the stamp of the partition it was taken from (:func:`stamp` at a run-ahead group's issue; a
  slot filled at a release holds the stamp its full tensor was gathered at, :func:`gathered`, or after a
  ``partition(has_been_updated=True)`` the new one);
- every read of a copy compares first (:func:`is_current`): a copy older than the partition is dropped and
  refetched from the partition (counted: ``stale_refetched`` in ``get_stats``, zero in a run whose listeners are
  complete), never served.

The listeners (``runtime/invalidation.py``, the run-ahead's cancel) stay: they free copies early and cancel
transfers that would be wasted. A listener that misses a copy costs one refetch, not a wrong weight.

The write paths of DeepSpeed 0.19.8's stage 3 (the bit16 partition), and where each is stamped:

- the optimizer: ``_unflatten_partitioned_parameters`` (every applied step, swap-in restores) and the step's end
  (``_post_step``: every parameter the optimizer owns), in ``engine/stage3.py``'s counting class, so a plain ZeRO-3
  engine over a model another engine caches stamps its writes too;
- loads: ``load_state_dict`` (rigid and universal, with or without the optimizer states), and every parameter of the
  module at ``checkpoint_event_epilogue`` (module-only loads, frozen parameters written through the module's state
  dict; saves and 16-bit consolidation take the same path, as the cache's flush always did);
- ``partition(has_been_updated=True)``: ``GatheredParameters(modifier_rank=...)`` edits, state-dict loads through it
  (Hugging Face), ``apply`` under ``zero.Init``; stamped by :func:`watch_partitions` *before* DeepSpeed writes the
  partition, so the refresh of a cached slice inside that call (``_partition_param_sec``) records the new stamp;
- DiLoCo's outer step (``diloco/``) writes the partitions itself and stamps them.

Streams: a stamp is a host fact; the write itself may still be queued on the writing engine's stream. So every
write also records a device event (:func:`last_write`), which every copy of partitions waits for besides its own
engine's events (``runtime/staged.py``'s ``copy_partitions``).

Agreement: stamps change only at those events, which every rank of the data-parallel group runs at the same logical
point, so :func:`is_current` answers alike on every rank and a refetch issues the same collective everywhere.
"""
from __future__ import annotations

import enum
import itertools
import threading
from collections import Counter
from typing import Any, Callable, Iterable

import torch

from fcdp_deepspeed.machine import device

#: The attribute that holds a parameter's stamp (0: never written since it was partitioned).
STAMP_ATTR = "ds_fcdp_written"
#: The stamp of the partitions a parameter's full tensor was last gathered from (:func:`gathered`): what a slot
#: filled from that tensor at its release holds.
GATHERED_ATTR = "ds_fcdp_gathered"
#: Marks a ``partition`` that :func:`watch_partitions` wrapped (it holds DeepSpeed's).
_WATCHED = "_fcdp_watched_partition"


class Write(enum.Enum):
    """Which path wrote a partition (``get_stats``' ``partition_writes``)."""

    OPTIMIZER = "optimizer"
    LOAD = "checkpoint"
    EDIT = "has_been_updated"
    OUTER = "diloco_outer"


class _Clock:
    """The process-wide stamp counter, the writes by kind and the device event after the last write (every engine
    in the process shares them)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._lock = threading.Lock()
        self.writes: Counter = Counter()
        #: Recorded on the writing stream after the last write (``None`` without streams): every copy of partitions
        #: waits for it, whichever engine wrote them ([Note: the optimizer's writes] in ``runtime/staged.py``).
        self.last_write: Any = None

    def tick(self, kind: Write, count: int) -> int:
        with self._lock:
            self.writes[kind.value] += count
            return next(self._next)

    def wrote(self) -> None:
        self.last_write = device.record_event()


CLOCK = _Clock()


def stamp(param: torch.nn.Parameter) -> int:
    """The stamp of ``param``'s partition now: what a copy taken now records."""
    return getattr(param, STAMP_ATTR, 0)


def stamps(params: Iterable[torch.nn.Parameter]) -> tuple[int, ...]:
    return tuple(getattr(p, STAMP_ATTR, 0) for p in params)


def is_current(param: torch.nn.Parameter, taken: int) -> bool:
    """Whether a copy of ``param`` taken at stamp ``taken`` still holds the partition's value."""
    return getattr(param, STAMP_ATTR, 0) == taken


def all_current(params: Iterable[torch.nn.Parameter], taken: Iterable[int]) -> bool:
    """:func:`is_current` for a group of copies taken together (a run-ahead group)."""
    return all(is_current(p, t) for p, t in zip(params, taken))


def written(params: Iterable[torch.nn.Parameter], kind: Write) -> None:
    """``params``' partitions were written: every older copy is stale, and later copies of partitions wait for the
    writing stream's work so far."""
    _stamp(params, kind)
    CLOCK.wrote()


def _stamp(params: Iterable[torch.nn.Parameter], kind: Write) -> None:
    params = list(params)
    if not params:
        return
    now = CLOCK.tick(kind, len(params))
    for param in params:
        setattr(param, STAMP_ATTR, now)


def last_write() -> Any:
    """The device event after the last write of any partition (``None`` without streams)."""
    return CLOCK.last_write


def gathered(params: Iterable[torch.nn.Parameter]) -> None:
    """``params``' full tensors are being gathered from their partitions as they are now."""
    for param in params:
        setattr(param, GATHERED_ATTR, getattr(param, STAMP_ATTR, 0))


def gathered_stamp(param: torch.nn.Parameter) -> int:
    """The stamp of the partitions ``param``'s full tensor was gathered from (-1, never current, if no gather that
    FCDP saw made it)."""
    return getattr(param, GATHERED_ATTR, -1)


def watch_partitions(params: Iterable[torch.nn.Parameter]) -> None:
    """Stamp every ``partition(has_been_updated=True)`` of ``params`` (once per parameter, whichever engine asks).

    DeepSpeed's ``GatheredParameters`` calls ``params[0].partition(param_list=params, has_been_updated=True)``: the
    call's list is stamped, not only the parameter whose closure it is."""
    for param in params:
        original = getattr(param, "partition", None)
        if original is None or getattr(original, _WATCHED, None) is not None:
            continue
        param.partition = _watched(param, original)


def _watched(param: torch.nn.Parameter, original: Callable) -> Callable:
    def partition(*args: Any, **kwargs: Any) -> Any:
        updated = kwargs.get("has_been_updated", args[2] if len(args) > 2 else False)
        if not updated:
            return original(*args, **kwargs)
        listed = kwargs.get("param_list", args[0] if args else None)
        _stamp(listed if listed is not None else [param], Write.EDIT)  # before: the refresh inside records it
        out = original(*args, **kwargs)
        CLOCK.wrote()  # after: the event follows DeepSpeed's write of the partitions
        return out

    setattr(partition, _WATCHED, original)
    return partition
