"""A GGUF target's tokenizer, checked against the GGUF's own metadata before it is cached.

transformers 5.17 converts Gemma 3's GGUF tokenizer to a Unigram model; saved and reloaded it
becomes a BPE model without merges, which splits every character, and no release before 5.23
adds the BOS token the file asks for. A target fed such ids writes garbage (a GPU run of
configs/gemma3-270m-quality.yaml on 5.17 did: 111 tokens for a 40-token prompt). So every
conversion is checked on a canary text; where a Gemma GGUF's conversion fails the check, its
tokenizer is built again from the file's vocabulary as transformers 5.23+ does (merges in the
file's token order, whitespace-only tokens spelled with "\u2581", BOS as the file says), and
checked again; anything else that fails is refused, naming what is wrong.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.errors import DataError

log = logging.getLogger(__name__)

# code, prose, indents and a tab: a working tokenizer needs well under one token per 2 characters
CANARY = 'def total(values):\n    """Add the values up."""\n\treturn sum(values)  # the end\n'
CONTROL, USER_DEFINED = 3, 4  # GGUF token types (llama.cpp's)


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer fields of a GGUF file."""

    arch: str
    add_bos: bool
    bos: int | None
    tokens: tuple[str, ...]
    types: tuple[int, ...]


def read_vocab(path: Path) -> GGUFVocab:
    """The file's tokenizer fields, parsed once per process while the file is unchanged (a parse
    is Python over every vocabulary entry: 18 s for Gemma 3's 262K on the 2-core machine)."""
    stat = Path(path).stat()
    return _read_vocab(Path(path).resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_vocab(path: Path, mtime_ns: int, size: int) -> GGUFVocab:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def get(key: str, default=None):
        return fields[key].contents() if key in fields else default

    return GGUFVocab(
        get("general.architecture", ""), bool(get("tokenizer.ggml.add_bos_token", False)),
        get("tokenizer.ggml.bos_token_id"), tuple(get("tokenizer.ggml.tokens", [])),
        tuple(get("tokenizer.ggml.token_type", [])),
    )  # fmt: skip


def problems(tok, vocab: GGUFVocab) -> list[str]:
    """What is wrong with `tok` once saved and reloaded (as the cache serves it), against what
    the GGUF describes: empty where it encodes the canary as it should."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as saved:
        tok.save_pretrained(saved)
        back = AutoTokenizer.from_pretrained(saved)
    ids, again = tok(CANARY)["input_ids"], back(CANARY)["input_ids"]
    body = back(CANARY, add_special_tokens=False)["input_ids"]
    found = []
    if ids != again:
        found.append(f"saved and reloaded, it encodes the canary as {len(again)} tokens, not "
                     f"{len(ids)}")  # fmt: skip
    if len(body) > len(CANARY) // 2:
        found.append(f"{len(body)} tokens for the canary's {len(CANARY)} characters (a "
                     "vocabulary split without its merges)")  # fmt: skip
    if vocab.add_bos and again[:1] != [vocab.bos]:
        found.append(f"the GGUF asks for BOS ({vocab.bos}) first, the ids start {again[:1]}")
    return found


def gemma_tokenizer(vocab: GGUFVocab):
    """Gemma's tokenizer from the GGUF's vocabulary with transformers' own BPE classes: the file
    lists no merges, and its token order (not its scores) ranks them."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    ids = {t: i for i, t in enumerate(tokens)}
    merges = generate_merges(ids, {t: -i for i, t in enumerate(tokens)})
    tok = GemmaTokenizer(vocab=ids, merges=merges, add_bos_token=vocab.add_bos,
                         add_eos_token=False)  # fmt: skip
    kinds = list(zip(tokens, vocab.types, strict=True))
    control = [AddedToken(t, normalized=False, special=True) for t, k in kinds if k == CONTROL]
    tok.add_special_tokens({"additional_special_tokens": control},
                           replace_extra_special_tokens=False)  # fmt: skip
    user = [AddedToken(t, normalized=False, special=False) for t, k in kinds if k == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    return tok


def checked(tok, gguf: Path):
    """`tok` (transformers' conversion of `gguf`'s tokenizer) where it passes the check, else a
    Gemma tokenizer built again from the file; DataError naming the problems otherwise."""
    vocab = read_vocab(gguf)
    found = problems(tok, vocab)
    if not found:
        return tok
    if vocab.arch.startswith("gemma"):
        log.warning("%s: this transformers converts its tokenizer wrongly (%s); building it "
                    "from the file's vocabulary", gguf, "; ".join(found))  # fmt: skip
        tok, first = gemma_tokenizer(vocab), found
        found = problems(tok, vocab)
        if not found:
            return tok
        found = first + ["built again from the vocabulary: " + "; ".join(found)]
    raise DataError(f"{gguf}: its tokenizer does not convert with this transformers: "
                    f"{'; '.join(found)} (transformers >= 5.23 converts it)")  # fmt: skip
