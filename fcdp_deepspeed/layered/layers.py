"""Which modules are a model's layers: the entries of one ``nn.ModuleList`` / ``nn.Sequential``.

``fcdp.layered.layers`` names the list (``"model.layers"``), or ``auto`` finds it: a Hugging Face model declares its
layer classes in ``_no_split_modules`` (``LlamaDecoderLayer``, ``GPT2Block``), and the longest list of those wins;
any other model's longest list of at least two modules of one class with parameters is taken (a transformer's
blocks, a ``Sequential`` stack). PEFT and other wrappers are searched through, since the search walks every
submodule.
"""
from __future__ import annotations

import torch

from fcdp_deepspeed.layered.split import LayeredCallError

_LISTS = (torch.nn.ModuleList, torch.nn.Sequential)


def _declared_layer_classes(model: torch.nn.Module) -> set[str]:
    names: set[str] = set()
    for sub in model.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    return names


def _candidates(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    out = []
    for name, sub in model.named_modules():
        if isinstance(sub, _LISTS) and len(sub) >= 2:
            entries = list(sub)
            if len({type(e) for e in entries}) == 1 and all(any(True for _ in e.parameters()) for e in entries):
                out.append((name, entries))
    return out


def find_layers(model: torch.nn.Module, spec: str) -> tuple[str, list[torch.nn.Module]]:
    """``(dotted name, layers)`` of ``model``'s layer list as ``spec`` (``fcdp.layered.layers``) says."""
    if spec != "auto":
        try:
            sub = model.get_submodule(spec)
        except AttributeError:
            sub = None
        if not isinstance(sub, _LISTS) or len(sub) == 0:
            raise LayeredCallError(f"fcdp.layered.layers = {spec!r} is not a non-empty nn.ModuleList or nn.Sequential "
                                   f"of {type(model).__name__}. Fix: give the dotted name of the layer list (one of: "
                                   f"{', '.join(n for n, _ in _candidates(model)) or 'none found'}), or \"auto\".")
        return spec, list(sub)
    found = _candidates(model)
    declared = _declared_layer_classes(model)
    preferred = [(n, e) for n, e in found if type(e[0]).__name__ in declared]
    pool = preferred or found
    if not pool:
        raise LayeredCallError(f"fcdp.layered.layers = \"auto\" found no list of layers in {type(model).__name__} (an "
                               f"nn.ModuleList or nn.Sequential of at least two modules of one class). Fix: set "
                               f"fcdp.layered.layers to the dotted name of the layer list, or remove fcdp.layered.")
    return max(pool, key=lambda item: len(item[1]))  # the first of the longest, in module order
