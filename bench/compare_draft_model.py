"""Draft-model and EAGLE speculation on tiny random models, in one process: output tokens/s of a random Llama target
without speculation, with its own first layers as the draft, with itself as the draft (every draft kept: the upper
bound), and with random EAGLE and EAGLE-3 heads; then of a transparent target of the same shapes (its layers add
nothing, see cluster/bench/random_eagle_heads.py) without speculation and with EAGLE / EAGLE-3 heads built to
reproduce it (every draft kept). Greedy at batch 1, with acceptance figures. Random weights say nothing about real
acceptance; the figures show what the machinery costs and returns at a given acceptance.

Usage:
  .venv/bin/python bench/compare_draft_model.py                 # 8-layer target, 2-layer draft, k=4
  .venv/bin/python bench/compare_draft_model.py --layers 12 --draft-layers 1 --k 3 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagerail import LLM  # noqa: E402
from pagerail.common.sampling_params import SamplingParams  # noqa: E402


def write_models(root: Path, layers: int, draft_layers: int) -> tuple[Path, Path]:
    """A random Llama target, and a draft made of its embedding, first `draft_layers` layers, norm and head."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    from pagerail.cluster.bench.random_checkpoints import save_random_weights

    shape = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4)
    config = LlamaConfig(
        vocab_size=4096, num_hidden_layers=layers, max_position_embeddings=1024, tie_word_embeddings=False, **shape
    )
    target = save_random_weights(config, root / "target", 0, scale=0.05)
    draft = root / "draft"
    draft.mkdir()
    config.num_hidden_layers = draft_layers
    config.save_pretrained(draft)
    tensors = load_file(str(target / "model.safetensors"))
    kept = {
        name: tensor
        for name, tensor in tensors.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < draft_layers
    }
    save_file(kept, str(draft / "model.safetensors"))
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from pagerail.cluster.bench.random_eagle_heads import make_eagle_head, make_transparent

    root = Path(tempfile.mkdtemp(prefix="pagerail-draft-"))
    target, draft = write_models(root, args.layers, args.draft_layers)
    transparent = root / "transparent"
    shutil.copytree(target, transparent)
    make_transparent(transparent)
    prompt = [[5 + (i * 37) % 4000 for i in range(48)]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # name → (target, speculative_config, the run it must match)
    configs = {
        "off": (target, None, "off"),
        f"draft_{args.draft_layers}_layers": (target, {"method": "draft_model", "model": str(draft)}, "off"),
        "draft_is_target": (target, {"method": "draft_model", "model": str(target)}, "off"),
        "eagle_random": (target, {"method": "eagle", "model": str(make_eagle_head(target, root / "e1", False))}, "off"),
        "eagle3_random": (
            target,
            {"method": "eagle3", "model": str(make_eagle_head(target, root / "e3", True))},
            "off",
        ),
        "transparent_off": (transparent, None, "transparent_off"),
        "transparent_eagle_exact": (
            transparent,
            {"method": "eagle", "model": str(make_eagle_head(transparent, root / "x1", False, exact=True))},
            "transparent_off",
        ),
        "transparent_eagle3_exact": (
            transparent,
            {"method": "eagle3", "model": str(make_eagle_head(transparent, root / "x3", True, exact=True))},
            "transparent_off",
        ),
    }
    engines = {}
    for name, (model, speculative, _) in configs.items():
        if speculative is not None:
            speculative = {**speculative, "num_speculative_tokens": args.k, "disable_by_batch_size": 1000}
        engines[name] = LLM(str(model), num_gpu_blocks=512, speculative_config=speculative)
        engines[name].generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    report: dict = {"k": args.k, "layers": args.layers, "draft_layers": args.draft_layers, "engines": {}}
    outputs = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            started = time.perf_counter()
            result = llm.generate(prompt, params)[0].outputs[0].token_ids
            seconds = time.perf_counter() - started
            outputs[name] = list(result)
            row = report["engines"].setdefault(name, {"tok_per_s": []})
            row["tok_per_s"].append(round(len(result) / seconds, 1))
    for name, llm in engines.items():
        policy, row = llm.engine.speculation, report["engines"][name]
        if policy.enabled:
            row["acceptance_rate"] = round(policy.num_accepted_tokens / max(policy.num_draft_tokens, 1), 3)
            row["mean_acceptance_length"] = round(policy.mean_acceptance_length, 2)
        baseline = configs[name][2]
        row["identical_to_off"] = outputs[name] == outputs[baseline]
        row["speedup"] = round(max(row["tok_per_s"]) / max(report["engines"][baseline]["tok_per_s"]), 2)
        llm.shutdown()
    if args.json:
        print(json.dumps(report))
        return
    for name, row in report["engines"].items():
        print(name, row)


if __name__ == "__main__":
    main()
