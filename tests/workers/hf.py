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
