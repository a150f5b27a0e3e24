"""The model runner and what it keeps between steps: the step protocol, the input batch, the KV
cache, CUDA graphs, the draft model and the runner's process."""
