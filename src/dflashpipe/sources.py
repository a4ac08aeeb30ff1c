"""Prompt sources: read each kind of file into raw conversations, counting what cannot be read.

A reader yields `RawConversation`s (role names still as the file spells them) and reports every
row it cannot use to a `DropLog` with the file and row, so a bad line never stops the stage and
never disappears silently. Code sources (kind python) also fill a `ReadLog`: which files they
read, so stats.json can tell whether two runs read the same code.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import platform
import re
import sysconfig
import textwrap
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflashpipe.config import STDLIB_PATH, TEMPLATE_KINDS, FieldMap, SourceConfig
from dflashpipe.errors import DataError

# Column names per kind when the source's `fields` leaves them unset.
KIND_FIELDS = {
    "sharegpt": FieldMap(id="id", messages="conversations", role="from", content="value"),
    "jsonl": FieldMap(id="id", messages="messages", role="role", content="content"),
    "parquet": FieldMap(id="id", messages="messages", role="role", content="content"),
    "hf": FieldMap(id="id", messages="messages", role="role", content="content"),
    "humaneval": FieldMap(id="task_id", prompt="prompt", response="canonical_solution"),
    "python": FieldMap(id="task_id", prompt="prompt", response="canonical_solution"),
}
EXAMPLES_PER_REASON = 3
# Every reason the prompts stage leaves something out (stats.json's `dropped`), with what one
# count is: the readers here, prompts.py's conversations, filters, dedupe, split and limits. A
# DropLog refuses a reason missing here, and the report explains each count from this table.
DROP_REASONS = {
    "not_an_object": "a record of the file that is not a JSON object",
    "missing_field": "a record without a field its kind (or the source's `fields`) names",
    "malformed_json": "a line or object of the file that does not parse as JSON",
    "truncated_tail": (
        "the cut-off last object of a JSON array (the packaged ShareGPT file ends mid-object)"
    ),
    "test_module": "a test module of a code source (its functions are not read)",
    "unreadable": "a file of a code source that could not be read",
    "unparsable": "a file of a code source that is not valid Python",
    "private": "a function or method of a code source whose name starts with `_`",
    "no_docstring": "a public function of a code source without a docstring (its prompt)",
    "no_body": "a function of a code source that is only a docstring",
    "unknown_role": "a conversation with a role name neither built in nor in the source's `roles`",
    "empty_message": "a conversation with an empty message",
    "system_not_first": "a conversation with a system message after its first message",
    "empty_conversation": "a conversation without a user message",
    "unanswered": "a user turn without an answer (prompts.keep_unanswered: false)",
    "too_short": "a prompt (a user turn with its history) under prompts.min_chars characters",
    "too_long": (
        "a prompt (a user turn with its history) over prompts.max_chars characters "
        "(prompts.trim_history keeps a tail that fits instead)"
    ),
    "too_many_turns": "a prompt with more than prompts.max_turns user turns",
    "reference_too_long": (
        "a prompt whose dataset answer is over prompts.max_reference_chars characters"
    ),
    "duplicate": (
        "a prompt whose messages repeat an earlier one's (prompts.dedupe; an eval "
        "source keeps its copy)"
    ),
    "trimmed_held_out": "a trimmed turn of a held-out conversation (trimmed prompts train only)",
    "excluded": "a train prompt that a prompts.exclude file holds",
    "over_limit": (
        "a prompt past its source's share of prompts.max_train (or past its `limit`): "
        "the sample kept is drawn at random"
    ),
}


class DropCounts(Counter):
    """stats.json's `dropped` of one source: a Counter that takes DROP_REASONS' names only."""

    def __setitem__(self, reason: str, count: int) -> None:
        if reason not in DROP_REASONS:
            raise KeyError(
                f"drop reason {reason!r} is not in sources.DROP_REASONS; declare it there with "
                "what one count of it is (the report explains every count from that table)"
            )
        super().__setitem__(reason, count)


# Directories of installed packages, never part of a code source's own code (the interpreter's
# standard library directory holds site-packages).
INSTALLED_DIRS = ("site-packages", "dist-packages")
TEST_DIRS = ("test", "tests", "testing", "idle_test")  # idle_test: idlelib's, in the stdlib


@dataclass
class RawConversation:
    conversation_id: str
    origin: str  # "file:row", for messages and stats
    turns: list[tuple[str, str]]  # (role as written, content)


@dataclass
class DropLog:
    """Dropped rows of one source: a count per reason and its first places, for stats.json."""

    counts: DropCounts = field(default_factory=DropCounts)
    examples: list[str] = field(default_factory=list)

    def drop(self, reason: str, origin: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if self.counts[reason] <= EXAMPLES_PER_REASON:
            self.examples.append(f"{origin}: {reason}" + (f" ({detail})" if detail else ""))


@dataclass
class ReadLog:
    """The .py files one code source read, for stats.json: where from (for <stdlib>, also which
    interpreter), how many, and one sha256 over their sorted (name, file sha256) pairs, so two
    runs with the same digest read the same code."""

    path: str = ""
    python: dict | None = None  # {"implementation", "version"} of the interpreter, for <stdlib>
    hashes: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, raw: bytes) -> None:
        self.hashes[name] = hashlib.sha256(raw).hexdigest()

    def summary(self) -> dict:
        pairs = "".join(f"{name}\t{digest}\n" for name, digest in sorted(self.hashes.items()))
        return {"path": self.path, **(self.python or {}), "read": len(self.hashes),
                "sha256": hashlib.sha256(pairs.encode()).hexdigest()}  # fmt: skip


def resolve_fields(src: SourceConfig) -> FieldMap:
    base = KIND_FIELDS[src.kind]
    given = {k: v for k, v in vars(src.fields).items() if v is not None}
    if given.get("prompt") and not given.get("messages"):
        # Instruction-style columns replace the kind's default list-of-turns layout.
        base = FieldMap(id=base.id)
    return FieldMap(**{**vars(base), **given})


def record_turns(rec: dict, fields: FieldMap, template: str | None = None) -> list[tuple[str, str]]:
    """Turns of one record, either from a list of turn objects or from instruction columns."""
    if fields.messages:
        turns = rec.get(fields.messages)
        if not isinstance(turns, list):
            raise KeyError(f"column {fields.messages!r} missing or not a list")
        out = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or fields.role not in t or fields.content not in t:
                raise KeyError(f"turn {i} lacks {fields.role!r}/{fields.content!r}")
            out.append(
                (str(t[fields.role]), "" if t[fields.content] is None else str(t[fields.content]))
            )
        return out
    if fields.prompt not in rec:
        raise KeyError(f"column {fields.prompt!r} missing")
    prompt = str(rec[fields.prompt])
    if fields.input and rec.get(fields.input):
        prompt = f"{prompt}\n\n{rec[fields.input]}"
    if template:
        prompt = template.replace("{prompt}", prompt)
    turns = (
        [("system", str(rec[fields.system]))] if fields.system and rec.get(fields.system) else []
    )
    turns.append(("user", prompt))
    if fields.response and rec.get(fields.response):
        turns.append(("assistant", str(rec[fields.response])))
    return turns


def _conversations(records, src: SourceConfig, drops: DropLog) -> Iterator[RawConversation]:
    """Turn (origin, record) pairs into RawConversations; unusable records become drops."""
    fields = resolve_fields(src)
    template = src.template if src.kind in TEMPLATE_KINDS else None
    for origin, rec in records:
        if not isinstance(rec, dict):
            drops.drop("not_an_object", origin, type(rec).__name__)
            continue
        try:
            turns = record_turns(rec, fields, template)
        except KeyError as e:
            drops.drop("missing_field", origin, str(e).strip("\"'"))
            continue
        conv_id = rec.get(fields.id) if fields.id else None
        yield RawConversation(str(conv_id) if conv_id is not None else origin, origin, turns)


_SKIP = re.compile(r"[\s,]*")


def _json_array_records(path: Path, text: str, drops: DropLog) -> Iterator[tuple[str, object]]:
    """Objects of a JSON array one at a time, so a file cut off mid-object still yields all the
    whole objects before the cut. A malformed object in the middle is skipped by resynchronizing
    on the next object that parses."""
    decoder = json.JSONDecoder()
    pos, n, end = text.index("[") + 1, 0, len(text)
    while True:
        pos = _SKIP.match(text, pos).end()
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            bad_at, pos = pos, _resync(text, pos + 1, decoder)
            reason = "truncated_tail" if pos >= end else "malformed_json"
            drops.drop(reason, f"{path}:object {n} (char {bad_at})", e.msg)
            n += 1
            continue
        yield f"{path}:object {n}", obj
        n += 1


def _resync(text: str, pos: int, decoder: json.JSONDecoder) -> int:
    """Offset of the next top-level-looking object after a decode error (or len(text))."""
    while (pos := text.find("{", pos)) != -1:
        try:
            obj, _ = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            pos += 1
            continue
        # A nested turn object also parses; only a conversation-shaped object resynchronizes.
        if (
            isinstance(obj, dict)
            and len(obj)
            and not {"from", "value", "role", "content"} & set(obj)
        ):
            return pos
        pos += 1
    return len(text)


def _jsonl_records(path: Path, text: str, drops: DropLog) -> Iterator[tuple[str, object]]:
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{i}", json.loads(line)
        except json.JSONDecodeError as e:
            drops.drop("malformed_json", f"{path}:{i}", e.msg)


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as e:  # permissions, I/O errors, a cut-off .gz
        raise DataError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None


def _file_records(
    src: SourceConfig, drops: DropLog, files: ReadLog
) -> Iterator[tuple[str, object]]:
    path = _stdlib(src, files) if src.path == STDLIB_PATH else Path(src.path)
    if not path.exists():
        raise DataError(f"prompt source file not found: {path} (prompts.sources '{src.name}' path)")
    if src.kind == "parquet":
        yield from _parquet_records(path)
        return
    if src.kind == "python":
        yield from _python_records(path, drops, files)
        return
    text = _read_text(path)
    if src.kind == "sharegpt" and text.lstrip().startswith("["):
        yield from _json_array_records(path, text, drops)
    else:
        yield from _jsonl_records(path, text, drops)


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            yield f"{path}:row {row}", rec
            row += 1


def _stdlib(src: SourceConfig, files: ReadLog) -> Path:
    """The running interpreter's standard library directory (path <stdlib>); `files` records
    which interpreter it is, since another Python's stdlib makes other prompts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"prompts.sources '{src.name}': path {STDLIB_PATH} resolves to {root}, "
            "which is not a directory"
        )
    files.python = {
        "implementation": platform.python_implementation(),
        "version": platform.python_version(),
    }
    return root


def _python_files(path: Path) -> Iterator[tuple[str, str, Callable[[], bytes]]]:
    """(name, where, read) of every .py file in a wheel or zip, under a directory (outside its
    site-packages), or the file itself: `name` is its path inside the source, `where` names it in
    drops and origins, `read()` returns its bytes (a skipped file is never read)."""
    if path.is_dir():
        for f in sorted(_py_files_under(path)):
            yield f.relative_to(path).as_posix(), str(f), f.read_bytes
    elif path.suffix in (".whl", ".zip"):
        try:
            with zipfile.ZipFile(path) as zf:
                for name in sorted(n for n in zf.namelist() if n.endswith(".py")):
                    yield name, f"{path}!{name}", lambda name=name: zf.read(name)
        except zipfile.BadZipFile as e:
            raise DataError(f"{path}: not a readable wheel or zip ({e})") from None
    else:
        yield path.name, str(path), path.read_bytes


def _py_files_under(root: Path) -> Iterator[Path]:
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in INSTALLED_DIRS]
        yield from (Path(folder, n) for n in names if n.endswith(".py"))


def _is_test_module(name: str) -> bool:
    parts = name.split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or parts[-1].startswith(("test_", "conftest"))


def _python_records(path: Path, drops: DropLog, files: ReadLog) -> Iterator[tuple[str, object]]:
    """HumanEval-shaped tasks from Python code: every documented public function and method,
    with its signature and docstring as the prompt and the whole function as the dataset's
    answer. Test modules, unreadable files, private names, undocumented functions and functions
    that are only a docstring are counted as drops; every file read goes into `files`."""
    files.path = str(path)
    for name, where, read in _python_files(path):
        if _is_test_module(name):
            drops.drop("test_module", where)
            continue
        try:
            raw = read()
        except (OSError, zipfile.BadZipFile, zlib.error) as e:  # permissions, a corrupt member
            drops.drop("unreadable", where, getattr(e, "strerror", None) or str(e))
            continue
        files.add(name, raw)
        try:  # ast numbers lines by \n, \r\n and \r only (str.splitlines also splits at \f)
            text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
            tree = ast.parse(text, filename=name)
        except (UnicodeDecodeError, SyntaxError, ValueError) as e:
            drops.drop("unparsable", where, type(e).__name__)
            continue
        lines = text.split("\n")
        for qualname, node in _functions(tree):
            origin = f"{where}:{node.lineno}"
            body = node.body
            if node.name.startswith("_"):
                drops.drop("private", origin, qualname)
            elif ast.get_docstring(node) is None:
                drops.drop("no_docstring", origin, qualname)
            elif len(body) < 2:
                drops.drop("no_body", origin, qualname)
            else:
                head = textwrap.dedent("\n".join(lines[node.lineno - 1 : body[0].end_lineno]))
                whole = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                yield origin, {"task_id": f"{name}:{qualname}", "prompt": head + "\n",
                               "canonical_solution": whole + "\n"}  # fmt: skip


def _functions(parent: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of a module's functions and its classes' methods, in file order
    (functions nested inside functions are part of their parent's answer)."""
    for node in ast.iter_child_nodes(parent):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _hf_records(src: SourceConfig) -> Iterator[tuple[str, object]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"prompts source '{src.name}' (kind hf) needs the `datasets` package: "
            "pip install 'dflashpipe[hf]'"
        ) from None
    try:
        ds = datasets.load_dataset(
            src.dataset, src.dataset_config, split=src.hf_split, data_files=src.data_files
        )
    except Exception as e:  # datasets raises many types (hub, file, builder); name the source
        raise DataError(
            f"prompts source '{src.name}': load_dataset({src.dataset!r}) failed: {e}"
        ) from e
    for i, rec in enumerate(ds):
        yield f"{src.dataset}[{src.hf_split}]:row {i}", rec


def read_source(
    src: SourceConfig, drops: DropLog, files: ReadLog | None = None
) -> Iterator[RawConversation]:
    """Every usable conversation of one configured source, in file order; a code source's files
    go into `files`."""
    files = ReadLog() if files is None else files
    records = _hf_records(src) if src.kind == "hf" else _file_records(src, drops, files)
    yield from _conversations(records, src, drops)
