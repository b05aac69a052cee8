"""Whether a request (or a session's next chunk) could ever be served: context, step budget and cache size."""

from __future__ import annotations

from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.request import Request
from pagerail.common.engine_config import SchedulerConfig


def check_fits(
    request: Request, num_tokens: int, max_model_len: int, config: SchedulerConfig, block_table: BlockTable
) -> None:
    """Refuse a request (or a session's next chunk) of `num_tokens` tokens that could never be served.

    `num_tokens` holds the outputs a resumed request already has; max_tokens counts them too.
    """
    limit = max_model_len
    num_outputs = request.num_output_tokens
    if request.max_tokens is None:
        # Up to the context: the prompt (and resumed outputs) must leave room for at least one output token.
        if num_tokens >= limit:
            resumed = f" with {num_outputs} resumed outputs" if num_outputs else ""
            raise ValueError(
                f"the prompt ({num_tokens} tokens{resumed}) leaves no room for output within max_model_len={limit}"
            )
        total = num_tokens + 1
    else:
        num_tokens -= num_outputs  # the prompt
        total = num_tokens + request.max_tokens
        if total > limit:
            raise ValueError(
                f"prompt ({num_tokens} tokens) + max_tokens ({request.max_tokens}) exceeds max_model_len={limit}"
            )
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill and total > budget:
        # Without chunking a prompt (or a preempted request's recompute) must fit one step's budget.
        raise ValueError(
            f"prompt ({num_tokens} tokens) + max_tokens ({request.max_tokens}) exceeds "
            f"max_num_batched_tokens={budget}, which bounds one unchunked prefill"
        )
    block_size = block_table.block_size
    needed = -(-total // block_size)
    if needed > block_table.num_blocks:
        raise ValueError(
            f"request needs {needed} KV blocks but the whole cache holds {block_table.num_blocks}; "
            f"lower max_tokens or the prompt length"
        )
