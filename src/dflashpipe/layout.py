"""Which target layers a drafter reads and which of its own layers use a sliding window.

Plain rules on integers, shared by the model, the extract stage and the checks that run before
any job (preflight), which must not pay for importing torch.

    taps:   drafter.target_layer_ids, or round(1 + i*(N-4)/(L-1)) for an N-layer target
            and L = drafter.num_target_layers; never the target's last layer N-1
    window: drafter.sliding_window on every drafter layer but the last, which keeps full
            attention (the layout of the published z-lab/Qwen3.6-27B-DFlash drafter:
            layer_types [sliding x4, full], sliding_window 2048)
"""

from __future__ import annotations

from collections.abc import Sequence

from dflashpipe.errors import ConfigError

FULL, SLIDING = "full_attention", "sliding_attention"


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps spread over layers 1..N-3 as in the published drafters: round(1 + i*(N-4)/(L-1))."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


def check_taps(ids: Sequence[int], num_target_layers: int, key: str, target: str) -> None:
    """Refuse taps outside the target and a tap on its last layer; `key` names the config key
    the taps came from, `target` the model whose layer count this is.

    Serving engines feed the drafter each tapped layer's output before the final norm (vLLM) or
    cannot tap the last layer at all (SGLang captures the input of layer i+1), while HF's
    hidden_states[N] — what extract would store for layer N-1 — is after the final norm."""
    last = num_target_layers - 1
    outside = [i for i in ids if not 0 <= i <= last]
    if outside or not ids:
        what = f"{outside} outside" if outside else "no layer of"
        raise ConfigError(
            f"{key} {list(ids)}: {what} the {num_target_layers} decoder layers of target "
            f"{target}; expected layer indices 0..{last - 1}"
        )
    if last in ids:
        raise ConfigError(
            f"{key} {list(ids)} taps layer {last}, the last of the {num_target_layers} decoder "
            f"layers of target {target}: HF's hidden_states[{num_target_layers}] is after the "
            "final norm, while vLLM feeds the drafter that layer's output before the norm and "
            f"SGLang cannot tap the last layer, so the drafter would be served other features; "
            f"tap layers 0..{last - 1}"
        )


def layer_types(num_layers: int, sliding_window: int | None) -> list[str]:
    """Per drafter layer: sliding attention for all but the last when a window is set."""
    if sliding_window is None:
        return [FULL] * num_layers
    return [SLIDING] * (num_layers - 1) + [FULL]
