"""The causal-LM loss through the output head a chunk of tokens at a time (`upcycle.tasks.head_loss`): the same loss
and gradients as transformers' own loss over the full logits, and a fraction of its memory."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny
from upcycle.tasks import head_loss
from upcycle.tasks.causal_lm import causal_lm_loss
from upcycle.training.memory.peak import measure_peak


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _loss_and_grads(model, loss_fn, batch):
    torch.manual_seed(5)        # the same dropout in both (GPT-2 has some)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _unfused(model, batch):
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return model(**batch, labels=labels).loss


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "phi3", "gpt2"])
def test_the_fused_loss_is_the_models_own(kind):
    """Loss and every gradient (the tied or untied head's included) as transformers computes them. Float32: the
    sums run in another order (per chunk, then over chunks), so they agree to rounding: 1.4e-7 at most measured,
    1e-6 asserted, on gradients of order 1e-2."""
    base = make_tiny(kind).train()
    assert head_loss.fusable(base) is not None
    batch = _batch()
    want, want_grads = _loss_and_grads(copy.deepcopy(base), _unfused, batch)
    got, got_grads = _loss_and_grads(copy.deepcopy(base), causal_lm_loss, batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=1e-6, msg=name)


def test_chunks_labels_and_dtypes():
    """Chunk boundaries inside the batch, ignored labels, no labelled token (NaN, as cross_entropy's mean gives),
    and bfloat16 compute under autocast (within bfloat16's rounding of the unfused loss)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::5] = -100
    want = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100)
    want.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    for chunk in (1, 4, 36, 37, 100):
        got = head_loss.HeadCrossEntropy.apply(hidden, weight, labels, chunk, torch.float32)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weight.grad, grads[1], rtol=1e-5, atol=1e-6)
        hidden.grad = weight.grad = None
    assert torch.isnan(head_loss.head_cross_entropy(hidden, weight, torch.full((37,), -100)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = head_loss.head_cross_entropy(hidden, weight, labels)
        unfused = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, unfused, rtol=1e-2, atol=1e-2)     # bfloat16 logits: 3 significant digits


def test_a_head_it_cannot_fuse_takes_the_models_loss():
    """A bias on the head, or Gemma's final logit soft-capping, is not what the fused loss computes: the model's
    own loss runs, and it is the same."""
    capped = make_tiny("gemma3").train()
    capped.config.final_logit_softcapping = 3.0
    biased = make_tiny("llama").train()
    biased.lm_head.bias = torch.nn.Parameter(torch.randn(128))
    for model in (capped, biased):
        assert head_loss.fusable(model) is None
        torch.testing.assert_close(causal_lm_loss(model, _batch()), _unfused(model, _batch()))


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_fraction_of_the_memory_at_llama3s_vocabulary():
    """128,256 words x 2,048 tokens: the unfused loss holds float32 logits, their log-softmax and gradient (3 GB);
    the fused one a chunk of them and the two gradients it keeps. Measured live tensor bytes (peak_memory)."""
    V, T, D = 128256, 2048, 64
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, D, generator=g) * 0.02).requires_grad_()
    hidden = torch.randn(T, D, generator=g).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)

    def unfused():
        loss = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels)
        loss.backward()
        return loss.detach()

    def fused():
        loss = head_loss.head_cross_entropy(hidden, weight, labels)
        loss.backward()
        return loss.detach()

    plain = measure_peak(unfused)
    weight.grad = hidden.grad = None
    chunked = measure_peak(fused)
    torch.testing.assert_close(chunked.result, plain.result, rtol=1e-6, atol=1e-6)
    assert plain.peak_bytes > T * V * 4 * 2           # at least the logits and their gradient
    assert chunked.peak_bytes <= plain.peak_bytes / 4, (chunked.peak_bytes, plain.peak_bytes)
