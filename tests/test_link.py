"""``fcdp.link``: the paths an engine runs, chosen from one fetch timed each way on its own groups (``paths.py``,
``machine/link.py``), the same on every rank; ZeRO-3's paths are ZeRO-3 bit for bit."""
from __future__ import annotations

import pytest
import torch

from fcdp_deepspeed import paths
from fcdp_lab.link_declaration import declared_for

GBIT, MBIT = 1e9 / 8, 1e6 / 8


def test_the_rule_picks_fcdp_on_a_slow_link_and_zero3_on_a_fast_one():
    # the emulated cluster: gloo on loopback moves about 4 Gbit/s per rank inside a node
    slow = paths.modeled_times(1 << 20, 2, 2, 100 * MBIT, 4 * GBIT, 6e-4)
    fast = paths.modeled_times(1 << 20, 2, 2, 20 * GBIT, 4 * GBIT, 6e-4)
    assert paths.choose(slow).paths is paths.Paths.FCDP
    assert paths.choose(fast).paths is paths.Paths.ZERO3
    assert "fcdp.link" in paths.choose(fast).why  # the way back to FCDP's paths is named
    # the margin: FCDP's collectives must win by MARGIN, not merely win
    edge = paths.FetchTimes(1, flat_s=1.0, two_stage_s=1.0, node_s=3 - 2 - 0.01)
    assert edge.fcdp_s < edge.zero3_s and paths.choose(edge).paths is paths.Paths.ZERO3
    # and a fetch across nodes must be SLOWER times one inside a node: a noisy two-stage time cannot flip a fast link
    noisy = paths.FetchTimes(1, flat_s=2.5, two_stage_s=1.0, node_s=1.0)
    assert noisy.zero3_s > paths.MARGIN * noisy.fcdp_s and paths.choose(noisy).paths is paths.Paths.ZERO3


def test_fit_extrapolates_latency_plus_rate_and_never_goes_negative():
    assert paths.fit((1000, 0.002), (2000, 0.003), 10_000) == pytest.approx(0.011)
    assert paths.fit((1000, 0.003), (2000, 0.002), 10_000) == pytest.approx(0.002)  # noise: no negative rate


def test_a_key_that_names_a_path_skips_the_probe():
    from fcdp_deepspeed.config import FCDPConfig
    for key, value in (("param_gather", "hierarchical"), ("grad_reduce", "flat"), ("grad_accumulation", "rank"),
                       ("param_compression", "int8")):
        assert FCDPConfig(enabled=True, **{key: value}).paths_asked(), key
    assert not FCDPConfig(enabled=True).paths_asked()


def test_a_bad_link_value_is_refused_by_key():
    from fcdp_deepspeed.config import parse_fcdp_config
    with pytest.raises(Exception, match="link"):
        parse_fcdp_config({"fcdp": {"enabled": True, "link": "medium"}})


def test_the_labs_declaration_reads_per_rank():
    assert declared_for("slow", 3) == "slow"
    assert declared_for("slow,fast@3", 3) == "fast" and declared_for("slow,fast@3", 2) == "slow"
    with pytest.raises(ValueError):
        declared_for("medium", 0)


def test_every_rank_chooses_the_same_paths_from_the_largest_times(ranks):
    """[Note: one choice per job]: rank 3 alone sees a fast link; every rank still chooses FCDP's paths, from the
    same times. Its broken variant (each rank decides from its own times) splits the job."""
    env = {"FCDP_LAB_LINK": "slow,fast@3"}
    agreed = ranks("link:choice_only", env=env, nbytes=1 << 20)
    assert {r["paths"] for r in agreed} == {"fcdp"}, agreed
    assert len({(r["link_flat_s"], r["link_two_stage_s"], r["link_node_s"]) for r in agreed}) == 1
    broken = ranks("link:choice_only", env={**env, "FCDP_LAB_BREAK": "link.no_agreement"}, nbytes=1 << 20)
    assert {r["paths"] for r in broken} == {"fcdp", "zero3"}, broken


def test_the_job_votes_across_data_parallel_groups(ranks):
    """Two data-parallel groups, one on a fast link and one on a slow one: the job runs FCDP's paths everywhere (a
    group on ZeRO-3's would skip FCDP's world collectives and hang the job). Without the vote each keeps its own."""
    env = {"FCDP_LAB_LINK": "fast,slow@4,slow@5,slow@6,slow@7"}
    voted = ranks("link:job_vote", world_size=8, env=env)
    assert [r["local"] for r in voted] == ["zero3"] * 4 + ["fcdp"] * 4, voted
    assert {r["paths"] for r in voted} == {"fcdp"}
    assert "another data-parallel group" in voted[0]["paths_why"]
    split = ranks("link:job_vote", world_size=8, env={**env, "FCDP_LAB_BREAK": "link.no_vote"})
    assert [r["paths"] for r in split] == ["zero3"] * 4 + ["fcdp"] * 4, split


def test_the_probe_on_real_groups(ranks):
    """No declaration: the probe times the loopback's groups; the choice is the rule's on the agreed times."""
    results = ranks("link:choice_only", env={"FCDP_LAB_LINK": ""}, nbytes=1 << 20)
    assert len({(r["paths"], r["link_flat_s"], r["link_two_stage_s"]) for r in results}) == 1, results
    r = results[0]
    assert r["link_source"] == "measured" and r["link_fetch_bytes"] == 1 << 20
    # [Note: loopback times] every "node" shares the loopback, so the three gathers cross one link and, at a few
    # milliseconds on two loaded cores, their order is noise (CI saw the node-only gather at 3.4 ms above the
    # two-stage one at 2.3 ms). The claims are the agreement above and the rule's choice below; noise that raises
    # a node time only keeps ZeRO-3's paths (the rule asks a fetch across nodes to take 4x one inside a node).
    assert min(r["link_flat_s"], r["link_two_stage_s"], r["link_node_s"]) > 0
    times = paths.FetchTimes(r["link_fetch_bytes"], r["link_flat_s"], r["link_two_stage_s"], r["link_node_s"])
    assert paths.choose(times).paths.value == r["paths"]


@pytest.fixture(scope="module")
def on_fast_link():
    from conftest import run_ranks
    return run_ranks("link:train_defaults", link="fast")


def test_zero3_paths_are_zero3_bit_for_bit(on_fast_link):
    r0 = on_fast_link[0]
    assert r0["fcdp"]["losses"] == r0["plain"]["losses"]
    for name, w in r0["plain"]["weights"].items():
        assert torch.equal(w, r0["fcdp"]["weights"][name]), name
    stats = r0["fcdp"]["stats"]
    assert stats["paths"] == "zero3" and stats["param_gather"] == "flat" and stats["grad_reduce"] == "flat"
    assert stats["cache_hits"] == 0 and stats["inter_node_allgather_calls"] > 0 and stats["fcdp_enabled"]


def test_the_on_line_says_zero3_paths_and_why(on_fast_link):
    line = on_fast_link[0]["fcdp"]["log"]
    assert len(line) == 1 and "ZeRO-3's paths: DeepSpeed's own ZeRO-3, nothing cached" in line[0], line
    assert "fcdp.link is \"fast\"" in line[0], line
