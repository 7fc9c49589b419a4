"""The KV cache store: a cluster-wide block store with a DRAM tier over a disk tier, so prompt
caches outlive a worker's memory. `store.py` is the storage (tiers, leases, admission);
`keys.py` says which blocks are interchangeable."""
