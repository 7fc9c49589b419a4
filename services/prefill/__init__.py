"""The prefill worker: computes prompts and pushes their KV blocks to decode workers."""
