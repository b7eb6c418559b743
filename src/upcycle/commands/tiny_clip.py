"""`upcycle tiny-clip OUT`: a small random dense CLIP and its caption tokenizer, to pretrain on the digits pairs."""

from __future__ import annotations

import argparse

from .flags import seed_number, whole_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument("--data", default="digits", help="captions to build the tokenizer from (default digits)")
    parser.add_argument("--image-size", type=whole_number, default=16, dest="image_size")
    parser.add_argument("--patch-size", type=whole_number, default=4, dest="patch_size")
    parser.add_argument("--hidden-size", type=whole_number, default=64, dest="hidden_size")
    parser.add_argument("--layers", type=whole_number, default=4)
    parser.add_argument("--max-length", type=whole_number, default=16, dest="max_length", help="caption tokens")
    parser.add_argument("--seed", type=seed_number, default=0)
    parser.add_argument("--overwrite", action="store_true")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..data.clip_pairs import caption_tokenizer, load_pairs
    from ..data.tiny_clip import check_sizes, tiny_clip
    from ..outputs.claims import claim_output, inputs

    sizes = dict(image_size=args.image_size, patch_size=args.patch_size, hidden_size=args.hidden_size,
                 layers=args.layers, max_length=args.max_length, seed=args.seed)
    check_sizes(**sizes)
    with claim_output(args.out, kind="tiny-clip", given=inputs(("caption data", args.data)),
                      overwrite=args.overwrite) as claim:
        pairs = load_pairs(args.data, split="train", image_size=args.image_size)
        tokenizer = caption_tokenizer(pairs.captions, max_length=args.max_length)
        model = tiny_clip(tokenizer, **sizes)
        with claim.directory() as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: dense CLIP, {params:,} parameters, {len(tokenizer)} caption tokens")
    return 0
