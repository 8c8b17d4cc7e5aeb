"""HF Trainer + PEFT LoRA (q_proj, v_proj) on a tiny config-built Llama, DeepSpeed ZeRO-3 + FCDP.

No downloads: the model is built from a LlamaConfig and trained on random tokens.
On a GPU-less machine, run it on CPU ranks, e.g. 4 ranks as 2 simulated nodes x 2:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/hf_lora.py --ranks-per-node 2
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/hf_lora.py --no-fcdp   # plain ZeRO-3

What a user must do differently from a GPU job (see README, "Hugging Face"): ``use_cpu=True``
(DeepSpeed stays on) and ``deepspeed.init_distributed("gloo")`` before the model is built under
``zero.Init``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "hf_lora_fcdp.json")


def run(steps: int = 5, fcdp: bool = True, ranks_per_node: Optional[int] = None, ds_config: str = DEFAULT_CONFIG,
        output_dir: Optional[str] = None, hidden: int = 256, layers: int = 2, use_peft: bool = True,
        runner: str = "trainer", fcdp_extra: Optional[dict] = None, grad_accum: int = 1) -> dict:
    """Train; return this rank's per-step losses and FCDP stats (called by the tests too)."""
    import tempfile

    import deepspeed
    from deepspeed import comm as dist

    import fcdp_deepspeed
    from fcdp_deepspeed.config import load_ds_config

    fcdp_deepspeed.install()  # before the model is built; no-op for configs without an enabled fcdp block
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(ranks_per_node)
    cfg = load_ds_config(ds_config)
    cfg["fcdp"] = {"enabled": fcdp, **({"ranks_per_node": ranks_per_node} if ranks_per_node else {}),
                   **(fcdp_extra or {})}
    output_dir = output_dir or tempfile.mkdtemp(prefix="fcdp-hf-")
    if runner == "trainer":
        return _run_trainer(cfg, steps, output_dir, hidden, layers, use_peft, grad_accum)
    return _run_accelerate(cfg, steps, hidden, layers, use_peft)


def _model(hidden: int, layers: int, use_peft: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)  # under zero.Init when ZeRO-3 is on
    if use_peft:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    return model


class _TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, seq: int = 32, vocab: int = 1024) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _run_trainer(cfg: dict, steps: int, output_dir: str, hidden: int, layers: int, use_peft: bool,
                 grad_accum: int = 1) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import fcdp_deepspeed

    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-3,
                             gradient_accumulation_steps=grad_accum,
                             deepspeed=cfg, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                             seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    model = _model(hidden, layers, use_peft)  # after TrainingArguments: HF then builds it under zero.Init
    record: dict = {"losses": [], "step_stats": []}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            record["step_stats"].append(fcdp_deepspeed.get_stats(trainer.model_wrapped))

    class LossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            record["losses"].append((out[0] if return_outputs else out).item())
            return out

    trainer = LossTrainer(model=model, args=args, train_dataset=_TokenDataset(), callbacks=[Record()])
    trainer.train()
    record["stats"] = fcdp_deepspeed.get_stats(trainer.model_wrapped)
    record["optimizer_class"] = type(trainer.model_wrapped.optimizer).__name__
    return record


def _run_accelerate(cfg: dict, steps: int, hidden: int, layers: int, use_peft: bool) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import fcdp_deepspeed

    cfg = json.loads(json.dumps(cfg).replace('"auto"', "null"))
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
    # Not cpu=True: that forces accelerate's MULTI_CPU (DDP) path. Without an accelerator the DeepSpeed
    # path still runs on the CPU once accelerate is told to use DeepSpeed.
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = _model(hidden, layers, use_peft)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loader = torch.utils.data.DataLoader(_TokenDataset(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    record: dict = {"losses": [], "step_stats": []}
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(loss.item())
        record["step_stats"].append(fcdp_deepspeed.get_stats(model))
    record["stats"] = fcdp_deepspeed.get_stats(model)
    record["optimizer_class"] = type(model.optimizer).__name__
    return record


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-fcdp", action="store_true", help="plain ZeRO-3 for comparison")
    ap.add_argument("--ranks-per-node", type=int, default=None, help="simulate nodes of this many ranks")
    ap.add_argument("--ds-config", default=DEFAULT_CONFIG)
    ap.add_argument("--runner", choices=["trainer", "accelerate"], default="trainer")
    args = ap.parse_args(argv)
    rec = run(args.steps, not args.no_fcdp, args.ranks_per_node, args.ds_config, runner=args.runner)
    from deepspeed import comm as dist
    if dist.get_rank() == 0:
        s = rec["stats"]
        print(json.dumps({"losses": rec["losses"], "inter_node_allgather_bytes": s["inter_node_allgather_bytes"],
                          "intra_node_allgather_bytes": s["intra_node_allgather_bytes"], "cache_hits": s["cache_hits"],
                          "optimizer": rec["optimizer_class"]}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
