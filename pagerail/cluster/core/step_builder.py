"""Turns the scheduler's decision into the StepBatch message: new requests in full, known ones as deltas."""

from __future__ import annotations

from pagerail.cluster.core.scheduler_output import SchedulerOutput
from pagerail.common.sampling_wire import sampling_to_step
from pagerail.proto import step_pb2


class StepMessageBuilder:
    """Remembers how many tokens each worker-side request already has, so each step sends only deltas.

    The ranks append every token they sample to their own copy of the request, so a known request is sent only
    what the head has and the ranks do not (an input chunk); its sampled tokens never travel back. That is what
    lets step N+1 be built and sent before step N's tokens reach the head.
    """

    def __init__(self) -> None:
        self._known_tokens: dict[int, int] = {}
        # Handles the workers may still hold state for although the head forgot them; sent as finished.
        self._forget: set[int] = set()
        self._next_step_id = 0

    def reset(self) -> None:
        """Forget every request after a failed step. The workers are usually fresh, but a group that was not
        restarted (the head gave up on its requests) still holds their state: tell it to drop them next step."""
        self._forget.update(self._known_tokens)
        self._known_tokens.clear()

    def build(self, out: SchedulerOutput) -> step_pb2.StepBatch:
        batch = step_pb2.StepBatch(step_id=self._next_step_id)
        self._next_step_id += 1
        known = self._known_tokens
        if self._forget:
            # Before any new request in this batch: a requeued request keeps its handle and is sent anew.
            batch.finished.extend(sorted(self._forget))
            self._forget.clear()
        for handle in out.finished_handles:
            if known.pop(handle, None) is not None:
                batch.finished.append(handle)
        for request in out.preempted:
            if request.handle in known:
                batch.preempted.append(request.handle)
        for block_id, slot, now in out.kv_offloads:
            batch.offload_blocks.append(block_id)
            batch.offload_slots.append(slot)
            batch.offload_now.append(now)
        for slot, block_id in out.kv_loads:
            batch.load_slots.append(slot)
            batch.load_blocks.append(block_id)
        decode_handles: list[int] = []
        for item in out.scheduled:
            request = item.request
            handle = request.handle
            num_known = known.get(handle)
            if (
                num_known is not None
                and (
                    item.plain
                    or (
                        item.num_tokens == 1
                        and not (item.skip_sampling or item.new_block_ids or item.resync or item.lookahead)
                    )
                )
                and len(request.all_token_ids) <= num_known
            ):
                # The common decode: nothing but "compute your next token" — sent as a bare handle.
                decode_handles.append(handle)
                known[handle] = num_known + 1
                continue
            if num_known is None:
                batch.new_requests.append(
                    step_pb2.NewRequest(
                        handle=request.handle,
                        request_id=request.request_id,
                        token_ids=request.all_token_ids,
                        num_prompt_tokens=request.num_prompt_tokens,
                        sampling=sampling_to_step(request.sampling_params, request.stop_token_ids),
                        block_ids=item.new_block_ids,
                        num_computed_tokens=request.num_computed_tokens,
                        num_scheduled_tokens=item.num_tokens,
                        skip_sampling=item.skip_sampling,
                        pooling=request.envelope.pooling or "",
                    )
                )
                lora = request.envelope.lora
                if lora is not None:
                    new = batch.new_requests[-1]
                    new.lora_id, new.lora_path = lora.lora_int_id, lora.lora_path
            else:
                delta = batch.cached_requests.add()
                delta.handle = request.handle
                if request.num_tokens > num_known:
                    delta.new_token_ids.extend(request.all_token_ids[num_known:])
                    if not request.output_token_ids:
                        delta.num_prompt_tokens = request.num_prompt_tokens
                if item.new_block_ids:
                    delta.new_block_ids.extend(item.new_block_ids)
                delta.num_scheduled_tokens = item.num_tokens
                if item.resync:
                    delta.resumed = True
                    delta.num_computed_tokens = request.num_computed_tokens
                if item.skip_sampling:
                    delta.skip_sampling = True
                if item.lookahead:
                    delta.num_lookahead_tokens = item.lookahead
            # The ranks will hold this step's sampled token once it ran.
            known[request.handle] = max(num_known or 0, request.num_tokens) + (0 if item.skip_sampling else 1)
        if decode_handles:
            batch.decode_handles.extend(decode_handles)
        return batch

    def ranks_appended(self, handle: int, extra: int) -> None:
        """A speculating step left the ranks `extra` tokens beyond the one a step is counted for."""
        if handle in self._known_tokens:
            self._known_tokens[handle] += extra
