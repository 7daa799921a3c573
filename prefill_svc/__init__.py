"""The prefill service: computes prompts' KV and first tokens and streams the KV to decode instances."""
