"""Prompt tokenization: conversations through the tokenizer's chat template, with an exact
assistant-only loss mask; or, for a target without a template (a base model), plain text.

    target.chat_template ─► apply_template_choice ─► tokenizer.chat_template
        a template ─► "chat":  messages rendered by it (below)
        None       ─► "plain": one user message's text, tokenized as the tokenizer does by default
                               (its BOS included), continued until the EOS token; anything else
                               (history, a system message) is refused, naming the key

The mask is found in token space. For each assistant turn the conversation before it (with the
generation prompt) and the conversation up to it are rendered and tokenized; both must be token
prefixes of the whole conversation's ids, and the tokens in between (trimmed after the last
end-of-turn token) are the answer. No string offsets are guessed, so a template that renders a
turn differently from how it stands in the whole conversation is an error, not a silent
misalignment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from dflashpipe.errors import ConfigError, DataError

# Tokens that close a turn besides the tokenizer's EOS (ChatML, Llama 3, Phi-3, Gemma).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
CHAT, PLAIN = "chat", "plain"  # prompt formats, as the sequences' metadata records them


def template_text(choice: str) -> str:
    """The Jinja text a target.chat_template other than auto / none names: itself where it reads
    as a template, else the file it names."""
    if "{{" in choice or "{%" in choice:
        return choice
    path = Path(choice).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ConfigError(
        f"target.chat_template {choice!r} is neither auto, none, Jinja template text nor an "
        "existing file holding one"
    )


def apply_template_choice(tokenizer: Any, choice: str | None) -> None:
    """Set the tokenizer's template as target.chat_template says (None / auto: its own)."""
    if choice not in (None, "auto"):
        tokenizer.chat_template = None if choice == "none" else template_text(choice)


def prompt_format(tokenizer: Any) -> str:
    """CHAT where the tokenizer has a template, else PLAIN."""
    return CHAT if getattr(tokenizer, "chat_template", None) is not None else PLAIN


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """EOS id plus the ids of the known end-of-turn tokens present in the vocabulary (a plain-text
    target: the EOS id alone, as a base model ends a text with it)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"tokenizer {_name(tokenizer)!r} has no EOS token (eos_token is None); generation "
            "needs one to stop and the loss mask needs it to close each answer"
        )
    ids = {eos}
    if prompt_format(tokenizer) == PLAIN:
        return ids
    for token in END_OF_TURN_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(token)
        # Unknown tokens map to the unk id; the round trip tells them apart.
        if isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == token:
            ids.add(tid)
    return ids


def encode_prompt(
    tokenizer: Any, messages: list[dict], enable_thinking: bool | None = None
) -> list[int]:
    """Token ids the target sees before it answers: the conversation rendered with
    add_generation_prompt=True (plain text: the user message's text)."""
    return encode_prompts(tokenizer, [messages], enable_thinking)[0]


def encode_prompts(
    tokenizer: Any, conversations: list[list[dict]], enable_thinking: bool | None = None
) -> list[list[int]]:
    """encode_prompt of many conversations: each rendered, all tokenized in one call, which a
    fast tokenizer spreads over its threads (regenerate encodes a whole shard's prompts before
    its GPU decodes any). The template's generation prompt is checked on the first."""
    for messages in conversations:
        _check_messages(tokenizer, messages, answered=False)
    if prompt_format(tokenizer) == PLAIN:
        texts = [_plain_text(tokenizer, messages) for messages in conversations]
        return [list(ids) for ids in tokenizer(texts)["input_ids"]] if texts else []
    kwargs = _template_kwargs(enable_thinking)
    texts = [
        _prompt_text(tokenizer, messages, kwargs)
        if k == 0
        else _render(tokenizer, messages, True, kwargs)
        for k, messages in enumerate(conversations)
    ]
    return _tokenize_all(tokenizer, texts)


def encode_chat(
    tokenizer: Any, messages: list[dict], enable_thinking: bool | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation ending with an assistant turn.

    loss_mask is 1 on every assistant turn's tokens up to and including its end-of-turn token
    (an empty think block the template puts there counts), 0 on everything else. Plain text: a
    user message and its answer; the answer's tokens (tokenized on their own, as the target
    would have produced them after the prompt's) and the EOS token after them are 1.
    """
    _check_messages(tokenizer, messages, answered=True)
    if prompt_format(tokenizer) == PLAIN:
        prompt = encode_prompt(tokenizer, messages[:-1])
        answer = _tokenize(tokenizer, messages[-1]["content"]) + [tokenizer.eos_token_id]
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    eot = end_of_turn_ids(tokenizer)
    kwargs = _template_kwargs(enable_thinking)
    ids = _encode(tokenizer, messages, False, kwargs)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = _assistant_span(tokenizer, messages, i, kwargs, ids)
        stop = _last_end_of_turn(tokenizer, ids, start, end, eot, i) + 1
        mask[start:stop] = [1] * (stop - start)
    return ids, mask


def _assistant_span(
    tok: Any, messages: list[dict], i: int, kwargs: dict, ids: list[int]
) -> tuple[int, int]:
    """Token range [start, end) of the assistant turn messages[i] inside ids, header excluded."""
    _prompt_text(tok, messages[:i], kwargs)  # raises when the template has no generation prompt
    upto = _encode(tok, messages[: i + 1], False, kwargs)
    if _is_prefix(upto, ids):
        end, settings = len(upto), [kwargs]
    else:
        end = _history_end(tok, messages, i, kwargs, ids)
        # A turn in history form was not rendered under the thinking switch (Qwen3 drops the
        # think block, so the enable_thinking=false prompt's empty block is absent): the
        # template's default generation prompt is what opens it.
        settings = [kwargs, {}] if kwargs else [kwargs]
    for setting in settings:
        before = _encode(tok, messages[:i], True, setting)
        if _is_prefix(before, ids) and len(before) <= end:
            return len(before), end
    raise DataError(
        f"tokenizer {_name(tok)!r}: the tokens of the generation prompt ({kwargs or 'default'}) "
        f"before the assistant turn at messages[{i}] are not a prefix of the whole "
        "conversation's tokens (the template renders earlier turns differently once later ones "
        "follow, or the tokenizer merges tokens across the end of the generation prompt); "
        "cannot mask this turn exactly"
    )


def _history_end(tok: Any, messages: list[dict], i: int, kwargs: dict, ids: list[int]) -> int:
    """End of assistant turn i when the template renders it differently once later messages
    follow (Qwen3 strips reasoning before the last user query): measured as (turn i + next
    message) minus (next message alone), both rendered after messages[:i] and checked."""
    if i + 1 >= len(messages):
        raise DataError(
            f"tokenizer {_name(tok)!r}: the conversation up to the final assistant turn at "
            f"messages[{i}] does not render to a token prefix of the whole conversation"
        )
    before = _encode(tok, messages[:i], False, kwargs)
    with_turn = _encode(tok, messages[: i + 2], False, kwargs)
    without_turn = _encode(tok, messages[:i] + [messages[i + 1]], False, kwargs)
    following = without_turn[len(before) :]
    end = len(with_turn) - len(following)
    consistent = (
        _is_prefix(with_turn, ids)
        and _is_prefix(before, with_turn)
        and _is_prefix(before, without_turn)
        and end >= len(before)
        and with_turn[end:] == following
    )
    if not consistent:
        raise DataError(
            f"tokenizer {_name(tok)!r}: the chat template rewrites history, so the assistant turn "
            f"at messages[{i}] renders differently once later messages follow and its tokens "
            "cannot be located in the whole conversation"
        )
    return end


def _last_end_of_turn(tok: Any, ids: list[int], start: int, end: int, eot: set[int], i: int) -> int:
    """Index of the last end-of-turn token in ids[start:end]; what follows it (the newline
    before the next turn) is template glue, not part of the answer."""
    for k in range(end - 1, start - 1, -1):
        if ids[k] in eot:
            return k
    names = sorted(tok.convert_ids_to_tokens(list(eot)))
    raise DataError(
        f"tokenizer {_name(tok)!r}: the assistant turn at messages[{i}] renders without an "
        f"end-of-turn token (expected one of {names}); the model would never learn to stop"
    )


def _prompt_text(tok: Any, messages: list[dict], kwargs: dict) -> str:
    """The conversation rendered with the generation prompt, which must add something."""
    text = _render(tok, messages, True, kwargs)
    if text == _render(tok, messages, False, kwargs):
        raise DataError(
            f"the chat template of tokenizer {_name(tok)!r} adds no generation prompt "
            "(add_generation_prompt=True renders the same text as False), so the start of the "
            "answer is unknown; use a template that opens the assistant turn"
        )
    return text


def _encode(tok: Any, messages: list[dict], generation_prompt: bool, kwargs: dict) -> list[int]:
    return _tokenize(tok, _render(tok, messages, generation_prompt, kwargs))


def _render(tok: Any, messages: list[dict], generation_prompt: bool, kwargs: dict) -> str:
    try:
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    except TemplateError as e:
        raise DataError(
            f"the chat template of tokenizer {_name(tok)!r} failed on {len(messages)} messages: {e}"
        ) from e


def _tokenize(tok: Any, text: str) -> list[int]:
    return _tokenize_all(tok, [text])[0]


def _tokenize_all(tok: Any, texts: list[str]) -> list[list[int]]:
    # The template owns the special tokens, as in apply_chat_template(tokenize=True) and vLLM:
    # with add_special_tokens=True a tokenizer that adds BOS would double a template's
    # {{ bos_token }} (SmolLM2's BOS is <|im_start|>, the opener of every turn).
    if not texts:
        return []
    return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def _template_kwargs(enable_thinking: bool | None) -> dict:
    # Only passed when set: a template that tests `enable_thinking is defined` must see it
    # undefined by default.
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def _plain_text(tok: Any, messages: list[dict]) -> str:
    """A plain-text prompt: the text of its one user message (no template to render more)."""
    if len(messages) != 1 or messages[0]["role"] != "user":
        roles = [m["role"] for m in messages]
        turns = ", or prompts.max_turns: 1 to keep single-turn prompts"
        raise DataError(
            f"tokenizer {_name(tok)!r} has no chat template, so a prompt is plain text: one user "
            f"message, not {len(messages)} messages {roles}; set target.chat_template to a "
            "template (Jinja text or a file) to render them"
            f"{turns if roles.count('user') > 1 else ''}"
        )
    return messages[0]["content"]


def _check_messages(tok: Any, messages: list[dict], answered: bool) -> None:
    if not messages:
        raise DataError("the conversation has no messages")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"messages[{k}] is not a dict with a string 'role': {message!r}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"messages[{k}]['content'] is not a string: {message.get('content')!r}")
    last = messages[-1]["role"]
    if answered and last != "assistant":
        raise DataError(f"the conversation ends with a {last!r} turn; expected 'assistant'")
    if not answered and last == "assistant":
        raise DataError("the prompt ends with an assistant turn; expected the turn to answer")


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _name(tok: Any) -> str:
    return getattr(tok, "name_or_path", "") or type(tok).__name__
