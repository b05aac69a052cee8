"""SamplingParams on the head-to-rank wire (step.proto's SamplingParams), both ways, by field name.

The step message names the SamplingParams fields the ranks act on; the head encodes them and each rank decodes
a new request's message back into the same frozen SamplingParams once. Nothing here lists the fields by hand:
they come from the message's descriptor, so a field added to both is carried without a change here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from pagerail.common.sampling_params import SamplingParams
from pagerail.common.structured_outputs import StructuredOutputs
from pagerail.proto import step_pb2

# Step-message fields whose SamplingParams field has another name.
_RENAMED = {"num_logprobs": "logprobs"}
# The output constraint travels as its kind and canonical text (StructuredOutputs.kind / .spec).
_CONSTRAINT = ("constraint_kind", "constraint_spec")
_PARAM_FIELDS = {field.name for field in dataclasses.fields(SamplingParams)}
# (wire name, SamplingParams name, has presence, repeated) of every field but the constraint's; a map field
# (logit_bias) counts as repeated and travels as its SamplingParams pairs.
_WIRE_FIELDS = tuple(
    (field.name, _RENAMED.get(field.name, field.name), field.has_presence, field.is_repeated)
    for field in step_pb2.SamplingParams.DESCRIPTOR.fields
    if field.name not in _CONSTRAINT
)
_MAPS = frozenset(
    field.name
    for field in step_pb2.SamplingParams.DESCRIPTOR.fields
    if field.message_type is not None and field.message_type.GetOptions().map_entry
)
# Repeated messages of token ids (bad_words_token_ids): a tuple of token-id tuples.
_SEQUENCES = frozenset(
    field.name
    for field in step_pb2.SamplingParams.DESCRIPTOR.fields
    if field.message_type is not None and not field.message_type.GetOptions().map_entry
)
# A repeated field whose SamplingParams default is None (allowed_token_ids): empty on the wire means None.
_NONE_WHEN_EMPTY = frozenset(
    field.name for field in dataclasses.fields(SamplingParams) if field.default is None and field.name != "seed"
)
_missing = [params_name for _, params_name, _, _ in _WIRE_FIELDS if params_name not in _PARAM_FIELDS]
if _missing:  # a field of step.proto's SamplingParams that SamplingParams lacks: a mistake in the message
    raise ImportError(f"step.proto's SamplingParams has fields SamplingParams lacks: {_missing}")
# Wrapped into uint64 on the wire, as torch.Generator.manual_seed wraps a negative seed.
_UINT64 = 0xFFFFFFFFFFFFFFFF


def sampling_to_step(params: SamplingParams, stop_token_ids: Iterable[int] | None = None) -> step_pb2.SamplingParams:
    """The step message's form of `params`; `stop_token_ids`, when given, replaces the request's own (the head
    adds the model's EOS ids). A None setting is left out."""
    message = step_pb2.SamplingParams()
    for wire_name, params_name, _, repeated in _WIRE_FIELDS:
        value = getattr(params, params_name)
        if params_name == "stop_token_ids":
            value = sorted(value if stop_token_ids is None else stop_token_ids)
        if wire_name in _MAPS:
            getattr(message, wire_name).update(value)
        elif wire_name in _SEQUENCES:
            for sequence in value:
                getattr(message, wire_name).add(token_ids=sequence)
        elif repeated:
            getattr(message, wire_name).extend(value or ())
        elif value is not None:
            setattr(message, wire_name, value & _UINT64 if params_name == "seed" else value)
    constraint = params.structured_outputs
    if constraint is not None:
        message.constraint_kind = constraint.kind
        message.constraint_spec = constraint.spec
    return message


def sampling_from_step(message: step_pb2.SamplingParams) -> SamplingParams:
    """The SamplingParams a rank keeps for a new request: an absent field takes SamplingParams' default. What only
    the head or the front door acts on (max_tokens, stop strings, bad words as text) is not on the wire."""
    kwargs: dict[str, object] = {"max_tokens": None}
    for wire_name, params_name, has_presence, repeated in _WIRE_FIELDS:
        if wire_name in _MAPS:
            kwargs[params_name] = dict(getattr(message, wire_name))
        elif wire_name in _SEQUENCES:
            kwargs[params_name] = tuple(tuple(sequence.token_ids) for sequence in getattr(message, wire_name))
        elif repeated:
            values = tuple(getattr(message, wire_name))
            kwargs[params_name] = None if not values and params_name in _NONE_WHEN_EMPTY else values
        elif not has_presence or message.HasField(wire_name):
            kwargs[params_name] = getattr(message, wire_name)
    if message.constraint_kind:
        kwargs["structured_outputs"] = StructuredOutputs.from_spec(message.constraint_kind, message.constraint_spec)
    return SamplingParams(**kwargs)
