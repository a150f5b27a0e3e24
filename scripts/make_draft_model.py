"""Make a draft model for the built-in model: its first layers, embeddings, final norm and head.

A "layer-skip" draft for speculative decoding (``SpeculativeConfig(method="draft_model",
model=DIR)``): a ``LlamaForCausalLM`` with the built-in model's config but ``--layers`` layers,
holding the built-in model's own weights for those layers (the rest are dropped), saved with
transformers' ``save_pretrained`` beside a copy of the tokenizer, so it shares the target's
tokenizer and vocabulary. ``--distill-steps N`` then trains the draft's layers and final norm
(embeddings and the tied head frozen) for N steps to match the built-in model's next-token
distributions (KL) on windows of Python's reference manual, the built-in model's own corpus.

``--measure`` runs the engine on the benchmark's grounded prompts (``bench speculative``'s,
greedy, ``--max-tokens`` each, one request at a time) without and with the draft, and prints
the acceptance rate and the median TPOT of each.

Usage::

    python scripts/make_draft_model.py --layers 1 --distill-steps 300 --measure
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncpaged import default_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def default_out(layers: int, steps: int) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "asyncpaged" / f"default-draft-{layers}l-{steps}s"


def layer_skip(target_dir: Path, layers: int) -> LlamaForCausalLM:
    """The target's first ``layers`` layers, embeddings, final norm and head."""
    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    config = LlamaConfig.from_pretrained(str(target_dir))
    if not 1 <= layers < config.num_hidden_layers:
        raise SystemExit(f"--layers must be in [1, {config.num_hidden_layers - 1}]")
    config.num_hidden_layers = layers
    draft = LlamaForCausalLM(config)
    state = {
        name: tensor
        for name, tensor in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    missing, unexpected = draft.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m for m in missing), missing
    draft.tie_weights()
    return draft.eval()


def _windows(tokenizer: Any, length: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    ids: list[int] = []
    for name in sorted(topics):
        ids.extend(tokenizer.encode(topics[name]))
    usable = len(ids) // length * length
    return torch.tensor(ids[:usable]).view(-1, length)


def distill(target_dir: Path, draft: LlamaForCausalLM, steps: int, seed: int = 0) -> None:
    """Train the draft's layers and final norm toward the target's distributions (KL)."""
    from transformers import AutoTokenizer

    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    windows = _windows(AutoTokenizer.from_pretrained(str(target_dir)), 128)
    params = [p for n, p in draft.named_parameters() if "embed_tokens" not in n]
    for n, p in draft.named_parameters():
        p.requires_grad_("embed_tokens" not in n and "lm_head" not in n)
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    draft.train()
    for step in range(steps):
        batch = windows[torch.randint(len(windows), (16,), generator=generator)]
        with torch.no_grad():
            teacher = torch.log_softmax(target(batch).logits, dim=-1)
        student = torch.log_softmax(draft(batch).logits, dim=-1)
        loss = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        (loss / batch.shape[1]).backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: KL {loss.item() / batch.shape[1]:.4f} per token", flush=True)
    draft.eval()


def save(draft: LlamaForCausalLM, target_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out / name)


async def measure(draft_dir: Path, k: int, max_tokens: int, num_prompts: int) -> dict[str, Any]:
    """Greedy TPOT at batch 1 without and with the draft, and the draft's acceptance rate."""
    from asyncpaged import (
        AsyncEngine,
        EngineConfig,
        RequestOutputKind,
        SamplingParams,
        SpeculativeConfig,
    )
    from asyncpaged.tools.bench_speculative import grounded_prompts

    prompts = grounded_prompts(num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=str(draft_dir))
    report: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for mode, config in (("off", None), ("draft", spec)):
        engine_config = EngineConfig(model=str(default_model.path()), speculative_config=config)
        async with AsyncEngine(engine_config) as engine:
            await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
            tpots, outputs[mode] = [], []
            for prompt in prompts:
                chunks: list[float] = []
                tokens: list[int] = []
                async for out in engine.generate(prompt, params):
                    if out.outputs[0].token_ids:
                        chunks.append(time.perf_counter())
                        tokens.extend(out.outputs[0].token_ids)
                outputs[mode].append(tokens)
                tpots.append((chunks[-1] - chunks[0]) / max(1, len(tokens) - 1) * 1e3)
            stats = engine.statistics()
        report[mode] = {"tpot_ms_median": statistics.median(tpots), "tpot_ms": tpots}
        if config is not None:
            report[mode].update(
                num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                acceptance_rate=stats.num_accepted_tokens / max(1, stats.num_draft_tokens),
                acceptance_by_position=list(stats.spec_acceptance_by_position),
            )
    report["identical_tokens"] = outputs["off"] == outputs["draft"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--distill-steps", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target_dir = Path(default_model.path())
    out = args.out or default_out(args.layers, args.distill_steps)
    draft = layer_skip(target_dir, args.layers)
    if args.distill_steps:
        distill(target_dir, draft, args.distill_steps)
    save(draft, target_dir, out)
    print(f"draft ({args.layers} layers, {args.distill_steps} distillation steps): {out}")
    if args.measure:
        import anyio

        report = anyio.run(measure, out, args.k, args.max_tokens, args.prompts)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
