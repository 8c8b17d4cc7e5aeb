"""Workers of test_gpu_check.py: case (a) of the GPU check against deliberately broken reducers."""
from __future__ import annotations

from fcdp_deepspeed import grads
from fcdp_lab.gpu import cases as gpu_cases


def broken_flush(kind: str) -> dict:
    """Run case (a) on gloo with a broken flush; return its checks as name -> (passed, detail)."""
    original = grads.GradReducer.flush

    def flush(self, comm_dtype, bucket_numel):
        if kind == "lose_window":  # the flushed window sum is dropped before stage 2
            for ds_id in self.buffer.dirty:
                self.buffer.slot(ds_id).zero_()
            yield from original(self, comm_dtype, bucket_numel)
        elif kind == "stale_buffer":  # delivered, but the slot stays dirty: the next window adds onto its sum
            kept = {i: self.buffer.slot(i).clone() for i in self.buffer.dirty}
            yield from original(self, comm_dtype, bucket_numel)
            for i, value in kept.items():
                self.buffer.slot(i).copy_(value)
                self.buffer.dirty.add(i)
        elif kind == "refused":  # what NCCL does with a host tensor
            raise RuntimeError("No backend type associated with device type cpu")
            yield
        else:
            raise ValueError(kind)

    grads.GradReducer.flush = flush
    res = gpu_cases.grad_flush_case("gloo")
    return {c.name: (c.passed, c.detail) for c in res.checks}
