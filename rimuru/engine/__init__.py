"""Engine: Request -> Scheduler -> Executor -> outputs, the memory policy around each step (docs/architecture.md)."""
