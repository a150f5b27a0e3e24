"""The built-in default model: a tiny Llama trained on Python's own documentation.

``path()`` returns a real Hugging Face checkpoint directory (``LlamaForCausalLM``, float32,
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``), small enough to ship in the package and to run on a CPU, trained well
enough that a streaming demo shows recognisable English / Python-docs words. It memorises its
small corpus more than it generalises; it is a demo and test model, not a useful LM.

How it was made (Python 3.11.7, torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3,
2 CPU cores)::

    python scripts/train_default_model.py --steps 1600 --threads 2 \
        --out src/asyncpaged/default_model/checkpoint

(defaults: --seed 0, batch 32 x 128 tokens, AdamW peak lr 3e-3, betas (0.9, 0.95), weight decay
0.1, 100 warmup steps then cosine to 10%, grad clip 1.0). After training, ``max_length`` was
dropped from ``generation_config.json`` by hand; the script no longer writes it.

- Corpus: every ``pydoc_data.topics.topics`` entry except "global" and "nonlocal" (held out for
  tests), plus the ``__doc__`` of importable stdlib modules and of the callables in their
  ``__all__``; deduplicated, 1466 documents, 1,039,974 characters, 282,930 tokens, each document
  wrapped as ``<s> ... </s>``.
- Tokenizer: byte-level BPE trained by ``tokenizers`` on that corpus, vocab 3072, ids 0-3 =
  ``<pad>``, ``<s>``, ``</s>``, ``<unk>``; encoding prepends ``<s>``.
- Model: hidden 192, 4 layers, 6 heads (head_dim 32), 2 KV heads (GQA), intermediate 512,
  SiLU, RMSNorm, RoPE theta 10000, max_position_embeddings 512, tied embeddings:
  2,164,416 parameters.
- Training: 1600 steps (about 6.5M tokens, about 23 passes over the corpus), 1013 s of training,
  1014 s in all; final training loss 0.68 (mean of the last 50 steps). Loss on the first 512
  tokens of a topic: "return" (seen) 2.16, held-out "global" 6.30, held-out "nonlocal" 5.27;
  a random init scores about 8.0.
- Sizes: model.safetensors 8,661,712 bytes, tokenizer.json 197,543, the rest about 1 kB;
  8,860,311 bytes in total.

Samples (``model.generate`` on the saved checkpoint, 40 new tokens; "sampled" is
``do_sample=True, temperature=0.8, top_k=50`` after ``torch.manual_seed(0)``)::

    greedy  "The return statement" -> "The return statement if the return value is a byte
            representation of object.  The return value is a tuple.  The default object is
            then the number of names in the mapping that contains the useful format"
    greedy  "The import statement" -> "The import statement to pass an exception if it doesn't
            exist.  The optional arguments are in the same order in which case the source code
            was originally, or a __veristent name."
    sampled "The import statement" -> "The import statement to pass a new execution frame.
            Return the argument to open(), except that it was as if it is a frame.__exit__
            attribute.  The following code:  **PEP 4"
    greedy  "def" -> "def\n\n        class Bar(TypedDict, total=False):\n            title:
            Required[str]\n            year: int ..."

(whitespace in the samples is condensed.)
"""

from __future__ import annotations

import pathlib

__all__ = ["path"]

_CHECKPOINT = pathlib.Path(__file__).resolve().parent / "checkpoint"


def path() -> pathlib.Path:
    """The checkpoint directory (``config.json``, ``model.safetensors``, tokenizer files).

    Pass it wherever a model directory is expected, e.g. ``AutoModelForCausalLM.from_pretrained``.
    Raises FileNotFoundError when the package was installed without its checkpoint files.
    """
    if not (_CHECKPOINT / "config.json").is_file():
        raise FileNotFoundError(
            f"default model checkpoint missing at {str(_CHECKPOINT)!r}; the package data was not "
            "installed (regenerate with scripts/train_default_model.py)."
        )
    return _CHECKPOINT
