"""Evaluation (docs/methods.md §6). Causal LMs: held-out perplexity = exp(mean next-token negative log-likelihood over
every real predicted token), summed over batches before dividing, so batch sizes and padding do not weight it.
CLIP: zero-shot classification with class-name prompts and image<->text retrieval Recall@K (Radford et al. 2021).

One held-out budget serves `upcycle eval` and training's evaluations: `held_out_rows` (the whole rows covering
the tokens asked for) of the same packed text, `upcycle.config.EVAL_TOKENS` tokens unless set. Inside
`progress_bars(label)` every evaluation shows a tqdm bar on stderr (none when stderr is not a terminal).
"""

from __future__ import annotations

import contextlib
import math
import sys
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from ..config import EVAL_TOKENS
from ..core.modes import eval_mode

# The label of the bar the evaluations in progress show (None: no bar). A context variable rather than an argument
# so that a task's `evaluate(model)` (`upcycle.tasks`, a task someone adds) shows one without passing it on.
_BAR_LABEL: ContextVar[str | None] = ContextVar("upcycle_eval_bar", default=None)


@contextlib.contextmanager
def progress_bars(label: str | None):
    """Evaluations run inside this block show a progress bar labelled `label` (None: no bar)."""
    token = _BAR_LABEL.set(label)
    try:
        yield
    finally:
        _BAR_LABEL.reset(token)


def _bar(total: int, unit: str):
    from tqdm.auto import tqdm

    label = _BAR_LABEL.get()
    # disable=None: tqdm draws only on a terminal, so logs and pipes get no carriage-return noise
    return tqdm(total=total, desc=label, unit=unit, file=sys.stderr, leave=False,
                disable=True if label is None else None)


def held_out_rows(tokens: int, sequence_length: int) -> int:
    """Packed rows an evaluation of `tokens` held-out tokens reads: the whole rows that cover them (a row of L
    tokens predicts L - 1 of them; the result's "tokens" is the number predicted)."""
    return max(1, -(-tokens // sequence_length))


@torch.no_grad()
def perplexity(model: nn.Module, input_ids_NS: torch.Tensor, attention_mask_NS: torch.Tensor, *,
               batch_size: int = 8) -> dict:
    """{"perplexity", "nll", "tokens"} of `model` on packed rows (token t predicts t+1 within a row; positions
    whose target is padding are excluded)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    predicted = int((attention_mask_NS[:, 1:] != 0).sum())
    with eval_mode(model), _bar(predicted, "tok") as bar:
        for start in range(0, input_ids_NS.shape[0], batch_size):
            ids = input_ids_NS[start:start + batch_size].to(device)
            mask = attention_mask_NS[start:start + batch_size].to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                  ignore_index=-100, reduction="sum")
            total += float(nll)
            done = int((targets != -100).sum())
            count += done
            bar.update(done)
    mean = total / max(count, 1)
    # exp overflows a float past 709: such a model's perplexity is infinite, not an error
    return {"perplexity": math.exp(mean) if mean < 709 else math.inf, "nll": mean, "tokens": count}


@torch.no_grad()
def text_features(model: nn.Module, tokenizer, captions: list[str], batch_size: int = 256,
                  where: str = "held-out captions") -> torch.Tensor:
    """Unit-norm projected caption embeddings [N, P]; `where`: the captions' file, named by a refusal of their
    tokens."""
    from ..data.clip_pairs import encode_captions
    from ..data.token_ids import embedding_rows

    device = next(model.parameters()).device
    max_length = model.config.text_config.max_position_embeddings
    rows = embedding_rows(model.config)
    out = []
    with _bar(len(captions), "caption") as bar:
        for start in range(0, len(captions), batch_size):
            enc = encode_captions(tokenizer, captions[start:start + batch_size], max_length, rows, where)
            features = model.get_text_features(**{k: v.to(device) for k, v in enc.items()})
            out.append(getattr(features, "pooler_output", features).float())
            bar.update(len(out[-1]))
    return F.normalize(torch.cat(out), dim=-1)


@torch.no_grad()
def image_features(model: nn.Module, images: list, batch_size: int = 256) -> torch.Tensor:
    """Unit-norm projected image embeddings [N, P]."""
    from ..data.clip_pairs import pixel_values

    device = next(model.parameters()).device
    size = model.config.vision_config.image_size
    out = []
    with _bar(len(images), "image") as bar:
        for start in range(0, len(images), batch_size):
            batch = pixel_values(images[start:start + batch_size], size).to(device)
            features = model.get_image_features(pixel_values=batch)
            out.append(getattr(features, "pooler_output", features).float())
            bar.update(len(out[-1]))
    return F.normalize(torch.cat(out), dim=-1)


def recall_at(scores_QC: torch.Tensor, relevant_QC: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """Fraction of queries with at least one relevant candidate among their top-k scores."""
    top = scores_QC.topk(min(max(ks), scores_QC.shape[1]), dim=1).indices
    # the scores come from the model's device (a GPU), the relevance table is built on the CPU
    hits = relevant_QC.gather(1, top.to(relevant_QC.device))
    return {f"R@{k}": float(hits[:, :k].any(dim=1).double().mean()) for k in ks}


@torch.no_grad()
def clip_metrics(model: nn.Module, tokenizer, pairs, *, batch_size: int = 256,
                 templates: tuple[str, ...] | None = None, where: str = "held-out captions") -> dict:
    """Zero-shot classification (when the pairs have labels) and image<->text retrieval Recall@1/5.

    Zero-shot: each class is the mean unit embedding of its prompts (CLIP's prompt ensembling), an image takes
    the nearest class. Retrieval ranks every distinct caption for an image (image->text) and every image for a
    caption (text->image); a hit is any item paired with the query. With one caption per image and distinct
    captions this is the usual Flickr/COCO Recall@K; templated captions repeat, so identical captions are one
    candidate rather than ties that would split the ranks.
    """
    with eval_mode(model):
        distinct = sorted(set(pairs.captions))
        text_CP = text_features(model, tokenizer, distinct, batch_size, where)
        image_NP = image_features(model, pairs.images, batch_size)
        index = {caption: i for i, caption in enumerate(distinct)}
        caption_of = torch.tensor([index[c] for c in pairs.captions])
        relevant_NC = torch.zeros(len(pairs), len(distinct), dtype=torch.bool)
        relevant_NC[torch.arange(len(pairs)), caption_of] = True
        scores_NC = image_NP @ text_CP.t()
        result = {"pairs": len(pairs), "distinct_captions": len(distinct),
                  "image_to_text": recall_at(scores_NC, relevant_NC),
                  "text_to_image": recall_at(scores_NC.t(), relevant_NC.t())}
        if pairs.labels is not None:
            templates = templates or pairs.templates
            prompts = [t.format(name=name) for name in pairs.class_names for t in templates]
            prompt_KP = text_features(model, tokenizer, prompts, batch_size)
            class_KP = F.normalize(prompt_KP.view(len(pairs.class_names), len(templates), -1).mean(1), dim=-1)
            predicted = (image_NP @ class_KP.t()).argmax(1)
            labels = torch.tensor(pairs.labels, device=predicted.device)      # predictions come from the model's device
            result["zero_shot"] = {"accuracy": float((predicted == labels).double().mean()),
                                   "classes": len(pairs.class_names), "templates": list(templates)}
    return result


def evaluate_model(name: str, *, data: str | None = None, tokens: int = EVAL_TOKENS, sequence_length: int = 256,
                   progress: bool = False, task: str | None = None, pairs: int | None = None,
                   device: str = "auto") -> dict:
    """`upcycle eval`: the model's task metrics on held-out data, as a JSON-ready dict. Causal LMs default to
    the embedded held-out Wikipedia split, CLIP models to the digits test split; `progress`: a bar on stderr
    (a terminal's) and the held-out budget said there. On `device` ("auto": a GPU where torch sees one, as
    training runs) in float32, as a training run's evaluations compute, so that the two agree."""
    from pathlib import Path

    from ..checkpoint.loading import check_sequence_length, load_model
    from ..data.clip_pairs import load_pairs
    from ..data.packing import pack_documents
    from ..data.text import read_texts, wikipedia_split
    from ..data.token_ids import check_token_ids, embedding_rows
    from ..errors import UpcycleError

    if tokens < 1:
        raise UpcycleError(f"--tokens must be >= 1, got {tokens}")
    if sequence_length < 1:         # the task's own floor follows (an encoder's special tokens, an LM's two
        raise UpcycleError(f"--sequence-length must be >= 1, got {sequence_length}")   # tokens), as in training
    from ..core.devices import resolve_device

    target = resolve_device(device)
    model, tokenizer = load_model(name)
    model.to(target)
    from .contrastive import evaluate_encoder
    from .kind import model_task

    task = model_task(model, task)
    if task == "contrastive":      # encoders: retrieval on text pairs (`pairs`: how many)
        with progress_bars("eval" if progress else None):
            return {"model": name, "task": "contrastive",
                    **evaluate_encoder(model, tokenizer, data, sequence_length=sequence_length, pairs=pairs)}
    result = {"model": name, "task": task}
    if tokenizer is None:
        raise UpcycleError(f"{name} has no tokenizer to evaluate it with")
    if task == "clip":
        source = data or "digits"
        result["data"] = "digits test split" if source == "digits" else source
        with progress_bars("eval" if progress else None):
            held = load_pairs(source, split="heldout", image_size=model.config.vision_config.image_size)
            result.update(clip_metrics(model, tokenizer, held, where=f"held-out captions of {result['data']}"))
        return result
    check_sequence_length(model, sequence_length)
    if data is not None and Path(data).is_dir():
        raise UpcycleError(f"held-out text: {data} is a folder; give a .txt or .jsonl file with --data")
    try:
        held = read_texts(data) if data is not None else wikipedia_split()[1]
    except (ValueError, OSError) as e:
        raise UpcycleError(f"held-out text: {e} (give a .txt or .jsonl file with --data)") from None
    result["data"] = data or "held-out Wikipedia (embedded)"
    # whole rows covering at least `tokens` tokens (the result's "tokens" says how many were predicted): only
    # as much text is tokenized as those rows hold
    rows = held_out_rows(tokens, sequence_length)
    ids, mask = pack_documents(tokenizer, held, sequence_length, max_tokens=rows * sequence_length)
    check_token_ids(ids, embedding_rows(model.config), f"held-out text {result['data']} as tokenized")
    if ids.shape[0] < rows:
        print(f"[upcycle] the held-out data holds {int(mask.sum()):,} tokens, fewer than the {tokens:,} asked for "
              f"(--tokens): all of it is evaluated", file=sys.stderr)
    if progress:
        print(f"[upcycle] held-out perplexity of {name} on {result['data']}: {min(rows, ids.shape[0])} rows of "
              f"{sequence_length} tokens (--tokens {tokens:,})", file=sys.stderr)
    with progress_bars("eval" if progress else None):
        result.update(perplexity(model, ids[:rows], mask[:rows]))
    result["sequence_length"] = sequence_length
    return result
