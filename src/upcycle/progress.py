"""A progress bar whose steps are a command's phases (convert, prune, grow): each phase, as it ends, says what it
did; work with a count of its own (blocks, steps) has its own bar beside it."""

from __future__ import annotations

from tqdm.auto import tqdm


class Phases:
    """`phases("model loaded")` marks a phase done and shows what it did; disabled (nothing printed) when
    `progress` is false, as `--quiet` asks."""

    def __init__(self, total: int, progress: bool, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="phase", disable=not progress)

    def __call__(self, message: str) -> None:
        self.bar.set_postfix_str(message)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
