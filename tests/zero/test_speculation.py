"""SpeculationPolicy: when a speculative step speculates, from what the last steps needed."""

from __future__ import annotations

from infinity.zero.speculation import SpeculationPolicy


def _run(policy: SpeculationPolicy, unclipped: list) -> list:
    """Step by step: whether each step speculated."""
    out = []
    for ok in unclipped:
        now = policy.speculate()
        out.append(now)
        policy.record(now, ok)
    return out


def test_it_speculates_while_steps_commit():
    assert _run(SpeculationPolicy(), [True] * 5) == [True] * 5


def test_after_a_redo_it_waits_for_an_unclipped_step():
    # step 1 is clipped (redone): step 2 falls back; step 2 unclipped, so step 3 speculates again
    assert _run(SpeculationPolicy(), [True, False, True, True, True]) == [True, True, False, True, True]


def test_a_clipped_fallback_step_restarts_the_wait():
    # redo at 0; fallback 1 clipped (calm 0), fallback 2 unclipped (calm 1): speculate at 3
    assert _run(SpeculationPolicy(), [False, False, True, True]) == [True, False, False, True]


def test_failed_speculations_in_a_row_double_the_wait_up_to_the_cap():
    # every step clips: speculations at 0, then after 1, 2, 4, 4 unclipped steps... here none ever comes, so
    # only the first step speculates
    assert _run(SpeculationPolicy(), [False] * 6) == [True] + [False] * 5
    # clipped speculation, one calm step, clipped speculation again: the wait is now 2 calm steps
    p = SpeculationPolicy(max_calm=4)
    assert _run(p, [False, True, False, True, True, False, True, True, True, True, False]) == \
        [True, False, True, False, False, True, False, False, False, False, True]
    assert p.state() == {"calm_needed": 4, "calm": 0}   # capped at max_calm (it would be 8)


def test_a_commit_resets_the_wait():
    p = SpeculationPolicy()
    # fail, calm, fail (wait 2), calm, calm, commit: the next failure waits 1 step again
    assert _run(p, [False, True, False, True, True, True, False, True, True]) == \
        [True, False, True, False, False, True, True, False, True]
