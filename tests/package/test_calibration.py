"""Calibration capture: layer-by-layer replay equals a full forward, padding is excluded, the reservoir is a
seeded uniform sample, and blocks are replayed only when the previous layer's activations were consumed."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from upcycle.config import CalibrationConfig, ConvertConfig, PlacementConfig
from upcycle.conversion.blockwise import CALIBRATION, convert_blocks, method_groups
from upcycle.conversion.calibration import Capture, Reservoir, join_batches
from upcycle.conversion.orchestrator import BlockSource
from upcycle.conversion.pipeline import upcycle_model
from upcycle.conversion.report import Timings
from upcycle.core.architectures import family_of, find_tower_layers
from upcycle.core.surgery import plan_targets
from upcycle.data.model_inputs import text_batches
from upcycle.errors import UpcycleError


def batches_for(kind: str, n: int = 3, seed: int = 0) -> list[dict]:
    """Model inputs with some padding (text towers) for a tiny model of `kind`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        ids = torch.randint(3, 128, (3, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[b % 3, 9 + b:] = 0          # a padded row per batch (right padding)
        batch = {"input_ids": ids, "attention_mask": mask}
        if kind == "clip":
            batch["pixel_values"] = torch.randn(3, 3, 16, 16, generator=g)
        out.append(batch)
    return out


def full_forward_capture(model, targets, batches) -> dict[str, torch.Tensor]:
    """Reference: hook every target's FFN input during ordinary forwards, keep real tokens."""
    family = family_of(model.config)
    got, current = {t.name: [] for t in targets}, {}
    handles = []
    for t in targets:
        def hook(module, args, _t=t):
            x = args[0]
            mask = current["mask"] if _t.tower != "vision" else None
            got[_t.name].append(x[mask.bool()] if mask is not None else x.reshape(-1, x.shape[-1]))
        handles.append(family.ffn_input(model.get_submodule(t.path)).register_forward_pre_hook(hook))
    with torch.no_grad():
        for batch in batches:
            current["mask"] = batch["attention_mask"]
            model(**batch)
    for h in handles:
        h.remove()
    return {name: torch.cat(xs) for name, xs in got.items()}


def capture(model, targets, batches, *, budget: int, seed: int = 0, on_block=None) -> list[tuple]:
    """(target, FFN inputs kept, tokens seen) per target, from the conversion's own block loop and calibration
    group (what a data-aware method receives), with a layer builder that only records."""
    got = []

    def record(visit, block, replayed, timings):
        reservoir = replayed.samples[CALIBRATION]
        got.append((visit.target, reservoir.sample(), reservoir.seen))
        if on_block is not None:
            on_block(visit.target)
        return None, None

    class Recording(BlockSource):           # a model held whole, its layers recorded, none built
        def __init__(self) -> None:
            self.model = model

        def layer_builder(self):
            return record

    convert_blocks(Recording(), targets, method_groups(budget, seed, None, batches), Timings(), progress=False)
    return got


def test_replay_equals_full_forward_and_excludes_padding(family):
    model = make_tiny(family)
    targets = plan_targets(model, PlacementConfig(every=2))
    batches = batches_for(family)
    expected = full_forward_capture(model, targets, batches)
    captured = capture(model, targets, batches, budget=10_000)
    assert [t for t, _, _ in captured] == targets
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    for target, x, seen in captured:
        ref = expected[target.name]
        if target.tower != "vision":
            assert x.shape[0] == seen == real        # padding excluded, nothing else dropped
        torch.testing.assert_close(x, ref.float(), rtol=0, atol=1e-5)


def test_each_layer_is_built_before_the_next_block_runs_and_later_blocks_never_run():
    model = make_tiny("llama", layers=4)
    targets = plan_targets(model, PlacementConfig(layers=(0, 2)))
    calls, seen_at_build = [], {}
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(lambda m, a, _i=i: calls.append(_i))
    capture(model, targets, batches_for("llama", n=2), budget=100,
            on_block=lambda target: seen_at_build.setdefault(target.index, set(calls)))
    assert seen_at_build[0] == {0}    # the first forward stops at block 0; block 0 replayed; nothing further
    assert seen_at_build[2] == {0, 1, 2}
    assert max(calls) == 2 and 3 not in calls   # blocks after the last target are never run


def test_the_last_block_stops_at_its_ffn_input_and_every_other_ffn_runs(family):
    """Nothing runs on the hidden states after the last target, so its forwards stop once the FFN's input is
    recorded: that FFN never runs, every earlier block's does, and what the last target receives is still the
    full forward's FFN input (`test_replay_equals_full_forward_and_excludes_padding`, the same path)."""
    model = make_tiny(family, layers=4)
    fam = family_of(model.config)
    targets = plan_targets(model, PlacementConfig(layers=(1, 2)))
    ran = {t: [] for t in ("text", "vision")}
    for tower, layers in fam.towers_of(model.config).items():
        found = find_tower_layers(model, layers)
        if found is None:
            continue
        for i, block in enumerate(found[1]):
            fam.ffn_output(block).register_forward_hook(lambda m, a, o, _t=tower, _i=i: ran[_t].append(_i))
    batches = batches_for(family)
    captured = capture(model, targets, batches, budget=10_000)
    forwards = len(join_batches(batches))       # the replay's forwards: text batches joined, image ones not
    for tower in {t.tower for t in targets}:
        # the replay runs each block up to the last target once per forward, the last one without its FFN (a
        # tower the model runs whole before reaching the other's first block, CLIP's vision, adds one run each)
        last, runs = max(t.index for t in targets if t.tower == tower), [ran[tower].count(i) for i in range(4)]
        assert runs[:last] == [runs[0]] * last and runs[last:] == [runs[0] - forwards] * (4 - last), runs
    expected = full_forward_capture(model, targets, batches)
    for target, x, _ in captured:
        torch.testing.assert_close(x, expected[target.name].float(), rtol=0, atol=1e-5)


def test_replaying_without_the_output_leaves_the_states_and_records_the_same_rows():
    from upcycle.conversion.calibration import first_block_inputs, replay_block

    model = make_tiny("llama", layers=2)
    block, batches = model.model.layers[0], batches_for("llama")
    masks = [b["attention_mask"] for b in batches]
    with torch.no_grad():
        kept = []
        for output_needed in (True, False):
            states = first_block_inputs(model, {"text": model.model.layers}, batches)["text"]
            before = [s.hidden.clone() for s in states]
            reservoir = Reservoir(10_000, torch.Generator().manual_seed(0))
            replay_block(block, states, masks, Capture(block.mlp, reservoir), output_needed=output_needed)
            kept.append(reservoir.sample())
            same = all(torch.equal(s.hidden, b) for s, b in zip(states, before, strict=True))
            assert same is (not output_needed)
    assert torch.equal(kept[0], kept[1]) and kept[0].shape[0] == sum(int(m.sum()) for m in masks)


def test_budget_keeps_a_seeded_subset_in_stream_order():
    model = make_tiny("llama")
    targets = plan_targets(model, PlacementConfig(layers=(1,)))
    batches = batches_for("llama")
    (_, full, seen), = capture(model, targets, batches, budget=10_000)
    (_, a, seen_a), = capture(model, targets, batches, budget=50, seed=1)
    (_, b, _), = capture(model, targets, batches, budget=50, seed=1)
    (_, c, _), = capture(model, targets, batches, budget=50, seed=2)
    assert seen == seen_a == full.shape[0] and a.shape == (50, full.shape[1])
    assert torch.equal(a, b) and not torch.equal(a, c)
    # every kept row is a captured row, kept in the order the stream produced them
    index = [int((full == row).all(1).nonzero()[0]) for row in a]
    assert index == sorted(index) and len(set(index)) == 50


def test_reservoir_is_uniform():
    n, cap, trials = 40, 10, 4000
    hits = torch.zeros(n)
    g = torch.Generator().manual_seed(0)
    stream = torch.arange(n, dtype=torch.float32)[:, None]
    for _ in range(trials):
        r = Reservoir(cap, g)
        for chunk in stream.split(7):          # uneven chunks exercise fill, then replace
            r.add(chunk)
        kept = r.sample().flatten().long()
        assert kept.numel() == cap and torch.equal(kept, kept.sort().values) and kept.unique().numel() == cap
        hits[kept] += 1
    p = cap / n
    expected, std = trials * p, (trials * p * (1 - p)) ** 0.5
    assert ((hits - expected).abs() < 4.5 * std).all(), hits  # every position included with probability cap/n


def test_reservoir_under_capacity_keeps_everything_in_order():
    r = Reservoir(100, torch.Generator().manual_seed(0))
    rows = torch.randn(30, 4)
    r.add(rows[:11])
    r.add(rows[11:])
    assert torch.equal(r.sample(), rows) and r.seen == 30
    with pytest.raises(ValueError):
        Reservoir(0, torch.Generator())


class CharTokenizer:
    pad_token_id, eos_token_id = None, 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) % 100) for c in text]}


def test_text_batches_cut_documents_into_padded_rows():
    shape = CalibrationConfig(tokens=60, sequence_length=10, batch_size=2)
    docs = ["a" * 25, "b" * 7, "c" * 40]
    batches = text_batches(CharTokenizer(), docs, shape, seed=0)
    rows = [ids[m.bool()].tolist() for b in batches
            for ids, m in zip(b["input_ids"], b["attention_mask"], strict=True)]
    assert sum(map(len, rows)) >= 60 and all(1 <= len(r) <= 10 for r in rows)
    assert all(len(set(r)) == 1 for r in rows)                 # a row never spans two documents
    for b in batches:                                            # right padding with the eos id
        m = b["attention_mask"]
        assert torch.equal(m, m.sort(dim=1, descending=True).values)
        assert (b["input_ids"][m == 0] == 2).all()
    again = text_batches(CharTokenizer(), docs, shape, seed=0)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, again, strict=True))
    with pytest.raises(UpcycleError):
        text_batches(CharTokenizer(), docs, CalibrationConfig(tokens=0))


def test_a_data_aware_method_refuses_empty_calibration():
    model = make_tiny("clip")
    with pytest.raises(UpcycleError, match="needs calibration data"):
        upcycle_model(model, ConvertConfig(method="cluster", placement=PlacementConfig(every=2)), calibration=[],
                      progress=False)


def _text_batch(rows: int, width: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, width // 2:] = 0
    return {"input_ids": torch.randint(3, 128, (rows, width), generator=g), "attention_mask": mask}


def test_consecutive_text_batches_of_one_width_are_joined_up_to_the_position_cap():
    a, b, c, d, e = (_text_batch(8, 64, 0), _text_batch(8, 64, 1), _text_batch(2, 64, 2), _text_batch(8, 32, 3),
                     _text_batch(8, 64, 4))
    joined = join_batches([a, b, c, d, e], max_positions=1200)
    # a+b+c: 1,152 positions; d is narrower; e would follow d, not c
    assert [j.rows for j in joined] == [[8, 8, 2], [8], [8]]
    for key in a:
        assert torch.equal(joined[0].batch[key], torch.cat([a[key], b[key], c[key]]))
    assert joined[1].batch["input_ids"] is d["input_ids"]
    # the cap holds; a batch larger than it stays whole; other inputs never meet
    assert [j.rows for j in join_batches([a, b, c], max_positions=1024)] == [[8, 8], [2]]
    assert [j.rows for j in join_batches([a, b], max_positions=100)] == [[8], [8]]
    no_mask = {"input_ids": a["input_ids"]}
    assert [j.rows for j in join_batches([a, no_mask, no_mask])] == [[8], [8, 8]]
    images = batches_for("clip")
    assert [j.rows for j in join_batches(images)] == [[3]] * len(images)


def _replay_rows(model, batches, *, join: bool, skip_padding: bool, budget: int = 10_000):
    """The FFN inputs a target receives and the block outputs at real tokens, replaying `batches` through the
    first two blocks of a tiny Llama joined or one by one, with padding skipping the FFN or not."""
    from upcycle.conversion.calibration import first_block_inputs, replay_block

    joined = join_batches(batches, max_positions=10**6 if join else 0)
    masks = [j.batch["attention_mask"] for j in joined]
    with torch.no_grad():
        states = first_block_inputs(model, {"text": model.model.layers}, [j.batch for j in joined])["text"]
        reservoir = Reservoir(budget, torch.Generator().manual_seed(0))
        for i, block in enumerate(model.model.layers[:2]):
            capture = Capture(block.mlp, reservoir, [j.rows for j in joined]) if i == 1 else None
            replay_block(block, states, masks, capture, padding_skips=block.mlp if skip_padding else None)
    out = torch.cat([s.hidden[m.bool()] for s, m in zip(states, masks, strict=True)])
    return reservoir.sample(), reservoir.seen, out


def test_joined_batches_and_padding_skipping_the_ffn_replay_the_same_rows():
    """The replay's two speed-ups leave what it computes for real tokens as it was: the target's FFN inputs
    (the reservoir's sample, all of them or a seeded third: rows handed on batch by batch, as before) and the
    block outputs. On this machine the rows are bit-identical; the 1e-6 margin is for a BLAS whose product of
    one row depends on how many rows it multiplies at once (its blocking differs with the matrix's height)."""
    model = make_tiny("llama", layers=2)
    batches = [_text_batch(3, 16, s) for s in range(4)] + [_text_batch(2, 9, 9)]
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    for budget in (10_000, real // 3):
        sample, seen, out = _replay_rows(model, batches, join=False, skip_padding=False, budget=budget)
        for join, skip in ((True, False), (False, True), (True, True)):
            s, n, o = _replay_rows(model, batches, join=join, skip_padding=skip, budget=budget)
            assert n == seen == real and s.shape == sample.shape == (min(budget, real), s.shape[1])
            torch.testing.assert_close(s, sample, rtol=0, atol=1e-6)
            torch.testing.assert_close(o, out, rtol=0, atol=1e-6)


def test_padding_skips_the_ffn_and_its_forward_comes_back():
    from upcycle.conversion.calibration import first_block_inputs, replay_block

    model = make_tiny("llama", layers=1)
    block, batches = model.model.layers[0], batches_for("llama")
    masks = [b["attention_mask"] for b in batches]
    rows = []
    block.mlp.up_proj.register_forward_pre_hook(lambda m, a: rows.append(a[0].reshape(-1, a[0].shape[-1]).shape[0]))
    own = block.mlp.forward                 # as accelerate's hooks leave it: an instance's own forward
    block.mlp.forward = own
    with torch.no_grad():
        states = first_block_inputs(model, {"text": model.model.layers}, batches)["text"]
        replay_block(block, states, masks, padding_skips=block.mlp)
    assert rows == [int(m.sum()) for m in masks]          # every batch has a padded row: only real tokens ran
    assert vars(block.mlp)["forward"] is own
    del block.mlp.forward
    with torch.no_grad():
        replay_block(block, states, masks, padding_skips=block.mlp)
    assert "forward" not in vars(block.mlp)               # the class's forward, as before
