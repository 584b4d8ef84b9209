"""The worker: rooms that import only the rooms below them (docs/architecture.md#layout).

service/ and llm.py (the gRPC and offline faces) -> core/ (engine, scheduler, blocks) -> runner/ (a step on
the device) -> sample/ (sampler, structured output, speculation) -> models/ -> layers/ -> step.py (the
step's contract), sequence.py, config.py, device.py."""
