"""GPU energy accounting from NVML's cumulative energy counter.

NVML exposes, per GPU (Volta and newer), the total energy consumed since the driver was loaded, in
millijoules. The energy of a window is the difference of two readings. The counter is refreshed only
every ~20-100 ms, so a window shorter than that often reads 0 J: measure over windows of at least
~1 s (the trainer laps once per logging window, i.e. every ``logging.every`` optimizer steps) and
divide by the steps and tokens of the window.

Each process measures its own GPU. In a multi-GPU run the per-rank joules must be summed across ranks
(an all-reduce) to get the energy of the job.

Everything here degrades to ``None``: on CPU, without ``pynvml`` (package ``nvidia-ml-py``), on MIG
instances (NVML does not report their energy) or on GPUs without the counter. Nothing here raises.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class EnergyMeter:
    """Joules consumed by one CUDA device between successive :meth:`lap` calls.

    Args:
        device: the torch device whose GPU to meter. The NVML handle is found through the device's
            UUID, so the mapping is right under any ``CUDA_VISIBLE_DEVICES`` ordering. A non-CUDA
            device gives a meter that always returns ``None``.

    Attributes:
        available: whether readings will be returned.
        unavailable_reason: why not (``None`` when available); the trainer logs it once so that a
            missing energy column is never a silent surprise.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.unavailable_reason: str | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._last_mj: int | None = None
        try:
            self._open()
        except Exception as exc:  # NVML failures have many types (library, driver, MIG); all mean "no meter"
            self.close()
            self.unavailable_reason = f"NVML energy counter unavailable: {type(exc).__name__}: {exc}"
        if self.unavailable_reason is not None:
            # On a CPU device no meter is expected: say so only at DEBUG, not as every CPU run's first line.
            level = logging.INFO if self.device.type == "cuda" else logging.DEBUG
            logger.log(level, "EnergyMeter(%s): %s", self.device, self.unavailable_reason)

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _open(self) -> None:
        """Initialise NVML, find the handle of ``self.device`` and take the first reading."""
        if self.device.type != "cuda":
            self.unavailable_reason = f"device {self.device} is not a CUDA device"
            return
        if not torch.cuda.is_available():
            self.unavailable_reason = "CUDA is not available"
            return
        try:
            import pynvml
        except ImportError:
            self.unavailable_reason = "pynvml is not installed (pip install nvidia-ml-py)"
            return
        pynvml.nvmlInit()
        self._nvml = pynvml
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = self._handle_by_uuid(uuid)
        if self._is_mig(handle):
            self.unavailable_reason = "MIG is enabled: NVML does not report energy for MIG instances"
            return
        self._last_mj = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        self._handle = handle

    def _handle_by_uuid(self, uuid: str) -> Any:
        """NVML handle for a CUDA UUID; torch gives the bare UUID, NVML wants a ``GPU-``/``MIG-`` prefix."""
        if uuid.startswith(("GPU-", "MIG-")):
            return self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        try:
            return self._nvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid)
        except self._nvml.NVMLError:
            return self._nvml.nvmlDeviceGetHandleByUUID("MIG-" + uuid)

    def _is_mig(self, handle: Any) -> bool:
        try:
            current, _pending = self._nvml.nvmlDeviceGetMigMode(handle)
        except self._nvml.NVMLError:  # GPUs without MIG support report NOT_SUPPORTED
            return False
        return bool(current == self._nvml.NVML_DEVICE_MIG_ENABLE)

    def lap(self) -> float | None:
        """Joules used by the GPU since the previous lap (or since construction), or ``None``.

        Synchronises the device first so the window includes the work already queued on it.
        Returns ``None`` when no meter is available or a reading fails (the next lap then starts
        a fresh window).
        """
        if self._handle is None:
            return None
        try:
            torch.cuda.synchronize(self.device)
            now_mj = int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as exc:
            logger.warning("EnergyMeter(%s): reading failed (%s); no energy for this window", self.device, exc)
            self._last_mj = None
            return None
        previous, self._last_mj = self._last_mj, now_mj
        if previous is None or now_mj < previous:  # no baseline, or the driver was reloaded
            return None
        return (now_mj - previous) / 1000.0

    def power_w(self) -> float | None:
        """Instantaneous board power in watts (NVML averages it over 1/6-1 s), or ``None``."""
        if self._handle is None:
            return None
        try:
            return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
        except Exception:
            return None

    def close(self) -> None:
        """Release NVML (reference-counted by NVML, so other users are unaffected)."""
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml = None
        self._handle = None
