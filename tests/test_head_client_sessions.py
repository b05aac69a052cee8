"""HeadEngineClient sends a session's next chunk only once the head admitted the session: the head runs its actor
calls as coroutines, so a chunk sent earlier could reach its engine first, find no session and be lost."""

from __future__ import annotations

import asyncio

from pagerail import SamplingParams
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.distributed.head_client import HeadEngineClient


class _Method:
    def __init__(self, call) -> None:
        self.remote = call


class _Head:
    """Stands in for a head actor handle: `.remote()` records the call at once, as Ray submits it then."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.admit = asyncio.Event()
        self.submit_many = _Method(self._submit_many)
        self.append_input = _Method(self._append_input)
        self.outputs = _Method(self._outputs)
        self.abort = _Method(lambda *args: None)

    def _submit_many(self, submissions: list[tuple[str, EngineRequest]]):
        self.events.extend(f"submit {request.request_id}" for _, request in submissions)

        async def admitted() -> list[None]:
            await self.admit.wait()
            self.events.extend(f"admitted {request.request_id}" for _, request in submissions)
            return [None] * len(submissions)

        return admitted()

    def _append_input(self, request_id: str, token_ids: list[int], final: bool):
        self.events.append(f"append {request_id} {token_ids} final={final}")

        async def done() -> None:
            return None

        return done()

    async def _outputs(self, channel_id: str):
        await asyncio.Event().wait()  # no deltas in this test
        yield


def test_a_chunk_sent_before_the_session_is_admitted_waits_for_the_admission():
    async def scenario() -> list[str]:
        head = _Head()
        client = HeadEngineClient(head, "tiny", {"max_model_len": 64, "vocab_size": 100, "eos_token_ids": []})
        request = EngineRequest("s1", [1, 2, 3], SamplingParams(max_tokens=4), final=False)
        stream = client.generate(request)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the submit call is out, not yet answered
        append = asyncio.ensure_future(client.append_input("s1", [4, 5], True))
        for _ in range(5):
            await asyncio.sleep(0)
        before_admission = list(head.events)
        head.admit.set()
        await asyncio.wait_for(append, 5)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        return before_admission, head.events

    before_admission, events = asyncio.run(scenario())
    assert before_admission == ["submit s1"]  # the chunk was held back while the submit was unanswered
    assert events[:3] == ["submit s1", "admitted s1", "append s1 [4, 5] final=True"]


def test_a_chunk_of_an_admitted_session_goes_out_at_once():
    async def scenario() -> list[str]:
        head = _Head()
        head.admit.set()
        client = HeadEngineClient(head, "tiny", {"max_model_len": 64, "vocab_size": 100, "eos_token_ids": []})
        stream = client.generate(EngineRequest("s2", [1, 2], SamplingParams(max_tokens=4), final=False))
        first = asyncio.ensure_future(anext(stream))
        for _ in range(5):
            await asyncio.sleep(0)
        await asyncio.wait_for(client.append_input("s2", [3], False), 5)
        await asyncio.wait_for(client.append_input("other", [9], True), 5)  # not this client's: passed on as is
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        return head.events

    assert asyncio.run(scenario())[:4] == [
        "submit s2",
        "admitted s2",
        "append s2 [3] final=False",
        "append other [9] final=True",
    ]


def test_requests_submitted_in_one_turn_go_in_one_call_and_a_refusal_reaches_only_its_caller():
    class _RefusingHead(_Head):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[list[str]] = []
            self.admit.set()

        def _submit_many(self, submissions):
            self.calls.append([request.request_id for _, request in submissions])

            async def answered() -> list:
                return [ValueError("bad one") if r.request_id == "bad" else None for _, r in submissions]

            return answered()

    async def scenario():
        head = _RefusingHead()
        client = HeadEngineClient(head, "tiny", {"max_model_len": 64, "vocab_size": 100, "eos_token_ids": []})
        streams = [client.generate(EngineRequest(i, [1, 2], SamplingParams(max_tokens=2))) for i in ("ok", "bad")]
        firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        for _ in range(5):
            await asyncio.sleep(0)
        refused = firsts[1].exception() if firsts[1].done() else None
        still_waiting = not firsts[0].done()  # admitted: waits for its deltas, which this head never sends
        firsts[0].cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        return head.calls, refused, still_waiting

    calls, refused, still_waiting = asyncio.run(scenario())
    assert calls == [["ok", "bad"]]  # one actor call for both
    assert isinstance(refused, ValueError) and still_waiting
