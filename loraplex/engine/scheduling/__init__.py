"""Which requests run each step and how many tokens each (pure Python, no torch): the scheduler, KV blocks, the prefix cache, joins."""
