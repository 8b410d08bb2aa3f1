"""The services' runtime, without the wire: micro-batching on a model thread (batching), the
session table with its LRU bound (session_table), Prometheus metrics (metrics). Used by the three
service cores; imports no grpc."""
