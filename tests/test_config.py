import pytest

from engine.config import EngineConfig


@pytest.fixture
def model_dir(tmp_path):
    return str(tmp_path)


def test_defaults_are_valid(model_dir):
    cfg = EngineConfig(model=model_dir)
    assert cfg.block_size == 16 and cfg.enable_prefix_caching


@pytest.mark.parametrize("field,value,allowed", [
    ("dtype", "float64", "float32"),
    ("device", "tpu", "cuda:N"),
    ("max_model_len", 0, ">= 1"),
    ("max_num_seqs", -1, ">= 1"),
    ("max_num_batched_tokens", 0, ">= 1"),
    ("prefill_hold_steps", -1, ">= 0"),
    ("prefill_hold_steps", 1.5, ">= 0"),
    ("piecewise_graph_max_tokens", -1, ">= 0"),
    ("block_size", 0, ">= 1"),
    ("block_size", 1.5, ">= 1"),
    ("num_kv_blocks", 0, ">= 1"),
    ("gpu_memory_utilization", 1.5, "(0.0, 1.0]"),
    ("gpu_memory_utilization", 0, "(0.0, 1.0]"),
    ("enable_prefix_caching", "yes", "true or false"),
    ("load_format", "pt", "dummy"),
    ("seed", "1", "integer"),
    ("seed", 2**64, "[-2**63, 2**64)"),        # torch.manual_seed's range: refused at start-up
    ("seed", -2**63 - 1, "[-2**63, 2**64)"),
    ("cpu_threads", 0, ">= 1"),
    ("tokenize_inline_max_chars", -1, ">= 0"),
    ("tokenizer_process", "no", "true or false"),
    ("decode_pdl", 1, "true or false"),
    ("decode_late_merge", "yes", "true or false"),
    ("tokenizer_process_priority", "high", "idle"),
    ("tokenizer_process_priority", 10, "normal"),
    ("response_senders", 0, ">= 1"),
    ("gil_switch_interval_us", 0, ">= 1"),
    ("prefix_routing_slack", -1, ">= 0"),
    ("prefix_routing_slack", 2.5, ">= 0"),
    ("kv_cache_dtype", "int8", "fp8_e4m3"),
])
def test_bad_setting_names_field_and_range(model_dir, field, value, allowed):
    with pytest.raises(ValueError) as e:
        EngineConfig(model=model_dir, **{field: value})
    assert field in str(e.value) and allowed in str(e.value)


def test_missing_model_folder():
    with pytest.raises(ValueError, match="model"):
        EngineConfig(model="/nonexistent/folder")


def test_from_dict_rejects_unknown_keys_listing_valid_ones(model_dir):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_dict({"model": model_dir, "max_batch": 3})
    assert "max_batch" in str(e.value) and "max_num_seqs" in str(e.value)


def test_kv_cache_dtype_from_a_triton_parameter(model_dir):
    """The served model's config.pbtxt parameters arrive as strings (settings_from_triton)."""
    assert EngineConfig.from_strings({"model": model_dir, "kv_cache_dtype": "fp8"}).kv_cache_dtype == "fp8"
    assert EngineConfig(model=model_dir).kv_cache_dtype == "auto"


def test_prefix_routing_slack_from_a_triton_parameter(model_dir):
    """An integer from config.pbtxt's strings; unset (None) is max_num_seqs / 8, the router's
    default (tests/test_prefix_routing.py)."""
    assert EngineConfig.from_strings({"model": model_dir, "prefix_routing_slack": "48"}
                                     ).prefix_routing_slack == 48
    assert EngineConfig(model=model_dir).prefix_routing_slack is None
    with pytest.raises(ValueError, match="prefix_routing_slack must be of type int"):
        EngineConfig.from_strings({"model": model_dir, "prefix_routing_slack": "lots"})


def _pbtxt(**params):
    return {"parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_settings_from_a_triton_config(model_dir, tmp_path):
    """config.pbtxt parameters: paths from the model repository (`~` expanded, spaces around
    dropped, tokenizer "none" is the model's own), an empty value keeps the default (so an
    empty device is the instance's, not the default GPU), Triton's Python-backend parameters
    are left to it, and a missing model is an error that says what to set."""
    import os

    from engine.config import settings_from_triton
    repo, rel = os.path.split(model_dir)
    got = settings_from_triton(_pbtxt(model=f" {rel} ", tokenizer="none", device="",
                                      max_num_seqs="", EXECUTION_ENV_PATH="$$TRITON_MODEL_DIRECTORY/env.tar.gz"),
                               repo, "cuda:3")
    assert got == {"model": model_dir, "tokenizer": "none", "device": "cuda:3"}
    config = EngineConfig.from_strings({**got, "device": "cpu"})
    assert config.tokenizer is None and config.max_num_seqs == EngineConfig(model=model_dir).max_num_seqs
    home = os.path.expanduser("~")
    assert settings_from_triton(_pbtxt(model="~/m"), repo, "cpu")["model"] == os.path.join(home, "m")
    for missing in (_pbtxt(), _pbtxt(model="  ")):
        with pytest.raises(ValueError, match="needs a `model` parameter"):
            settings_from_triton(missing, repo, "cpu")


def test_string_settings_name_what_they_take(model_dir):
    for key, value, needle in (("enable_prefix_caching", "yes", "(true, false, 1 or 0), got 'yes'"),
                               ("max_num_seqs", "1_0", "max_num_seqs must be of type int, got '1_0'"),
                               ("gpu_memory_utilization", "0_5", "must be of type float")):
        with pytest.raises(ValueError) as e:
            EngineConfig.from_strings({"model": model_dir, key: value})
        assert needle in str(e.value)
    assert EngineConfig.from_strings({"model": model_dir, "max_num_seqs": "10"}).max_num_seqs == 10


def test_model_key_tells_engines_that_answer_alike(tmp_path):
    """engine.config.model_key: one folder and one setting of the numerics give one key; other
    weights, a rewritten checkpoint, another dtype or a dummy model's seed give another."""
    import os
    import shutil
    from engine.config import model_key
    from scripts.make_tiny_model import make_tiny_model
    a = str(make_tiny_model(tmp_path / "a", arch="llama", seed=3))
    b = str(make_tiny_model(tmp_path / "b", arch="llama", seed=4))
    base = dict(model=a, dtype="float32", device="cpu")
    key = model_key(EngineConfig(**base))
    assert key == model_key(EngineConfig(**base, max_num_seqs=8))       # scheduling: same
    assert key != model_key(EngineConfig(**{**base, "model": b}))
    assert key != model_key(EngineConfig(**{**base, "dtype": "bfloat16"}))
    weights = os.path.join(a, "model.safetensors")
    shutil.copy(weights, weights + ".tmp")
    os.replace(weights + ".tmp", weights)                                # rewritten in place
    assert key != model_key(EngineConfig(**base))
    dummy = dict(base, load_format="dummy")
    assert model_key(EngineConfig(**dummy)) != model_key(EngineConfig(**dummy, seed=1))


def test_a_repository_reached_through_a_link_finds_its_relative_model_beside_it(model_dir,
                                                                              tmp_path):
    """"../models/x" from a repository reached through a link (how tritonserver_env serves one
    under a path with spaces) is the folder beside the real repository, as the OS resolves it,
    not beside the link."""
    import os

    from engine.config import settings_from_triton
    real = tmp_path / "real" / "model_repository"
    real.mkdir(parents=True)
    os.symlink(real, tmp_path / "link")
    got = settings_from_triton(_pbtxt(model="../models/m"), str(tmp_path / "link"), "cpu")
    assert got["model"] == str(tmp_path / "real" / "models" / "m")


def test_instance_kinds_map_to_devices_and_kind_model_places_itself():
    """Triton's vLLM backend's sample config has `kind: KIND_MODEL` (the model places itself):
    it ran the engine on the CPU of a GPU host."""
    from engine.config import instance_device
    assert instance_device("GPU", 2) == "cuda:2"
    assert instance_device("CPU", 0) == "cpu"
    assert instance_device("MODEL", 0) == "auto"


def test_the_engine_device_names_where_auto_and_cuda_run():
    """The metric labels and the "engine ready on" line name the engine's device (a `device`
    parameter overrides the instance's), "auto" and "cuda" as the core resolves them."""
    import torch

    from engine.config import engine_device
    assert engine_device("cuda") == "cuda:0" and engine_device("cuda:3") == "cuda:3"
    assert engine_device("cpu") == "cpu"
    assert engine_device("auto") == ("cuda:0" if torch.cuda.device_count() else "cpu")


def test_paths_may_be_path_objects_and_other_types_are_named(model_dir):
    import pathlib
    config = EngineConfig(model=pathlib.Path(model_dir), tokenizer=pathlib.Path(model_dir))
    assert config.model == model_dir and config.tokenizer == model_dir
    import json
    from dataclasses import asdict
    json.dumps(asdict(config))                  # what the core process is given
    with pytest.raises(ValueError, match="tokenizer must be a path to a local folder, got 7"):
        EngineConfig(model=model_dir, tokenizer=7)


def test_a_gpu_index_is_checked_against_the_host_before_the_core_is_pinned():
    """cuda:N the host has not: named as asked (the core, pinned to it as its cuda:0, said
    "cuda:0"); an empty CUDA_VISIBLE_DEVICES hides every GPU (it was taken for unset, and the
    core ran on GPU N)."""
    import torch

    from engine.core_client import _pin_device
    config = EngineConfig(model=_model_for_pin(), device="cuda:5")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='' has 0 device"):
        _pin_device(config, {"CUDA_VISIBLE_DEVICES": ""})
    if torch.cuda.device_count() <= 5:
        with pytest.raises(ValueError, match=r"device 'cuda:5' asked for, but (this host has "
                                             r"\d GPU|no CUDA device is available)"):
            _pin_device(config, {})
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,7"}
    assert _pin_device(config, env).device == "cuda:0" and env["CUDA_VISIBLE_DEVICES"] == "7"


def _model_for_pin():
    import tempfile
    return tempfile.mkdtemp()           # EngineConfig checks only that the folder exists
