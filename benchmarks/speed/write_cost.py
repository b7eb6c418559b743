"""What writing a merge's output costs the kernel on this machine: the three-source merge's 1.17 GB (32 blocks of
35 MiB, `merge_speed.py`), written through upcycle's `ShardedWriter` in line, then deleted and written again at
once, each into a new file in the work folder.

On a virtual machine whose host takes back memory the guest left free, the first write's page-cache pages are new
to the guest and each costs a fault on the host; the second write gets the pages the first one's deletion just
freed. The merge's writer thread pays the first kind beside the replay (docs/merging.md, "Time"). Each round
pauses first (`--pause`, seconds) so that the guest's free memory can be taken back again; the wall and system
seconds of both writes go to benchmarks/results/write_cost.json.

    .venv/bin/python benchmarks/speed/write_cost.py [--rounds 3] [--pause 20] [--work out/write-cost]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from upcycle.checkpoint.writer import ShardedWriter
from upcycle.machine import machine
from upcycle.scripts import claim_work, clear, note, output_folder

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, BLOCK_BYTES = 32, 35 * 2**20


def write_once(folder: Path) -> dict:
    """Seconds (wall, system) to write BLOCKS tensors of BLOCK_BYTES into a new folder's shards."""
    folder.mkdir(parents=True)
    block = torch.ones(BLOCK_BYTES // 4)
    specs = [(f"block.{i}", tuple(block.shape), block.dtype) for i in range(BLOCKS)]
    writer = ShardedWriter(folder, specs)
    before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for name, _, _ in specs:
        writer.write(name, block)
    writer.close()
    after = resource.getrusage(resource.RUSAGE_SELF)
    note(folder)
    return {"wall_s": round(time.perf_counter() - t, 2), "system_s": round(after.ru_stime - before.ru_stime, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause", type=float, default=20.0)
    parser.add_argument("--work", type=output_folder, default=ROOT / "out" / "write-cost")
    args = parser.parse_args()
    if args.rounds < 1 or not args.pause >= 0:
        parser.error(f"--rounds must be >= 1 and --pause >= 0, got {args.rounds} and {args.pause}")
    work = claim_work(args.work)
    rounds = []
    for i in range(args.rounds):
        for folder in (work / "first", work / "again"):
            clear(folder, work)
        time.sleep(args.pause)
        first = write_once(work / "first")
        clear(work / "first", work)
        again = write_once(work / "again")
        rounds.append({"first": first, "again": again})
        print(f"round {i + 1}: first {first}, again {again}", flush=True)
    clear(work, work)
    median = {kind: {key: statistics.median(r[kind][key] for r in rounds) for key in ("wall_s", "system_s")}
              for kind in ("first", "again")}
    result = {"machine": machine(), "bytes": BLOCKS * BLOCK_BYTES, "pause_s": args.pause, "rounds": rounds,
              "median": median}
    out = ROOT / "benchmarks" / "results" / "write_cost.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(median))


if __name__ == "__main__":
    main()
