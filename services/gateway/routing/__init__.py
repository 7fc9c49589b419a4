"""Which worker gets a request, and what the gateway knows to decide it:

- endpoints.py: the workers, discovered and health-checked, with what this gateway has in
  flight on each;
- prefix_index.py: which worker caches which KV blocks, kept current by each worker's KV
  events (kv_events.py, over event_feed.py);
- store_view.py: what the KV cache store holds (the same event feed);
- affinity.py: `x-session-affinity`, a session back to its worker;
- policies/: the routing policies, one file each (`--router`).
"""
