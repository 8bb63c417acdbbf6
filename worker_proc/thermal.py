"""Device temperature sensors, and the per-step MAX all-reduce of their readings across the
tensor-parallel group.

Sensors (--thermal-sensor):
* nvml: the hotter of the GPU core and HBM temperature (the memory temperature field where the
  device reports it), plus power draw and the slowdown threshold, through nvidia-ml-py.
* psutil: the hottest of psutil.sensors_temperatures() (often empty in containers and VMs:
  then there is no reading, never a made-up 0).
* file:PATH: a number (Celsius) read from PATH at every reading; `{rank}` in PATH becomes the
  worker's rank. For tests, and for a BMC or DCGM sidecar that writes one.
* auto: nvml on a CUDA device if it initialises, else psutil if it reads anything, else none.

Every --thermal-interval-steps steps, each rank reads its sensor and the group all-reduces
(MAX) a small tensor holding every rank's temperature and power in its own column, on a
dedicated gloo group, in a helper thread started before the forward pass and joined after it.
Rank 0 then knows every rank's reading, the maximum and which rank is hottest.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist
from spmd_runtime.protocol.messages import ThermalReading

log = logging.getLogger("spmd.worker")

# A rank without a reading contributes this to the MAX: below any real temperature.
NO_READING = -1.0e9
# A sensor that fails to read (a file caught mid-write, a busy BMC) repeats its last good
# reading this many times before it counts as having none: one missed read of the hot rank
# must not make the group look cool and end a throttle episode.
MAX_STALE_READINGS = 3


@dataclass
class SensorReading:
    temp_c: float                      # what the policy sees: the hotter of core and memory
    core_c: float | None = None
    memory_c: float | None = None
    power_w: float | None = None
    slowdown_c: float | None = None    # the device's own throttling threshold, where known

    def describe(self) -> str:
        parts = [f"{self.temp_c:.1f} C"]
        if self.core_c is not None:
            parts.append(f"core {self.core_c:.0f} C")
        if self.memory_c is not None:
            parts.append(f"memory {self.memory_c:.0f} C")
        if self.power_w is not None:
            parts.append(f"power {self.power_w:.0f} W")
        if self.slowdown_c is not None:
            parts.append(f"slowdown at {self.slowdown_c:.0f} C")
        return ", ".join(parts)


class Sensor:
    kind = "none"

    def read(self) -> SensorReading | None:
        return None

    def close(self) -> None:
        pass


class FileSensor(Sensor):
    kind = "file"

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> SensorReading | None:
        try:
            with open(self.path) as f:
                text = f.read().strip()
        except OSError:
            return None
        try:
            value = float(text)
        except ValueError:
            return None
        return SensorReading(value) if math.isfinite(value) else None


class PsutilSensor(Sensor):
    kind = "psutil"

    def read(self) -> SensorReading | None:
        reader = getattr(psutil, "sensors_temperatures", None)
        if reader is None:
            return None
        try:
            groups = reader()
        except (OSError, RuntimeError):
            return None
        values = [entry.current for entries in groups.values() for entry in entries
                  if entry.current is not None and math.isfinite(entry.current)
                  and entry.current > 0]
        return SensorReading(max(values)) if values else None


class NvmlSensor(Sensor):
    """One CUDA device through NVML. Raises at construction if NVML does not initialise."""

    kind = "nvml"

    def __init__(self, device: torch.device) -> None:
        import pynvml
        self.nvml = pynvml
        pynvml.nvmlInit()
        try:
            self.handle = self._handle(device)
            self.slowdown_c = self._optional(
                pynvml.nvmlDeviceGetTemperatureThreshold, self.handle,
                pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        except Exception:
            pynvml.nvmlShutdown()
            raise

    def _handle(self, device: torch.device):
        """The NVML handle of the torch device, by UUID (CUDA_VISIBLE_DEVICES may renumber)."""
        nvml = self.nvml
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except nvml.NVMLError:
                pass
        return nvml.nvmlDeviceGetHandleByIndex(index)

    def _optional(self, call, *args):
        try:
            return float(call(*args))
        except self.nvml.NVMLError:
            return None

    def _memory_temperature(self) -> float | None:
        nvml = self.nvml
        field = getattr(nvml, "NVML_FI_DEV_MEMORY_TEMP", None)
        if field is None:
            return None
        try:
            (value,) = nvml.nvmlDeviceGetFieldValues(self.handle, [field])
        except nvml.NVMLError:
            return None
        if value.nvmlReturn != nvml.NVML_SUCCESS:
            return None
        reading = _field_number(nvml, value)
        return reading if reading else None   # 0 means the device does not report it

    def read(self) -> SensorReading | None:
        nvml = self.nvml
        core = self._optional(nvml.nvmlDeviceGetTemperature, self.handle, nvml.NVML_TEMPERATURE_GPU)
        memory = self._memory_temperature()
        temps = [t for t in (core, memory) if t is not None]
        if not temps:
            return None
        milliwatts = self._optional(nvml.nvmlDeviceGetPowerUsage, self.handle)
        return SensorReading(max(temps), core, memory,
                             None if milliwatts is None else milliwatts / 1000.0, self.slowdown_c)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def _field_number(nvml, value) -> float:
    """The number in an nvmlFieldValue_t, whatever its value type."""
    kinds = {getattr(nvml, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
             getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
             getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
             getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
             getattr(nvml, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal"}
    return float(getattr(value.value, kinds.get(value.valueType, "uiVal")))


def make_sensor(spec: str, rank: int, device: torch.device) -> Sensor:
    """The sensor named by --thermal-sensor for this rank."""
    if spec.startswith("file:"):
        return FileSensor(spec[len("file:"):].replace("{rank}", str(rank)))
    if spec == "none":
        return Sensor()
    if spec == "psutil":
        return PsutilSensor()
    if spec == "nvml":
        try:
            return NvmlSensor(device)
        except Exception as error:
            raise RuntimeError(f"--thermal-sensor nvml: NVML did not initialise ({error}); use "
                               "auto, psutil, file:PATH or none") from None
    if spec != "auto":
        raise ValueError(f"unknown --thermal-sensor {spec!r}: use auto, nvml, psutil, file:PATH "
                         "or none")
    if device.type == "cuda":
        try:
            return NvmlSensor(device)
        except Exception as error:
            log.info("rank %d: NVML unavailable (%s); trying psutil", rank, error)
    if PsutilSensor().read() is not None:
        return PsutilSensor()
    return Sensor()


class ThermalMonitor:
    """Reads this rank's sensor every `interval` steps and all-reduces the group's readings,
    overlapped with the forward pass: begin() before it, finish() after."""

    def __init__(self, sensor: Sensor, rank: int, world_size: int, interval: int,
                 group=None, enabled: bool = True) -> None:
        self.sensor = sensor
        # False when no rank has a sensor: then nothing is read or all-reduced at all.
        self.enabled = enabled
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.group = group
        # A daemon thread, so a rank that fails mid-step never waits on a collective its
        # peers will not finish.
        self._requests: queue.SimpleQueue[Future | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="thermal", daemon=True)
        self._thread.start()
        # Seconds spent reading + all-reducing (in the helper thread), and waiting for it.
        self.background_s = 0.0
        self.wait_s = 0.0
        self.num_readings = 0
        self._last: SensorReading | None = None
        self._misses = 0

    @classmethod
    def create(cls, spec: str, interval: int, rank: int, world_size: int,
               device: torch.device, timeout_s: float = 300.0) -> "ThermalMonitor":
        """Every rank must call this, in the same order as its other group creations."""
        sensor = make_sensor(spec, rank, device)
        group = None
        enabled = sensor.kind != "none"
        if world_size > 1:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            any_sensor = torch.tensor([int(enabled)])
            dist.all_reduce(any_sensor, op=dist.ReduceOp.MAX, group=group)
            enabled = bool(any_sensor.item())
        return cls(sensor, rank, world_size, interval, group, enabled)

    def _serve(self) -> None:
        while True:
            pending = self._requests.get()
            if pending is None:
                return
            try:
                pending.set_result(self._read_and_reduce())
            except BaseException as error:  # handed to the step loop, which fails the worker
                pending.set_exception(error)

    def begin(self, step_id: int) -> Future | None:
        """Start this step's reading if it is due. Every rank sees the same plans, so every
        rank starts the same collectives."""
        if not self.enabled or step_id < 0 or step_id % self.interval:
            return None
        pending: Future = Future()
        self._requests.put(pending)
        return pending

    def finish(self, pending: Future | None) -> ThermalReading | None:
        if pending is None:
            return None
        started = time.perf_counter()
        reading = pending.result()
        self.wait_s += time.perf_counter() - started
        return reading

    def _read_and_reduce(self) -> ThermalReading | None:
        started = time.perf_counter()
        local = self._read_local()
        table = torch.full((2, self.world_size), NO_READING, dtype=torch.float64)
        if local is not None:
            table[0, self.rank] = local.temp_c
            if local.power_w is not None:
                table[1, self.rank] = local.power_w
        if self.group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        self.background_s += time.perf_counter() - started
        self.num_readings += 1
        temps = [t if t > NO_READING / 2 else None for t in table[0].tolist()]
        known = [(t, rank) for rank, t in enumerate(temps) if t is not None]
        if not known:
            return None
        max_temp, hottest = max(known, key=lambda item: (item[0], -item[1]))
        powers = [p for p in table[1].tolist() if p > NO_READING / 2]
        return ThermalReading(max_temp_c=max_temp, hottest_rank=hottest, temps_c=temps,
                              power_w=sum(powers) if powers else None)

    def _read_local(self) -> SensorReading | None:
        local = self.sensor.read()
        if local is not None:
            self._last, self._misses = local, 0
            return local
        if self._last is not None and self._misses < MAX_STALE_READINGS:
            self._misses += 1
            return self._last
        return None

    def close(self) -> None:
        self._requests.put(None)
        self.sensor.close()
