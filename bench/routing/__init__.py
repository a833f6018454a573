"""`kvgate bench routing`: workloads.py (request streams), configurations.py (what routes, as data), runner.py
(one configuration at one rate on a fresh stack), report.py (ratios, tables, plot), cli.py (the command)."""
