"""The peer tier: agents that know each other, and shard copies on peers' T0."""
