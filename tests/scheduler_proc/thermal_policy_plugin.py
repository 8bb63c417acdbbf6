"""A thermal policy of a user's own, loaded by tests as module:Class (in-process, and in the
scheduler process as tests.scheduler_proc.thermal_policy_plugin:KeepTwoWhenWarm)."""
from __future__ import annotations

from spmd_runtime.scheduler_proc.thermal import ThermalPolicy


class KeepTwoWhenWarm(ThermalPolicy):
    """Caps the batch at two requests whenever the group is at 30 C or more (far below the
    built-in controller's target), and evicts the oldest requests first."""

    def on_temperature(self, max_temp_c: float) -> None:
        super().on_temperature(max_temp_c)
        self.throttling = max_temp_c >= 30.0

    def max_running(self, current_cap: int) -> int:
        return min(2, current_cap) if self.throttling else current_cap

    def select_victims(self, running, n):
        return list(running[:n])


class NotAPolicy:
    pass
