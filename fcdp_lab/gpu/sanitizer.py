"""Case (d) of the GPU check: FCDP's stream orderings under PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``).

The sanitizer (``torch.cuda._sanitizer``) records, for every CUDA kernel, which device memory it reads and
writes and on which stream, and raises ``CUDASanitizerErrors`` with both stack traces when two streams touch
the same memory without an event or stream wait between them: on real streams what the CPU suite's
stream-order model checks on fake ones (``fcdp_lab/strict/strict_streams.py``). It does not see host memory,
so a host read of a pinned slot before its copy finished stays the CPU model's (and verify mode's) to catch.
Same fake world of 4 as case (b), a small model: plain ZeRO-3, then FCDP with host slots (fills on the fill
stream, staged hits on the copy stream) and with the host node buffer (its round trip on its own stream, the
flush). The device is synchronized after each optimizer step (``measure_variant``), as DeepSpeed's throughput timer
does from its second step: orderings within a step are what this checks.

[Note: the sanitizer and the two-stage gather] The sanitizer reports a false race on the two-stage gather: stage 2
is issued on FCDP's gather stream and waited for on DeepSpeed's all-gather stream, an ordering through the
collective's work object the sanitizer does not model. So the FCDP variants run with ``param_gather: flat`` (the
misses take DeepSpeed's ring, which the zero3 variant covers anyway): every other FCDP ordering is still checked,
and a real race there is still reported. The two-stage gather's stream order is the CPU model's to check (the
``two_stage_gather`` broken variant of ``tests/test_device_discipline.py``) and case (c)'s timeline's on 4+ GPUs.
The sanitizer sees kernels and stream waits, not the caching allocator's frees: it cannot check ``record_stream``
(the CPU model's free check does).
"""
from __future__ import annotations

import traceback

from fcdp_lab.gpu.report import CaseResult


def fcdp_frames(text: str) -> list[str]:
    """Lines of a sanitizer report that name FCDP's core (the tools excluded)."""
    return [line.strip() for line in text.splitlines()
            if "fcdp_deepspeed/" in line and "fcdp_lab/" not in line]


def error_text(exc: BaseException) -> str:
    """What a failed variant reports: every sanitizer error whole, then the raising trace's tail.
    [Note: both accesses] ``str(CUDASanitizerErrors)`` is only "detected N errors" and the raising trace shows only
    the *current* access (often DeepSpeed's free of a parameter); the other stream's access, the one that may be
    FCDP's, is in each error's own text (``UnsynchronizedAccessError``: both stacks and the allocation's)."""
    parts = [f"{type(exc).__name__}: {exc}"]
    parts += [str(err) for err in getattr(exc, "errors", None) or []]
    parts.append(traceback.format_exc()[-4000:])
    return "\n".join(parts)


def sanitizer_case(dry_run: bool, hidden: int, layers: int, steps: int) -> CaseResult:
    """(d) Each variant trains ``steps`` steps with the sanitizer on (GPU); on the CPU accelerator, without it."""
    import torch

    from fcdp_lab.gpu.fake_pg import fake_node_discovery, init_fake_world, measure_variant

    res = CaseResult("d_sanitizer")
    on_gpu = not dry_run
    if on_gpu:
        from torch.cuda._sanitizer import cuda_sanitizer, enable_cuda_sanitizer
        if not cuda_sanitizer.enabled:
            enable_cuda_sanitizer()
    init_fake_world(res)
    flat = {"param_gather": "flat"}  # [Note: the sanitizer and the two-stage gather]
    variants = {"zero3": None, "host": {"cache_device": "host", **flat},
                "node_host": {"cache_device": "host", "grad_accumulation": "node", "grad_buffer_device": "host", **flat}}
    # [Note: once in three runs] The H200's first run stopped node_host on one report that runs 2 and 3 did not
    # repeat (which waits happen can depend on timing): the variant runs twice, for another chance at it.
    variants["node_host_again"] = variants["node_host"]
    errors: dict[str, str] = {}
    with fake_node_discovery(ranks_per_node=2):
        for name, extra in variants.items():
            try:
                measure_variant(extra, hidden, layers, steps, on_gpu=False)  # no profiler: the sanitizer is slow enough
            except Exception as exc:  # CUDASanitizerErrors, or anything else: reported with its trace
                errors[name] = error_text(exc)
            torch.cuda.synchronize() if on_gpu else None
    why = "" if on_gpu else "CPU accelerator: no CUDA streams to sanitize"
    res.numbers.update(hidden=hidden, layers=layers, steps=steps, errors=errors, param_gather="flat",
                       not_checked=["the two-stage gather (param_gather: hierarchical)", "record_stream (frees)"])
    res.check("zero3: ran (a race in DeepSpeed's own code is reported, not counted against FCDP)", True,
              errors.get("zero3", "")[:300])
    for name in (n for n in variants if n != "zero3"):
        text = errors.get(name, "")
        frames = fcdp_frames(text)
        sanitizer = "CUDASanitizerErrors" in text
        res.check(f"{name}: no stream race in FCDP's code (CUDA sanitizer)", not frames,
                  "; ".join(frames[:4]) if frames else (text[:300] or why), on_gpu)
        res.check(f"{name}: ran to the end", not text, text[:300],
                  applicable=not (sanitizer and not frames))  # stopped by a race in DeepSpeed's own code: n/a
    return res
