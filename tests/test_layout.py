"""layout.py: the taps' and the sliding window's rules, shared by the model and the checks."""

import pytest

from dflashpipe.errors import ConfigError
from dflashpipe.layout import check_taps, default_target_layer_ids, layer_types


def test_default_taps_never_reach_the_last_layer():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(30, 3) == [1, 14, 27]  # SmolLM2, the embedded default
    for n in range(4, 80):
        for taps in range(1, 9):
            check_taps(default_target_layer_ids(n, taps), n, "drafter.target_layer_ids", "t")


@pytest.mark.parametrize(
    "ids, message",
    [
        (
            [1, 29],
            r"drafter\.target_layer_ids \[1, 29\] taps layer 29, the last of the 30 .*"
            r"before the norm .* tap layers 0\.\.28",
        ),  # fmt: skip
        (
            [1, 30],
            r"drafter\.target_layer_ids \[1, 30\]: \[30\] outside the 30 decoder layers "
            r"of target T; expected layer indices 0\.\.28",
        ),  # fmt: skip
        ([-1, 3], r"\[-1\] outside"),
        ([], r"\[\]: no layer of the 30 decoder layers"),
    ],
)
def test_taps_on_the_last_layer_or_outside_are_refused(ids, message):
    with pytest.raises(ConfigError, match=message):
        check_taps(ids, 30, "drafter.target_layer_ids", "T")


def test_the_window_goes_to_every_layer_but_the_last():
    assert layer_types(5, 2048) == ["sliding_attention"] * 4 + ["full_attention"]
    assert layer_types(2, 64) == ["sliding_attention", "full_attention"]
    assert layer_types(3, None) == ["full_attention"] * 3
