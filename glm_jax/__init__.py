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

import importlib

__version__ = "0.1.0"

# The public names are imported on first use (PEP 562), not with the package: `glm-jax` installs its Ctrl-C /
# SIGTERM handling before the seconds-long jax import, which `import glm_jax` would otherwise do first.
_PUBLIC = {"Engine": ".engine", "GenerationResult": ".engine", "default_model_path": ".engine",
           "GlmJaxError": ".errors", "ConfigError": ".model.config", "ModelConfig": ".model.config",
           "load_config": ".model.config"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    if not name.startswith("_"):                  # a submodule, as `glm_jax.engine` after `import glm_jax` was
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
