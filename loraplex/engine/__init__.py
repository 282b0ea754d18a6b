"""The engine: per-request state, KV block accounting, scheduling, and the step loop."""
