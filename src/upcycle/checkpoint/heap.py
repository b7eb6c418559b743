"""Give freed memory back to the operating system between blocks of a streaming conversion.

glibc's malloc serves allocations below its mmap threshold from the heap, and the threshold rises to the size of
the largest block freed so far (up to 32 MiB), so a block's float32 tensors (16-32 MiB each at 0.5-2B) end up
there. Freed, they stay in the process as heap holes that the next block's differently-sized tensors do not
exactly reuse: measured on the 0.5B cluster conversion, resident memory at the method's entry grew by about
0.15 GB per MoE layer while the live tensors stayed at 0.33 GB. `malloc_trim(0)` returns every free page of
every arena (madvise), which takes milliseconds. Elsewhere (macOS, musl, Windows) this is a no-op.

Trimming has a price: the pages it returns are the ones the next block's forwards would have reused, and each comes
back as a page fault. Trimmed after every block, the replay of the three-source merge of SmolLM2-135M took 0.5M
page faults, ten times as many as untrimmed, and 1.5 s more system time. So `HeapTrimmer` trims only once the
process's anonymous memory (its heap, not the checkpoint files it maps) has grown by more than an allowance since
the last trim: a conversion whose blocks each grow it by more than that is trimmed after every block, and that
merge (150-210 MB a block) every 5-7 blocks, never holding more than the allowance beyond its floor; and
at least every eighth block whatever the counters say.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):   # not glibc: no malloc_trim
        return None


def anonymous_resident_bytes() -> int | None:
    """Resident memory that is not a mapped file (the heap and anonymous maps), from /proc/self/statm; None where
    there is none (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim_heap() -> bool:
    """Return the heap's free pages to the system; True when glibc's malloc_trim ran and released something."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


# Trimming after a block is skipped while the anonymous memory is within this of what it was after the last
# trim: above what one block of a 135M merge takes (150-210 MB), and a sixth of the 1.5 GB that the streaming
# conversion's memory target allows for overhead (docs/large-models.md).
TRIM_ALLOWANCE_BYTES = 256 * 2**20


class HeapTrimmer:
    """`trim_heap` after a block once anonymous memory has grown by more than `allowance` bytes since the last
    trim (module docstring), and after every `every`-th block in any case: resident-memory counters are the
    kernel's, and a count that does not move must not let the heap grow without end. Without /proc (not Linux),
    every time."""

    def __init__(self, allowance: int = TRIM_ALLOWANCE_BYTES, every: int = 8) -> None:
        self.allowance, self.every = allowance, every
        self.floor: int | None = None      # anonymous memory just after the last trim
        self.since = 0                     # blocks since the last trim

    def __call__(self) -> bool:
        """True when it trimmed."""
        self.since += 1
        now = anonymous_resident_bytes()
        if (now is not None and self.floor is not None and now - self.floor <= self.allowance
                and self.since < self.every):
            return False
        trim_heap()
        self.floor, self.since = anonymous_resident_bytes(), 0
        return True
