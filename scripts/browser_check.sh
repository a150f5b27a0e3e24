#!/usr/bin/env bash
# The live block map in a real browser: starts `asyncpaged serve` on the built-in model with a
# small KV cache (so that concurrent requests fill it, share blocks and swap), keeps a few long
# streaming requests running, loads /blocks in headless Chromium, saves a screenshot to
# docs/images/block_map.png (or $1) and checks that the page drew blocks: the DOM has cells in
# used / cached states and the page polled more than once, and the PNG is not blank.
#   bash scripts/browser_check.sh [screenshot.png]
# Installs Debian's chromium when it is missing (apt-get; needs root). About a minute.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SHOT="${1:-docs/images/block_map.png}"
PY=.venv/bin/python
PORT="${PORT:-$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
BASE="http://127.0.0.1:$PORT"
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

if ! command -v chromium >/dev/null; then
  echo "installing chromium (apt-get)"
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi

echo "starting asyncpaged serve on $BASE"
OMP_NUM_THREADS=1 .venv/bin/asyncpaged serve --port "$PORT" --num-device-blocks 160 \
  --swap-space-mib 2 --preemption-mode swap --max-num-seqs 12 2>"$WORK/serve.log" &
PIDS+=($!)
for _ in $(seq 300); do
  curl -sf "$BASE/health" >/dev/null && break
  sleep 0.2
done
curl -sf "$BASE/health" >/dev/null || { cat "$WORK/serve.log"; exit 1; }

echo "firing concurrent long requests"
"$PY" - "$BASE" >"$WORK/load.log" 2>&1 <<'PYEOF' &
"""Keep about eight long streaming requests in flight (n = 2 samples share their prompt)."""
import sys
import threading
import time

import httpx

BASE = sys.argv[1]
PROMPTS = ["The with statement is used to wrap the execution of a block with methods",
           "A class definition defines a class object and its attributes and methods",
           "The import statement finds a module, loads and initializes it if necessary"]


def worker(i: int) -> None:
    body = {"prompt": PROMPTS[i % 3], "max_tokens": 400, "n": 1 + i % 2, "temperature": 0.8,
            "seed": i, "ignore_eos": True, "stream": True}
    while True:
        with httpx.stream("POST", BASE + "/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                pass
        body["seed"] += 100


for i in range(8):
    threading.Thread(target=worker, args=(i,), daemon=True).start()
    time.sleep(0.3)
time.sleep(600)
PYEOF
PIDS+=($!)

for _ in $(seq 100); do
  used="$(curl -sf "$BASE/blocks.json" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["device"]["counts"]["used"])')"
  [[ "$used" -gt 40 ]] && break
  sleep 0.2
done
echo "device blocks in use: $used"
for _ in $(seq 100); do  # let the cache fill up until a request is on the host
  host="$(curl -sf "$BASE/blocks.json" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["host"]["counts"]["used"])')"
  [[ "$host" -gt 0 ]] && break
  sleep 0.2
done
echo "host blocks in use: $host"

CHROME=(chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run
  --disable-background-networking --disable-component-update --disable-sync
  --hide-scrollbars --window-size=1400,400 --virtual-time-budget=4000)
mkdir -p "$(dirname "$SHOT")"
timeout 120 "${CHROME[@]}" --user-data-dir="$(mktemp -d -p "$WORK")" --screenshot="$SHOT" \
  "$BASE/blocks" 2>"$WORK/chrome.log" || { cat "$WORK/chrome.log"; exit 1; }
timeout 120 "${CHROME[@]}" --user-data-dir="$(mktemp -d -p "$WORK")" --dump-dom "$BASE/blocks" \
  >"$WORK/dom.html" 2>>"$WORK/chrome.log" || { cat "$WORK/chrome.log"; exit 1; }

"$PY" - "$WORK/dom.html" "$SHOT" <<'PYEOF'
"""The DOM has block cells with non-free states and the page updated; the PNG is not blank."""
import re
import sys

from PIL import Image

dom = open(sys.argv[1], encoding="utf-8").read()
states = re.findall(r'class="blk [^"]*" data-block="\d+" data-state="(\w+)"', dom)
states += re.findall(r'data-state="(\w+)"[^>]*class="blk', dom)
counts = {s: states.count(s) for s in sorted(set(states))}
updates = re.search(r'data-updates="(\d+)"', dom)
print("cells by state:", counts, "| page updates:", updates.group(1) if updates else None)
assert sum(counts.values()) >= 160, "the grid has fewer cells than device blocks"
assert counts.get("used", 0) > 0, "no used block drawn"
assert updates is not None and int(updates.group(1)) >= 2, "the page did not poll"
image = Image.open(sys.argv[2]).convert("RGB")
colours = image.getcolors(maxcolors=1 << 20) or []
print(f"screenshot {image.size[0]}x{image.size[1]}, {len(colours)} colours")
assert len(colours) > 50, "the screenshot looks blank"
PYEOF
grep -q '"swap_outs"' <(curl -sf "$BASE/blocks.json") && echo "stats: $(curl -sf "$BASE/blocks.json" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["stats"])')"
echo "ok: $SHOT"
