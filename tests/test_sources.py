import gzip
import json
import platform
import sysconfig
from itertools import islice
from pathlib import Path

import pytest
from conftest import base_config

from dflashpipe.config import Config, SourceConfig
from dflashpipe.errors import DataError
from dflashpipe.sources import DropLog, ReadLog, _is_test_module, _python_files, read_source


def _read(src: SourceConfig):
    drops = DropLog()
    return list(read_source(src, drops)), drops


def _source(data_dir, name):
    cfg = Config.from_dict(base_config(data_dir))
    return next(s for s in cfg.prompts.sources if s.name == name)


def test_truncated_sharegpt_array_keeps_every_whole_object(data_dir):
    convs, drops = _read(_source(data_dir, "share"))
    assert [c.conversation_id for c in convs] == ["conv-a", "conv-b", "conv-c", "conv-d", "conv-e"]
    assert drops.counts == {"malformed_json": 1, "truncated_tail": 1}
    assert convs[0].turns[:2] == [("human", "What is the capital of France?"), ("gpt", "Paris.")]
    assert any("object 2" in e and "malformed_json" in e for e in drops.examples)
    assert any("object 6" in e and "truncated_tail" in e for e in drops.examples)


def test_real_sized_truncation_at_every_cut(tmp_path):
    """Cutting a valid array anywhere keeps exactly the objects that end before the cut."""
    objs = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"q{i} {{x}}"}]}
        for i in range(6)
    ]
    text = "[\n" + ",\n".join(json.dumps(o) for o in objs) + "\n]"
    ends = [text.index(json.dumps(o)) + len(json.dumps(o)) for o in objs]
    for cut in range(len(text) // 2, len(text), 7):
        path = tmp_path / "cut.json"
        path.write_text(text[:cut], encoding="utf-8")
        convs, drops = _read(SourceConfig(name="s", kind="sharegpt", path=str(path)))
        whole = sum(e <= cut for e in ends)
        assert len(convs) == whole, cut
        rest = text[ends[whole - 1] if whole else 1 : cut].strip(" ,\n]")
        assert sum(drops.counts.values()) == (1 if rest else 0), cut


def test_sharegpt_jsonl_variant(tmp_path):
    path = tmp_path / "sg.jsonl"
    path.write_text(
        json.dumps({"id": "x", "conversations": [{"from": "human", "value": "hi"}]}) + "\n{bad\n",
        encoding="utf-8",
    )
    convs, drops = _read(SourceConfig(name="s", kind="sharegpt", path=str(path)))
    assert [c.conversation_id for c in convs] == ["x"]
    assert drops.counts == {"malformed_json": 1}
    assert drops.examples[0].startswith(f"{path}:2: malformed_json")


def test_jsonl_messages_and_bad_lines(data_dir):
    convs, drops = _read(_source(data_dir, "msgs"))
    assert [c.conversation_id for c in convs] == ["m1", "m2", "m3", "m5"]
    assert drops.counts == {"malformed_json": 1, "missing_field": 1}
    assert any(":3: malformed_json" in e for e in drops.examples)
    assert any(":5: missing_field" in e and "'messages'" in e for e in drops.examples)


def test_parquet_messages(data_dir):
    convs, drops = _read(_source(data_dir, "pq"))
    assert [c.turns[0][1] for c in convs] == ["Parquet question one?", "Parquet question two?"]
    assert convs[1].turns[1][0] == "gpt" and not drops.counts


def test_humaneval_template_and_reference(data_dir):
    convs, _ = _read(_source(data_dir, "he"))
    assert len(convs) == 3 and convs[0].conversation_id == "HumanEval/0"
    (role, text), (arole, answer) = convs[0].turns
    assert role == "user" and "def f0(x):" in text and text.startswith("Complete the following")
    assert arole == "assistant" and "return x + 0" in answer


def test_instruction_fields(data_dir):
    src = SourceConfig(
        name="alp", kind="jsonl", path=str(data_dir / "alpaca.jsonl"),
        fields={"prompt": "instruction", "input": "input", "response": "output"},
    )  # fmt: skip
    convs, drops = _read(src)
    assert len(convs) == 4 and not drops.counts
    assert convs[1].turns == [
        ("user", "Write code number 1.\n\nin Python"),
        ("assistant", "print(1)"),
    ]
    assert convs[0].turns[0] == ("user", "Write code number 0.")


def test_hf_source_through_datasets(data_dir):
    pytest.importorskip("datasets")
    src = SourceConfig(
        name="hfjson", kind="hf", dataset="json", data_files=str(data_dir / "alpaca.jsonl"),
        fields={"prompt": "instruction", "response": "output"},
    )  # fmt: skip
    convs, drops = _read(src)
    assert [c.turns[-1][1] for c in convs] == [f"print({i})" for i in range(4)]
    assert convs[0].origin == "json[train]:row 0"


def test_missing_file_is_named(tmp_path):
    src = SourceConfig(name="s", kind="jsonl", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match=r"not found: .*missing.jsonl \(prompts.sources 's' path"):
        _read(src)


def test_not_parquet_is_named(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match="x.parquet"):
        _read(SourceConfig(name="s", kind="parquet", path=str(path)))


def test_not_utf8_is_named(tmp_path):
    path = tmp_path / "x.jsonl.gz"
    path.write_bytes(gzip.compress(b"\xff\xfe\x00bad"))
    with pytest.raises(DataError, match="not UTF-8"):
        _read(SourceConfig(name="s", kind="jsonl", path=str(path)))


MODULE = '''"""A module."""
import os
\x0c


def add(a: int, b: int) -> int:
    """Add two numbers.

    >>> add(2, 3)
    5
    """
    total = a + b
    return total


def undocumented(x):
    return x


def _private(x):
    """Hidden."""
    return x


def only_doc():
    """Nothing else."""


class Box:
    def size(self):
        """How many items."""
        return len(self.items)

    async def fill(self, n):
        """Fill it with n items."""
        self.items = list(range(n))
        return self
'''


def _python_package(tmp_path, as_wheel):
    files = {"pkg/core.py": MODULE, "pkg/tests/test_core.py": MODULE, "pkg/broken.py": "def (:\n",
             "pkg/latin.py": "s = '\xe9'\n".encode("latin-1")}  # fmt: skip
    if as_wheel:
        import zipfile

        path = tmp_path / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            for name, text in files.items():
                zf.writestr(name, text)
        return path
    for name, text in files.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        mode = "wb" if isinstance(text, bytes) else "w"
        with open(tmp_path / "src" / name, mode) as f:
            f.write(text)
    return tmp_path / "src"


@pytest.mark.parametrize("as_wheel", [True, False], ids=["wheel", "directory"])
def test_python_source_makes_humaneval_shaped_tasks(tmp_path, as_wheel):
    path = _python_package(tmp_path, as_wheel)
    src = Config.from_dict(
        {"target": {"model": "m"},
         "prompts": {"sources": [{"name": "code", "kind": "python", "path": str(path)}]}}
    ).prompts.sources[0]  # fmt: skip
    convs, drops = _read(src)
    assert [c.conversation_id for c in convs] == [
        "pkg/core.py:add", "pkg/core.py:Box.size", "pkg/core.py:Box.fill"]  # fmt: skip
    (role, text), (arole, answer) = convs[0].turns
    assert role == "user" and text.startswith("Complete the following Python function")
    assert 'def add(a: int, b: int) -> int:\n    """Add two numbers.\n\n    >>> add(2, 3)' in text
    assert "total = a + b" not in text  # the body is the answer, not the prompt
    assert arole == "assistant" and answer.endswith("total = a + b\n    return total\n")
    fill = convs[2].turns[0][1]  # a method is dedented to the left margin
    assert 'async def fill(self, n):\n    """Fill it with n items."""\n```' in fill
    assert convs[0].origin.endswith("core.py:6")  # the form-feed line is one line, as for ast
    assert dict(drops.counts) == {"test_module": 1, "unparsable": 2, "no_docstring": 1,
                                  "private": 1, "no_body": 1}  # fmt: skip
    assert any("broken.py: unparsable (SyntaxError)" in e for e in drops.examples)
    assert any("latin.py: unparsable (UnicodeDecodeError)" in e for e in drops.examples)


def test_python_source_names_a_bad_archive(tmp_path):
    bad = tmp_path / "pkg.whl"
    bad.write_bytes(b"not a zip")
    src = SourceConfig(name="code", kind="python", path=str(bad))
    with pytest.raises(DataError, match="pkg.whl: not a readable wheel or zip"):
        _read(src)
    with pytest.raises(DataError, match="not found"):
        _read(SourceConfig(name="code", kind="python", path=str(tmp_path / "nope.whl")))


def test_python_source_reads_one_file(tmp_path):
    path = tmp_path / "core.py"
    path.write_text(MODULE)
    convs, drops = _read(SourceConfig(name="code", kind="python", path=str(path)))
    assert [c.conversation_id for c in convs] == [
        "core.py:add",
        "core.py:Box.size",
        "core.py:Box.fill",
    ]
    assert convs[0].origin == f"{path}:6"
    assert f"{path}:16: no_docstring (undocumented)" in drops.examples


def _stdlib_like(root: Path) -> Path:
    """A directory laid out like a standard library: modules, packages, test suites where
    CPython keeps them, installed packages, a file that is not UTF-8 and one that cannot be read."""
    files = {"json/__init__.py": MODULE, "textwrap.py": MODULE.replace("Box", "Wrapper"),
             "test/support.py": MODULE, "idlelib/idle_test/htest.py": MODULE,
             "lib2to3/tests/data/py2.py": "print 'x'\n", "unittest/test/test_case.py": MODULE,
             "site-packages/numpy/core.py": MODULE, "dist-packages/six.py": MODULE,
             "latin.py": "s = '\xe9'\n".encode("latin-1")}  # fmt: skip
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    (root / "gone.py").symlink_to(root / "nowhere.py")  # listed, but reading it fails
    return root


def test_python_directory_laid_out_like_a_stdlib(tmp_path):
    root = _stdlib_like(tmp_path / "lib")
    drops, files = DropLog(), ReadLog()
    convs = list(read_source(SourceConfig(name="std", kind="python", path=str(root)), drops, files))
    assert sorted({c.conversation_id.split(":")[0] for c in convs}) == [
        "json/__init__.py", "textwrap.py"]  # fmt: skip
    assert "textwrap.py:Wrapper.fill" in [c.conversation_id for c in convs]
    assert drops.counts["test_module"] == 4  # test/, idle_test/, lib2to3/tests/, unittest/test/
    assert drops.counts["unparsable"] == 1 and drops.counts["unreadable"] == 1
    assert any("gone.py: unreadable (No such file or directory)" in e for e in drops.examples)
    assert not any("packages" in c.origin for c in convs)  # installed packages are not read
    summary = files.summary()
    assert summary["path"] == str(root) and summary["read"] == 3  # the two modules and latin.py
    assert set(files.hashes) == {"json/__init__.py", "textwrap.py", "latin.py"}
    assert "version" not in summary  # only <stdlib> names an interpreter


def test_read_digest_follows_the_code_read(tmp_path):
    root = _stdlib_like(tmp_path / "lib")
    src = SourceConfig(name="std", kind="python", path=str(root))

    def digest() -> str:
        files = ReadLog()
        list(read_source(src, DropLog(), files))
        return files.summary()["sha256"]

    first = digest()
    assert digest() == first  # the same files, the same digest
    (root / "test" / "support.py").write_text(MODULE + "\n# edited\n")
    assert digest() == first  # a test module is never read
    (root / "json" / "__init__.py").write_text(MODULE.replace("total = a + b", "total = b + a"))
    changed = digest()
    assert changed != first
    (root / "json" / "__init__.py").rename(root / "json" / "core.py")
    assert digest() not in (first, changed)  # the names count, not only the contents


def test_stdlib_source_reads_this_python():
    """path <stdlib> on the real interpreter: reading stops where the caller stops (20 tasks),
    and listing every file (nothing read) finds no installed package and leaves no test suite
    unrecognized."""
    root = Path(sysconfig.get_paths()["stdlib"])
    src = Config.from_dict(
        {"target": {"model": "m"},
         "prompts": {"sources": [{"name": "std", "kind": "python", "path": "<stdlib>"}]}}
    ).prompts.sources[0]  # fmt: skip
    drops, files = DropLog(), ReadLog()
    convs = list(islice(read_source(src, drops, files), 20))
    assert len(convs) == 20 and 0 < len(files.hashes) < 40
    assert files.summary()["path"] == str(root)
    assert files.python == {"implementation": platform.python_implementation(),
                            "version": platform.python_version()}  # fmt: skip
    for c in convs:
        module, qualname = c.conversation_id.split(":")
        source = (root / module).read_text(encoding="utf-8")
        (_, prompt), (_, answer) = c.turns
        assert c.origin.startswith(f"{root}/{module}:") and module in files.hashes
        assert answer.splitlines()[0].lstrip() in source  # the function's own `def` line
        assert answer.splitlines()[0] in prompt and qualname.split(".")[-1] in answer
    names = [name for name, _, _ in _python_files(root)]
    assert "json/__init__.py" in names and "os.py" in names
    assert not any(n.startswith(("site-packages/", "dist-packages/")) for n in names)
    suites = [n for n in names if any("test" in d and d != "unittest" for d in n.split("/")[:-1])]
    assert suites and all(_is_test_module(n) for n in suites)
