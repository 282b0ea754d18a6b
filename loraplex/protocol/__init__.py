"""Request/response schemas and validation: the edge where user input becomes SamplingParams."""
