"""The model's math: config, the forward pass and its pieces, the NNX modules.  Pure functions over the params
pytree (WORKSPACE.md); nothing here reads files or knows about the expert store.

Data path, in reading order:
    config.py       ModelConfig (glm4_moe, glm_moe_dsa, glm5_next), load_config
    layers.py       rms_norm, linear (float or QWeight: the native kernels), rope, mlp, embed, head
    attention.py    GQA attention + the KV cache (glm4_moe); dispatches to mla.py (MLA + DSA, glm_moe_dsa)
    router.py       the router -> RoutingState (the routing plugins rewrite it)
    moe.py          THE MOE SEAM: moe_routed and its backends (native kernels / XLA / a mesh's expert axis)
    transformer.py  one decoder layer (moe_route -> an ExpertSource's experts -> moe_output), step() (prefill /
                    decode / verify), the MTP layer
    modules.py      the same model as flax NNX modules with logical axes (the sharding rules' input)
    kda.py, hyper.py, dsa_pool.py, glm5_next.py, glm5_next_modules.py   glm5_next (GLM-5.3): its mechanisms, its
                    forward and its NNX modules

The names below are the forward's public pieces (``from glm_jax import model as M; M.step(...)``).
"""

from .attention import attention, attn_block, gqa_attention, init_cache, kv_bytes_per_token  # noqa: F401
from .layers import apply_rope_half, embed, head, head_logits, linear, mlp, positions_of, rms_norm, rope_cos_sin  # noqa: F401
from .kda import STATE_KEYS  # noqa: F401
from .mla import indexer_type, variant_layer  # noqa: F401
from .moe import moe_combine, moe_finish, moe_real_rows, moe_routed, moe_terms, real_rows  # noqa: F401
from .router import identity_plugin, route  # noqa: F401
from .transformer import (ExpertSource, ResidentExperts, as_params, dense_layer, layer_forward, moe_output,  # noqa: F401
                          moe_route, mtp_forward, mtp_input, mtp_output, step)
