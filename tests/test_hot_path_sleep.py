"""[Note: no sleep(0) on a hot path] (``fcdp_lab/sabotage/params.py``): the test-only skews are the lab's wrappers,
installed only in the rank they name and never for 0 seconds, because ``time.sleep(0)`` releases the GIL at every
stage's issue; they still sleep for the rank they name, and the package's issue paths have no sleep of their own."""
from __future__ import annotations

import inspect

import pytest

from fcdp_deepspeed.runtime import gather, runahead, sequencer, staged
from fcdp_lab import sabotage
from fcdp_lab.sabotage import params


@pytest.mark.parametrize("name, owner, attribute", [("push.delay", runahead.RunAhead, "push"),
                                                    ("gather.delay", gather.HierarchicalGather, "stage1")])
def test_skews_sleep_only_in_the_rank_they_name(monkeypatch, name, owner, attribute):
    monkeypatch.setattr(owner, attribute, lambda self, *args, **kwargs: "issued")  # the product's, as a stub
    stub = vars(owner)[attribute]
    slept = []
    monkeypatch.setattr(params.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "1")
    for value in (f"{name}@0=0.25", f"{name}@1=0"):  # another rank's skew; none at all
        with sabotage.applied(value):
            assert vars(owner)[attribute] is stub, value
    with sabotage.applied(f"{name}@1=0.25"):
        assert getattr(owner, attribute)(object()) == "issued"
    assert slept == [0.25] and vars(owner)[attribute] is stub


def test_the_package_s_issue_paths_do_not_sleep():
    for module in (runahead, sequencer, staged, gather):
        assert "sleep(" not in inspect.getsource(module), module.__name__
