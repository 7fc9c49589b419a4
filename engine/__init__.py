"""tandem's inference engine: checkpoints, paged KV cache, scheduler, sampler, model runner.

The engine imports neither gRPC nor `services`; workers wrap it. Submodules are imported
explicitly (`from engine.llm_engine import LLMEngine`) so that torch-free parts such as
`engine.block_hash` and `engine.tokenizer` stay importable by the gateway without torch.
"""
