"""The event model: a tiny token model with an embedding, and the HF-style operations on it under ZeRO-3.

[Note: what is HF's and what is ours] ``hf_load_state_dict`` follows transformers 5.x
``integrations/deepspeed.py: _load_state_dict_into_zero3_model`` (per module: gather the parameters the
state dict names with ``GatheredParameters(modifier_rank=0)``, rank 0 calls ``module._load_from_state_dict``).
``resize_token_embeddings`` follows ``modeling_utils._get_resized_embeddings`` under ZeRO-3: ``"hf5"`` builds
the new ``nn.Embedding`` as a plain module, copies the old rows inside ``GatheredParameters([old, new],
modifier_rank=0)`` and assigns the new weight to the old module inside a second one (transformers 5.x);
``"zero_init"`` builds it under ``zero.Init`` and swaps the module (transformers 4.x). Both run before
``deepspeed.initialize``: DeepSpeed's hooks and optimizer are bound to the modules and parameters they
saw, so a resize of a running engine is not supported by ZeRO-3 itself.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch.utils.checkpoint import checkpoint

import deepspeed
from deepspeed import comm as dist

from fcdp_lab.harness.toy import Block

HIDDEN = 16
VOCAB = 24
SEQ = 3


class EventModel(torch.nn.Module):
    """Embedding -> ``layers`` blocks (``toy.Block``: linear, optional LoRA adapters) -> head."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = 2, lora_rank: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, lora_rank) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, hidden)
        #: Read at every training forward: activation-checkpoint recomputation on or off.
        self.activation_checkpointing = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
            h = checkpoint(block, h, use_reentrant=False) if recompute else block(h)
        return self.head(h)


def set_trainable(model: torch.nn.Module, mode: str) -> None:
    """``"full"``: every parameter trains; ``"lora"``: only the adapters (a frozen base, as in PEFT);
    ``"partial"``: the blocks train, the embedding and the head stay frozen."""
    for name, param in model.named_parameters():
        param.requires_grad = {"full": True, "lora": "lora_" in name, "partial": name.startswith("blocks.")}[mode]


def modules_with_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that own parameters directly, in a fixed order (events address them by index)."""
    return [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]


def hf_load_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """transformers' ``_load_state_dict_into_zero3_model``: module by module, rank 0 loads what it names."""
    state_dict = dict(state_dict)

    def load(module: torch.nn.Module, prefix: str = "") -> None:
        named = dict(module.named_parameters(prefix=prefix[:-1], recurse=False))
        params = [p for k, p in named.items() if k in state_dict]
        if params:
            args = (state_dict, prefix, {}, True, [], [], [])
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if dist.get_rank() == 0:
                    module._load_from_state_dict(*args)
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    load(model)


def resize_token_embeddings(model: EventModel, new_num_tokens: int, style: str, ds_config: Optional[dict],
                            seed: int) -> None:
    """Grow or shrink ``model.embed`` under ZeRO-3 the way transformers does (see [Note: what is HF's])."""
    old = model.embed
    with deepspeed.zero.GatheredParameters(old.weight, modifier_rank=None):
        old_num, dim = old.weight.size()
    n = min(old_num, new_num_tokens)
    torch.manual_seed(seed)
    if style == "zero_init":
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            new = torch.nn.Embedding(new_num_tokens, dim)
        with deepspeed.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
            new.weight.data[:n, :] = old.weight.data[:n, :]  # every rank, as transformers 4.x; rank 0's is broadcast
        model.embed = new
        return
    new = torch.nn.Embedding(new_num_tokens, dim, dtype=old.weight.dtype)
    with deepspeed.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
        new.weight.data[:n, :] = old.weight.data[:n, :]
    with deepspeed.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
        old.weight = new.weight
        old.num_embeddings = new.weight.data.shape[0]
