"""The generation runtime, below the Engine facade: forward passes over a KV cache and the loop that drives them.

    runner.py       Runner: forward passes of a loaded model over a [B, S] KV cache (resident or streamed)
    backends.py     the fetch modes as backends (resident, loop, callback, fused), chosen once at load
    streaming.py    forwards whose experts come from the expert store (fetch=loop / callback / fused)
    memory_guard.py MemoryGuard: a RAM-budgeted run kept inside its memory plan after the load
    stats.py        per-forward routing numbers and per-run statistics
    sampling.py     greedy / temperature / top-k / top-p, one row or per-row parameters
    speculative.py  MTP / n-gram speculative decoding of one row
    scheduler.py    THE generation loop: continuous batching over max_batch KV rows
    prefix_store.py host-RAM copies of K/V the rows no longer hold (the prefix cache's second level)
    mesh.py         device meshes: placement by the sharding rules, jax.distributed start-up
"""
