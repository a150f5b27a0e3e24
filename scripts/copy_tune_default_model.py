"""Continue training the built-in model so that it copies spans of its input.

The built-in model (``scripts/train_default_model.py``: 4 layers, 1600 steps on the reference
manual) rarely repeats a passage it has just read, so prompt lookup (speculative decoding's
``ngram`` method) finds little to propose on input-grounded prompts, where a real model copies
names, phrases and whole lines from its context. This script continues its training on the same
corpus, half of the windows ordinary language-model windows and half *copy windows*: a random
span of the corpus, a blank line, and the same span again (the loss covers both halves, and the
second is predictable only by looking back). Deterministic for a given Python / torch build.

Usage::

    python scripts/copy_tune_default_model.py --steps 400 --threads 2 \
        --out ~/.cache/asyncpaged/copy-tuned
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import time

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from asyncpaged import default_model


def _corpus() -> list[str]:
    path = pathlib.Path(__file__).with_name("train_default_model.py")
    spec = importlib.util.spec_from_file_location("train_default_model", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus: list[str] = module.build_corpus()
    return corpus


def _batch(
    data: torch.Tensor, batch: int, window: int, sep: list[int], gen: torch.Generator
) -> torch.Tensor:
    """Half plain windows of ``window`` tokens, half a span + ``sep`` + the span again."""
    rows = []
    span = (window - len(sep)) // 2
    for i in range(batch):
        start = int(torch.randint(0, data.numel() - window, (1,), generator=gen))
        if i % 2 == 0:
            rows.append(data[start : start + window])
            continue
        piece = data[start : start + span]
        row = torch.cat([piece, torch.tensor(sep, dtype=torch.long), piece])
        rows.append(row[:window])
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--window", type=int, default=129)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    source = default_model.path()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.train()
    ids: list[int] = []
    for doc in _corpus():
        ids.extend([tokenizer.bos_token_id, *tokenizer.encode(doc, add_special_tokens=False),
                    tokenizer.eos_token_id])  # fmt: skip
    data = torch.tensor(ids, dtype=torch.long)
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    began, running = time.perf_counter(), 0.0
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / args.warmup)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm * cosine
        batch = _batch(data, args.batch, args.window, sep, gen)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += float(loss)
        if (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps} loss {running / args.log_every:.4f} "
                  f"{time.perf_counter() - began:.0f}s", flush=True)  # fmt: skip
            running = 0.0
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):  # fmt: skip
        if (source / name).is_file():
            (args.out / name).write_bytes((source / name).read_bytes())


if __name__ == "__main__":
    main()
