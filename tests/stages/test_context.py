"""The stage timer: exclusive times per stage name."""

import pytest

from raot_hf.stages import context
from raot_hf.stages.context import StageTimer


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """The timer's clock, moved by hand."""
    clock = _Clock()
    monkeypatch.setattr(context.time, "perf_counter", clock)
    return clock


def test_a_stage_inside_another_is_counted_once_under_its_own_name(clock):
    timer = StageTimer()
    with timer.stage("calibration"):
        clock.now += 3
        for _ in range(2):  # a stage entered twice adds up
            with timer.stage("solve"):
                clock.now += 2
        clock.now += 1
    with pytest.raises(RuntimeError), timer.stage("sweep"):  # a failing stage is still timed
        clock.now += 5
        raise RuntimeError
    assert timer.times == {"calibration": 4.0, "solve": 4.0, "sweep": 5.0}
    assert sum(timer.times.values()) == clock.now  # nothing counted twice


def test_nested_three_deep_each_level_keeps_only_its_own_time(clock):
    timer = StageTimer()
    with timer.stage("a"):
        clock.now += 1
        with timer.stage("b"):
            clock.now += 2
            with timer.stage("c"):
                clock.now += 4
        with timer.stage("a"):  # a stage inside itself
            clock.now += 8
    assert timer.times == {"a": 9.0, "b": 2.0, "c": 4.0}
