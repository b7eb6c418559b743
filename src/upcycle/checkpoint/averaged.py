"""A checkpoint read as the mean of several (Branch-Train-MiX's `non_ffn: average`: the merged model's attention,
embeddings and norms are the mean of the fine-tunes'), with the reader's interface, so the streamed conversion
reads it as it reads one checkpoint."""

from __future__ import annotations

import torch

from .reader import CheckpointReader


class AveragedReader:
    """A checkpoint whose every tensor is the mean over `readers` (a float32 mean of the floating tensors;
    integer buffers are the first reader's)."""

    def __init__(self, readers: list[CheckpointReader]):
        self.readers = readers
        self.folder = readers[0].folder

    def names(self) -> list[str]:
        return self.readers[0].names()

    def __contains__(self, name: str) -> bool:
        return name in self.readers[0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.readers[0].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.readers[0].dtype(name)

    def get(self, name: str) -> torch.Tensor:
        first = self.readers[0].get(name)
        if not first.is_floating_point() or len(self.readers) == 1:
            return first
        # a copy: a tensor from the reader may share pages with its memory map, and an in-place sum there would
        # show in the next read of that tensor (the source's own FFN read later in the same block)
        total = first.to(torch.float32, copy=True)
        for reader in self.readers[1:]:
            total += reader.get(name).float()
        return total / len(self.readers)         # float32: rounded once, to the output's dtype, by the caller

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
