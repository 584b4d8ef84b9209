"""The model runner: one-time construction (build.py) and the per-step execution of a SchedulerOutput
(model_runner.py), with the step's inputs, decode graphs, tensor parallelism, CPU share and KV sizing."""
