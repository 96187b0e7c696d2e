"""KV offload tiers of the worker: full KV blocks kept past the pool, in host memory
(`host_tier`) and on disk (`disk_tier`, its file format in `disk_format`), each LRU under
its own byte budget (`config`). Blocks are named by `keys.BlockKey` (block hash, KV group);
every tier serves a block only to the salted root it was stored under, and the disk tier
only to a worker of the same `keys.TierIdentity` (model, geometry, TP rank, PP stage).

Pure Python + torch: no gRPC, no event loop. Components return what they evicted or dropped
(`keys.Evicted`) instead of calling back; the connector that wires them to the pool and
the scheduler publishes the events.
"""
