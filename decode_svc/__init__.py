"""The decode service: receives prompts' KV from prefill instances and generates the rest in a continuous batch."""
