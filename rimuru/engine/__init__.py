"""Engine: Request -> Scheduler -> ModelRunner (Executor) -> outputs (DESIGN.md §4)."""
