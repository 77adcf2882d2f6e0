"""User routing plugins written outside the engine (README "Worked example"): put this directory on PYTHONPATH and
load them with ``--plugin=my_plugins:late_topk --plugin_args=from_layer=2,keep=2`` or
``Engine.load(plugins=["my_plugins:late_topk"])``.  They only import glm_jax_plugins."""
import jax.numpy as jnp
from glm_jax_plugins import Plugin, renormalize


def late_topk(from_layer=2, keep=2):
    """From layer `from_layer` on, each position keeps only its `keep` heaviest experts."""
    def apply(s):
        rank = jnp.argsort(jnp.argsort(-jnp.where(s.valid, s.weights, -jnp.inf), axis=-1), axis=-1)
        return renormalize(s, valid=s.valid & ((rank < keep) | (s.layer < from_layer)))
    return Plugin(apply, f"late_topk(from_layer={from_layer}, keep={keep})")


def prefer_resident():
    """A counter-example: keep each position's heaviest expert plus whichever of its others are already cached.
    Its decisions depend on the expert cache, so it breaks MTP's contract (glm-jax-eval --check_contract says so)."""
    def apply(s):
        top = jnp.argmax(jnp.where(s.valid, s.weights, -jnp.inf), axis=-1)
        first = jnp.arange(s.ids.shape[-1]) == top[:, None]
        return renormalize(s, valid=s.valid & (s.resident[s.ids] | first))
    return Plugin(apply, "prefer_resident")
