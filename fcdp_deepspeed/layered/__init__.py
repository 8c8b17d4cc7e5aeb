"""Layered (breadth-first) gradient accumulation (``fcdp.layered``): a batch's chunks pass each layer together.

``stack.py`` installs the chunk loop on a model's layers, ``layers.py`` finds them, ``split.py`` splits a layer
call over the batch and joins the outputs.
"""
from fcdp_deepspeed.layered.layers import find_layers
from fcdp_deepspeed.layered.split import LayeredCallError
from fcdp_deepspeed.layered.stack import LayeredStack, attach

__all__ = ["LayeredCallError", "LayeredStack", "attach", "find_layers"]
