"""Engine: Request -> Scheduler -> Executor -> outputs, with the memory policy around the step (docs/architecture.md)."""
