"""The experts' storage: what lies on disk and how it reaches the seam.

    tensors.py     HF safetensors: the sharded index, FP8 block dequant, the finiteness check
    weights.py     the HF loader -> the params pytree (dense weights; resident experts as ExpertBanks)
    container.py   the converted-model format: manifest, per-layer expert record files, checks, HF expert source
    store.py       ExpertStore: RAM-bounded expert cache over a container, slot arenas aliased as jax arrays
    convert.py     glm-jax-convert: HF dir -> container
"""
