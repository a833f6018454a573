import os

# Tests share two cores with engine processes and the e2e rig; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")
