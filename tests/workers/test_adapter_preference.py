"""Pulling by adapter (workers/adapters.py: AdapterPreference), on a fake clock: which adapter
queues a worker reads, given what it holds, what other live workers hold, and how long a
queue has waited unread."""

from __future__ import annotations

from workers.adapters import AdapterPreference

SIX = [f"adapter-{i}" for i in range(6)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def preference(name: str = "w1", max_loras: int = 2, wait_seconds: float = 10.0) -> tuple[AdapterPreference, Clock]:
    clock = Clock()
    return AdapterPreference(name, max_loras, wait_seconds, clock), clock


def record(name: str, held: list[str], draining: int = 0) -> dict:
    return {"name": name, "lora_held": held, "draining": draining}


def test_a_fresh_worker_takes_as_many_new_adapters_as_it_has_slots():
    pref, _ = preference(max_loras=2)
    chosen = pref.choose(SIX, held=set(), busy=set())
    assert len(chosen) == 2 and chosen <= set(SIX)


def test_held_adapters_are_always_read_and_busy_slots_are_not_offered():
    pref, _ = preference(max_loras=2)
    # adapter-0 is running here (busy), adapter-1 sits idle in the other slot: one slot may change.
    chosen = pref.choose(SIX, held={"adapter-0", "adapter-1"}, busy={"adapter-0"})
    assert {"adapter-0", "adapter-1"} <= chosen and len(chosen) == 3
    # Both slots busy: only what is held, however many queues wait.
    assert pref.choose(SIX, held={"adapter-0", "adapter-1"}, busy={"adapter-0", "adapter-1"}) == {
        "adapter-0", "adapter-1"}


def test_workers_starting_together_reach_for_different_adapters():
    # Rendezvous hashing on (worker, adapter): over many worker names the first picks spread
    # across the adapters instead of every worker taking the same two.
    firsts = set()
    for i in range(20):
        firsts |= preference(f"worker-{i}")[0].choose(SIX, held=set(), busy=set())
    assert firsts == set(SIX)


def test_an_adapter_another_worker_holds_waits_for_it_then_anyone_takes_it():
    pref, clock = preference(max_loras=2, wait_seconds=10.0)
    pref.refresh([record("w1", []), record("w2", ["adapter-3"])])
    assert pref.held_elsewhere == {"adapter-3": {"w2"}}  # its own record is not "elsewhere"
    assert pref.choose(["adapter-3"], held=set(), busy=set()) == set()
    clock.now += 9.9
    assert pref.choose(["adapter-3"], held=set(), busy=set()) == set()
    clock.now += 0.1  # waited --lora-wait-seconds unread: affinity never strands work
    assert pref.choose(["adapter-3"], held=set(), busy=set()) == {"adapter-3"}
    assert pref.skipped_since == {}


def test_unheld_adapters_come_before_those_held_elsewhere():
    pref, _ = preference(max_loras=1)
    pref.refresh([record("w2", ["adapter-0", "adapter-1"])])
    assert pref.choose(["adapter-0", "adapter-1", "adapter-2"], held=set(), busy=set()) == {"adapter-2"}


def test_a_draining_worker_holds_nothing_for_the_fleet():
    pref, _ = preference(max_loras=1)
    pref.refresh([record("w2", ["adapter-0"], draining=1)])
    assert pref.held_elsewhere == {}
    assert pref.choose(["adapter-0"], held=set(), busy=set()) == {"adapter-0"}


def test_a_queue_that_stops_waiting_starts_its_wait_afresh():
    pref, clock = preference(max_loras=0, wait_seconds=10.0)
    pref.refresh([record("w2", ["adapter-0"])])
    assert pref.choose(["adapter-0"], held=set(), busy=set()) == set()
    clock.now += 8
    assert pref.choose([], held=set(), busy=set()) == set()  # its queue emptied
    assert pref.skipped_since == {}
    clock.now += 8  # 16 s since it was first skipped, but its new wait began now
    assert pref.choose(["adapter-0"], held=set(), busy=set()) == set()
    clock.now += 10
    assert pref.choose(["adapter-0"], held=set(), busy=set()) == {"adapter-0"}
