"""The machine a result was measured on, as results' JSON records it (benchmarks, analyses, comparisons)."""

from __future__ import annotations

import os
import platform

import torch

from .version import __version__

# A Python process with torch and transformers imported, before any model (measured: about 0.6 GB); the memory
# estimates of convert's and prune's and grow's dry runs start from it
PROCESS_BYTES = int(0.6e9)


def launcher_count(name: str, default: int) -> int:
    """A process count the launcher sets in the environment (WORLD_SIZE, LOCAL_WORLD_SIZE, LOCAL_RANK): a whole
    number, at least 1 for a count (0 for a rank); anything else refused in one line naming the variable."""
    from .errors import UpcycleError

    text = os.environ.get(name)
    least = 0 if name.endswith("RANK") else 1
    if text is None:
        return default
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < least:
        raise UpcycleError(f"{name}={text!r} in the environment: the launcher sets it to a whole number >= {least} "
                           f"(unset it to run one process)")
    return value


def machine(device: torch.device | str | None = None) -> dict:
    """The machine a result was measured on (its CPU, and the GPU when `device` is one), for results' JSON."""
    import transformers

    processor = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            processor = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"platform": platform.platform(), "processor": processor, "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "upcycle": __version__,
           "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
           "load_average": [round(x, 2) for x in os.getloadavg()]}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   capability=list(torch.cuda.get_device_capability(device)))
    return out
