"""Time per streamed event of writing a completions and a chat chunk: json.dumps of the whole payload, as the
routes wrote it before, against the per-response template (`cluster/frontend/sse_events.py`), alternating in
this process, on the same texts.

Usage:
  .venv/bin/python bench/sse_events.py [--events 50000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagerail.cluster.frontend.sse_events import ChunkEvents

_ENVELOPE = ("cmpl-3f2a9c0d6b8e4f1a9d7c5b3e1f0a2c4d", "text_completion", 1764633600, "SmolLM2-135M-Instruct")


def _dumps(choice: dict) -> str:
    id, object, created, model = _ENVELOPE
    payload = {"id": id, "object": object, "created": created, "model": model, "choices": [choice]}
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def completions_seconds(texts: list[str], templated: bool) -> tuple[float, list[str]]:
    chunks = ChunkEvents(*_ENVELOPE)
    started = time.perf_counter()
    if templated:
        out = [chunks.text_choice(0, text, None, None) for text in texts]
    else:
        out = [_dumps({"index": 0, "text": text, "logprobs": None, "finish_reason": None}) for text in texts]
    return (time.perf_counter() - started) / len(texts), out


def chat_seconds(texts: list[str], templated: bool) -> tuple[float, list[str]]:
    chunks = ChunkEvents(*_ENVELOPE)
    started = time.perf_counter()
    if templated:
        out = [chunks.delta_choice(0, {"content": text}, None, None) for text in texts]
    else:
        out = [
            _dumps({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}) for text in texts
        ]
    return (time.perf_counter() - started) / len(texts), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50000, help="events, one per word of this repository's README")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    words = (Path(__file__).resolve().parents[1] / "README.md").read_text().split(" ")
    texts = [" " + words[i % len(words)] for i in range(args.events)]
    print(f"{len(texts)} events, one README word each; µs per event")
    print("round  completions: json.dumps  template  ratio  chat: json.dumps  template  ratio")
    for round_number in range(1, args.rounds + 1):
        row = [f"{round_number:5d}"]
        for measure in (completions_seconds, chat_seconds):
            slow, slow_out = measure(texts, templated=False)
            fast, fast_out = measure(texts, templated=True)
            if slow_out != fast_out:
                raise SystemExit("the two writers produced different events")
            row.append(f"{slow * 1e6:10.2f} {fast * 1e6:9.2f} {slow / fast:5.1f}x")
        print("  ".join(row))


if __name__ == "__main__":
    main()
