"""Tensor parallelism: N rank processes each hold a slice of every layer (heads, MLP rows and
columns, each expert's slice) and its own KV heads, and sum partial outputs with all-reduce.

- group.py: the process group (gloo on CPU, NCCL on CUDA) and the few collectives the model
  and the step plan use.
- sharding.py: a rank's view of the model config, and which weights split by rows, columns,
  or not at all.
- rank.py: ranks 1..N-1's process: load their slices, then run every step rank 0 plans.
"""
