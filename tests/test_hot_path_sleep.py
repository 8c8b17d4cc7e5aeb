"""[Note: no sleep(0) on a hot path] (``faults.rank_skew``): the test-only skews sleep only when asked to, because
``time.sleep(0)`` releases the GIL at every stage's issue; and they still sleep for the rank they name."""
from __future__ import annotations

import pytest

from fcdp_deepspeed import faults
from fcdp_deepspeed.grads import inflight
from fcdp_deepspeed.runtime import sequencer


@pytest.mark.parametrize("module, fn, env", [(inflight, "issue_delay", inflight.DELAY_ENV),
                                             (sequencer, "stage1_delay", sequencer.DELAY_ENV)])
def test_skews_sleep_only_when_asked(monkeypatch, module, fn, env):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setattr(module.dist, "get_rank", lambda: 1)
    monkeypatch.delenv(env, raising=False)
    getattr(module, fn)()
    monkeypatch.setenv(env, "0:0.25")  # another rank's skew
    getattr(module, fn)()
    assert slept == []
    monkeypatch.setenv(env, "1:0.25")
    getattr(module, fn)()
    assert slept == [0.25]
