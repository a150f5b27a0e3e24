"""``asyncpaged bench kv-accuracy``: what a quantized KV cache costs against the unquantized one.

For each model (the reference workload's random Llama, and tiny checkpoints of other families,
``--families``) and each ``--kv-cache-dtypes`` dtype, on ``--num-prompts`` prompts of the
reference workload (ids folded into the model's vocabulary):

* the unquantized model's greedy continuation of ``--new-tokens`` tokens is scored teacher-forced
  twice, by transformers as it is and by transformers whose attention sees K and V rounded as
  the cache of that dtype stores them (``asyncpaged.testing.kv_rounding``: the engine's exact
  reference, token for token), giving per position the next-token distributions p (unquantized)
  and q: ``mean KL`` is the mean of KL(p || q) over the positions, ``top-1`` the share of
  positions whose most likely token is the same;
* the greedy continuation under the rounding is generated too: ``greedy`` is the share of its
  tokens equal to the unquantized continuation's up to the first difference, ``same`` the share
  of prompts whose whole continuation is the same.

float32 math throughout. ``kv_accuracy.json`` holds every figure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asyncpaged.model.kv_quant import KV_QUANT_DTYPES

DEFAULT_DTYPES = "int8,fp8_e4m3,fp8_e5m2"
DEFAULT_FAMILIES = "opt,gemma2"


@dataclass(frozen=True, slots=True, kw_only=True)
class KVAccuracy:
    """One model with one quantized KV dtype against its unquantized cache."""

    model: str
    kv_cache_dtype: str
    num_prompts: int
    num_positions: int
    mean_kl: float  # KL(p_unquantized || p_quantized), nats, mean over positions
    top1_agreement: float  # teacher-forced: same most likely next token
    greedy_agreement: float  # free-running: tokens equal up to the first difference
    same_sequences: float  # free-running: whole continuation equal


def measure(
    model: Any,
    name: str,
    prompts: list[tuple[int, ...]],
    new_tokens: int,
    kv_dtypes: list[str],
) -> list[KVAccuracy]:
    """The accuracy of each of ``kv_dtypes`` for the transformers ``model`` (float32, eval)."""
    from asyncpaged.testing.kv_rounding import rounded_kv

    def greedy(prompt: tuple[int, ...]) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
        return list(out[0, len(prompt) :].tolist())

    def scores(prompt: tuple[int, ...], continuation: list[int]) -> torch.Tensor:
        ids = torch.tensor([[*prompt, *continuation]])
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
        steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)]
        return torch.log_softmax(steps.double(), dim=-1)  # [L, V]

    results = []
    with torch.no_grad():
        plain = [greedy(p) for p in prompts]
        base = [scores(p, c) for p, c in zip(prompts, plain, strict=True)]
        for kv_name in kv_dtypes:
            kl, top1, agree, same, positions = 0.0, 0, 0, 0, 0
            with rounded_kv(KV_QUANT_DTYPES[kv_name]):
                for prompt, want, logp in zip(prompts, plain, base, strict=True):
                    logq = scores(prompt, want)
                    kl += float((logp.exp() * (logp - logq)).sum())
                    top1 += int((logp.argmax(-1) == logq.argmax(-1)).sum())
                    positions += len(want)
                    got = greedy(prompt)
                    prefix = next((i for i, (a, b) in enumerate(zip(got, want, strict=True))
                                   if a != b), len(want))  # fmt: skip
                    agree += prefix
                    same += got == want
            results.append(
                KVAccuracy(
                    model=name,
                    kv_cache_dtype=kv_name,
                    num_prompts=len(prompts),
                    num_positions=positions,
                    mean_kl=kl / positions,
                    top1_agreement=top1 / positions,
                    greedy_agreement=agree / positions,
                    same_sequences=same / len(prompts),
                )
            )
    return results


def format_table(results: list[KVAccuracy]) -> str:
    head = f"{'model':<12} {'kv dtype':<9} {'mean KL':>10} {'top-1':>7} {'greedy':>7} {'same':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.model:<12} {r.kv_cache_dtype:<9} {r.mean_kl:>10.2e} "
            f"{100 * r.top1_agreement:>6.1f}% {100 * r.greedy_agreement:>6.1f}% "
            f"{100 * r.same_sequences:>5.0f}%"
        )
    return "\n".join(lines)


def _load(path: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    softcapped = getattr(config, "attn_logit_softcapping", None) is not None
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, **({"attn_implementation": "eager"} if softcapped else {})
    )
    return model.eval()  # type: ignore[no-untyped-call]


def run(args: argparse.Namespace) -> int:
    from asyncpaged.testing.tiny_models import build_tiny_checkpoint
    from asyncpaged.tools.bench_workload import build_checkpoint, make_workload

    kv_dtypes = [d for d in args.kv_cache_dtypes.split(",") if d]
    unknown = [d for d in kv_dtypes if d not in KV_QUANT_DTYPES]
    if unknown:
        raise SystemExit(f"--kv-cache-dtypes takes {', '.join(KV_QUANT_DTYPES)}; got {unknown}")
    torch.set_num_threads(args.threads)
    workload = make_workload(quick=args.quick)
    prompts = [p[: args.max_prompt_tokens] for p in workload.prompts[: args.num_prompts]]
    models: list[tuple[str, Path]] = []
    model_dir = Path(args.model_dir or Path.home() / ".cache/asyncpaged/bench" / workload.name)
    models.append((workload.name, build_checkpoint(workload, model_dir)))
    scratch = Path(tempfile.mkdtemp(prefix="asyncpaged-kv-accuracy-"))
    for family in (f for f in args.families.split(",") if f):
        models.append((family, build_tiny_checkpoint(family, scratch / family)))
    results: list[KVAccuracy] = []
    for name, path in models:
        model = _load(path)
        vocab = int(model.config.vocab_size)
        folded = [tuple(4 + t % (vocab - 4) for t in p) for p in prompts]
        results += measure(model, name, folded, args.new_tokens, kv_dtypes)
    print(
        f"{len(prompts)} prompts of the {workload.name} workload (at most "
        f"{args.max_prompt_tokens} tokens), {args.new_tokens} new tokens; KL(unquantized || "
        "quantized) of the next-token distributions, teacher-forced; greedy: free-running "
        "tokens equal up to the first difference"
    )
    print(format_table(results))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    report = {"num_prompts": len(prompts), "new_tokens": args.new_tokens,
              "max_prompt_tokens": args.max_prompt_tokens, "threads": args.threads,
              "results": [asdict(r) for r in results]}  # fmt: skip
    (out / "kv_accuracy.json").write_text(json.dumps(report, indent=2))
    return 0


def add_parser(modes: Any) -> None:
    p = modes.add_parser("kv-accuracy", help="quantized KV caches against the unquantized one")
    p.add_argument("--kv-cache-dtypes", default=DEFAULT_DTYPES, help="comma-separated")
    p.add_argument("--families", default=DEFAULT_FAMILIES,
                   help="tiny checkpoints measured beside the workload's model")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="the quick workload's smaller model")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--model-dir", help="checkpoint cache (default ~/.cache/asyncpaged/bench/NAME)")
    p.add_argument("--output", default="bench-results", help="folder for kv_accuracy.json")
    p.set_defaults(func=run)
