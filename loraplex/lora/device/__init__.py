"""Adapters on the device: which adapter holds which slot (residency, pure Python), the slots' weights (the table) and their uploads."""
