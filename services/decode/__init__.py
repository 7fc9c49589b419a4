"""The decode worker: receives prompts' KV from prefill workers and generates the rest."""
