"""glm-jax: a JAX/XLA inference engine for GLM-family MoE models with streamed int4 experts."""

from .config import ConfigError, GlmJaxError, ModelConfig, load_config  # noqa: F401
from .engine import Engine, GenerationResult, default_model_path  # noqa: F401

__version__ = "0.1.0"
