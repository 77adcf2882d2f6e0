"""Tenants don't share the prefix cache: a client's ``cached_tokens`` never measures another API key's prompt (it
told client B how much of client A's "vault code" it had guessed), neither through a row's K/V nor through the prefix
store in host RAM; ``cache_salt`` splits one key's cache; --prefix_cache_scope=global shares it again.  API keys
from --api_key_file / $GLM_JAX_API_KEY, --api_key warned about.  Through the official openai client."""

import os

import openai
import pytest
import serving

import glm_jax
from glm_jax.errors import GlmJaxError
from glm_jax.serve import tenancy

SECRET = ("ROMEO: The vault below the chapel opens to a word that only the two of us were ever told, and that word "
          "is MERCUTIO")


@pytest.fixture(scope="module")
def server():
    from glm_jax.serve.app import Server

    # one row: every new prompt moves the row's K/V into the prefix store, so both levels of the cache are crossed
    eng = glm_jax.Engine.load(max_batch=1, prefill_chunk=16, prefix_store_mb=64)
    srv = Server(eng, api_key=["key-a", "key-b"], max_queue=8)
    with serving.running(srv):
        yield srv
    eng.close()


def _cached(server, key, prompt, **extra):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=120)
    r = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=1, temperature=0,
                             extra_body=extra or None)
    d = r.usage.prompt_tokens_details
    return d.cached_tokens if d is not None else 0


def test_another_key_never_sees_a_prompt_cached(server):
    assert _cached(server, "key-a", SECRET) == 0
    guess = SECRET[:-6]                                   # "... word is MER"
    assert _cached(server, "key-b", guess) == 0           # row held A's K/V: not B's to reuse
    assert _cached(server, "key-b", guess) > 0            # B's own prompt, from the row
    assert _cached(server, "key-a", SECRET) > 0           # A's, back from the prefix store
    assert _cached(server, "key-b", SECRET) > 0           # B shares its own guess's prefix, never more of A's
    assert _cached(server, "key-b", SECRET) == _cached(server, "key-b", SECRET)


def test_cache_salt_splits_a_key(server):
    p = SECRET.replace("MERCUTIO", "TYBALT")
    _cached(server, "key-a", p, cache_salt="alice")
    assert _cached(server, "key-a", p, cache_salt="bob") == 0
    assert _cached(server, "key-a", p, cache_salt="alice") > 0
    with pytest.raises(openai.BadRequestError) as e:
        _cached(server, "key-a", p, cache_salt=5)
    assert e.value.body["param"] == "cache_salt"


def test_global_scope_shares_between_keys(server, monkeypatch):
    monkeypatch.setattr(server, "prefix_cache_scope", "global")
    p = SECRET.replace("MERCUTIO", "BENVOLIO")
    _cached(server, "key-a", p)
    assert _cached(server, "key-b", p) > 0


def test_api_key_sources(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# tenants\nk1\n\n k2 \n")
    os.chmod(f, 0o600)
    monkeypatch.setenv(tenancy.ENV_KEY, "k3")
    keys, warn = tenancy.api_keys("", str(f))
    assert keys == ["k1", "k2", "k3"] and warn is None
    assert "/proc" in tenancy.api_keys("k0", "")[1]
    os.chmod(f, 0o644)
    with pytest.raises(GlmJaxError, match="readable by others"):
        tenancy.read_key_file(str(f))
    os.chmod(f, 0o600)
    k = tenancy.Keys(keys)
    assert k.match(b"Bearer k2") == 1 and k.match(b"Bearer k") is None and k.match(b"k1") is None


def test_api_key_file_through_the_command(tmp_path):
    """glm-jax-serve refuses a world-readable key file in one line, before loading the model."""
    import subprocess
    import sys

    f = tmp_path / "keys"
    f.write_text("k1\n")
    os.chmod(f, 0o644)
    r = subprocess.run([sys.executable, "-m", "glm_jax.serve.app", f"--api_key_file={f}", "--port=0", "--nowarmup"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "readable by others" in r.stderr, r.stderr
