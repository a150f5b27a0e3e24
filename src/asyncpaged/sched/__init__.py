"""The scheduler core: requests, queues, policy, planning and preemption; synchronous and pure
Python (the scheduler actor wraps it)."""
