"""Calibration: the FFN-input activations of the layers being converted, captured layer by layer.

docs/design.md principle 6 ("stream, don't copy"), the approach GPTQ-style quantizers take (Frantar et al. 2023,
"GPTQ", §4 "Step 3"): the dense model runs once only up to the first block of each tower, whose inputs are kept
(hidden states and the keyword arguments the model passes its blocks: masks, rotary embeddings). Then the
blocks are replayed one at a time on those hidden states, each block's output becoming the next block's input.
While a target block runs, a hook on its FFN collects the FFN's input for real tokens only (padding excluded)
into a reservoir of at most `budget` tokens. The layer's activations are handed to the method and dropped
before the next block runs, so memory stays at one model, one copy of the calibration hidden states and one
layer's reservoir, however many layers are converted.

The reservoir is a uniform sample without replacement from the token stream: each token gets a uniform random
key and the `budget` smallest keys are kept (Efraimidis & Spirakis 2006, "Weighted random sampling with a
reservoir", with equal weights), updated in place per batch. Keys come from a seeded generator per layer, so a
seed fixes the sample. Shape suffixes: B batch, S sequence, D width, N tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.modes import forward_replaced
from ..data.model_inputs import INPUT_KEYS
from ..data.token_ids import GPU_STATE_LOST, is_cuda_failure
from ..errors import UpcycleError


class Reservoir:
    """A uniform random sample of at most `capacity` rows from a stream of [n, D] chunks, in stream order."""

    def __init__(self, capacity: int, generator: torch.Generator) -> None:
        if capacity < 1:
            raise ValueError(f"reservoir capacity must be >= 1, got {capacity}")
        self.capacity, self.generator, self.seen = capacity, generator, 0
        self.rows_ND: torch.Tensor | None = None
        self.keys_N = torch.empty(0)
        self.position_N = torch.empty(0, dtype=torch.long)
        self.filled = 0

    def add(self, rows_ND: torch.Tensor) -> None:
        n = rows_ND.shape[0]
        if n == 0:
            return
        rows_ND = rows_ND.detach().float()
        keys_N = torch.rand(n, generator=self.generator)
        position_N = torch.arange(self.seen, self.seen + n)
        self.seen += n
        if self.rows_ND is None:
            self.rows_ND = rows_ND.new_empty(self.capacity, rows_ND.shape[1])
            self.keys_N = torch.empty(self.capacity)
            self.position_N = torch.empty(self.capacity, dtype=torch.long)
        free = min(self.capacity - self.filled, n)
        if free:   # not full yet: take the first rows as they come
            sl = slice(self.filled, self.filled + free)
            self.rows_ND[sl], self.keys_N[sl], self.position_N[sl] = rows_ND[:free], keys_N[:free], position_N[:free]
            self.filled += free
            rows_ND, keys_N, position_N = rows_ND[free:], keys_N[free:], position_N[free:]
        if rows_ND.shape[0] == 0:
            return
        # full: keep the `capacity` smallest keys among the held and the new rows; new winners take the slots of
        # the held rows that lost
        keep = torch.topk(torch.cat([self.keys_N, keys_N]), self.capacity, largest=False).indices
        new = keep[keep >= self.capacity] - self.capacity
        if new.numel() == 0:
            return
        held = torch.zeros(self.capacity, dtype=torch.bool)
        held[keep[keep < self.capacity]] = True
        slots = (~held).nonzero().flatten()
        self.rows_ND[slots] = rows_ND[new.to(rows_ND.device)]
        self.keys_N[slots], self.position_N[slots] = keys_N[new], position_N[new]

    def sample(self) -> torch.Tensor:
        """The kept rows [min(seen, capacity), D] in the order they arrived."""
        if self.rows_ND is None:
            raise ValueError("the reservoir is empty")
        order = torch.argsort(self.position_N[: self.filled])
        return self.rows_ND[: self.filled][order.to(self.rows_ND.device)]


REPLAY_POSITIONS = 2048     # token positions per forward of the replay when it joins batches (below)


@dataclass
class JoinedBatch:
    """Consecutive text batches of one width that the replay runs as one forward, and the rows each of them
    brought: the FFN's inputs are still handed on batch by batch, in order, as if each had run alone."""

    batch: dict[str, torch.Tensor]
    rows: list[int]


def _text_only(batch: dict[str, torch.Tensor]) -> bool:
    return bool(batch) and all(k in INPUT_KEYS and k != "pixel_values" and v.dim() == 2 for k, v in batch.items())


def join_batches(batches: list[dict[str, torch.Tensor]], max_positions: int = REPLAY_POSITIONS) -> list[JoinedBatch]:
    """Consecutive text batches with the same inputs and width joined along the rows, up to `max_positions`
    tokens a forward (a batch is never split; image batches stay as they are). Each row of a block's output
    depends only on its own row, so the joined forward computes the rows the separate ones did, and with a
    larger matrix product per call it is faster on a CPU (a few batches of 8 rows of 64 tokens: about 10 % of
    a replay); the positions are capped so that one forward's intermediate tensors stay a few megabytes."""
    runs: list[list[dict]] = []
    for batch in batches:
        last = runs[-1] if runs else None
        if (last is not None and _text_only(batch) and _text_only(last[0]) and batch.keys() == last[0].keys()
                and all(v.shape[1] == last[0][k].shape[1] and v.dtype == last[0][k].dtype for k, v in batch.items())
                and sum(_rows(b) * _width(b) for b in (*last, batch)) <= max_positions):
            last.append(batch)
        else:
            runs.append([batch])
    return [JoinedBatch({k: torch.cat([b[k] for b in run]) if len(run) > 1 else run[0][k] for k in run[0]},
                        [_rows(b) for b in run]) for run in runs]


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return next(iter(batch.values())).shape[0]


def _width(batch: dict[str, torch.Tensor]) -> int:
    return next(iter(batch.values())).shape[1]       # a text batch: every input is [rows, tokens]


def real_tokens(batches: list[dict[str, torch.Tensor]]) -> int:
    """Real (unpadded) text tokens in the batches, or image count x 1 for image-only batches."""
    total = 0
    for batch in batches:
        if "attention_mask" in batch:
            total += int(batch["attention_mask"].sum())
        elif "input_ids" in batch:
            total += batch["input_ids"].numel()
        elif "pixel_values" in batch:
            total += batch["pixel_values"].shape[0]
    return total


@dataclass
class BlockInput:
    """What the model passed one block for one batch: the hidden states and the rest (masks, rotary
    embeddings), which every later block of the tower takes as well."""

    args: list
    kwargs: dict

    @property
    def hidden(self) -> torch.Tensor:
        return self.args[0] if self.args else self.kwargs["hidden_states"]

    @hidden.setter
    def hidden(self, value: torch.Tensor) -> None:
        if self.args:
            self.args[0] = value
        else:
            self.kwargs["hidden_states"] = value


class _Stop(Exception):
    """Raised by the first-block hook once every tower's block inputs are recorded: the rest of the forward is
    not needed."""


def first_block_inputs(model: nn.Module, towers: dict[str, nn.ModuleList], batches: list[dict[str, torch.Tensor]],
                       device: torch.device | None = None) -> dict[str, list[BlockInput]]:
    """Each tower's first-block inputs for every batch: the model's forward, stopped once every tower's first
    block was reached (nothing after it runs). `device`: where the batches go (default: the model's)."""
    inputs = {name: [] for name in towers}
    pending: set[str] = set()

    def hook(name):
        def record(module, args, kwargs):
            inputs[name].append(BlockInput(list(args), dict(kwargs)))
            pending.discard(name)
            if not pending:
                raise _Stop
        return record

    handles = [blocks[0].register_forward_pre_hook(hook(name), with_kwargs=True) for name, blocks in towers.items()]
    device = device or next(p for p in model.parameters() if not p.is_meta).device
    extra = {"use_cache": False} if hasattr(model.config, "use_cache") else {}
    try:
        for batch in batches:
            pending.update(towers)
            try:
                model(**{k: v.to(device) for k, v in batch.items()}, **extra)
            except _Stop:
                pass
            except Exception as e:   # a batch that does not fit the model (vocabulary, image size, names)
                lost = f"; {GPU_STATE_LOST}" if is_cuda_failure(e) else ""
                raise UpcycleError(f"calibration: the model's forward failed on a calibration batch "
                                   f"({type(e).__name__}: {e}){lost}") from e
            if pending:
                raise UpcycleError(f"calibration: the forward pass never reached the first block of {sorted(pending)}"
                                   f" (does each batch have that tower's inputs?)")
    finally:
        for h in handles:
            h.remove()
    return inputs


@dataclass
class Capture:
    """Where a replay hands a block's FFN inputs: `ffn` is the module whose input is recorded, `sampler` keeps it
    (a `Reservoir`, or all rows), and `rows` are the rows of each batch a state was joined from
    (`JoinedBatch.rows`; default one batch per state), so the sampler draws the same keys as for the batches run
    one by one."""

    ffn: nn.Module
    sampler: Reservoir
    rows: list[list[int]] | None = None


def replay_block(block: nn.Module, states: list[BlockInput], masks: list[torch.Tensor | None],
                 capture: Capture | None = None, *, output_needed: bool = True,
                 padding_skips: nn.Module | None = None) -> None:
    """Run `block` on every batch's hidden states, replacing them by its output; with `capture`, add the FFN's
    input at real tokens (mask 1, or every token when the batch has no mask for this tower) to its sampler, one
    `add` per batch a state was joined from.
    Without `output_needed` (no later block runs on these states), each forward stops once the FFN's input is
    recorded: the FFN and what follows it do not run, and the hidden states are left as they were.
    `padding_skips`: a module of the block mapping each token to one of the same width on its own (the FFN,
    when one module takes its input and gives its output), run on the real tokens only, padding getting zeros:
    padding is masked out of every later block's attention, so no real token's state changes, and the FFN
    holds most of a block's arithmetic."""
    reservoir = capture.sampler if capture is not None else None
    current: dict = {}

    def collect(module, args):
        x_BSD, mask_BS, parts = args[0], current["mask"], current["rows"]
        if mask_BS is not None and mask_BS.shape == x_BSD.shape[:2]:
            pieces = zip(x_BSD.split(parts), mask_BS.split(parts), strict=True)
            for x, mask in pieces:
                reservoir.add(x[mask.to(x.device).bool()])
        elif x_BSD.shape[0] % sum(parts) == 0:      # [B, ...] or flattened [B*S, ...]: each batch's share
            per_row = x_BSD.shape[0] // sum(parts)
            for x in x_BSD.split([n * per_row for n in parts]):
                reservoir.add(x.reshape(-1, x.shape[-1]))
        else:
            reservoir.add(x_BSD.reshape(-1, x_BSD.shape[-1]))
        if not output_needed:
            raise _Stop

    handle = capture.ffn.register_forward_pre_hook(collect) if capture is not None else None
    rows = (capture.rows if capture is not None else None) or [[s.hidden.shape[0]] for s in states]
    skipping = [padding_skips] if padding_skips is not None else []
    try:
        with forward_replaced(skipping, lambda module, forward: _on_real_tokens(forward, current)):
            for state, mask, parts in zip(states, masks, rows, strict=True):
                current["mask"], current["rows"] = mask, parts
                try:
                    out = block(*state.args, **state.kwargs)
                except _Stop:
                    continue
                state.hidden = out[0] if isinstance(out, tuple) else out
    finally:
        if handle is not None:
            handle.remove()


def _on_real_tokens(forward, current: dict):
    """`forward` (of a token-wise module) run on the rows of `current["mask"]` only, zeros elsewhere."""
    def masked(x_BSD: torch.Tensor) -> torch.Tensor:
        mask_BS = current["mask"]
        if mask_BS is None or mask_BS.shape != x_BSD.shape[:2] or bool(mask_BS.all()):
            return forward(x_BSD)
        real = mask_BS.to(x_BSD.device).bool()
        y_ND = forward(x_BSD[real])
        out_BSD = y_ND.new_zeros((*x_BSD.shape[:2], *y_ND.shape[1:]))
        out_BSD[real] = y_ND
        return out_BSD
    return masked
