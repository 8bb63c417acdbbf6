"""Thermal control on a fake worker: the proportional controller with hysteresis, victim
selection, evictions through swap or soft reset, no bouncing, and loading a policy of one's own."""
from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
from fake_engine import add, assert_pool_full, make, step, token_at
from spmd_runtime.scheduler_proc import thermal as thermal_module
from spmd_runtime.scheduler_proc.request import Request, RequestStatus
from spmd_runtime.scheduler_proc.thermal import (
    ProportionalThermalPolicy,
    ThermalControl,
    ThermalPolicy,
    load_policy_class,
    select_victims,
)

PROMPT = 8
OUTPUT = 40


def controlled(num_requests=6, num_cpu_blocks=64, victims="lru", k_p=1.0, max_num_seqs=16):
    control = ThermalControl(ProportionalThermalPolicy(target_c=82.0, hysteresis_c=3.0, k_p=k_p,
                                                       victims=victims))
    scheduler, loop = make(num_blocks=128, block_size=4, budget=256, max_num_seqs=max_num_seqs,
                           num_cpu_blocks=num_cpu_blocks, thermal=control)
    requests = [add(scheduler, rid, PROMPT, max_tokens=OUTPUT) for rid in range(num_requests)]
    return scheduler, loop, control, requests


def run_trace(scheduler, loop, temps: dict[int, float], default: float = 60.0):
    """Run to completion with the group temperature of each step taken from temps (by step
    id, holding the last value given); returns the running-batch size of every step."""
    def trace(step_id: int) -> float:
        known = [s for s in temps if s <= step_id]
        return temps[max(known)] if known else default
    loop.thermal_trace = trace
    sizes = []
    for _ in range(1000):
        if not scheduler.has_work:
            break
        scheduled, _ = step(scheduler, loop)
        sizes.append(len(scheduled.num_scheduled))
    loop.idle()
    return sizes


def assert_outputs_exact(requests: list[Request]) -> None:
    for r in requests:
        assert r.output_token_ids == [token_at(r.request_id, PROMPT + i) for i in range(OUTPUT)]


def test_controller_has_hysteresis_and_a_cap_that_only_falls_during_an_episode() -> None:
    policy = ProportionalThermalPolicy(target_c=82.0, hysteresis_c=3.0, k_p=2.0)
    policy.on_temperature(81.9)
    assert not policy.throttling and policy.max_running(10) == 10
    policy.on_temperature(82.0)                       # at the target: throttle, at least one
    assert policy.throttling and policy.max_running(10) == 9
    policy.on_temperature(84.6)                       # 2.6 degrees over, k_p 2: five fewer
    assert policy.max_running(10) == 5
    policy.on_temperature(83.0)                       # cooler, still over: the cap stays down
    assert policy.max_running(10) == 5
    policy.on_temperature(79.5)                       # under target, above target - hysteresis
    assert policy.throttling and policy.max_running(10) == 5
    policy.on_temperature(200.0)
    assert policy.max_running(10) == 1                # never below one request
    policy.on_temperature(78.9)                       # below 82 - 3: the episode ends
    assert not policy.throttling and policy.max_running(10) == 10
    policy.on_temperature(82.5)                       # a new episode starts from the batch now
    assert policy.max_running(4) == 3


def test_victim_orders() -> None:
    running = [Request(i, [1] * 4, None, priority=p) for i, p in enumerate([5, -1, 5, 0])]
    for request, blocks in zip(running, [3, 1, 7, 2], strict=True):
        request.block_ids = list(range(blocks))
    ids = lambda rs: [r.request_id for r in rs]  # noqa: E731
    assert ids(select_victims(running, 2, "lru")) == [3, 2]
    assert ids(select_victims(running, 2, "largest_kv")) == [2, 0]
    assert ids(select_victims(running, 3, "lowest_priority")) == [1, 3, 2]
    assert select_victims(running, 0, "lru") == []
    with pytest.raises(ValueError, match="largest_kv"):
        select_victims(running, 1, "random")


def test_hot_group_shrinks_the_batch_at_the_next_step_and_swaps_victims_out() -> None:
    scheduler, loop, control, requests = controlled()
    sizes = run_trace(scheduler, loop, {5: 85.0, 15: 70.0})
    # Step 5 reports 85 C: the plan of step 6 has 6 - 3 requests; victims come back after
    # the group cools below 79 C at step 15.
    assert sizes[:6] == [6] * 6 and sizes[6:16] == [3] * 10 and sizes[16] == 6
    assert control.thermal_evictions == 3
    assert scheduler.counters.num_swaps_out == 3 and scheduler.counters.num_swaps_in == 3
    assert [e.kind for e in control.events] == ["throttle_start", "thermal_evict",
                                                "throttle_stop"]
    evict = control.events[1]
    assert (evict.step, evict.cap, evict.running, evict.request_ids) == (6, 3, 3, [5, 4, 3])
    assert_outputs_exact(requests)
    assert_pool_full(scheduler)


def test_temperature_hovering_at_the_target_evicts_once_and_resumes_nobody() -> None:
    scheduler, loop, control, requests = controlled()
    hover = {3: 82.5}
    hover.update({s: 81.0 if s % 2 else 83.0 for s in range(4, 30)})   # target +- 1 degree
    sizes = run_trace(scheduler, loop, hover | {30: 78.0})
    assert sizes[4:31] == [5] * 27 and sizes[31] == 6
    assert control.thermal_evictions == 1 and scheduler.counters.num_swaps_in == 1
    assert [e.kind for e in control.events] == ["throttle_start", "thermal_evict",
                                                "throttle_stop"]
    assert_outputs_exact(requests)


def test_victims_are_soft_reset_without_swap_space_and_lose_nothing() -> None:
    scheduler, loop, control, requests = controlled(num_cpu_blocks=0, victims="largest_kv")
    run_trace(scheduler, loop, {4: 84.0, 12: 60.0})
    assert control.thermal_evictions == 2 and scheduler.counters.num_soft_resets == 2
    assert_outputs_exact(requests)
    assert_pool_full(scheduler)


def test_victims_wait_for_a_free_slot_under_the_cap() -> None:
    """While throttling, an evicted request resumes only when another one finishes."""
    control = ThermalControl(ProportionalThermalPolicy(target_c=82.0))
    scheduler, loop = make(num_blocks=128, block_size=4, budget=256, num_cpu_blocks=64,
                           thermal=control)
    short = [add(scheduler, rid, PROMPT, max_tokens=10) for rid in range(2)]
    long = [add(scheduler, rid, PROMPT, max_tokens=OUTPUT) for rid in range(2, 4)]
    sizes = run_trace(scheduler, loop, {2: 90.0})
    # 8 degrees over: a cap of 4 - 8 -> 1 request at a time, never more.
    assert sizes[:3] == [4, 4, 4] and max(sizes[3:]) == 1
    assert all(r.status is RequestStatus.FINISHED for r in short + long)
    assert control.thermal_evictions == 3


def test_no_readings_no_throttling() -> None:
    scheduler, loop, control, requests = controlled()
    sizes = run_trace(scheduler, loop, {})
    assert set(sizes) == {6} and control.thermal_evictions == 0 and not control.events
    assert_outputs_exact(requests)


def test_custom_policy_from_a_module_is_used() -> None:
    cls = load_policy_class("thermal_policy_plugin:KeepTwoWhenWarm")
    control = ThermalControl(cls(target_c=82.0))
    scheduler, loop = make(num_blocks=128, block_size=4, budget=256, num_cpu_blocks=64,
                           thermal=control)
    requests = [add(scheduler, rid, PROMPT, max_tokens=OUTPUT) for rid in range(5)]
    sizes = run_trace(scheduler, loop, {2: 40.0}, default=20.0)
    assert sizes[:3] == [5, 5, 5] and max(sizes[3:]) == 2
    # Its own victim order: the oldest leave first.
    assert control.thermal_evictions == 3
    assert [e.request_ids for e in control.events if e.kind == "thermal_evict"][0] == [0, 1, 2]
    assert_outputs_exact(requests)


def test_policy_loading_errors_say_what_to_change(monkeypatch) -> None:
    assert load_policy_class("") is ProportionalThermalPolicy
    with pytest.raises(ValueError, match="cannot load"):
        load_policy_class("no_such_module_xyz:Policy")
    with pytest.raises(ValueError, match="not a subclass"):
        load_policy_class("thermal_policy_plugin:NotAPolicy")
    with pytest.raises(ValueError, match="no entry point"):
        load_policy_class("coolest")
    entry = EntryPoint("coolest", "thermal_policy_plugin:KeepTwoWhenWarm",
                       thermal_module.ENTRY_POINT_GROUP)
    monkeypatch.setattr(thermal_module, "entry_points",
                        lambda group: [entry] if group == thermal_module.ENTRY_POINT_GROUP else [])
    assert load_policy_class("coolest").__name__ == "KeepTwoWhenWarm"


def test_a_policy_returning_bad_victims_is_overruled_not_fatal(caplog) -> None:
    class Careless(ThermalPolicy):
        def on_temperature(self, max_temp_c):
            self.throttling = True

        def max_running(self, current_cap):
            return 1 if self.throttling else current_cap

        def select_victims(self, running, n):
            return running[:1]          # fewer than asked

    scheduler, loop = make(num_blocks=64, block_size=4, num_cpu_blocks=16,
                           thermal=ThermalControl(Careless()))
    requests = [add(scheduler, rid, PROMPT, max_tokens=OUTPUT) for rid in range(3)]
    sizes = run_trace(scheduler, loop, {0: 50.0})
    assert sizes[0] == 3 and max(sizes[1:]) == 1
    assert "must return 2 distinct running requests" in caplog.text
    assert_outputs_exact(requests)
