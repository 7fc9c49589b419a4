"""A generation's tokens back into what the client reads (generation.py): text, detokenized
incrementally (detokenizer.py) with stop strings cut, reasoning (reasoning.py) and tool calls
(tool_calls.py, in each family's markup: tool_formats.py; their arguments streamed as they are
written: tool_streams.py, json_prefix.py) parsed out of it, logprobs, usage and latency metrics.
The markup also shapes the prompt (prepare/ renders past calls and forces calls in it)."""
