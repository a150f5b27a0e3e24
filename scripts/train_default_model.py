"""Train asyncpaged's built-in default model: a tiny Llama on Python's own documentation.

Everything comes from the running Python, offline: the reference-manual topics in
``pydoc_data.topics.topics`` (all of them but the held-out ``HELD_OUT_TOPICS``) plus the
``__doc__`` of importable standard-library modules and of the callables in their ``__all__``.
A byte-level BPE tokenizer is trained by ``tokenizers`` on the same text (special tokens
``<pad>``, ``<s>``, ``</s>``, ``<unk>`` are ids 0-3), then a ``LlamaForCausalLM`` is trained on
``<s> document </s>`` concatenated into one stream, cut into random windows. The result is saved
with ``save_pretrained`` (float32) as a Hugging Face checkpoint directory.

Deterministic for a given Python / torch build: the corpus order is sorted, torch is seeded and
the window order comes from a seeded generator. (The stdlib docstrings differ between Python
versions, so a different interpreter trains on slightly different text.)

Usage::

    python scripts/train_default_model.py --steps 1600 --threads 2 \
        --out src/asyncpaged/default_model/checkpoint

Options that change the recipe (all off by default; with them off the run is the one above):
``--init DIR`` continues from a checkpoint (its config and its tokenizer, which is reused, not
retrained); ``--copy-frac F`` builds that fraction of each batch as *copy windows*:
``<s> passage \n\n passage[q:] \n\n passage ...`` cut to the window, where the passage is a
random span of the stream and ``q`` is 0 or a random offset, so the model learns to continue a
span it has already seen in its context (induction heads, what prompt-lookup speculation
needs); ``--copy-once`` makes each copy window repeat its passage once and then go on with
the text (a copy that ends, not a loop); ``--copy-shuffled F`` shuffles the passage of that
fraction of the text copy windows (text-like tokens no memorised text predicts);
``--save-every N`` saves the checkpoint during the run; ``--eval-every N`` prints the copy
metric (on held-out docs and on spans of random tokens, which only copying predicts) and
held-out docs loss every N steps; ``--bf16`` runs forward and backward under bf16 autocast
(measured 1.24x on an AMX Xeon at batch 32 x 256 for this small
model: its steps are not GEMM-bound).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import math
import pathlib
import sys
import time
import warnings

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Kept out of training so a test can compare trained vs random-init loss on unseen docs text.
HELD_OUT_TOPICS = ("global", "nonlocal")
# Importing these has side effects (a browser, printing, GUI) or they are not documentation.
SKIP_MODULES = frozenset(
    {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "pydoc_data"}
)
MIN_DOC_CHARS = 40


def stdlib_docstrings() -> list[str]:
    """Module docstrings plus docstrings of the public callables each module lists in __all__."""
    docs: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        try:
            with (
                warnings.catch_warnings(),
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # a platform without the module just skips it
            continue
        docs.append(module.__doc__ or "")
        for attr in sorted(getattr(module, "__all__", None) or []):
            obj = getattr(module, attr, None)
            if obj is not None and callable(obj):
                doc = getattr(obj, "__doc__", None)
                if isinstance(doc, str):
                    docs.append(doc)
    return docs


def build_corpus() -> list[str]:
    """Topics first (sorted by key), then deduplicated stdlib docstrings; all stripped."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    corpus: list[str] = []
    candidates = [topics[k] for k in sorted(topics) if k not in HELD_OUT_TOPICS]
    candidates += stdlib_docstrings()
    held_out = {topics[k].strip() for k in HELD_OUT_TOPICS}
    for doc in candidates:
        text = doc.strip()
        if len(text) >= MIN_DOC_CHARS and text not in seen and text not in held_out:
            seen.add(text)
            corpus.append(text)
    return corpus


def train_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, (special, tok.token_to_id(special))
    # Prompts start with <s>, like every training document does.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, corpus: list[str]) -> torch.Tensor:
    ids: list[int] = []
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert isinstance(bos, int)
    assert isinstance(eos, int)
    for doc in corpus:
        ids.append(bos)
        ids.extend(tokenizer.encode(doc, add_special_tokens=False))
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def separator_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids "\\n\\n" gets between two words (how a blank line inside a prompt is encoded)."""
    ids: list[int] = tokenizer.encode("a\n\na", add_special_tokens=False)
    a = tokenizer.encode("a", add_special_tokens=False)
    assert ids[: len(a)] == a, ids
    assert ids[-len(a) :] == a, ids
    return ids[len(a) : -len(a)]


def copy_window(
    data: torch.Tensor,
    window: int,
    sep: list[int],
    bos: int,
    gen: torch.Generator,
    random_tokens: bool = False,
    once: bool = False,
    shuffled: bool = False,
) -> torch.Tensor:
    """``<s> passage sep passage[q:] sep passage ...`` cut to ``window`` tokens; the passage is
    a span of the stream, or uniformly random non-special tokens with ``random_tokens`` (which
    no memorised text predicts, so only copying from the context lowers their loss). With
    ``once`` the passage comes back once and the stream follows (after a text passage, the text
    that follows it; after random tokens, a random span of text): a copy that ends, as a
    quotation or an edited line does, rather than a loop. With ``shuffled`` a text passage's
    tokens come in a random order: text-like tokens that no memorised text predicts, so only
    copying them pays (a model that memorises its corpus otherwise recites instead of copying)."""
    longest = max(9, (2 * window) // 3)
    length = int(torch.randint(8, longest, (1,), generator=gen))
    start = 0
    if random_tokens:
        high = int(data.max()) + 1
        passage = torch.randint(len(SPECIAL_TOKENS), high, (length,), generator=gen).tolist()
    else:
        start = int(torch.randint(0, data.numel() - length, (1,), generator=gen))
        passage = data[start : start + length].tolist()
        if shuffled:
            passage = [passage[i] for i in torch.randperm(length, generator=gen).tolist()]
    skip = 0
    if bool(torch.rand((), generator=gen) < 0.5):
        skip = int(torch.randint(0, length // 2 + 1, (1,), generator=gen))
    ids = [bos, *passage]
    if once:
        ids += sep + passage[skip:]
        rest = max(0, window - len(ids))
        after = (
            start + length
            if not random_tokens
            else int(torch.randint(0, data.numel() - rest, (1,), generator=gen))
        )
        after = min(after, data.numel() - rest)
        ids += data[after : after + rest].tolist()
    while len(ids) < window:
        ids += sep + passage[skip:]
        skip = 0
    return torch.tensor(ids[:window], dtype=torch.long)


def copy_eval(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    texts: list[str] | list[list[int]],
    span: int = 200,
) -> tuple[float, float]:
    """(copy accuracy, docs loss) on held-out texts (or token id lists). Copy accuracy:
    teacher-forced greedy accuracy on the second occurrence of the text's first ``span`` tokens in
    ``<s> text[:span] sep text[:span]`` (its first 4 tokens excluded); docs loss: mean token
    loss on ``<s> text`` (first 512 tokens), as tests/test_default_model.py measures it."""
    sep = separator_ids(tokenizer)
    bos = tokenizer.bos_token_id
    was_training = model.training
    model.train(False)
    hits = total = 0
    losses = []
    with torch.no_grad():
        for text in texts:
            ids = (
                text if isinstance(text, list) else tokenizer.encode(text, add_special_tokens=False)
            )
            doc = torch.tensor([[bos, *ids][:512]])
            losses.append(float(model(input_ids=doc, labels=doc).loss))
            passage = ids[:span]
            seq = [bos, *passage, *sep, *passage]
            logits = model(input_ids=torch.tensor([seq])).logits[0]
            first = 1 + len(passage) + len(sep) + 4  # first scored target position
            pred = logits[first - 1 : len(seq) - 1].argmax(-1)
            target = torch.tensor(seq[first:])
            hits += int((pred == target).sum())
            total += target.numel()
    model.train(was_training)
    return hits / max(1, total), sum(losses) / len(losses)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def save_checkpoint(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: pathlib.Path
) -> None:
    """``save_pretrained`` (float32) of the model, its generation config and its tokenizer."""
    was_training = model.training
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 writes its own class name; the generic fast class loads in 4.x and 5.x.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # added by from_pretrained (--init)
        tok_config.pop(key, None)
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved to {out}: {total} bytes", flush=True)
    model.train(was_training)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("checkpoint"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=3072)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument(
        "--init",
        type=pathlib.Path,
        default=None,
        help="continue from this checkpoint (reuses its config and tokenizer)",
    )
    parser.add_argument(
        "--copy-frac", type=float, default=0.0, help="fraction of each batch built as copy windows"
    )
    parser.add_argument(
        "--copy-random",
        type=float,
        default=0.0,
        help="fraction of the copy windows whose passage is random tokens",
    )
    parser.add_argument(
        "--copy-shuffled",
        type=float,
        default=0.0,
        help="fraction of the text copy windows whose passage is shuffled",
    )
    parser.add_argument(
        "--copy-once",
        action="store_true",
        help="copy windows repeat their passage once, then the text goes on (no loops)",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="forward and backward under bf16 autocast (fast where the CPU has AMX or "
        "avx512_bf16; the weights and the optimizer stay float32)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="print copy accuracy and held-out docs loss every N steps",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="also save the checkpoint to --out every N steps (a long run can be stopped)",
    )
    args = parser.parse_args()

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.set_flush_denormal(True)  # denormals slow CPU matmuls badly

    corpus = build_corpus()
    if args.init is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init)
    else:
        tokenizer = train_tokenizer(corpus, args.vocab)
    data = encode_stream(tokenizer, corpus)
    chars = sum(len(d) for d in corpus)
    print(
        f"corpus: {len(corpus)} documents, {chars} chars, {data.numel()} tokens "
        f"(vocab {len(tokenizer)}); {time.perf_counter() - start:.1f}s",
        flush=True,
    )

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if args.init is not None:
        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    window = args.seq_len + 1
    offsets = torch.arange(window)
    running = 0.0
    n_copy = round(args.batch * args.copy_frac)
    n_random = round(n_copy * args.copy_random)
    sep = separator_ids(tokenizer) if n_copy else []
    from pydoc_data.topics import topics

    held_out = [topics[k].strip() for k in HELD_OUT_TOPICS]

    eval_gen = torch.Generator().manual_seed(12345)
    high = int(data.max()) + 1
    random_texts = [
        torch.randint(len(SPECIAL_TOKENS), high, (120,), generator=eval_gen).tolist()
        for _ in range(8)
    ]

    def evaluate(label: str) -> None:
        acc, docs_loss = copy_eval(model, tokenizer, held_out)
        random_acc, _ = copy_eval(model, tokenizer, random_texts)
        print(
            f"eval {label}: copy accuracy {acc:.3f} (random spans {random_acc:.3f}) "
            f"held-out docs loss {docs_loss:.4f}",
            flush=True,
        )

    if args.eval_every:
        evaluate("step 0")
    train_start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(0, data.numel() - window, (args.batch - n_copy,), generator=gen)
        batch = data[starts[:, None] + offsets[None, :]]
        if n_copy:
            bos = tokenizer.bos_token_id
            n_shuffled = round((n_copy - n_random) * args.copy_shuffled)
            copies = [copy_window(data, window, sep, bos, gen, random_tokens=i < n_random,
                                  once=args.copy_once, shuffled=i >= n_copy - n_shuffled)
                      for i in range(n_copy)]  # fmt: skip
            batch = torch.cat([batch, torch.stack(copies)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            count = (step % args.log_every) + 1
            elapsed = time.perf_counter() - train_start
            print(
                f"step {step + 1}/{args.steps} loss {running / count:.4f} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} {elapsed:.0f}s",
                flush=True,
            )
            running = 0.0
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            evaluate(f"step {step + 1}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_checkpoint(model, tokenizer, args.out)

    save_checkpoint(model, tokenizer, args.out)
    print(f"total time {time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
