"""The example models shipped with loraplex, assembled on first use from parts committed in this repository
(`vision`: LLaVA-NeXT `loraplex/smollm2-shapes`; `mllama`: Llama-3.2-Vision-style `loraplex/smollm2-mllama-shapes`).

Importing this package registers their ids with `checkpoints.sources`, so `resolve_model` serves them; whoever
resolves a model id (engine/loading.py, the CLI) imports it once.
"""

from loraplex.checkpoints.sources import register_model_resolver
from loraplex.example_models.mllama import EXAMPLE_MLLAMA_MODEL_ID, example_mllama_dir
from loraplex.example_models.vision import EXAMPLE_VISION_MODEL_ID, example_model_dir

register_model_resolver(EXAMPLE_VISION_MODEL_ID, example_model_dir)
register_model_resolver(EXAMPLE_MLLAMA_MODEL_ID, example_mllama_dir)
