"""glm-jax: a JAX/XLA inference engine for GLM-family MoE models with streamed int4 experts.

The package follows the data path (imports go one way, down this list):
    errors.py, paths.py, memory.py   leaves: error classes, per-user dirs, the process's memory
    kernels/     native CPU kernels (jax.ffi) and the weight formats they compute on (formats.py)
    model/       config and the math: layers, attention (GQA, MLA + DSA), router, THE MOE SEAM, the decoder, NNX
    experts/     the experts' storage: safetensors loader, the container, the expert store, the converter
    runtime/     forward passes over the KV cache, streamed forwards, sampling, speculation, the scheduler, meshes
    options.py   the one option table (absl flags, Engine.load keywords)
    chat.py      chat templates
    engine.py    the facade: Engine.load / generate / stream / request
    cli.py, evaluate.py, serve/      glm-jax, glm-jax-eval, glm-jax-serve
"""

from .engine import Engine, GenerationResult, default_model_path  # noqa: F401
from .errors import GlmJaxError  # noqa: F401
from .model.config import ConfigError, ModelConfig, load_config  # noqa: F401

__version__ = "0.1.0"
