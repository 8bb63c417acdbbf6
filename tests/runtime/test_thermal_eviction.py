"""Thermal eviction end to end: workers read file: sensors, all-reduce the group's maximum,
and the scheduler shrinks and regrows the running batch; admin batch control over RPC; a
thermal policy class of a test module used by the scheduler process.

Every run's greedy outputs are compared with the same engine running the same prompts again
with nothing hot and no eviction (prefix cache reset in between).
"""
from __future__ import annotations

import os
import threading

import pytest
from conftest import wait_until
from sharp_llama import sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams
from spmd_runtime.runtime.client import Client

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
# Stats polls: often enough to see a batch of 200-token requests in every state it passes
# through (each lasts many steps), rarely enough not to steal the engine's CPU with RPCs.
POLL_S = 0.02
OPTIONS = dict(dtype="float32", num_kv_blocks=128, max_model_len=256, max_num_seqs=8,
               kv_swap_memory="0.01GiB")


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 3 * i)] for i in range(n)]


class Background:
    """generate() in a thread, on a client of its own (clients are not thread-safe)."""

    def __init__(self, llm: LLM, token_lists, params, **kwargs) -> None:
        self.outputs = None
        self.error: BaseException | None = None

        def work():
            try:
                with Client(llm.config.rpc_address) as client:
                    self.outputs = client.generate(token_lists, params, **kwargs)
            except BaseException as error:  # re-raised in the test thread by join()
                self.error = error
        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 120.0):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "generation did not finish"
        if self.error is not None:
            raise self.error
        return [o.token_ids for o in self.outputs]


def write_atomically(path, value: float) -> None:
    """As a sidecar should: a reader never sees a half-written file."""
    staging = path.with_suffix(".tmp")
    staging.write_text(f"{value}\n")
    os.replace(staging, path)


def wait_for(client: Client, condition, what: str, timeout_s: float = 60.0, on_poll=None):
    """Poll stats until condition(stats) and return those stats; on_poll(stats) sees every
    poll's stats."""
    last = {}

    def poll():
        last["stats"] = stats = client.stats()
        if on_poll is not None:
            on_poll(stats)
        return stats if condition(stats) else None
    return wait_until(poll, timeout_s, POLL_S, what=lambda: f"{what}; last stats: {last.get('stats')}")


def reference(llm: LLM, token_lists) -> list[list[int]]:
    """The same engine, nothing hot, nothing evicted, nothing cached."""
    llm.client.reset_prefix_cache()
    before = llm.client.stats()
    outputs = [o.token_ids for o in llm.generate(token_lists, LONG)]
    after = llm.client.stats()
    assert after.num_preemptions == before.num_preemptions
    return outputs


@pytest.mark.timeout(600)
def test_hot_rank_throttles_the_tp_group_without_bouncing(tmp_path) -> None:
    model, _ = sharp_llama(tmp_path / "model")
    temps = [tmp_path / "temp0", tmp_path / "temp1"]

    def set_temps(rank0: float, rank1: float) -> None:
        for path, value in zip(temps, (rank0, rank1), strict=True):
            write_atomically(path, value)
    set_temps(60.0, 60.0)
    token_lists = prompts(6)
    with LLM(model, nproc_per_node=2, device="cpu", thermal_sensor=f"file:{tmp_path}/temp{{rank}}",
             thermal_target_c=82.0, thermal_hysteresis_c=3.0, thermal_kp=1.0,
             **OPTIONS) as llm:
        client = llm.client
        run = Background(llm, token_lists, LONG)
        wait_for(client, lambda s: s.num_running == 6, "all six requests running")

        # Rank 1 warms up to just under the target (the scheduler then plans step by step,
        # see ThermalControl.near_target) and crosses it while rank 0 stays cool: the global
        # max is rank 1's.
        set_temps(60.0, 80.0)
        warm = wait_for(client, lambda s: s.max_temp_c == 80.0, "the warm reading")
        assert not warm.thermal_throttling and warm.thermal_evictions == 0
        set_temps(60.0, 83.0)
        written_at = client.stats().num_steps
        throttled = wait_for(client, lambda s: s.thermal_evictions > 0, "a thermal eviction")
        assert throttled.thermal_throttling and throttled.max_temp_c == 83.0
        assert throttled.hottest_rank == 1 and throttled.rank_temps_c == [60.0, 83.0]
        assert throttled.thermal_sensor == "file"
        (start,) = [e for e in throttled.thermal_events if e.kind == "throttle_start"]
        (evict,) = [e for e in throttled.thermal_events if e.kind == "thermal_evict"]
        # A step that starts after the write reads it; the plan after its result is smaller.
        assert evict.step <= written_at + 2, (written_at, throttled.thermal_events)
        assert evict.cap == 5 and evict.running == 5 and len(evict.request_ids) == 1
        assert throttled.num_running == 5 and throttled.running_cap == 5
        assert throttled.num_swapped == 1

        # Hovering around the target (+- 1 degree) for many steps: no further evictions, no
        # resumes, the batch stays at the cap.
        running_seen = set()
        for value in (81.0, 83.0, 82.0, 81.5, 82.9, 81.0, 83.0):
            set_temps(60.0, value)
            now = client.stats().num_steps
            wait_for(client, lambda s, now=now: s.num_steps >= now + 3, "three steps",
                     on_poll=lambda s: running_seen.add(s.num_running))
        hovered = client.stats()
        assert running_seen == {5}
        assert hovered.thermal_evictions == 1 and hovered.num_swaps_in == 0
        assert hovered.thermal_throttling and hovered.num_finished == 0

        # Cooling below target - hysteresis ends throttling: the batch grows back.
        set_temps(60.0, 78.5)
        grown = wait_for(client, lambda s: s.num_running == 6, "the batch growing back")
        assert not grown.thermal_throttling and grown.num_swaps_in == 1
        assert [e.kind for e in grown.thermal_events] == [
            "throttle_start", "thermal_evict", "throttle_stop"]

        throttled_outputs = run.join()
        assert [len(t) for t in throttled_outputs] == [LONG.max_tokens] * 6
        done = client.stats()
        assert done.num_finished == 6 and done.num_running == done.num_swapped == 0
        assert throttled_outputs == reference(llm, token_lists)

        # Admin is off unless asked for.
        with pytest.raises(PermissionError, match="--admin-token"):
            client.admin_batch(force_evict=1, dry_run=True)


@pytest.mark.timeout(600)
def test_admin_batch_dry_run_then_evict(tmp_path) -> None:
    model, _ = sharp_llama(tmp_path / "model")
    token_lists = prompts(4)
    with LLM(model, thermal_sensor="none", enable_admin=True, admin_token="s3cret", **OPTIONS) as llm:
        client = llm.client
        run = Background(llm, token_lists, LONG)
        wait_for(client, lambda s: s.num_running == 4, "four requests running")
        for token in ("", "wrong"):
            with Client(llm.config.rpc_address, admin_token=token) as intruder:
                with pytest.raises(PermissionError, match="admin token missing or wrong"):
                    intruder.admin_batch(force_evict=2)
        with Client(llm.config.rpc_address, admin_token="s3cret") as admin:
            with pytest.raises(ValueError, match="at most"):
                admin.admin_batch(force_evict=9)
            dry = admin.admin_batch(force_evict=2, dry_run=True)
            assert dry.dry_run and dry.previous_running == 4 and dry.new_running == 2
            assert len(dry.evicted_request_ids) == 2 and dry.new_max_num_seqs == 2
            assert dry.estimated_watts_saved is None        # no power reading here
            unchanged = client.stats()
            assert unchanged.num_running == 4 and unchanged.admin_evictions == 0
            assert unchanged.max_num_seqs == OPTIONS["max_num_seqs"]

            real = admin.admin_batch(force_evict=2)
        assert not real.dry_run and real.evicted_request_ids == dry.evicted_request_ids
        after = client.stats()
        assert after.num_running == 2 and after.num_swapped == 2
        assert after.admin_evictions == 2 and after.max_num_seqs == 2
        (event,) = after.thermal_events
        assert event.kind == "admin_evict" and event.request_ids == real.evicted_request_ids

        # They complete later: when the others finish, under the lowered cap.
        evicted_outputs = run.join()
        assert client.stats().num_swaps_in == 2
        assert [len(t) for t in evicted_outputs] == [LONG.max_tokens] * 4
        with Client(llm.config.rpc_address, admin_token="s3cret") as admin:
            restored = admin.admin_batch(max_num_seqs=8)
        assert restored.new_max_num_seqs == 8 and restored.evicted_request_ids == []
        assert evicted_outputs == reference(llm, token_lists)


@pytest.mark.timeout(600)
def test_custom_policy_class_from_a_test_module(tmp_path) -> None:
    model, _ = sharp_llama(tmp_path / "model")
    (tmp_path / "temp").write_text("20")
    token_lists = prompts(5)
    with LLM(model, thermal_sensor=f"file:{tmp_path}/temp",
             thermal_policy="tests.scheduler_proc.thermal_policy_plugin:KeepTwoWhenWarm",
             **OPTIONS) as llm:
        client = llm.client
        run = Background(llm, token_lists, LONG)
        wait_for(client, lambda s: s.num_running == 5, "five requests running")
        # 40 C is far below the built-in controller's 82 C target; this policy caps at two.
        write_atomically(tmp_path / "temp", 40.0)
        capped = wait_for(client, lambda s: s.thermal_evictions == 3, "the policy's evictions")
        assert capped.running_cap == 2 and capped.num_running == 2 and capped.thermal_throttling
        (evict,) = [e for e in capped.thermal_events if e.kind == "thermal_evict"]
        assert sorted(evict.request_ids) == evict.request_ids   # its own order: oldest first
        running_seen = set()
        wait_for(client, lambda s: not run.thread.is_alive(), "the generation's end",
                 timeout_s=120.0, on_poll=lambda s: running_seen.add(s.num_running))
        outputs = run.join()
        assert outputs is not None and max(running_seen) <= 2
        write_atomically(tmp_path / "temp", 20.0)
        assert outputs == reference(llm, token_lists)
