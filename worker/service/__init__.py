"""The worker's gRPC face: the server, the engine's thread (engine_loop.py), metrics and request spans."""
