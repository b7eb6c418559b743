"""One profile of a few calls on the GPU, small enough to bring back from a lent machine: what the device was busy
with, and for how much of the wall time (benchmarks/speed/train_step.py --profile,
benchmarks/speed/moe_layer.py --profile).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def profile(name: str, step, device: torch.device, folder: Path, steps: int = 2) -> None:
    """`steps` calls of `step(step=i)` under torch.profiler (after the timed ones): the device's busy time
    against the wall time (the share left idle is launch gaps and host work), the top kernels by device time,
    and the operators that launched them, into FOLDER/profile_NAME.json."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            step(step=10_000 + i)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))

    averages = prof.key_averages()
    # the device's own events (kernels, copies, memsets): an operator's device time is its kernels', counted again
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA and device_us(e) > 0]
    busy = sum(device_us(e) for e in kernels) / 1e6
    ops = [e for e in averages if e.device_type != torch.autograd.DeviceType.CUDA and device_us(e) > 0]
    record = {"model": name, "steps": steps, "wall_s_per_step": wall / steps, "device_busy_s_per_step": busy / steps,
              "device_idle_share": 1 - busy / wall if cuda and wall > 0 else None,
              "top_kernels": [{"name": e.key[:160], "count": e.count // steps,
                               "ms_per_step": device_us(e) / 1e3 / steps,
                               "share_of_busy": device_us(e) / 1e6 / busy if busy else None}
                              for e in sorted(kernels, key=device_us, reverse=True)[:30]],
              "top_operators_by_device_time": [{"name": e.key[:160], "count": e.count // steps,
                                                "ms_per_step": device_us(e) / 1e3 / steps}
                                               for e in sorted(ops, key=device_us, reverse=True)[:30]],
              "top_host_ops": [{"name": e.key[:160], "count": e.count // steps,
                                "ms_per_step": e.self_cpu_time_total / 1e3 / steps}
                               for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total,
                                               reverse=True)[:15]]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"profile_{name}.json").write_text(json.dumps(record, indent=1))
