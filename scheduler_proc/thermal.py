"""Thermal-aware batch control: the hottest device of the tensor-parallel group caps the
running batch.

Every all-reduce of a TP step waits for the slowest rank, so one hot device slows the whole
group; lowering max_num_seqs alone changes nothing for requests already decoding. So the
workers all-reduce the MAX of their readings, the scheduler hands it to a ThermalPolicy, and
when the policy's cap falls below the number of running requests the surplus leaves the batch
through preemption (offloaded to the CPU swap space when there is room, else soft reset). The
victims come back only when the cap allows.

The default policy is a proportional controller with hysteresis: throttling starts when the
hottest device reaches the target and stops only below target minus the hysteresis; while it
throttles, the cap is the batch at the start of the episode minus k_p per degree over target
(at least one, never below one request), and it only ever goes down until the episode ends.
That ratchet plus the hysteresis is what keeps a temperature hovering around the target from
evicting and resuming the same requests step after step.

A policy of one's own: subclass ThermalPolicy and pass --thermal-policy module:Class, or
publish it as an entry point in the group `spmd_runtime.thermal_policies`.
"""
from __future__ import annotations

import importlib
import logging
import math
from collections import deque
from importlib.metadata import entry_points

from spmd_runtime.protocol.config_fields import VICTIM_POLICIES
from spmd_runtime.protocol.messages import ThermalEvent, ThermalReading
from spmd_runtime.scheduler_proc.request import Request

log = logging.getLogger("spmd.thermal")

ENTRY_POINT_GROUP = "spmd_runtime.thermal_policies"
MAX_EVENTS = 64


def select_victims(running: list[Request], n: int, victims: str) -> list[Request]:
    """n requests of the running batch (given in admission order) to take off it.

    lru: the most recently admitted or resumed (they lose the least progress); largest_kv:
    those holding the most KV blocks (they free the most memory and work); lowest_priority:
    lowest priority first, the most recently admitted among equals."""
    if n <= 0:
        return []
    newest_first = list(reversed(running))
    if victims == "lru":
        ranked = newest_first
    elif victims == "largest_kv":
        ranked = sorted(newest_first, key=lambda r: -len(r.block_ids))
    elif victims == "lowest_priority":
        ranked = sorted(newest_first, key=lambda r: r.priority)
    else:
        raise ValueError(f"unknown victim policy {victims!r}: use {', '.join(VICTIM_POLICIES)}")
    return ranked[:n]


class ThermalPolicy:
    """Decides how many requests may run, given the group's hottest temperature, and which
    ones leave when there are too many.

    The scheduler calls on_temperature with every new reading (the MAX over the TP group),
    max_running before planning each step, and select_victims when the running batch exceeds
    the cap. `throttling` tells the scheduler (and stats) whether the policy is limiting the
    batch; subclasses keep it current. A subclass is built with the keyword arguments below.
    """

    def __init__(self, *, target_c: float = 82.0, hysteresis_c: float = 3.0, k_p: float = 1.0,
                 victims: str = "lru") -> None:
        if victims not in VICTIM_POLICIES:
            raise ValueError(f"unknown victim policy {victims!r}: use {', '.join(VICTIM_POLICIES)}")
        self.target_c = target_c
        self.hysteresis_c = hysteresis_c
        self.k_p = k_p
        self.victims = victims
        self.throttling = False
        self.last_temp_c: float | None = None

    def on_temperature(self, max_temp_c: float) -> None:
        self.last_temp_c = max_temp_c

    def max_running(self, current_cap: int) -> int:
        """The most requests that may run now. current_cap is what would run without thermal
        limits: min(max_num_seqs, requests that want to run)."""
        return current_cap

    def select_victims(self, running: list[Request], n: int) -> list[Request]:
        return select_victims(running, n, self.victims)


class ProportionalThermalPolicy(ThermalPolicy):
    """P-controller with hysteresis and a cap that only goes down during an episode."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._episode_base: int | None = None   # the batch when this throttle episode began
        self._cap: int | None = None

    def on_temperature(self, max_temp_c: float) -> None:
        super().on_temperature(max_temp_c)
        if not self.throttling and max_temp_c >= self.target_c:
            self.throttling = True
        elif self.throttling and max_temp_c < self.target_c - self.hysteresis_c:
            self.throttling = False
            self._episode_base = None
            self._cap = None

    def max_running(self, current_cap: int) -> int:
        if not self.throttling:
            return current_cap
        if self._episode_base is None:
            self._episode_base = current_cap
        over = max(0.0, self.last_temp_c - self.target_c)
        reduction = max(1, math.floor(self.k_p * over))
        cap = max(1, self._episode_base - reduction)
        self._cap = cap if self._cap is None else min(self._cap, cap)
        return min(self._cap, current_cap)


def load_policy_class(spec: str) -> type[ThermalPolicy]:
    """'' for the default, 'module:Class', or the name of an entry point."""
    if not spec:
        return ProportionalThermalPolicy
    if ":" in spec:
        module_name, _, class_name = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"--thermal-policy {spec}: cannot load {class_name} from "
                             f"{module_name} ({error})") from None
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not found:
            known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
            raise ValueError(f"--thermal-policy {spec}: no entry point of that name in group "
                             f"{ENTRY_POINT_GROUP} (installed: {', '.join(known) or 'none'}); "
                             "or give module:Class")
        cls = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, ThermalPolicy)):
        raise ValueError(f"--thermal-policy {spec}: {cls!r} is not a subclass of "
                         "spmd_runtime.scheduler_proc.thermal.ThermalPolicy")
    return cls


class ThermalControl:
    """The scheduler's side: the latest group reading, the policy, the cap, and the record of
    throttle episodes and evictions for stats and logs."""

    def __init__(self, policy: ThermalPolicy) -> None:
        self.policy = policy
        self.reading: ThermalReading | None = None
        self.thermal_evictions = 0
        self.admin_evictions = 0
        self.events: deque[ThermalEvent] = deque(maxlen=MAX_EVENTS)

    @property
    def throttling(self) -> bool:
        return self.policy.throttling

    @property
    def max_temp_c(self) -> float | None:
        return self.reading.max_temp_c if self.reading else None

    def running_cap(self, current_cap: int, max_num_seqs: int, demand: int) -> int:
        """The most requests allowed to run in the step being planned: max_num_seqs, or less
        while the policy throttles. `demand` counts the requests that want to run."""
        if not demand:
            # Idle: keep showing the cap in force until throttling stops.
            return min(current_cap, max_num_seqs) if self.throttling else max_num_seqs
        unlimited = min(max_num_seqs, demand)
        limited = self.policy.max_running(unlimited)
        return max(1, limited) if limited < unlimited else max_num_seqs

    def record_evictions(self, step: int, cap: int, running: int, request_ids: list[int]) -> None:
        """Requests the cap took off the batch (`running` are left)."""
        self.thermal_evictions += len(request_ids)
        self.record(step, "thermal_evict", cap, running, request_ids)
        log.info("thermal cap %d (%.1f C): took requests %s off the batch, %d running",
                 cap, self.max_temp_c or float("nan"), request_ids, running)

    def near_target(self) -> bool:
        """Throttling, or the hottest device within the hysteresis band below the target: the
        next reading may cross it, so the scheduler plans steps one at a time (a step planned
        ahead is sent before the reading of the step in flight arrives)."""
        temp = self.max_temp_c
        return self.policy.throttling or (
            temp is not None and temp >= self.policy.target_c - self.policy.hysteresis_c)

    def observe(self, reading: ThermalReading, step: int, cap: int, running: int) -> None:
        was_throttling = self.policy.throttling
        self.reading = reading
        self.policy.on_temperature(reading.max_temp_c)
        if self.policy.throttling == was_throttling:
            return
        if self.policy.throttling:
            log.warning("thermal throttling starts at %.1f C (hottest: rank %d; target %.1f C), "
                        "%d requests running", reading.max_temp_c, reading.hottest_rank,
                        self.policy.target_c, running)
            self.record(step, "throttle_start", cap, running)
        else:
            log.warning("thermal throttling stops at %.1f C (hottest: rank %d; resumes below "
                        "%.1f C): the batch may grow back", reading.max_temp_c,
                        reading.hottest_rank, self.policy.target_c - self.policy.hysteresis_c)
            self.record(step, "throttle_stop", cap, running)

    def record(self, step: int, kind: str, cap: int, running: int,
               request_ids: list[int] = ()) -> None:
        self.events.append(ThermalEvent(step=step, kind=kind, max_temp_c=self.max_temp_c,
                                        cap=cap, running=running, request_ids=list(request_ids)))

    def watts_per_request(self, num_running: int) -> float | None:
        """The group's measured power over the running requests, where power is known."""
        if self.reading is None or self.reading.power_w is None or num_running == 0:
            return None
        return self.reading.power_w / num_running
