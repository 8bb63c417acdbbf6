"""Temperature sensors (file, psutil, NVML through a fake pynvml) and the MAX all-reduce of
the group's readings, on one rank and on two gloo ranks."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from collections import namedtuple

import psutil
import pytest
import torch
from conftest import repo_pythonpath
from spmd_runtime.protocol.transport import free_tcp_port
from spmd_runtime.worker_proc import thermal
from spmd_runtime.worker_proc.thermal import FileSensor, NvmlSensor, PsutilSensor, ThermalMonitor, make_sensor

CPU = torch.device("cpu")
Entry = namedtuple("Entry", "label current high critical")


def test_file_sensor_reads_a_number_each_time_and_expands_the_rank(tmp_path) -> None:
    (tmp_path / "gpu3").write_text("71.5\n")
    sensor = make_sensor(f"file:{tmp_path}/gpu{{rank}}", rank=3, device=CPU)
    assert isinstance(sensor, FileSensor) and sensor.kind == "file"
    assert sensor.read().temp_c == 71.5
    (tmp_path / "gpu3").write_text("88")
    assert sensor.read().temp_c == 88.0
    for garbage in ("", "hot", "nan", "inf"):
        (tmp_path / "gpu3").write_text(garbage)
        assert sensor.read() is None, garbage
    (tmp_path / "gpu3").unlink()
    assert sensor.read() is None


def test_psutil_sensor_reports_no_reading_rather_than_zero(monkeypatch) -> None:
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {}, raising=False)
    assert PsutilSensor().read() is None
    assert make_sensor("auto", 0, CPU).kind == "none"
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {
        "k10temp": [Entry("Tctl", 64.0, None, None), Entry("Tccd1", 0.0, None, None)],
        "nvme": [Entry("Composite", 41.0, 80.0, 85.0)]}, raising=False)
    assert PsutilSensor().read().temp_c == 64.0
    assert make_sensor("auto", 0, CPU).kind == "psutil"


def test_unknown_sensor_is_refused() -> None:
    with pytest.raises(ValueError, match="file:PATH"):
        make_sensor("dcgm", 0, CPU)


class FakeNvml(types.ModuleType):
    """The pynvml calls the sensor makes, with an H100-like device."""

    NVML_SUCCESS = 0
    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_FI_DEV_MEMORY_TEMP = 82
    NVML_VALUE_TYPE_UNSIGNED_INT = 1

    class NVMLError(Exception):
        pass

    def __init__(self, memory_reported: bool = True) -> None:
        super().__init__("pynvml")
        self.memory_reported = memory_reported
        self.calls = []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append(uuid)
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index):
        return "handle"

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 67

    def nvmlDeviceGetTemperatureThreshold(self, handle, kind):
        return 90

    def nvmlDeviceGetPowerUsage(self, handle):
        return 412_345

    def nvmlDeviceGetFieldValues(self, handle, fields):
        value = types.SimpleNamespace(uiVal=74 if self.memory_reported else 0)
        ret = self.NVML_SUCCESS if self.memory_reported else 3
        return [types.SimpleNamespace(nvmlReturn=ret, valueType=1, value=value)]


@pytest.mark.parametrize("memory_reported", [True, False])
def test_nvml_sensor_takes_the_hotter_of_core_and_memory(monkeypatch, memory_reported) -> None:
    fake = FakeNvml(memory_reported)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(uuid="1234-abcd"))
    sensor = NvmlSensor(torch.device("cuda", 0))
    reading = sensor.read()
    assert fake.calls[:2] == ["init", "GPU-1234-abcd"]
    assert reading.core_c == 67.0 and reading.slowdown_c == 90.0
    assert reading.power_w == pytest.approx(412.345)
    if memory_reported:
        assert reading.memory_c == 74.0 and reading.temp_c == 74.0
    else:
        assert reading.memory_c is None and reading.temp_c == 67.0
    assert "slowdown at 90 C" in reading.describe()
    sensor.close()
    assert fake.calls[-1] == "shutdown"


def test_nvml_that_does_not_initialise_is_an_error_when_asked_for(monkeypatch) -> None:
    fake = FakeNvml()

    def fail():
        raise fake.NVMLError("Driver Not Loaded")
    fake.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(RuntimeError, match="NVML did not initialise"):
        make_sensor("nvml", 0, torch.device("cuda", 0))


def test_one_rank_monitor_reads_on_due_steps_only(tmp_path) -> None:
    path = tmp_path / "t"
    path.write_text("55")
    monitor = ThermalMonitor(FileSensor(str(path)), rank=0, world_size=1, interval=3)
    try:
        assert monitor.begin(-1) is None                # housekeeping plans read nothing
        assert monitor.finish(monitor.begin(1)) is None  # not due
        reading = monitor.finish(monitor.begin(3))
        assert (reading.max_temp_c, reading.hottest_rank, reading.temps_c) == (55.0, 0, [55.0])
        assert reading.power_w is None
        path.unlink()
        # A failed read repeats the last good one a few times, then there is no reading.
        for step in range(6, 6 + 3 * thermal.MAX_STALE_READINGS, 3):
            assert monitor.finish(monitor.begin(step)).max_temp_c == 55.0
        assert monitor.finish(monitor.begin(99)) is None
        path.write_text("61")
        assert monitor.finish(monitor.begin(102)).max_temp_c == 61.0
    finally:
        monitor.close()


def test_a_group_without_sensors_reads_and_reduces_nothing() -> None:
    monitor = ThermalMonitor.create("none", 1, rank=0, world_size=1, device=CPU)
    try:
        assert not monitor.enabled and monitor.begin(0) is None
    finally:
        monitor.close()


TWO_RANKS = """
import os, sys, torch.distributed as dist
from spmd_runtime.worker_proc.thermal import ThermalMonitor
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
monitor = ThermalMonitor.create(sys.argv[1], 1, dist.get_rank(), 2, __import__("torch").device("cpu"))
reading = monitor.finish(monitor.begin(0))
if dist.get_rank() == 0:
    print(reading.max_temp_c, reading.hottest_rank, reading.temps_c)
reading = monitor.finish(monitor.begin(1))
if dist.get_rank() == 0:
    print(reading)
monitor.close()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_two_ranks_all_reduce_the_hottest_reading(tmp_path) -> None:
    (tmp_path / "t0").write_text("61")
    (tmp_path / "t1").write_text("86.5")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_tcp_port()),
               PYTHONPATH=repo_pythonpath())
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, f"file:{tmp_path}/t{{rank}}"],
                              env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    assert all(code == 0 for code, _, _ in outputs), outputs
    first, second = outputs[0][1].splitlines()
    assert first == "86.5 1 [61.0, 86.5]"
    assert "hottest_rank=1" in second
