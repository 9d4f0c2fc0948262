"""KV-cache tiers below the device cache (host memory, disk), and moving blocks between them and
an engine's prefix cache: tier (Tier), cpu, disk, store (TieredKVStore), load, offload."""
