"""The messages between the head and its workers (step.proto, worker.proto) and of the public API (api.proto)."""

# Both ends of the head-worker link: a step carrying a few thousand new prompts (token and block ids) runs to tens
# of MiB.
STEP_LINK_OPTIONS = (("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20))
