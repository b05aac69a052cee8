"""Time per token of streaming detokenization and stop-string matching: the tokenizer's `decode` against the
per-token decoder (`cluster/frontend/token_text.py`), both in this process, alternating, on the same tokens.

Usage:
  .venv/bin/python bench/detokenize.py [--tokens 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from pagerail.cluster.frontend.detokenizer import IncrementalDetokenizer
from pagerail.common.model_source import resolve_model_dir


def _as_given(tokenizer, through_tokenizer: bool):
    """The tokenizer itself, or a stand-in offering only its `decode`, which the per-token decoder must call."""
    return SimpleNamespace(decode=tokenizer.decode) if through_tokenizer else tokenizer


def stream_seconds(tokenizer, ids: list[int], through_tokenizer: bool) -> tuple[float, str]:
    """Seconds per token to stream `ids` one at a time, and the text streamed."""
    detokenizer = IncrementalDetokenizer(_as_given(tokenizer, through_tokenizer), ids[:5])
    started = time.perf_counter()
    pieces = [detokenizer.add([token]) for token in ids]
    pieces.append(detokenizer.flush())
    return (time.perf_counter() - started) / len(ids), "".join(pieces)


def match_seconds(tokenizer, ids: list[int], through_tokenizer: bool) -> float:
    """Seconds per token to watch `ids` for a stop string that never comes."""
    matcher = IncrementalDetokenizer(_as_given(tokenizer, through_tokenizer), ids[:5], stop=["\x00never\x00"])
    started = time.perf_counter()
    for token in ids:
        matcher.add([token])
    return (time.perf_counter() - started) / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000, help="tokens of this repository's README to stream")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tokenizer.encode(text)[: args.tokens]
    print(f"{len(ids)} tokens of README.md, embedded tokenizer; µs per token")
    print("round  stream: decode  per-token  ratio  stop strings: decode  per-token  ratio")
    for round_number in range(1, args.rounds + 1):
        slow, slow_text = stream_seconds(tokenizer, ids, through_tokenizer=True)
        fast, fast_text = stream_seconds(tokenizer, ids, through_tokenizer=False)
        if slow_text != fast_text:
            raise SystemExit("the two decoders streamed different text")
        slow_match, fast_match = match_seconds(tokenizer, ids, True), match_seconds(tokenizer, ids, False)
        print(
            f"{round_number:5d}  {slow * 1e6:14.2f}  {fast * 1e6:9.2f}  {slow / fast:4.2f}x"
            f"  {slow_match * 1e6:20.2f}  {fast_match * 1e6:9.2f}  {slow_match / fast_match:4.2f}x"
        )


if __name__ == "__main__":
    main()
