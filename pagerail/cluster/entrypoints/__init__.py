"""The user-facing API: the offline `LLM` and `pagerail serve`."""
