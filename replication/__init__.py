"""replication: where checkpoint shards are replicated across nodes, and the moving of their bytes.

Works on opaque shard payloads and never imports localckpt (localckpt imports it). Strategies,
exchange plans and the executor arrive with the replication work; this package is the home they
are built in.
"""

__all__: list[str] = []
