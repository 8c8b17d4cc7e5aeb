"""Workers of test_hf.py: examples/hf_lora.py on every rank."""
from __future__ import annotations


def hf_run(**kwargs) -> dict:
    """examples/hf_lora.py's ``run`` on this rank (HF Trainer or accelerate)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_lora.py")
    spec = importlib.util.spec_from_file_location("hf_lora_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(**kwargs)


def _example():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_lora.py")
    spec = importlib.util.spec_from_file_location("hf_lora_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer_stats_runs(ds_config: str, steps: int = 4) -> dict:
    """HF Trainer runs in one process, none calling ``install()`` (the startup hook did): an enabled
    block with ``log_interval: 2``, no block, the block with ``FCDP_HF_CALLBACK=0``, and an enabled
    block under ZeRO stage 2. For each: the callbacks in order, what a reporter placed after them saw
    in ``logs``, the log history, FCDP's own ``[fcdp]`` lines, the final stats, or the error."""
    import os
    import tempfile

    import deepspeed
    from deepspeed import comm as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import fcdp_deepspeed
    from fcdp_deepspeed.config import load_ds_config
    from workers.common import ZERO3_GRADS, LogCapture

    example = _example()
    installed = fcdp_deepspeed.is_installed()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    log = LogCapture()

    def one_run(block, stage: int = 3, opt_out: bool = False) -> dict:
        cfg = load_ds_config(ds_config)
        cfg["zero_optimization"]["stage"] = stage
        if stage < 3:
            cfg["zero_optimization"] = {"stage": stage}
        if block is None:
            cfg.pop("fcdp", None)
        else:
            cfg["fcdp"] = block
        seen: list = []

        class Reporter(TrainerCallback):  # stands for the console/wandb/TensorBoard reporters, which come first
            def on_log(self, args, state, control, logs=None, **kw):
                seen.append(dict(logs))

        out_dir = tempfile.mkdtemp(prefix="fcdp-hf-")
        cfg["csv_monitor"] = {"enabled": True, "output_path": out_dir, "job_name": "run"}
        # log_level info: the Trainer sets DeepSpeed's logger to it (default warning hides [fcdp] lines)
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-3,
                                 deepspeed=cfg, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                                 data_seed=0, dataloader_num_workers=0, disable_tqdm=True, log_level="info",
                                 log_level_replica="info")
        model = example._model(64, 1, False)
        if opt_out:
            os.environ["FCDP_HF_CALLBACK"] = "0"
        try:
            trainer = Trainer(model=model, args=args, train_dataset=example._TokenDataset(), callbacks=[Reporter()])
        finally:
            os.environ.pop("FCDP_HF_CALLBACK", None)
        first = len(log.messages)
        out = {"callbacks": [type(cb).__name__ for cb in trainer.callback_handler.callbacks]}
        try:
            trainer.train()
        except Exception as exc:  # the stage-2 run: the test checks the message
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
        out.update(seen=seen, history=trainer.state.log_history, stats=fcdp_deepspeed.get_stats(trainer.model_wrapped),
                   fcdp_lines=[m for m in log.messages[first:] if m.startswith("[fcdp]")],
                   steps_per_print=trainer.model_wrapped.steps_per_print(),
                   monitor_csv=_read(os.path.join(out_dir, "run", "fcdp_inter_node_allgather_bytes.csv")))
        return out

    block = {"enabled": True, "ranks_per_node": 2, "log_interval": 2, **ZERO3_GRADS}
    return {"installed": installed, "enabled": one_run(block), "plain": one_run(None),
            "opt_out": one_run(block, opt_out=True), "stage2": one_run(block, stage=2)}


def _read(path: str) -> list[str]:
    import os
    return open(path).read().strip().splitlines() if os.path.exists(path) else []
