"""HTTP server: LoRAX/TGI-native routes (and, later, OpenAI routes) over the AsyncEngine."""
