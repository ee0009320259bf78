"""Process CPU utilisation and, where a GPU and NVML exist, GPU utilisation and memory."""

from __future__ import annotations

import os
import time
from typing import Any


class CpuSampler:
    """CPU time of this process over wall time since the previous reading, per CPU it may use (0..1)."""

    def __init__(self, clock: Any = time.monotonic, cpu_clock: Any = time.process_time) -> None:
        self.clock, self.cpu_clock = clock, cpu_clock
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._wall, self._cpu = clock(), cpu_clock()

    def utilization(self) -> float:
        wall, cpu = self.clock(), self.cpu_clock()
        dw, dc = wall - self._wall, cpu - self._cpu
        if dw <= 0:
            return 0.0
        self._wall, self._cpu = wall, cpu
        return max(0.0, min(1.0, dc / dw / self.cpus))


class NvmlSampler:
    """GPU utilisation (0..1) and memory in use of one device through NVML; ``available`` False without one."""

    def __init__(self, index: int = 0) -> None:
        self.available = False
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            self.available = True
        except Exception:  # no driver, no device or no pynvml: CPU-only replica
            self.available = False

    def utilization(self) -> float:
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu) / 100.0

    def memory_used_bytes(self) -> float:
        return float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
