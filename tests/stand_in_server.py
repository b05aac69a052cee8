"""A stand-in for `pagerail serve` in its own process: the OpenAI API over the fake engine, with step-duration
metrics that grow by a known amount per generated token, for benchmark tests that start servers as children.

`python -m tests.stand_in_server --model DIR --port P [other pagerail serve flags, ignored]`
"""

from __future__ import annotations

import argparse
import sys

import uvicorn
from transformers import AutoTokenizer

from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.fake_engine import FakeEngineClient

# Each generated token counts as one step: 2 ms forward, 0.5 ms other rank work, 0.1 ms scheduling.
PHASE_SECONDS = {"schedule": 0.0001, "dispatch": 0.0, "forward": 0.002, "sample": 0.0005}


class SteppingEngine(FakeEngineClient):
    """The fake engine, counting the tokens it produced and exposing them as pagerail step histograms."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tokens = 0

    async def generate(self, *args, **kwargs):
        async for delta in super().generate(*args, **kwargs):
            self.tokens += len(delta.token_ids)
            yield delta

    async def metrics(self) -> str:
        name = "pagerail_step_duration_seconds"
        lines = [f"# HELP {name} Engine step time by phase.", f"# TYPE {name} histogram"]
        for phase, seconds in PHASE_SECONDS.items():
            labels = f'model_name="stand-in",phase="{phase}"'
            lines += [
                f'{name}_bucket{{{labels},le="+Inf"}} {self.tokens}',
                f"{name}_count{{{labels}}} {self.tokens}",
                f"{name}_sum{{{labels}}} {seconds * self.tokens}",
            ]
        lines += [
            "# HELP pagerail_num_preemptions_total Requests preempted.",
            "# TYPE pagerail_num_preemptions_total counter",
            'pagerail_num_preemptions_total{model_name="stand-in"} 0.0',
        ]
        return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="a directory holding the tokenizer")
    args, _ = parser.parse_known_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = SteppingEngine(model_name="stand-in", max_model_len=4096, vocab_size=len(tokenizer), step_delay_s=0.001)
    state = ServerState(engine, tokenizer, FrontendSettings("stand-in"))
    uvicorn.run(create_app(state), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
