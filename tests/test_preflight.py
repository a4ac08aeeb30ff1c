"""preflight.py: a target's shape read cheaply from local files, and the checks that run before
any job (the refusals' messages are in test_bad_inputs.py, as the CLI prints them)."""

import json
import time

import pytest
from conftest import SMOLLM2_GGUF, base_config

from dflashpipe.config import Config, TargetConfig
from dflashpipe.errors import ConfigError
from dflashpipe.preflight import (
    TargetShape,
    check_against_target,
    check_config,
    check_fits_target,
    read_target_shape,
)


def _config(data_dir, target: dict, **sections) -> Config:
    raw = base_config(data_dir)
    raw["target"] = target
    for name, values in sections.items():
        raw[name] = values
    return Config.from_dict(raw)


def test_the_smollm2_gguf_shape_in_milliseconds(smollm2_dir):
    target = TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
    read_target_shape(target)  # imports gguf's constants once
    start = time.perf_counter()
    shape = read_target_shape(target)
    elapsed = time.perf_counter() - start
    name = f"{smollm2_dir}/{SMOLLM2_GGUF}"
    assert shape == TargetShape(30, 49152, name, "llama", True, hidden_size=576)
    assert elapsed < 0.5, f"{elapsed:.3f} s: the metadata walk should stop early"


def test_a_gguf_without_vocab_size_counts_its_tokens(tmp_path):
    """Keys in another order and no {arch}.vocab_size: the tokenizer's token list gives it."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.merges", ["a b", "c d"])
    writer.add_block_count(7)
    writer.add_tensor("token_embd.weight", np.zeros((300, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = read_target_shape(TargetConfig(model=str(tmp_path), gguf_file="m.gguf"))
    assert (shape.num_layers, shape.vocab_size) == (7, 300)


def test_hf_directories_and_what_is_not_local(tiny_target_dir, tmp_path):
    shape = read_target_shape(TargetConfig(model=str(tiny_target_dir)))
    assert (shape.num_layers, shape.vocab_size) == (3, 49152)
    vlm = tmp_path / "vlm"  # a multimodal config: the text model's sizes
    vlm.mkdir()
    (vlm / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 48, "vocab_size": 262208}})
    )
    assert read_target_shape(TargetConfig(model=str(vlm))).num_layers == 48
    for model, gguf_file in [
        ("resources/not-retrieved-yet", "m.gguf"),  # the workflow retrieves it later
        (str(tmp_path / "vlm"), "absent.gguf"),
        ("nobody-has/this-model-cached", None),  # a hub id: the local HF cache only
    ]:
        assert read_target_shape(TargetConfig(model=model, gguf_file=gguf_file)) is None
    (vlm / "config.json").write_text("{not json")
    assert read_target_shape(TargetConfig(model=str(vlm))) is None  # the stage will say why


def test_skipped_where_the_target_is_not_local(data_dir):
    """A hub id the local cache does not hold: nothing to check the taps against yet (extract
    will). A local path that is not there is refused instead (test_planning.py)."""
    cfg = _config(data_dir, {"model": "someorg/not-cached"}, drafter={"target_layer_ids": [0, 99]})
    check_against_target(cfg)


def test_a_group_size_that_does_not_split_the_hidden_size_is_refused_at_start(data_dir):
    """fp4-zstd's extract.group_size against the target's hidden size, before any job runs (not
    when extract loads the target, after regenerate's GPU hours)."""
    fp4 = {"codec": "fp4-zstd", "group_size": 40}
    cfg = _config(data_dir, {"model": "x"}, extract=fp4)
    check_fits_target(cfg, TargetShape(30, 100, "x", hidden_size=640))  # 640 = 16 x 40
    with pytest.raises(ConfigError, match=r"extract\.group_size is 40, .* hidden size 576"):
        check_fits_target(cfg, TargetShape(30, 100, "x", hidden_size=576))


def test_default_taps_are_checked_and_named(data_dir):
    cfg = _config(data_dir, {"model": "x"}, drafter={"num_target_layers": 3})
    check_fits_target(cfg, TargetShape(30, 100, "x"))
    with pytest.raises(ConfigError, match=r"null: the default taps for drafter\.num_target_"):
        check_fits_target(cfg, TargetShape(2, 100, "x"))  # too few layers for any default


@pytest.mark.parametrize(
    "drafter, train, message",
    [
        ({"sliding_window": 600, "num_layers": 2}, {"max_length": 512},
         r"drafter\.sliding_window 600 is larger than train\.max_length 512"),
        ({"sliding_window": 64, "num_layers": 1}, {},
         r"drafter\.sliding_window 64 with drafter\.num_layers 1"),
    ],
)  # fmt: skip
def test_a_window_that_would_do_nothing_is_refused(data_dir, drafter, train, message):
    cfg = _config(data_dir, {"model": "x"}, drafter=drafter, train=train)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)
    ok = _config(data_dir, {"model": "x"}, drafter={"sliding_window": 512, "num_layers": 2},
                 train={"max_length": 512})  # fmt: skip
    check_config(ok)
