"""The worker process: one per device; runs the scheduler's step plans on its model shard."""
