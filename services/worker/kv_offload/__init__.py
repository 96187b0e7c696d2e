"""The worker's disk tier of the KV offload (`disk_tier`, its file format in `disk_format`):
full KV blocks kept past the host-memory tier, LRU under a byte budget, across restarts.
Blocks are named by `keys.BlockKey` (block hash, KV group); a block is served only to the
salted root it was stored under, and only to a worker of the same `keys.TierIdentity`
(model, geometry, TP rank, PP stage). The host-memory tier is a second KV pool the
scheduler manages (`services/scheduler/kv_offload.py`).

Pure Python + torch: no gRPC, no event loop. The tier returns what it evicted or dropped
(`keys.Evicted`) instead of calling back.
"""
