"""The shard format and its storage: manifest, shard writer and reader, the store of one node
root, and streaming shards to and from peers."""
