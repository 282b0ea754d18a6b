"""Tool calling for OpenAI chat requests: definitions and choice (definitions.py), prompts (prompt.py),
parsing calls out of answers (parsers.py)."""
