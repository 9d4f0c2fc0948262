"""KV transports: move one KVPayload (kv.payload) between processes by transfer id:
transport (KVTransport), nats (chunks under credit), shm (shared memory), credit (ByteCredits, torch-free).

Services (worker, KV broker) use them; the engine imports no NATS, so they live apart from
the engine-facing KV code, and nothing here imports a service."""
