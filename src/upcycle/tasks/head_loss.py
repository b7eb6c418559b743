"""Next-token cross-entropy computed through the output head a chunk of tokens at a time, so that the full
[tokens x vocabulary] logits never exist.

A causal LM's loss is usually `cross_entropy(lm_head(h).float(), labels)`: at Llama 3's 128,256-word vocabulary
and 16k tokens that is 4.2 GB of bfloat16 logits, 8.4 GB as float32, and as much again for their softmax and
gradient, all held at once. Here the head and the loss are one autograd function (the fusion Liger-Kernel calls
"fused linear cross-entropy"): for each chunk of tokens it computes the logits, their float32 log-sum-exp, the
loss, and at once the gradient d loss / d logits = softmax - onehot(label), which it multiplies into the
gradients of the hidden states and of the head's weight; the chunk's logits are then freed. What it keeps for the
backward pass is those two gradients, [tokens, D] and [V, D], scaled by the incoming gradient there. Three
matmuls per chunk, as the unfused head's forward and backward take: no recomputation.

The loss is the mean over the tokens whose label is not -100 (transformers' causal-LM loss, whose labels are the
inputs shifted by one), and every float is as in the unfused loss: the logits in the compute dtype (the autocast
dtype, else the weights'), their softmax in float32, the weight's gradient summed over chunks in float32.

The head is reached through a forward pre-hook on the model's output embeddings (`install`): while `labels_for` has
labels set, the hook takes the hidden states the model hands its head, computes the loss here, and hands the head
an empty sequence instead, so the model's own forward (and DDP's, FSDP2's and torch.compile's wrappers of it) runs
unchanged and returns empty logits. A head this cannot fuse (a bias, Gemma's logit soft-capping, an adapter
around it) takes the unfused loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..core.autocast import autocast_off
from ..core.grouped_ffn import compute_dtype

# Float32 logits of one chunk: large enough that a chunk's matmuls fill a GPU, small next to the activations of
# the batch (1/32 of the unfused float32 logits at 128,256 words x 2,048 tokens).
CHUNK_BYTES = 32 * 2**20
IGNORE = -100


def chunk_tokens(vocabulary: int) -> int:
    """Tokens per chunk: as many as keep one chunk's float32 logits within CHUNK_BYTES (at least one)."""
    return max(1, CHUNK_BYTES // (4 * vocabulary))


class HeadCrossEntropy(torch.autograd.Function):
    """mean over labelled tokens of -log softmax(h W^T)[label], with the gradients computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor, chunk: int,
                dtype: torch.dtype) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T = hidden_TD.shape[0]
        w = weight_VD.to(dtype)
        valid_T = labels_T != IGNORE
        count = valid_T.sum()
        total = torch.zeros((), dtype=torch.float32, device=hidden_TD.device)
        grad_h = torch.empty_like(hidden_TD) if need_h else None
        grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_w else None
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            h = hidden_TD[start:end].to(dtype)
            labels = labels_T[start:end]
            valid = valid_T[start:end]
            logits = torch.mm(h, w.t()).float()                       # [c, V] float32, the chunk's only copy
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
            total += torch.where(valid, lse - target, 0.0).sum()
            if not (need_h or need_w):
                continue
            # d loss_sum / d logits = softmax - onehot(label) on labelled tokens, 0 elsewhere (in place)
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, labels.clamp_min(0)[:, None], torch.full_like(lse[:, None], -1.0))
            grad.mul_(valid[:, None])
            grad = grad.to(dtype)
            if need_h:
                grad_h[start:end] = torch.mm(grad, w).to(grad_h.dtype)
            if need_w:      # summed over chunks in float32 (a float32 chunk product is added in place)
                if dtype == torch.float32:
                    # addmm_ computes the same; torch's flop counter counts addmm and not it
                    torch.addmm(grad_w, grad.t(), h, out=grad_w)
                else:
                    grad_w.add_(torch.mm(grad.t(), h))
        ctx.count = count
        # kept in the compute dtype, as the unfused head's weight gradient is computed (autograd casts it to the
        # weight's dtype when it hands it on)
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(dtype))
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss / ctx.count
        return (None if grad_h is None else grad_h * scale.to(grad_h.dtype),
                None if grad_w is None else grad_w * scale.to(grad_w.dtype), None, None, None)


def head_cross_entropy(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """mean over tokens with a label (not -100) of -log softmax(hidden W^T)[label], never holding the logits of
    more than one chunk of tokens; in the autocast dtype where autocast is on, else the weight's dtype."""
    dtype = compute_dtype(hidden_TD.device, weight_VD.dtype)
    with autocast_off(hidden_TD.device.type):
        return HeadCrossEntropy.apply(hidden_TD, weight_VD, labels_T, chunk_tokens(weight_VD.shape[0]), dtype)


class _Labels:
    """The labels the head's pre-hook turns into a loss while `labels_for` is active, and that loss (plain
    attributes, as `core.routing_context`'s, so torch.compile traces their reads)."""

    labels: torch.Tensor | None = None
    loss: torch.Tensor | None = None


_LABELS = _Labels()


def fusable(model: nn.Module) -> nn.Linear | None:
    """The model's output head where the fused loss computes what the model's own loss computes: a plain bias-free
    linear map (not wrapped by an adapter), with no logit soft-capping or scale after it; else None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1.0):
        return None
    return head


def install(model: nn.Module) -> bool:
    """Hook the fused loss into `model`'s output head (once); False where it does not apply (`fusable`)."""
    head = fusable(model)
    if head is None:
        return False
    if not getattr(head, "_upcycle_head_loss", False):
        head.register_forward_pre_hook(_head_pre_hook)
        head._upcycle_head_loss = True
    return True


def _head_pre_hook(module: nn.Linear, args: tuple) -> tuple | None:
    labels_BS = _LABELS.labels
    if labels_BS is None:
        return None
    hidden_BSD = args[0]
    if hidden_BSD.shape[:-1] != labels_BS.shape:
        raise RuntimeError(f"the output head got hidden states of shape {tuple(hidden_BSD.shape)} for labels of "
                           f"shape {tuple(labels_BS.shape)}")
    # position t predicts the label at t + 1 (the labels are the inputs, as transformers' causal-LM loss shifts them)
    shifted_BS = F.pad(labels_BS[:, 1:], (0, 1), value=IGNORE)
    _LABELS.loss = head_cross_entropy(hidden_BSD.reshape(-1, hidden_BSD.shape[-1]), module.weight,
                                      shifted_BS.reshape(-1))
    return (hidden_BSD[:, :0],)          # the head computes no logits


@contextlib.contextmanager
def labels_for(labels_BS: torch.Tensor) -> Iterator[_Labels]:
    """Inside the block, a forward of a model whose head `install` hooked computes the loss of `labels_BS` [B, S]
    (read from the yielded object's `loss`) and returns empty logits."""
    _LABELS.labels, _LABELS.loss = labels_BS, None
    try:
        yield _LABELS
    finally:         # nothing of the batch is kept past the block (the loss holds its graph)
        _LABELS.labels = _LABELS.loss = None


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP's, torch.compile's and Accelerate's wrappers (FSDP2 wraps in place)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        model = getattr(model, "_orig_mod", None) or getattr(model, "module", None) or model
    return model

