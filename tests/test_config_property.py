"""Property test of the fcdp block parser: every generated block is accepted or refused with an
FCDPConfigError naming a key of the block (never another exception type)."""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fcdp_deepspeed.config import FCDPConfig, FCDPConfigError, parse_fcdp_config  # noqa: E402

KEYS = sorted(FCDPConfig.model_fields) + ["cache_devcie", "budget"]
SIZES = st.tuples(st.integers(0, 10**6).map(str) | st.text("0123456789", min_size=1, max_size=400),
                  st.sampled_from(["", "%", "GiB", "mb", "kb", "TiB", " b", "x"])).map("".join)
VALUES = (st.none() | st.booleans() | st.integers() | st.integers(10**300, 10**420) | st.floats() |
          st.sampled_from(["auto", "host", "device", "flat", "hierarchical", "rank", "node", "50%", "150%", "8GiB"]) |
          SIZES | st.text(max_size=12) | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3),
                                                                                                 st.integers(), max_size=1))
BLOCKS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=5)


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(block=BLOCKS)
def test_every_block_is_accepted_or_refused_naming_a_key(block):
    try:
        config = parse_fcdp_config({"fcdp": {"enabled": True, **block}})
    except FCDPConfigError as err:
        assert any(f"fcdp.{key}" in str(err) for key in block), (block, str(err))
        return
    for spec in ("host_budget_spec", "device_budget_spec", "grad_buffer_budget_spec"):
        getattr(config, spec)  # an accepted budget parses again later, at engine creation


@pytest.mark.parametrize("budget", ["1" * 400, 10**400, "1" * 400 + "GiB", float("inf")])
def test_budget_too_large_for_a_float_is_refused_naming_the_key(budget):
    with pytest.raises(FCDPConfigError, match="fcdp.host_budget"):
        parse_fcdp_config({"fcdp": {"enabled": True, "host_budget": budget}})
