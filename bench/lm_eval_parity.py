"""lm-evaluation-harness through `pagerail serve` against its own Hugging Face backend, on the same weights.

A multiple-choice task of our own (local JSON data: capitals and everyday facts, 30 questions, 4 choices each) is
scored twice by lm-eval: with `local-completions` against a running `pagerail serve` (each choice one
`echo` + `logprobs` completion, as lm-eval sends it), and with its `hf` backend loading the same safetensors
directory. The report gives, per choice, the difference of the two loglikelihoods, whether each agrees on
is_greedy, and both accuracies.

lm-eval is not a dependency of pagerail: it runs from its own interpreter (--lm-eval-python or $LM_EVAL_PYTHON),
e.g. a venv with `pip install "lm-eval[api,hf]" torch`.

    LM_EVAL_PYTHON=/path/to/venv/bin/python .venv/bin/python bench/lm_eval_parity.py [--out DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

from pagerail.cluster.bench.server_process import ServerProcess, free_port, pagerail_serve_command
from pagerail.common.model_source import resolve_model_dir

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Russia", "Moscow"), ("Canada", "Ottawa"), ("Greece", "Athens"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("Ireland", "Dublin"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Cuba", "Havana"),
    ("Finland", "Helsinki"),
]  # fmt: skip
FACTS = [
    ("Water freezes at zero degrees", "Celsius", ["Fahrenheit", "Kelvin", "meters"]),
    ("The color of the clear sky is", "blue", ["green", "red", "purple"]),
    ("Two plus two equals", "four", ["five", "seven", "ten"]),
    ("The largest ocean on Earth is the", "Pacific", ["Atlantic", "Indian", "Arctic"]),
    ("Bees make", "honey", ["milk", "bread", "glass"]),
    ("The opposite of hot is", "cold", ["tall", "fast", "loud"]),
    ("A week has seven", "days", ["years", "cats", "miles"]),
    ("The sun rises in the", "east", ["west", "north", "south"]),
    ("Fish live in", "water", ["trees", "sand", "fire"]),
    ("Snow is usually", "white", ["black", "orange", "pink"]),
]
TASK = "pagerail_mc"


def questions() -> list[dict]:
    """Each question with its right answer rotated to a different place, so position says nothing."""
    cities = [city for _, city in CAPITALS]
    items = [
        (f"The capital of {country} is", city, [cities[(i + k) % len(cities)] for k in (3, 7, 11)])
        for i, (country, city) in enumerate(CAPITALS)
    ]
    items += FACTS
    docs = []
    for i, (question, answer, wrong) in enumerate(items):
        choices = [answer, *wrong]
        choices = choices[i % 4 :] + choices[: i % 4]
        docs.append({"question": question, "choices": choices, "answer": choices.index(answer)})
    return docs


def write_task(out: Path) -> Path:
    """The task's data and YAML under `out`; returns the folder to pass as lm-eval's --include_path."""
    folder = out / "task"
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in questions()))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\ntarget_delimiter: " "\nmetric_list:\n  - metric: acc\n'
    )
    return folder


def lm_eval(python: str, model: str, model_args: str, task_dir: Path, out: Path, *extra: str) -> None:
    command = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK]
    command += ["--include_path", str(task_dir), "--log_samples", "--output_path", str(out), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval --model {model} failed:\n{done.stderr[-3000:]}")


def samples(out: Path) -> dict[int, tuple[list[float], list[str], float]]:
    """doc id → (each choice's loglikelihood, each choice's is_greedy, the doc's accuracy)."""
    (path,) = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    found = {}
    for line in Path(path).read_text().splitlines():
        sample = json.loads(line)
        scores = sample["filtered_resps"]
        found[sample["doc_id"]] = ([float(s[0]) for s in scores], [str(s[1]) for s in scores], sample["acc"])
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval-python", default=os.environ.get("LM_EVAL_PYTHON"), help="lm-eval's interpreter")
    parser.add_argument("--model", default=None, help="a safetensors directory (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/lm-eval-parity"))
    args = parser.parse_args()
    if not args.lm_eval_python:
        parser.error("lm-eval needs its interpreter: --lm-eval-python PATH or LM_EVAL_PYTHON=PATH")
    model = Path(args.model) if args.model else resolve_model_dir(None)
    args.out.mkdir(parents=True, exist_ok=True)
    task_dir = write_task(args.out)

    port = free_port()
    flags = ["--served-model-name", "served", "--device", "cpu", "--dtype", "float32"]
    command = pagerail_serve_command(sys.executable, model, port, *flags, "--kv-cache-memory-bytes", str(256 << 20))
    with ServerProcess(command, f"http://127.0.0.1:{port}", args.out / "server.log", ready_timeout_s=600):
        served_args = f"model=served,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={model},"
        served_args += "num_concurrent=4,max_retries=1,tokenized_requests=True"
        lm_eval(args.lm_eval_python, "local-completions", served_args, task_dir, args.out / "served")
    lm_eval(
        args.lm_eval_python, "hf", f"pretrained={model},dtype=float32", task_dir, args.out / "hf", "--device", "cpu"
    )

    served, reference = samples(args.out / "served"), samples(args.out / "hf")
    diffs = [abs(a - b) for doc in served for a, b in zip(served[doc][0], reference[doc][0], strict=True)]
    report = {
        "docs": len(served),
        "choices": len(diffs),
        "max_abs_diff_nats": max(diffs),
        "mean_abs_diff_nats": sum(diffs) / len(diffs),
        "is_greedy_agree": all(served[doc][1] == reference[doc][1] for doc in served),
        "accuracy_served": sum(s[2] for s in served.values()) / len(served),
        "accuracy_hf": sum(s[2] for s in reference.values()) / len(reference),
        "same_answer_per_doc": all(served[doc][2] == reference[doc][2] for doc in served),
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["max_abs_diff_nats"] <= 0.05 and report["same_answer_per_doc"] else 1


if __name__ == "__main__":
    sys.exit(main())
