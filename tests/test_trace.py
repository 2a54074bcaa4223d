import json
import threading

import pytest

from infinity.trace import NULL_TRACER, Tracer


def test_records_only_the_chosen_step(tmp_path):
    t = Tracer(rank=3)
    t.record_step(1)
    for step in range(3):
        t.begin_step()
        with t.span("forward", lane="compute", step=step):
            pass
        t.end_step()
    evs = t.events()
    assert [e["args"]["step"] for e in evs] == [1]
    doc = json.loads(t.dump(tmp_path / "trace.json").read_text())
    names = {(e["ph"], e["name"]) for e in doc["traceEvents"]}
    assert ("M", "thread_name") in names and ("M", "process_name") in names and ("X", "forward") in names
    assert all(e["pid"] == 3 for e in doc["traceEvents"])


def test_one_lane_per_thread_and_durations():
    t = Tracer()
    t.record_step(0)
    t.begin_step()

    def work(i):
        with t.span("io", piece=i):
            pass

    threads = [threading.Thread(target=work, args=(i,), name=f"io-{i}") for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.add("adam", 1.0, 1.5, lane="adam-0")
    evs = t.events()
    assert len({e["tid"] for e in evs}) == 4
    adam = next(e for e in evs if e["name"] == "adam")
    assert adam["dur"] == pytest.approx(0.5e6)
    assert all(e["dur"] >= 0 for e in evs)


def test_span_records_even_when_the_body_raises():
    t = Tracer()
    t.record_step(0)
    t.begin_step()
    with pytest.raises(ValueError):
        with t.span("boom"):
            raise ValueError("x")
    assert [e["name"] for e in t.events()] == ["boom"]


def test_null_tracer_never_records():
    NULL_TRACER.begin_step()
    with NULL_TRACER.span("x"):
        pass
    assert NULL_TRACER.events() == []
    with pytest.raises(RuntimeError, match="cannot record"):
        NULL_TRACER.record_step(0)
