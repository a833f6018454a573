"""Tensor parallelism: the process group of the ranks (group.py), the worker processes and their control
channel (workers.py, worker.py). The model's parallel layers are engine/models/parallel_linear.py."""
