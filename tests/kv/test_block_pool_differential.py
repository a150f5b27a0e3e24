"""The block pool against a record of its own behaviour: 1,000 seeded random operation sequences.

Each seed builds a pool (device and host sizes, block size, prefix caching, sometimes KV tiers)
and runs a random sequence of calls over the whole public API: allocations (tuple and list
prompts, extra keys, chunks, ``read_cache=False``), appends (copy-on-write after a fork,
speculative tokens, placeholders), the one-token fast path, forks, frees, truncations, swaps out
and in with their completion, pins, eviction, the tier transaction calls and every query, with
invalid calls mixed in (unknown or misplaced sequences, empty token lists, bad counts) and
pools small enough to run short. Each call's result is rendered as text (the exception's type
and message for a call that raises), then the final statistics, tables, pins and block states;
the sha256 of the joined text (in the vocabulary of ``pool_commit``: ``RENAMED``) is the seed's
digest.

``block_pool_golden.json`` holds the digests the pool produced at ``pool_commit``; the test
asserts the pool still produces every one. On a mismatch it names the seed and, where git can
extract ``pool_commit``'s sources, the first call whose record differs. By hand::

    .venv/bin/python tests/kv/test_block_pool_differential.py --trace SEED   # one seed's record
    .venv/bin/python tests/kv/test_block_pool_differential.py --golden      # rewrite the file

(``--golden`` records the behaviour of the pool it runs against: run it only where that is the
behaviour to keep.)

The generator is deterministic across processes: one ``random.Random(seed)``, choices made
from sorted lists, sets rendered sorted (``PYTHONHASHSEED`` varies).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN, Location, SwapDirection
from asyncpaged.kv.tiers import SpillOp, TierIndex

GOLDEN = Path(__file__).with_name("block_pool_golden.json")
ROOT = Path(__file__).resolve().parents[2]
NUM_SEEDS = 1000

BASES = (
    (1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0),
    (1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
    (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    (3, 1, 3, 1, 2, 0, 2, 0, 3, 3, 1, 1, 2, 2, 0, 0, 3, 2, 1, 0),
)
EXTRA_KEYS = (None, None, None, "tenant-a", "tenant-b")
STRANGERS = (99, "ghost")  # sequence ids no generator ever allocates


def show(value: object) -> str:
    """A deterministic rendering: sets sorted, mappings in their order, dataclasses by field."""
    if isinstance(value, frozenset | set):
        return "{" + ", ".join(sorted(show(v) for v in value)) + "}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{show(k)}: {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(show(v) for v in value) + ")"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, bytes):
        return value.hex()[:16]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(
            f"{f.name}={show(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({fields})"
    return repr(value)


def _sort_key(seq_id: object) -> tuple[bool, str]:
    return isinstance(seq_id, str), str(seq_id)


class Run:
    """One seed's operation sequence against a fresh pool, with its record."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lines: list[str] = []
        self.swap_ids: list[int] = []
        self.pin_ids: list[int] = []
        self.spills: list[bytes] = []
        self.prompts: list[tuple[Sequence[int], str | None]] = []  # allocated ones, to pin
        self.next_id = 0
        rng = self.rng
        block_size = rng.choice((1, 2, 4, 4, 4))
        num_device = rng.randint(1, 24)
        num_host = rng.choice((0, rng.randint(1, 12), rng.randint(1, 12)))
        caching = rng.random() < 0.75
        tiers = None
        if caching and rng.random() < 0.3:
            tiers = TierIndex(rng.randint(0, 4), rng.randint(0, 4))
        if rng.random() < 0.03:
            bad = [num_device, num_host, block_size]
            bad[rng.randrange(3)] = -1
            self.call("BlockPool", lambda: BlockPool(bad[0], bad[1], block_size=bad[2]), bad)
        self.lines.append(
            f"BlockPool({num_device}, {num_host}, block_size={block_size}, "
            f"enable_prefix_caching={caching}, tiers={tiers is not None})"
        )
        self.pool = BlockPool(
            num_device,
            num_host,
            block_size=block_size,
            enable_prefix_caching=caching,
            tiers=tiers,
        )
        self.block_size = block_size

    # ---- recording ------------------------------------------------------------------------

    def call(self, name: str, fn: Callable[[], object], args: object = ()) -> object:
        """Run one call and record its result or the exception it raised."""
        try:
            result = fn()
        except AssertionError:
            raise
        except Exception as exc:
            self.lines.append(f"{name}{show(args)} raised {type(exc).__name__}: {exc}")
            return None
        self.lines.append(f"{name}{show(args)} -> {show(result)}")
        return result

    def pool_call(self, name: str, *args: object, **kwargs: object) -> object:
        method = getattr(self.pool, name)
        shown = (*args, *(f"{k}={show(v)}" for k, v in kwargs.items()))
        return self.call(name, lambda: method(*args, **kwargs), shown)

    # ---- choosing arguments ---------------------------------------------------------------

    def seqs(self, where: Location | None = None) -> list[Any]:
        return sorted(
            (s for s, t in self.pool.tables().items() if where is None or t.location is where),
            key=_sort_key,
        )

    def some_seq(self, where: Location | None = Location.DEVICE) -> object:
        """A sequence in ``where`` mostly; sometimes any sequence or one that does not exist."""
        rng = self.rng
        r = rng.random()
        chosen = self.seqs(where) if r < 0.8 else self.seqs() if r < 0.93 else []
        return rng.choice(chosen) if chosen else rng.choice(STRANGERS)

    def new_id(self) -> object:
        self.next_id += 1
        return self.next_id if self.next_id % 2 else f"s{self.next_id}"

    def prompt(self) -> Sequence[int]:
        rng = self.rng
        base = rng.choice(BASES)
        tokens = [
            *base[: rng.randint(0, 14)],
            *(rng.randint(0, 3) for _ in range(rng.randint(0, 5))),
        ]
        if not tokens and rng.random() < 0.7:
            tokens = [rng.randint(0, 3)]
        return tuple(tokens) if rng.random() < 0.6 else tokens

    def tokens(self) -> list[int]:
        rng = self.rng
        r = rng.random()
        if r < 0.1:
            return [PLACEHOLDER_TOKEN]
        if r < 0.13:
            return [rng.randint(0, 3), PLACEHOLDER_TOKEN]
        if r < 0.15:
            return []
        return [rng.randint(0, 3) for _ in range(rng.choice((1, 1, 1, 2, 3, 5)))]

    def group(self, where: Location) -> list[Any]:
        rng = self.rng
        r = rng.random()
        pool = self.seqs(where)
        if r < 0.05:
            return []
        if r < 0.12:
            return [self.some_seq(None)]
        if not pool:
            return [rng.choice(STRANGERS)]
        group = rng.sample(pool, rng.randint(1, min(3, len(pool))))
        if r < 0.16:
            group.append(group[0])
        return group

    def token_count(self, seq_id: object) -> int:
        table = self.pool.tables().get(seq_id)  # type: ignore[call-overload]
        return 0 if table is None else table.num_tokens

    # ---- the operations -------------------------------------------------------------------

    def op_allocate(self) -> None:
        rng = self.rng
        seq_id = self.new_id() if rng.random() < 0.93 else self.some_seq(None)
        prompt = self.prompt()
        kwargs: dict[str, object] = {}
        if rng.random() < 0.5:
            kwargs["extra_key"] = rng.choice(EXTRA_KEYS)
        if rng.random() < 0.3:
            kwargs["max_new_tokens"] = rng.choice((0, 1, 2, 3, 5, 8))
        if rng.random() < 0.1:
            kwargs["read_cache"] = False
        if rng.random() < 0.3:
            query = {k: v for k, v in kwargs.items() if k != "read_cache"}
            self.pool_call(rng.choice(("num_blocks_to_allocate", "can_allocate")), prompt, **query)
        if self.pool_call("allocate", seq_id, prompt, **kwargs) is not None:
            extra_key = kwargs.get("extra_key")
            self.prompts.append((prompt, extra_key if isinstance(extra_key, str) else None))

    def op_append(self) -> None:
        rng = self.rng
        seq_id = self.some_seq()
        tokens = self.tokens()
        n = len(tokens)
        num_spec = rng.choice((0, 0, 0, 0, max(n - 1, 0), n, n + 1, -1))
        if rng.random() < 0.3:
            self.pool_call(rng.choice(("num_blocks_to_append", "can_append")), seq_id, max(n, 1))
        if num_spec:
            self.pool_call("append", seq_id, tokens, num_speculative_tokens=num_spec)
        else:
            self.pool_call("append", seq_id, tokens)

    def op_append_token(self) -> None:
        token = PLACEHOLDER_TOKEN if self.rng.random() < 0.1 else self.rng.randint(0, 3)
        self.pool_call("append_token", self.some_seq(), token)

    def op_set_placeholder(self) -> None:
        rng = self.rng
        late = [s for s in self.seqs(Location.DEVICE) if rng.random() < 0.5]
        seq_id = late[0] if late else self.some_seq()
        self.pool_call("set_placeholder", seq_id, rng.choice((0, 1, 2, 3, -2)))

    def op_fork(self) -> None:
        rng = self.rng
        child = self.new_id() if rng.random() < 0.9 else self.some_seq(None)
        self.pool_call("fork", self.some_seq(), child)

    def op_free(self) -> None:
        self.pool_call("free", self.some_seq(None))

    def op_truncate(self) -> None:
        rng = self.rng
        seq_id = self.some_seq()
        length = self.token_count(seq_id)
        num = rng.choice((length, length - 1, length - 2, rng.randint(0, length + 1)))
        if rng.random() < 0.4 and self.pool.has_seq(seq_id):
            self.pool_call("has_speculative_tokens", seq_id)
        self.pool_call("truncate", seq_id, num)

    def op_swap_out(self) -> None:
        group = self.group(Location.DEVICE)
        if self.rng.random() < 0.3:
            self.pool_call("can_swap_out", group)
        self.record_swap(self.pool_call("swap_out", group))

    def op_swap_in(self) -> None:
        group = self.group(Location.HOST)
        if self.rng.random() < 0.3:
            self.pool_call("num_blocks_to_swap", group, self.rng.choice(list(SwapDirection)))
        self.record_swap(self.pool_call("swap_in", group))

    def record_swap(self, plan: object) -> None:
        if plan is not None:
            self.swap_ids.append(plan.swap_id)  # type: ignore[attr-defined]

    def op_complete_swap(self) -> None:
        rng = self.rng
        if self.swap_ids and rng.random() < 0.9:
            swap_id = self.swap_ids.pop(rng.randrange(len(self.swap_ids)))
        else:
            swap_id = rng.choice((1000, -1))
        if rng.random() < 0.5:
            self.pool_call("num_blocks_freed_by_swap", swap_id)
        self.pool_call("complete_swap", swap_id)

    def op_pin(self) -> None:
        rng = self.rng
        if self.prompts and rng.random() < 0.7:
            prompt, extra_key = rng.choice(self.prompts)
        else:
            prompt, extra_key = self.prompt(), rng.choice(EXTRA_KEYS)
        pin = self.pool_call("pin_prefix", prompt, extra_key)
        if pin is not None:
            self.pin_ids.append(pin.pin_id)  # type: ignore[attr-defined]

    def op_unpin(self) -> None:
        rng = self.rng
        if self.pin_ids and rng.random() < 0.85:
            pin_id = self.pin_ids.pop(rng.randrange(len(self.pin_ids)))
        else:
            pin_id = rng.choice((1000, -1))
        self.pool_call("unpin_prefix", pin_id)

    def op_evict(self) -> None:
        self.pool_call("evict_cached_blocks", self.rng.choice((None, 0, 1, 2, 5)))

    def op_tiers(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.45:
            ops = self.pool_call("drain_tier_ops")
            self.spills.extend(op.block_hash for op in ops or () if isinstance(op, SpillOp))
        elif r < 0.9:
            failed = [self.spills.pop(0)] if self.spills and rng.random() < 0.5 else []
            self.pool_call("begin_tier_txn", failed)
        else:
            self.pool_call("persist_tiers")

    def op_query(self) -> None:
        rng = self.rng
        name = rng.choice(QUERIES)
        if name in ("num_free_device_blocks", "num_free_host_blocks", "num_blocks_coming"):
            self.call(name, lambda: getattr(self.pool, name))
        elif name in ("tables", "pins", "shared_tails", "statistics"):
            self.pool_call(name)
        elif name == "release_counts":
            self.pool_call(name, self.group(Location.DEVICE))
        elif name == "num_blocks_to_append_all":
            appends = [(s, rng.randint(1, 5)) for s in self.group(Location.DEVICE)]
            self.pool_call(name, appends)
        elif name == "lookup_prefix":
            self.pool_call(name, self.prompt(), rng.choice(EXTRA_KEYS))
        else:
            self.pool_call(name, self.some_seq(None))

    def run(self, num_ops: int) -> list[str]:
        rng = self.rng
        names = [name for name, _ in OPS]
        weights = [weight for _, weight in OPS]
        for _ in range(num_ops):
            name = rng.choices(names, weights)[0]
            if not self.pool.tables() and rng.random() < 0.7:
                name = "allocate"  # most calls need a sequence
            getattr(self, f"op_{name}")()
            try:
                self.pool.check_invariants()
            except AssertionError:
                # recorded, and the sequence ends: what a broken pool does next is not behaviour
                self.lines.append("check_invariants() raised AssertionError")
                break
        pool = self.pool
        self.lines.append(f"final statistics -> {show(pool.statistics())}")
        self.lines.append(f"final tables -> {show(pool.tables())}")
        self.lines.append(f"final pins -> {show(pool.pins())}")
        self.lines.append(f"final device -> {show(pool.device.state())}")
        self.lines.append(f"final host -> {show(pool.host.state())}")
        if pool.tiers is not None:
            self.lines.append(f"final tiers -> {show(pool.tiers.state())}")
        return self.lines


QUERIES = (
    "num_free_device_blocks",
    "num_free_host_blocks",
    "num_blocks_coming",
    "tables",
    "pins",
    "shared_tails",
    "statistics",
    "release_counts",
    "num_blocks_to_append_all",
    "lookup_prefix",
    "has_seq",
    "block_ids",
    "num_tokens",
    "location",
    "has_speculative_tokens",
)
OPS = (
    ("allocate", 14),
    ("append", 18),
    ("append_token", 8),
    ("set_placeholder", 4),
    ("fork", 6),
    ("free", 8),
    ("truncate", 7),
    ("swap_out", 5),
    ("swap_in", 4),
    ("complete_swap", 6),
    ("pin", 3),
    ("unpin", 2),
    ("evict", 2),
    ("tiers", 3),
    ("query", 10),
)


def trace(seed: int) -> list[str]:
    """The record of one seed (its length drawn from the seed too)."""
    num_ops = random.Random(-seed - 1).randint(30, 90)
    return Run(seed).run(num_ops)


# The pool's vocabulary at ``pool_commit`` for what it names differently now: a record is
# digested in those words, so a renamed method or message compares equal and any other change
# of behaviour still shows.
RENAMED = (
    ("set_placeholder", "set_late_token"),
    ("a placeholder", "a late token"),
    ("no placeholder", "no late token"),
)


def digest(lines: Sequence[str]) -> str:
    text = "\n".join(lines)
    for new, old in RENAMED:
        text = text.replace(new, old)
    return hashlib.sha256(text.encode()).hexdigest()


def _old_trace(seed: int, commit: str) -> list[str] | None:
    """The seed's record from the pool at ``commit`` (its sources extracted by git), or None."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "src"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(tmp, filter="data")
            env = {**os.environ, "PYTHONPATH": str(Path(tmp) / "src")}
            out = subprocess.run(
                [sys.executable, __file__, "--trace", str(seed)],
                capture_output=True,
                check=True,
                text=True,
                env=env,
                timeout=120,
            ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()


def _first_difference(seed: int, commit: str) -> str:
    new = trace(seed)
    old = _old_trace(seed, commit)
    if old is None:
        return f"seed {seed}: (the pool at {commit} could not be run; replay with --trace)"
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return f"seed {seed}, line {i}:\n  expected {a}\n  got      {b}"
    return f"seed {seed}: the records differ in length ({len(old)} expected, {len(new)} got)"


def test_pool_reproduces_the_recorded_behaviour() -> None:
    golden = json.loads(GOLDEN.read_text())
    expected: list[str] = golden["digests"]
    assert len(expected) == NUM_SEEDS
    mismatched = [seed for seed in range(NUM_SEEDS) if digest(trace(seed)) != expected[seed]]
    if mismatched:
        detail = _first_difference(mismatched[0], golden["pool_commit"])
        raise AssertionError(
            f"{len(mismatched)} of {NUM_SEEDS} seeds differ (first: {mismatched[:10]});\n{detail}"
        )


def _write_golden() -> None:
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, check=True, text=True
    ).stdout.strip()
    digests = [digest(trace(seed)) for seed in range(NUM_SEEDS)]
    GOLDEN.write_text(json.dumps({"pool_commit": commit, "digests": digests}, indent=0) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trace"]:
        print("\n".join(trace(int(sys.argv[2]))))
    elif sys.argv[1:] == ["--golden"]:
        _write_golden()
    else:
        sys.exit(__doc__)
