"""A model's special token ids as its own tokenizer files name them, read without loading the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path


def tokenizer_special_id(model_dir: Path, name: str) -> int | None:
    """The id of the tokenizer's `name` token ("eos_token", "sep_token"), from tokenizer_config.json looked up in
    tokenizer.json; None when the model ships no such tokenizer or names no such token."""
    config_file, tokenizer_file = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not config_file.exists() or not tokenizer_file.exists():
        return None
    token = json.loads(config_file.read_text()).get(name)
    if isinstance(token, dict):  # the AddedToken form
        token = token.get("content")
    if not isinstance(token, str):
        return None
    tokenizer = json.loads(tokenizer_file.read_text())
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    token_id = tokenizer.get("model", {}).get("vocab", {}).get(token)
    return int(token_id) if isinstance(token_id, int) else None
