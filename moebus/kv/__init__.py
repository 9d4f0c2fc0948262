"""KV: the one home for moving, naming, storing and indexing KV-cache blocks.

Torch-free (the balancer and the KV broker's index import these):
  hashing            block names across processes: stable chained block hashes, KV namespace, fingerprint
  index              PrefixIndex: which holder (worker, tier) has which blocks, fed by KVEvents
  broker_client      KVBrokerClient: the broker protocol (events, prefix queries, shared tiers)
  host               KVHost: the Protocol of what the KV code asks of an engine (types only)
  connector_port     KVConnectorPort: the Protocol of what a worker asks of an engine's KV (types only)
  transports/credit  ByteCredits: a receiver's bytes-in-flight pool
With torch:
  encoding           the binary layout of tensors + a checksummed JSON header (format VERSION)
  payload            KVBlock / KVPayload: blocks with checksums and identity, their encodings
  groups             KV groups: which cache part lives in which block pool, pool sizes
  cache_io           gathers and scatters of blocks of an engine's paged cache
  transfer           extract a request's KV, admit a request prefilled elsewhere (prefill/decode split)
  cache_events       the device prefix cache as stored/evicted stable-hash events
  tiers/             CPU and disk tiers, TieredKVStore; load (tier -> prefix cache), offload (cache -> tier)
  connector          KVConnector (`LLMEngine.kv`): the verbs above for a worker, over a KVHost
  transports/        KVTransport and its NATS (chunks under credit) and shared-memory implementations
  block_client       KVBlockClient: the broker's shared tiers in KV blocks, over a NATS transport
Nothing here imports a service or the engine loop (moebus.engine.llm_engine); the package
__init__s import nothing, so a torch-free module never loads torch through its package.
"""
