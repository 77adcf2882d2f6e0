"""The XLA compilation cache is trusted like the kernels' cache: its entries are native code the process loads.  A
directory of ours others may write is made private (it was used as it was, without a word); one under a directory
others may write (no sticky bit) or owned by another user is refused when named, unused when it is the default;
entries that are symlinks, foreign or group/world-writable files, or a checked entry changed since (a swapped pair
crashed the run: 'result is incompatible with its layout annotation') are removed before JAX reads them."""

import os
import stat
import zlib

import jax
import pytest

from glm_jax import compile_cache
from glm_jax.engine import set_compile_cache
from glm_jax.errors import GlmJaxError


@pytest.fixture
def restore_cache():
    yield
    set_compile_cache("")                        # back to the suite's cache


def test_world_writable_dir_of_ours_is_made_private(tmp_path, capsys, restore_cache):
    d = tmp_path / "xla"
    d.mkdir()
    os.chmod(d, 0o777)
    set_compile_cache(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0
    assert "writable by other users" in capsys.readouterr().err
    assert jax.config.jax_compilation_cache_dir == str(d)


def test_dir_under_an_open_parent_is_refused(tmp_path, restore_cache):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)                      # others may replace "xla" itself: no sticky bit
    with pytest.raises(GlmJaxError, match=r"--compile_cache=.*writable by other users"):
        set_compile_cache(str(parent / "xla"), "--compile_cache")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_dir_of_another_user_is_refused(tmp_path, restore_cache):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 4321, 4321)
    with pytest.raises(GlmJaxError, match="owned by uid 4321"):
        set_compile_cache(str(d), "--compile_cache")


def _entry(d, name, payload: bytes):
    p = d / name
    p.write_bytes(zlib.compress(payload))
    os.chmod(p, 0o644)
    os.utime(p, (1e9, 1e9))                      # not one being written right now
    return p


def test_foreign_and_changed_entries_are_removed(tmp_path):
    d = tmp_path / "xla"
    d.mkdir(mode=0o700)
    a, b = _entry(d, "a-cache", b"program a"), _entry(d, "b-cache", b"program bb")
    good = _entry(d, "c-cache", b"program c")
    assert compile_cache.heal(str(d)) == 0       # checked and remembered
    tmp = d / "t"
    os.rename(a, tmp)                            # a and b swapped (the same user, a copied cache, ...)
    os.rename(b, a)
    os.rename(tmp, b)
    planted = _entry(d, "p-cache", b"planted")
    os.chmod(planted, 0o666)                     # others may write it
    os.symlink(good, d / "s-cache")
    assert compile_cache.heal(str(d)) == 4
    assert sorted(os.listdir(d)) == [compile_cache.INDEX, "c-cache"]
    assert compile_cache.heal(str(d)) == 0


def test_state_dir_is_checked_like_the_caches(tmp_path):
    """--state_dir (the usage histories that choose pinned experts) under a directory others may write is refused;
    one of ours that others may write is made private."""
    import glm_jax

    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(GlmJaxError, match=r"--state_dir=.*writable by other users"):
        glm_jax.Engine.load(cache_cap=2, state_dir=str(parent / "state"))
    mine = tmp_path / "state"
    mine.mkdir()
    os.chmod(mine, 0o777)
    glm_jax.Engine.load(cache_cap=2, state_dir=str(mine)).close()
    assert stat.S_IMODE(os.stat(mine).st_mode) & 0o077 == 0
