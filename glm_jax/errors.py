"""The user-facing error classes shared across the layers (a leaf: imports nothing of glm_jax).

Every error a user can cause is a ``GlmJaxError`` whose one-line message names the file, flag or field; each layer
defines its own subclasses beside its code (ConfigError in model/config.py, ContainerError in experts/container.py,
StoreError in experts/store.py, OptionError in options.py, ...).  The ones several layers raise live here.
"""


class GlmJaxError(ValueError):
    """Base class of every user-facing error in glm_jax (one line, names the culprit)."""


class NonFiniteError(GlmJaxError):
    """The model produced NaN/Inf logits."""


class PluginError(GlmJaxError):
    """A user routing plugin could not be loaded or broke the plugin contract (glm_jax_plugins.contract)."""
