"""A plain Hugging Face Trainer script: full fine-tuning of a tiny config-built GPT-2 (no downloads).

Nothing FCDP in it, and it imports neither DeepSpeed nor fcdp_deepspeed: transformers/accelerate import
DeepSpeed inside ``Trainer(...)``. FCDP comes from the ``"fcdp"`` block of the DeepSpeed config
alone, and its counters appear in the Trainer's logs as ``fcdp/*`` entries. On CPU ranks:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_gpt2_trainer.py --deepspeed_config configs/hf_full_fcdp.json

``--out DIR`` writes ``rank<N>.json`` per rank: the ``fcdp/*`` log entries, the optimizer class, and
whether DeepSpeed was imported before the Trainer was built (it should not have been).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 16, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    out_dir = args.out or "hf-gpt2-out"
    training = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=args.steps,
                                 learning_rate=1e-3, deepspeed=args.deepspeed_config, use_cpu=True, report_to=[],
                                 logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True)
    deepspeed_before_trainer = "deepspeed" in sys.modules
    trainer = Trainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()
    if args.out:
        rank = int(os.environ.get("RANK", "0"))
        result = {"deepspeed_before_trainer": deepspeed_before_trainer,
                  "optimizer": type(trainer.model_wrapped.optimizer).__name__,
                  "callbacks": [type(cb).__name__ for cb in trainer.callback_handler.callbacks],
                  "fcdp_logs": [{k: v for k, v in h.items() if k.startswith("fcdp/")} for h in trainer.state.log_history
                                if "loss" in h]}
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
