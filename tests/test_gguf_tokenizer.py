"""A GGUF target's tokenizer is checked before it is cached (dflashpipe.gguf_tokenizer): the real
Gemma 3 and SmolLM2 GGUFs, their conversions and the broken kind transformers 5.17 made of
Gemma's (every character a token, no BOS)."""

from __future__ import annotations

import pytest
from conftest import GEMMA3_GGUF, SMOLLM2_GGUF

from dflashpipe import gguf_tokenizer
from dflashpipe.errors import DataError
from dflashpipe.target import CONVERSION

CODE = ["def cxxcode(expr, assign_to=None, standard='c++11', **settings):\n    \"\"\" C++. \"\"\"",
        "class Grid:\n\tdef __init__(self):\n        self.cells   = {}  # 🙂 ünïcode",
        "<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n"]  # fmt: skip


@pytest.fixture(scope="module")
def gemma_vocab(gemma3_dir):
    return gguf_tokenizer.read_vocab(gemma3_dir / GEMMA3_GGUF)


@pytest.fixture(scope="module")
def gemma_built(gemma_vocab):
    """Gemma's tokenizer built from the GGUF's vocabulary (its merges: about 5 s)."""
    return gguf_tokenizer.gemma_tokenizer(gemma_vocab)


def _merges_dropped(tok):
    """`tok`'s vocabulary without its merges: what 5.17's conversion became once reloaded."""
    from transformers import GemmaTokenizer

    return GemmaTokenizer(vocab=tok.get_vocab(), merges=[], add_bos_token=False)


@pytest.mark.slow
def test_gemma_rebuilt_from_its_vocabulary_encodes_as_transformers_does(gemma_vocab, gemma_built,
                                                                        gemma3_cache):  # fmt: skip
    """The tokenizer built from the GGUF's vocabulary encodes code, tabs, runs of spaces, emoji
    and turn markers with the same ids as the run's conversion (gemma3_cache: this transformers'
    own, checked), BOS first; both pass the check."""
    from transformers import AutoTokenizer

    (converted,) = (gemma3_cache / "gguf").iterdir()
    assert converted.name.endswith(f".v{CONVERSION}")
    native, built = AutoTokenizer.from_pretrained(converted), gemma_built
    assert (gemma_vocab.arch, gemma_vocab.add_bos, gemma_vocab.bos) == ("gemma3", True, 2)
    for text in CODE:
        ids = built(text)["input_ids"]
        assert ids == native(text)["input_ids"], text
        assert ids[0] == 2 and len(ids) < len(text) / 2
    assert built(CODE[2])["input_ids"][1] == 105  # <start_of_turn>: one special token
    assert gguf_tokenizer.problems(native, gemma_vocab) == []
    assert gguf_tokenizer.problems(built, gemma_vocab) == []


@pytest.mark.slow
def test_a_broken_gemma_conversion_is_built_again(gemma3_dir, gemma_vocab, gemma_built):
    """A conversion that splits every character and drops BOS fails the check on both counts;
    `checked` gives the tokenizer built from the file instead."""
    built = gemma_built
    broken = _merges_dropped(built)
    assert len(broken(CODE[0], add_special_tokens=False)["input_ids"]) == len(CODE[0])
    found = gguf_tokenizer.problems(broken, gemma_vocab)
    assert any("tokens for the canary" in p for p in found), found
    assert any("asks for BOS (2)" in p for p in found), found
    fixed = gguf_tokenizer.checked(broken, gemma3_dir / GEMMA3_GGUF)
    assert fixed(CODE[0])["input_ids"] == built(CODE[0])["input_ids"]


def test_smollm2_passes_and_a_broken_one_is_refused(smollm2_dir):
    """SmolLM2's conversion (its GGUF lists merges, adds no BOS) passes as it is; the same
    vocabulary without merges is refused, naming the file and the fault (no rebuild: only Gemma
    files are built again)."""
    from transformers import AutoTokenizer, GPT2Tokenizer

    gguf = smollm2_dir / SMOLLM2_GGUF
    vocab = gguf_tokenizer.read_vocab(gguf)
    assert (vocab.arch, vocab.add_bos) == ("llama", False)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
    assert gguf_tokenizer.checked(tok, gguf) is tok
    broken = GPT2Tokenizer(vocab=tok.get_vocab(), merges=[])
    with pytest.raises(DataError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf: .*tokens for the "
                                         r"canary"):  # fmt: skip
        gguf_tokenizer.checked(broken, gguf)
