"""Chat tokenization and the assistant-only loss mask, on the real SmolLM2 tokenizer and on a
Qwen3-style template fixture applied to a copy of it; plain-text prompts of a base model (the
same vocabulary without a template, with a BOS)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import SMOLLM2_GGUF, cache_dir
from tokenizers import Regex, pre_tokenizers, processors

from dflashpipe.chat import (
    CHAT,
    PLAIN,
    apply_template_choice,
    encode_chat,
    encode_prompt,
    encode_prompts,
    end_of_turn_ids,
    prompt_format,
)
from dflashpipe.errors import ConfigError, DataError

QWEN3_STYLE = Path(__file__).parent / "data" / "qwen3_style_template.jinja"
# Qwen2/Qwen3's pre-tokenizer split: a run of newlines stays one piece after punctuation and
# before text alike, which is what makes "</think>\n\n" tokenize the same at the end of the
# generation prompt and in front of the answer.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
EOT = "<|im_end|>"

# Marks the latest user message, so every earlier turn changes once a new question follows.
REWRITING_TEMPLATE = (
    "{%- set s = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set s.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' -}}"
    "{%- if loop.index0 == s.last -%}{{- '(latest) ' -}}{%- endif -%}"
    "{{- m.content + '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
NO_GENERATION_PROMPT_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path, smollm2_cache: Path):
    """SmolLM2's tokenizer as dflashpipe loads it: from the GGUF's conversion (smollm2_cache),
    named after the GGUF file."""
    from dflashpipe.config import TargetConfig
    from dflashpipe.target import load_tokenizer

    with cache_dir(smollm2_cache):
        return load_tokenizer(TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF))


def with_template(tok, template: str):
    out = copy.deepcopy(tok)
    out.chat_template = template
    return out


@pytest.fixture(scope="module")
def qwen3_style(smollm2):
    """SmolLM2's vocabulary with a Qwen3-style template, Qwen's pre-tokenizer split and
    <think>/</think> as added tokens, as in Qwen3."""
    tok = with_template(smollm2, QWEN3_STYLE.read_text(encoding="utf-8"))
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.add_tokens(["<think>", "</think>"])
    return tok


def template_ids(tok, messages: list[dict], **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each contiguous run of masked tokens."""
    runs, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    decode = lambda run: tok.decode(run, clean_up_tokenization_spaces=False)  # noqa: E731
    return [decode(run) for run in runs]


def test_end_of_turn_ids_smollm2(smollm2):
    assert end_of_turn_ids(smollm2) == {smollm2.convert_tokens_to_ids(EOT)} == {2}


def test_single_turn_masks_only_the_answer(smollm2):
    messages = [user("What is 2+2?"), assistant("2 + 2 = 4.\nAnything else?")]
    ids, mask = encode_chat(smollm2, messages)
    assert ids == template_ids(smollm2, messages)
    assert masked_runs(smollm2, ids, mask) == ["2 + 2 = 4.\nAnything else?" + EOT]
    # The newline after <|im_end|> is template glue, not part of the answer.
    assert mask[-1] == 0 and smollm2.decode(ids[-1:]) == "\n"


def test_prompt_is_the_prefix_before_the_answer(smollm2):
    messages = [user("Name a colour."), assistant("Blue.")]
    prompt = encode_prompt(smollm2, messages[:1])
    ids, mask = encode_chat(smollm2, messages)
    assert prompt == template_ids(smollm2, messages[:1], add_generation_prompt=True)
    assert ids[: len(prompt)] == prompt
    assert mask.index(1) == len(prompt) and not any(mask[: len(prompt)])
    assert smollm2.decode(prompt).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("system", [None, "You answer tersely."])
def test_multi_turn_masks_every_answer(smollm2, system):
    questions = ["Capital of France?", "Population?", "Greet in code."]
    answers = ["Paris.", "About 2.1 million people.", "```python\nprint('bonjour')\n```"]
    messages = [{"role": "system", "content": system}] if system else []
    for question, answer in zip(questions, answers, strict=True):
        messages += [user(question), assistant(answer)]
    ids, mask = encode_chat(smollm2, messages)
    assert ids == template_ids(smollm2, messages)
    assert masked_runs(smollm2, ids, mask) == [a + EOT for a in answers]
    # SmolLM2 inserts its own system prompt when none is given; it is never masked.
    text = smollm2.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert (system or "named SmolLM") in text


def test_bos_is_not_doubled(smollm2):
    # SmolLM2's BOS is <|im_start|>, which the template already opens with; a tokenizer that
    # also prepends BOS itself must not get a second one.
    messages = [user("Hi"), assistant("Hello.")]
    adds_bos = copy.deepcopy(smollm2)
    adds_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    assert adds_bos("x")["input_ids"][0] == smollm2.bos_token_id == 1
    for tok in (smollm2, adds_bos):
        ids, _ = encode_chat(tok, messages)
        assert ids[0] == 1 and ids[1] != 1
        assert encode_prompt(tok, messages[:1])[:2] == ids[:2]


@pytest.mark.parametrize(
    ("enable_thinking", "answer_run"),
    [
        (False, "Sure." + EOT),
        (True, EMPTY_THINK + "Sure." + EOT),
        (None, EMPTY_THINK + "Sure." + EOT),
    ],
)
def test_qwen3_style_empty_think(qwen3_style, enable_thinking, answer_run):
    messages = [{"role": "system", "content": "Be kind."}, user("Help?"), assistant("Sure.")]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids, mask = encode_chat(qwen3_style, messages, enable_thinking)
    assert ids == template_ids(qwen3_style, messages, **kwargs)
    # The empty think block is the target's own output unless the prompt already holds it.
    assert masked_runs(qwen3_style, ids, mask) == [answer_run]
    prompt = qwen3_style.decode(encode_prompt(qwen3_style, messages[:2], enable_thinking))
    assert prompt.endswith(
        "<|im_start|>assistant\n" + (EMPTY_THINK if enable_thinking is False else "")
    )


@pytest.mark.parametrize(
    ("enable_thinking", "final", "final_run"),
    [
        (False, "Yes.", "Yes." + EOT),
        (True, "Yes.", EMPTY_THINK + "Yes." + EOT),
        (
            True,
            "<think>\nCheck twice.\n</think>\n\nYes.",
            "<think>\nCheck twice.\n</think>\n\nYes." + EOT,
        ),
    ],
)
def test_qwen3_style_multi_turn(qwen3_style, enable_thinking, final, final_run):
    # Reasoning before the last user query is dropped from history, so earlier answers render
    # differently once a later question follows; their masks follow the history form.
    messages = [
        {"role": "system", "content": "Be brief."},
        user("Is 7 prime?"),
        assistant("<think>\nDivisors: 1 and 7.\n</think>\n\nYes, 7 is prime."),
        user("Is 11?"),
        assistant("Also prime."),
        user("And 13?"),
        assistant(final),
    ]
    ids, mask = encode_chat(qwen3_style, messages, enable_thinking)
    assert ids == template_ids(qwen3_style, messages, enable_thinking=enable_thinking)
    runs = masked_runs(qwen3_style, ids, mask)
    assert runs == ["Yes, 7 is prime." + EOT, "Also prime." + EOT, final_run]
    assert "Divisors" not in qwen3_style.decode(ids)


def test_qwen3_style_system_not_first(qwen3_style):
    messages = [user("Hi"), {"role": "system", "content": "Late."}, assistant("Hello.")]
    with pytest.raises(DataError, match="system message must come first"):
        encode_chat(qwen3_style, messages)


def test_generation_prompt_merged_by_tokenizer(smollm2):
    # With SmolLM2's own (GPT-2) pre-tokenizer, "\n\n" ending the enable_thinking=False prompt
    # is one token but splits into two before the answer: no exact token boundary exists.
    tok = with_template(smollm2, QWEN3_STYLE.read_text(encoding="utf-8"))
    messages = [user("Help?"), assistant("Sure.")]
    with pytest.raises(DataError, match=r"enable_thinking.*messages\[1\].*not a prefix"):
        encode_chat(tok, messages, enable_thinking=False)
    ids, mask = encode_chat(tok, messages, enable_thinking=True)
    assert masked_runs(tok, ids, mask) == [EMPTY_THINK + "Sure." + EOT]


def test_template_without_generation_prompt(smollm2):
    tok = with_template(smollm2, NO_GENERATION_PROMPT_TEMPLATE)
    with pytest.raises(DataError, match=r"resources/smollm2.*no generation prompt"):
        encode_prompt(tok, [user("Hi")])
    with pytest.raises(DataError, match="no generation prompt"):
        encode_chat(tok, [user("Hi"), assistant("Hello.")])


def test_tokenizer_without_eos(smollm2):
    tok = copy.deepcopy(smollm2)
    tok.eos_token = None
    with pytest.raises(DataError, match="no EOS token"):
        end_of_turn_ids(tok)
    with pytest.raises(DataError, match="no EOS token"):
        encode_chat(tok, [user("Hi"), assistant("Hello.")])


def test_template_that_rewrites_history(smollm2):
    tok = with_template(smollm2, REWRITING_TEMPLATE)
    single = [user("One?"), assistant("1.")]
    assert masked_runs(tok, *encode_chat(tok, single)) == ["1." + EOT]
    with pytest.raises(DataError, match=r"rewrites history.*messages\[1\]"):
        encode_chat(tok, single + [user("Two?"), assistant("2.")])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "no messages"),
        ([user("Hi")], "ends with a 'user' turn"),
        ([user("Hi"), {"role": "assistant", "content": None}], r"messages\[1\]\['content'\]"),
        ([{"content": "Hi"}, assistant("Hello.")], r"messages\[0\]"),
    ],
)
def test_malformed_conversations(smollm2, messages, match):
    with pytest.raises(DataError, match=match):
        encode_chat(smollm2, messages)


@pytest.fixture(scope="module")
def base_model(smollm2):
    """SmolLM2's vocabulary as a base model's: no chat template, and a BOS token the tokenizer
    adds to every text by default (as Gemma's and Llama's do)."""
    tok = with_template(smollm2, None)
    bos = tok.convert_ids_to_tokens(0)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, 0)]
    )
    return tok


def test_a_tokenizer_without_template_reads_plain_text(base_model):
    """A base model: the user message's text as the tokenizer encodes it by default (its BOS
    first), no role markers; the answer ends with EOS alone, and only it and the answer are 1."""
    code = 'def add(a, b):\n    """Return a plus b."""\n'
    assert prompt_format(base_model) == PLAIN
    prompt = encode_prompt(base_model, [user(code)], enable_thinking=False)
    assert prompt == base_model(code)["input_ids"] and prompt[0] == 0
    assert base_model.decode(prompt[1:]) == code
    assert end_of_turn_ids(base_model) == {base_model.eos_token_id}
    body = "    return a + b\n"
    ids, mask = encode_chat(base_model, [user(code), assistant(body)])
    answer = base_model(body, add_special_tokens=False)["input_ids"]
    assert ids == prompt + answer + [base_model.eos_token_id]
    assert mask == [0] * len(prompt) + [1] * (len(answer) + 1)
    assert masked_runs(base_model, ids, mask) == [body + base_model.eos_token]


@pytest.mark.parametrize(
    "messages",
    [
        [user("Hi"), assistant("Hello."), user("And?")],  # history
        [{"role": "system", "content": "Be brief."}, user("Hi")],
    ],
)
def test_plain_text_takes_one_user_message(base_model, messages):
    with pytest.raises(DataError, match=r"no chat template.*target\.chat_template"):
        encode_prompt(base_model, messages)
    with pytest.raises(DataError, match=r"target\.chat_template"):
        encode_chat(base_model, [*messages, assistant("Fine.")])


def test_chat_template_choice(smollm2, tmp_path):
    """target.chat_template: auto keeps the tokenizer's own, none drops it, Jinja text or a
    file sets it; anything else is refused, naming the key."""
    own = smollm2.chat_template
    tok = with_template(smollm2, own)
    apply_template_choice(tok, "auto")
    assert tok.chat_template == own and prompt_format(tok) == CHAT
    apply_template_choice(tok, "none")
    assert tok.chat_template is None and prompt_format(tok) == PLAIN
    apply_template_choice(tok, REWRITING_TEMPLATE)
    assert tok.chat_template == REWRITING_TEMPLATE
    (tmp_path / "t.jinja").write_text(NO_GENERATION_PROMPT_TEMPLATE)
    apply_template_choice(tok, str(tmp_path / "t.jinja"))
    assert tok.chat_template == NO_GENERATION_PROMPT_TEMPLATE
    with pytest.raises(ConfigError, match="target.chat_template 'templates/missing.jinja' is"):
        apply_template_choice(tok, "templates/missing.jinja")


def test_prompt_must_not_end_with_an_answer(smollm2):
    with pytest.raises(DataError, match="ends with an assistant turn"):
        encode_prompt(smollm2, [user("Hi"), assistant("Hello.")])


def test_prompts_encoded_together_are_those_encoded_one_by_one(smollm2, base_model):
    """encode_prompts (one tokenizer call for all, as regenerate encodes a shard) gives each
    conversation the ids its own rendering and tokenization give, chat template or plain text."""
    chats = [[user("Hi.")], [{"role": "system", "content": "Be terse."}, user("2+2?")],
             [user("Name a fruit."), assistant("Apple."), user("Another one, longer: " * 9)]]  # fmt: skip
    expected = [smollm2(smollm2.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"] for m in chats]  # fmt: skip
    assert encode_prompts(smollm2, chats) == expected
    assert len({len(ids) for ids in expected}) == 3 and encode_prompts(smollm2, []) == []
    texts = ["def f():", "x = 1\ny = 2"]
    plain = encode_prompts(base_model, [[user(t)] for t in texts])
    assert plain == [base_model(t)["input_ids"] for t in texts] and plain[0][0] == 0
