"""Bounds of the data's locality that the wire checks and the coordinator's locality keeps to:
shards a worker may say it holds, shards one prefetch hint names, and the largest shuffle window
(shards) of a shard-aware epoch order. Here, not in the wire's module, so that the pure
locality policy (coordinator/locality.py) does not depend on the protocol."""

MAX_HELD_SHARDS = 4096
MAX_PREFETCH = 64
MAX_SHUFFLE_WINDOW = 65536
