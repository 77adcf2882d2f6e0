"""Issue 15 (hardening): every bad input is a one-line GlmJaxError naming its source; runtime state only in per-user
directories; a container's dense weights are checked at load; NaN/Inf is refused; a second start compiles nothing.

Cheap by design: the option table and the validating functions are tested directly, engines are only loaded (no
forward) except for one NaN-logits forward, and the CLIs run in-process (two tiny subprocesses check the real entry
point)."""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

import glm_jax
from glm_jax import options as O
from glm_jax.engine import default_model_path
from glm_jax.errors import GlmJaxError
from glm_jax.model.config import load_config

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
PLAIN = os.path.join(GOLDEN, "glm4moe_plain")


def _one_line(e) -> str:
    s = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in s and "Traceback" not in s, s
    return s


# ----------------------------------------------------------------------------- item 6: every option has its range
def test_every_option_has_a_range_or_a_check():
    for o in O.OPTIONS:
        if o.kind in ("int", "float"):
            assert o.lo is not None, f"option {o.name}: no range"
        elif o.kind == "enum":
            assert o.choices and o.default in o.choices, o.name
        elif o.kind == "str":
            assert o.check is not None, f"option {o.name}: no check"
        O.check_value(o, o.default, "default")            # every default passes its own check


# (option, raw text): each is refused the same way as a flag, an environment alias and an Engine.load keyword
NONSENSE = [("expert_budget", "-1"), ("expert_topp", "0"), ("expert_topp", "-1"), ("expert_topp", "2"),
            ("cache_cap", "-5"), ("io_threads", "0"), ("draft", "-5"), ("pin_gb", "-1"), ("mtp_guard_pct", "500"),
            ("mtp_guard_window", "0"), ("budget_max_positions", "-1"), ("route_j", "0"), ("ram_gb", "nan"),
            ("expert_format", "int3"), ("expert_format", "int4_g0"), ("expert_format", "int4_g7"),
            ("pin", "/nonexistent/usage.json"), ("route_trace", "/nonexistent/dir/trace.jsonl"),
            ("sim_expert_mb", "0"), ("read_chunk_mb", "-1")]


@pytest.mark.parametrize("name,raw", NONSENSE)
def test_nonsense_is_refused_from_every_source_with_the_same_text(name, raw):
    o = O.BY_NAME[name]
    typed = int(raw) if o.kind == "int" else float(raw) if o.kind == "float" else raw
    msgs = []
    with pytest.raises(O.OptionError) as e:
        O.resolve({name: typed}, environ={})                       # Engine.load(name=...)
    msgs.append((_one_line(e), f"option '{name}'"))
    with pytest.raises(O.OptionError) as e:
        O.resolve({name: typed}, environ={}, kind="flag")          # --name=...
    msgs.append((_one_line(e), f"flag --{name}"))
    for env in o.env:
        with pytest.raises(O.OptionError) as e:
            O.resolve({"colibri_env": True}, environ={env: raw})
        msgs.append((_one_line(e), f"environment variable {env}"))
    tails = set()
    for msg, src in msgs:
        assert msg.startswith(src) and ": invalid value " in msg, (msg, src)
        tails.add(msg[msg.index(": invalid value "):])
    assert len(tails) == 1, tails                                  # the same check, the same words


def test_keywords_are_not_silently_coerced():
    for kw in ({"cache_cap": 1.7}, {"cache_cap": True}, {"mtp": "maybe"}, {"mtp": 2}, {"expert_topp": "x"},
               {"fetch": 3}, {"pin": 5}):
        with pytest.raises(O.OptionError):
            O.resolve(kw, environ={})
    assert O.resolve({"cache_cap": np.int64(3), "mtp": 0}, environ={})["cache_cap"] == 3


def test_an_explicit_value_wins_over_a_garbage_alias():
    on = {"colibri_env": True}          # the aliases are read only when asked for (issue 22)
    assert O.resolve({"draft": 2, **on}, {"DRAFT": "abc"}, kind="flag")["draft"] == 2
    assert O.resolve({"pin": "", **on}, {"PIN": "/nope"})["pin"] == ""
    with pytest.raises(O.OptionError) as e:
        O.resolve(on, {"DRAFT": "-3"})
    assert _one_line(e).startswith("environment variable DRAFT")
    with pytest.raises(O.OptionError) as e:
        O.resolve(on, {"PIN": "/nope"})
    assert _one_line(e).startswith("environment variable PIN") and "file not found" in str(e.value)
    o = O.resolve(on, {"RAM_GB": "3"})
    assert o.label("ram_gb") == "RAM_GB" and o.label("pin") == "--pin"


# ----------------------------------------------------------------------------- the CLI, in-process
@pytest.fixture
def cli():
    from absl import flags

    from glm_jax import cli as C
    yield C
    flags.FLAGS.unparse_flags()


def test_cli_flags_and_aliases(cli, monkeypatch, capsys):
    monkeypatch.setenv("DRAFT", "abc")
    cli.parse_flags(["glm-jax", "--draft=2", "--colibri_env"])
    assert O.from_flags()["draft"] == 2                            # the flag wins; the alias is never parsed
    cli.FLAGS.unparse_flags()
    cli.parse_flags(["glm-jax", "--colibri_env"])
    with pytest.raises(O.OptionError, match="environment variable DRAFT"):
        O.from_flags()
    cli.FLAGS.unparse_flags()
    monkeypatch.delenv("DRAFT")
    with pytest.raises(SystemExit) as ex:                          # absl's own parse errors: one line, exit 2
        cli.parse_flags(["glm-jax", "--max_new_tokens=x"])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("glm-jax: error: ") and err.count("\n") == 1


def test_cli_checks_output_json_before_loading_anything(cli, monkeypatch, capsys, tmp_path):
    def boom(*a, **k):
        raise AssertionError("the model was loaded before --output_json was checked")
    monkeypatch.setattr(glm_jax.Engine, "from_options", boom)
    for bad in (str(tmp_path / "no" / "such" / "dir" / "o.json"), str(tmp_path)):
        cli.parse_flags(["glm-jax", f"--output_json={bad}", "--max_new_tokens=1"])
        assert cli.main(["glm-jax"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("glm-jax: error: --output_json=") and err.count("\n") == 1, err
        cli.FLAGS.unparse_flags()
    assert not os.listdir(tmp_path)                                # the probe left nothing behind
    cli.parse_flags(["glm-jax", "--route_trace=/nonexistent/t.jsonl"])
    assert cli.main(["glm-jax"]) == 2
    assert "flag --route_trace" in capsys.readouterr().err


def test_help_lists_the_main_flags(cli, capsys):
    with pytest.raises(SystemExit) as ex:
        cli.parse_flags(["glm-jax", "--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    for f in ("--model", "--prompt", "--max_new_tokens", "--temperature", "--top_p", "--output_json",
              "--fetch", "--ram_gb", "--expert_budget", "--draft", "--compile_cache", "--state_dir", "--helpfull"):
        assert f in out, f


def test_real_entry_point_help(tmp_path):
    """The console script (absl's --help listed nothing for it: its flags live in glm_jax.cli, not __main__)."""
    exe = shutil.which("glm-jax") or os.path.join(os.path.dirname(sys.executable), "glm-jax")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0 and "--max_new_tokens" in r.stdout and "--expert_budget" in r.stdout, r.stdout[-2000:]


def test_cli_main_one_line_error_exit_2(cli, capsys, monkeypatch):
    monkeypatch.setenv("DRAFT", "garbage")
    cli.parse_flags(["glm-jax", "--draft=-5", "--model=/nonexistent", "--colibri_env"])
    assert cli.main(["glm-jax"]) == 2
    assert capsys.readouterr().err == "glm-jax: error: flag --draft: invalid value -5 (expected an integer in " \
                                      "[-1, 63])\n"


# ----------------------------------------------------------------------------- item 6: the Python API
@pytest.fixture(scope="module")
def plain():
    eng = glm_jax.Engine.load(PLAIN)
    yield eng
    eng.close()


@pytest.mark.parametrize("call", [
    lambda e: e.logits("hello"), lambda e: e.logits([1.7]), lambda e: e.logits([1, True]),
    lambda e: e.logits(b"\x01\x02"), lambda e: e.batch_logits([]), lambda e: e.batch_logits("ab"),
    lambda e: e.logits([10 ** 9]), lambda e: e.generate(b".."), lambda e: e.generate([1.5, 2]),
    lambda e: e.generate([1, 2], temperature=-1), lambda e: e.generate([1, 2], temperature=float("nan")),
    lambda e: e.generate([1, 2], top_k=999999), lambda e: e.generate([1, 2], top_k=-1),
    lambda e: e.generate([1, 2], top_p=0.0), lambda e: e.generate([1, 2], top_p=1.5),
    lambda e: e.generate([1, 2], max_new_tokens=2.5), lambda e: e.generate([1, 2], max_new_tokens=-1),
    lambda e: e.generate([1, 2], seed="x"), lambda e: e.generate([1, 2], chat="yes"),
    lambda e: e.encode(b"text")])
def test_api_refuses_bad_arguments(plain, call):
    with pytest.raises(GlmJaxError) as e:
        call(plain)
    _one_line(e)


def test_api_after_close_says_closed():
    eng = glm_jax.Engine.load(PLAIN)
    eng.close()
    eng.close()                                                    # idempotent
    for call in (lambda: eng.generate([1, 2], max_new_tokens=1), lambda: eng.logits([1, 2])):
        with pytest.raises(GlmJaxError, match="closed"):
            call()


def test_engine_load_checks_its_options_and_path():
    with pytest.raises(O.OptionError, match="option 'expert_format'"):
        glm_jax.Engine.load(PLAIN, expert_format="int3")
    with pytest.raises(GlmJaxError, match="not a directory"):
        glm_jax.Engine.load(os.path.join(PLAIN, "config.json"))
    with pytest.raises(GlmJaxError, match="path must be"):
        glm_jax.Engine.load(123)


# ----------------------------------------------------------------------------- item 3: NaN/Inf, dense crc
def _flip(path, offset, data=b"\xff\xff\xff\xff"):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _data_offset(path, key):
    from glm_jax.experts.container import SafeTensorsDir
    return SafeTensorsDir(os.path.dirname(path)).info(key).start


def test_nan_in_hf_weights_is_refused_naming_the_tensor(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(PLAIN, d)
    st = str(d / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    _flip(st, _data_offset(st, key) + 40)                         # four 0xff bytes: an f32 NaN
    from glm_jax.experts.weights import WeightError
    for fetch in ("resident", "loop"):
        with pytest.raises(GlmJaxError) as e:
            eng = glm_jax.Engine.load(str(d), fetch=fetch)
            eng.store.fetch(1, np.arange(8)) if eng.store else None
        assert key in _one_line(e) and "NaN/Inf" in str(e.value)
    # the converter refuses it too
    from glm_jax.experts.convert import convert
    with pytest.raises(WeightError, match=key.replace(".", r"\.")):
        convert(str(d), str(tmp_path / "c"), progress=False)


def test_nan_logits_are_refused(plain, monkeypatch):
    """A step that overflows (faked: no compile of the model needed) is refused at the forward, not sampled from."""
    import jax.numpy as jnp

    def overflowing_step():
        def f(params, cache, tokens, start, lengths, resident, logit_rows=None, moe_rows=None):
            B, T = tokens.shape
            logits = jnp.zeros((B, T, plain.cfg.vocab_size)).at[0, 1, 5].set(jnp.inf)
            return logits, jnp.zeros((B, T, plain.cfg.hidden_size)), cache, {}
        return f
    monkeypatch.setattr(plain, "_step_resident", overflowing_step)
    from glm_jax.engine import NonFiniteError
    with pytest.raises(NonFiniteError) as e:
        plain.logits([1, 2, 3])
    assert "NaN/Inf logits" in _one_line(e)
    plain.logits([1])                       # the Inf sits at position 1: a forward over position 0 only is fine


@pytest.fixture
def shipped(tmp_path):
    d = str(tmp_path / "shipped")
    shutil.copytree(default_model_path(), d)
    return d


def test_flipped_dense_bytes_are_caught_at_load(shipped):
    dense = os.path.join(shipped, "dense.safetensors")
    _flip(dense, os.path.getsize(dense) // 2)
    from glm_jax.experts.container import ChecksumError
    with pytest.raises(ChecksumError) as e:
        glm_jax.Engine.load(shipped)
    assert "dense.safetensors" in _one_line(e) and "checksum" in str(e.value)


# ----------------------------------------------------------------------------- item 7: messages say what it is
def test_a_container_without_its_manifest_is_an_incomplete_conversion(shipped):
    os.remove(os.path.join(shipped, "manifest.json"))
    with pytest.raises(GlmJaxError) as e:
        glm_jax.Engine.load(shipped)
    assert "incomplete conversion" in _one_line(e) and "glm-jax-convert" in str(e.value)


def test_a_half_converted_container_is_an_incomplete_conversion(tmp_path):
    from glm_jax.experts.convert import convert
    from tools.fixtures.synth_model import tiny_config, write_hf_checkpoint
    write_hf_checkpoint(str(tmp_path / "hf"), tiny_config(), seed=1)
    with pytest.raises(RuntimeError):
        convert(str(tmp_path / "hf"), str(tmp_path / "c"), progress=False, fail_after_layers=1)
    with pytest.raises(GlmJaxError) as e:
        glm_jax.Engine.load(str(tmp_path / "c"))
    assert "incomplete conversion" in _one_line(e) and "config.json" not in str(e.value)


def test_missing_dense_file_is_named(shipped):
    os.remove(os.path.join(shipped, "dense.safetensors"))
    with pytest.raises(GlmJaxError) as e:
        glm_jax.Engine.load(shipped)
    msg = _one_line(e)
    assert "dense.safetensors" in msg and "model.safetensors" not in msg


def test_ram_refusal_names_the_setting_the_user_made(shipped, monkeypatch):
    from glm_jax.experts.store import RamBudgetError
    monkeypatch.setenv("RAM_GB", "0.001")
    with pytest.raises(RamBudgetError) as e:
        glm_jax.Engine.load(shipped, colibri_env=True)
    msg = _one_line(e)
    assert "(RAM_GB)" in msg and "--ram_gb >=" in msg
    assert "--dense_format" not in msg or "glm-jax-convert --dense_format" in msg   # a converter flag, said so


# ----------------------------------------------------------------------------- item 8: every math field is checked
def test_config_fields_cover_every_model_config_field():
    import dataclasses

    from glm_jax.experts.container import CONFIG_FIELDS, CONFIG_FIELDS_DEFAULTED, CONFIG_FIELDS_IGNORED
    from glm_jax.model.config import ModelConfig
    assert (set(CONFIG_FIELDS) | set(CONFIG_FIELDS_DEFAULTED) | set(CONFIG_FIELDS_IGNORED)
            == {f.name for f in dataclasses.fields(ModelConfig)})


@pytest.mark.parametrize("field,value", [("routed_scaling_factor", 1.25), ("num_experts_per_tok", 2),
                                         ("rope_theta", 5000.0)])
def test_an_edited_container_config_is_refused(shipped, field, value):
    p = os.path.join(shipped, "config.json")
    raw = json.load(open(p))
    assert raw.get(field, (raw.get("rope_parameters") or {}).get(field)) != value
    if field == "rope_theta" and "rope_parameters" in raw:
        raw["rope_parameters"][field] = value
    else:
        raw[field] = value
    json.dump(raw, open(p, "w"))
    from glm_jax.experts.container import ConfigMismatchError
    with pytest.raises(ConfigMismatchError) as e:
        glm_jax.Engine.load(shipped)
    assert f"'{field}'" in _one_line(e)
    from glm_jax.experts.container import open_container
    with pytest.raises(ConfigMismatchError):                       # what glm-jax-convert --verify runs: no longer OK
        open_container(shipped, load_config(shipped), verify="all")


# ----------------------------------------------------------------------------- item 1: state in per-user dirs
def test_usage_history_never_goes_into_the_model_dir(tmp_path):
    from glm_jax import paths
    from glm_jax.experts.store import ExpertStore
    model = default_model_path()                                   # the installed package's own model
    before = sorted(os.listdir(model))
    cfg = load_config(model)
    for state_dir, where in (("", paths.state_root()), (str(tmp_path / "st"), str(tmp_path / "st")),
                             ("off", None)):
        st = ExpertStore.open(model, cfg, cache_cap=2, **({"state_dir": state_dir} if state_dir else {}))
        st.fetch(1, np.array([3, 4]))
        st.close()
        if where is None:
            assert st.usage_path is None
        else:
            assert st.usage_path.startswith(where + os.sep) and os.path.exists(st.usage_path)
            assert json.load(open(st.usage_path))["layers"]["1"][3] >= 1
    assert sorted(os.listdir(model)) == before


def _save_many(path, n, cfg_json):
    from glm_jax.experts.store import ExpertStore
    from glm_jax.model.config import config_from_dict
    fake = types.SimpleNamespace(usage_path=path, cfg=config_from_dict(cfg_json),
                                 _usage={1: np.ones(8), 2: np.arange(8, dtype=np.float64)})
    for _ in range(n):
        ExpertStore.save_usage(fake)


@pytest.mark.filterwarnings("ignore:os.fork")     # the children run only json/numpy code, never JAX
def test_concurrent_usage_saves_lose_no_counts(tmp_path):
    """Processes merging into one history at once: every count survives (the read-modify-write is locked)."""
    from tools.fixtures.synth_model import tiny_config
    path = str(tmp_path / "usage" / "m.json")
    os.makedirs(os.path.dirname(path))
    ctx = multiprocessing.get_context("fork")
    procs, n = 4, 40
    ps = [ctx.Process(target=_save_many, args=(path, n, tiny_config())) for _ in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    u = json.load(open(path))["layers"]
    assert u["1"] == [float(procs * n)] * 8 and u["2"] == [float(procs * n * e) for e in range(8)]


def test_a_garbage_pin_file_is_an_error(tmp_path):
    from glm_jax.experts.store import ExpertStore, StoreError
    model = default_model_path()
    cfg = load_config(model)
    for content in ("not json", json.dumps({"version": 1, "layers": {"1": "x"}}), json.dumps([1, 2])):
        p = tmp_path / "pins.json"
        p.write_text(content)
        with pytest.raises(StoreError) as e:
            ExpertStore.open(model, cfg, cache_cap=1, pin=str(p), pin_gb=1.0, labels={"pin": "PIN"})
        assert _one_line(e).startswith(f"PIN={p}")


# ----------------------------------------------------------------------------- item 11: persistent compile cache
def test_compile_cache_dir_is_per_user_and_movable(tmp_path):
    import jax
    import jax.numpy as jnp

    from glm_jax import paths
    from glm_jax.engine import set_compile_cache
    default = paths.cache_root()
    assert default.startswith(os.environ["XDG_CACHE_HOME"])        # conftest: hermetic
    events = []

    def listen(name, **kw):
        events.append(name)
    jax.monitoring.register_event_listener(listen)

    def make():
        def hardening_probe(x):
            return jnp.sin(x) * 2.5 + x
        return jax.jit(hardening_probe)
    try:
        glm_jax.Engine.load(PLAIN, compile_cache=str(tmp_path / "xla"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        make()(np.arange(7.0))
        assert os.listdir(tmp_path / "xla")                        # the program was stored
        events.clear()
        make()(np.arange(7.0))                                     # a "second start": served from the cache
        assert "/jax/compilation_cache/cache_hits" in events
        glm_jax.Engine.load(PLAIN, compile_cache="off")
        assert jax.config.jax_compilation_cache_dir is None
        with pytest.raises(GlmJaxError, match="compile_cache"):
            set_compile_cache(str(tmp_path / "xla" / os.listdir(tmp_path / "xla")[0]), "--compile_cache")
    finally:
        jax.monitoring.unregister_event_listener(listen) if hasattr(jax.monitoring, "unregister_event_listener") \
            else None
        set_compile_cache("")                                      # back to the suite's cache
    assert jax.config.jax_compilation_cache_dir == default


def test_nan_logits_in_the_fused_decode_loop_are_refused():
    """The compiled decode loop (32 tokens per dispatch) carries the finite check: a token whose embedding overflows
    stops the generation with NonFiniteError instead of sampling garbage."""
    import jax.numpy as jnp

    from glm_jax.errors import NonFiniteError

    eng = glm_jax.Engine.load(None)
    assert eng.opts["fetch"] == "resident"
    prompt = eng.encode("ROMEO:\n")
    first = eng.generate(prompt, max_new_tokens=1).tokens[0]       # the prefill's token, fed to the first decode
    assert first not in prompt
    import dataclasses

    emb = eng.params["embed"]                   # a float table, or a bf16 / quantized QWeight (rows widened)
    bad = dataclasses.replace(emb, q=emb.q.at[first].set(jnp.inf)) if hasattr(emb, "q") else emb.at[first].set(jnp.inf)
    eng.params = dict(eng.params, embed=bad)
    eng._view = None
    with pytest.raises(NonFiniteError, match="NaN/Inf logits"):
        eng.generate(prompt, max_new_tokens=8, stop_on_eos=False)
