import pytest
from hypothesis import given, settings, strategies as st

from infinity.schedule import TracePrefetcher, TraceState

FWD_BWD = [0, 1, 2, 3, 3, 2, 1, 0]


def run_step(pf, order):
    fetched = []
    for u in order:
        fetched.append(pf.on_use(u))
    return fetched


def test_first_step_records_then_prefetches_along_trace():
    pf = TracePrefetcher({u: 10 for u in range(4)}, prefetch_bytes=20)
    assert run_step(pf, FWD_BWD) == [[]] * 8
    assert pf.end_step() is False and pf.trace == FWD_BWD and pf.state is TraceState.FOLLOWING
    fetched = run_step(pf, FWD_BWD)
    # two units (20 bytes) ahead of the one in use; unit 3's second use is free (live now)
    assert fetched[0] == [1, 2]
    assert fetched[1] == [3]
    assert pf.end_step() is True and pf.steps_recorded == 1 and pf.steps_diverged == 0


def test_divergence_stops_prefetch_and_rerecords():
    pf = TracePrefetcher({u: 1 for u in range(4)}, prefetch_bytes=2)
    run_step(pf, FWD_BWD)
    pf.end_step()
    other = [0, 2, 1, 3, 3, 1, 2, 0]
    fetched = run_step(pf, other)
    assert fetched[0] == [1, 2] and all(f == [] for f in fetched[1:])
    assert pf.state is TraceState.DIVERGED
    assert pf.end_step() is False and pf.trace == other and pf.steps_diverged == 1


def test_a_rank_that_disagrees_forces_rerecord_everywhere():
    pf = TracePrefetcher({u: 1 for u in range(4)}, prefetch_bytes=2)
    run_step(pf, FWD_BWD)
    pf.end_step()
    run_step(pf, FWD_BWD)
    assert pf.end_step(agree=lambda ok: False) is False  # another rank diverged
    assert pf.trace == FWD_BWD and pf.steps_recorded == 2


def test_shorter_step_is_a_divergence():
    pf = TracePrefetcher({u: 1 for u in range(4)}, prefetch_bytes=2)
    run_step(pf, FWD_BWD)
    pf.end_step()
    run_step(pf, FWD_BWD[:4])
    assert pf.end_step() is False and pf.trace == FWD_BWD[:4]


def test_bad_input():
    with pytest.raises(ValueError, match="prefetch_bytes"):
        TracePrefetcher({0: 1}, -1)
    with pytest.raises(KeyError, match="unknown unit 7"):
        TracePrefetcher({0: 1}, 1).on_use(7)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    budget=st.integers(0, 120),
    data=st.data(),
)
def test_never_more_than_budget_ahead_and_deterministic(sizes, budget, data):
    units = range(len(sizes))
    order = data.draw(st.lists(st.sampled_from(list(units)), min_size=1, max_size=20))
    order2 = data.draw(st.lists(st.sampled_from(list(units)), min_size=1, max_size=20))

    def simulate():
        pf = TracePrefetcher(dict(enumerate(sizes)), budget)
        log = []
        for step_order in (order, order, order2, order2):
            outstanding = set()  # fetched, not yet used
            for u in step_order:
                outstanding.discard(u)
                new = pf.on_use(u)
                assert not (set(new) & outstanding), "a unit fetched twice while outstanding"
                outstanding |= set(new)
                outstanding.discard(u)
                assert sum(sizes[x] for x in outstanding) <= budget
                log.append(tuple(new))
            log.append(pf.end_step())
        return log

    assert simulate() == simulate()


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 10), min_size=2, max_size=6), data=st.data())
def test_with_room_for_one_unit_every_use_after_the_first_was_prefetched(sizes, data):
    order = data.draw(st.permutations(list(range(len(sizes)))))
    pf = TracePrefetcher(dict(enumerate(sizes)), prefetch_bytes=max(sizes))
    run_step(pf, order)
    pf.end_step()
    fetched = set()
    for i, u in enumerate(order):
        if i > 0:
            assert u in fetched
        fetched |= set(pf.on_use(u))
