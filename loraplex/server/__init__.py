"""HTTP server over the AsyncEngine: LoRAX/TGI-native routes (native.py: /generate, /generate_stream, /tokenize,
/health, /info, ...), OpenAI-compatible routes (openai_routes.py: /v1/models, /v1/completions, /v1/chat/completions)
and the playground page (playground.py)."""
