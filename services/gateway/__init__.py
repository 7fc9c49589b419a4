"""The gateway: the public API in front of the workers. It never imports torch.

A request passes, one job to each folder or file:
- api/: a surface (OpenAI HTTP, Responses, Messages, or gRPC) reads the request in its wire
  format into the gateway's own types (protocol.py);
- prepare/: it is checked, rendered through the chat template and tokenized, one generation
  request per prompt and choice;
- frontend.py: its caller is authenticated and its generations run, their events merged;
- admission.py: each generation waits for a worker slot in a bounded, fair queue;
- worker_pool.py: routed (routing/: endpoints, prefix index, policies) and run on the workers,
  colocated or prefill -> decode, refusals retried;
- output/: the tokens come back as text, reasoning and tool calls, with usage;
- api/ again: the surface writes the events as its replies.

Beside them: config.py, errors.py, metrics.py, pricing.py and api_keys.py.
"""
