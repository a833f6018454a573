"""The `kvgate bench ...` commands: engine, EPP, scheduling, datalayer, serving and routing benchmarks."""
