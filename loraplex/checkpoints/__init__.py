"""Reading checkpoints: resolving a model id to a directory (sources), safetensors weights and the strict loader
(weights), GGUF conversion (gguf), safetensors header checks, bounded JSON files and the cache they are kept in."""
