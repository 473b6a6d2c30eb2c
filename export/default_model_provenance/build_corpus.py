"""Build the default model's training corpus from the Python installation that runs this script.

Nothing is downloaded. The corpus has four kinds of documents, all from the running interpreter's standard library:

    source     every `*.py` file under the stdlib folder (tests included), except `site-packages/` and
               `pydoc_data/topics.py` (whose text is the `topic` documents below); files that are not UTF-8 or
               are empty are skipped. Newlines are normalised to "\\n"; nothing else is changed.
    topic      the language reference text shipped for `help()`: `pydoc_data.topics.topics`, one per key.
    cdoc       docstrings of the compiled (C) modules, which have no `.py` source: the module docstring and
               the docstrings of its public classes, their methods and its functions, written as a plain-text
               stub. Only docstrings and names are used, never values, so the text does not depend on the machine.
    chat       ChatML conversations generated from the documents above: "what does X do?" answered with X's
               docstring, "write X, which ..." answered with X's source (short functions only), and "explain the
               topic T" answered with the start of the reference text. They teach the chat format and the
               `<|im_end|>` stop.

Every document has an id ("Lib/json/encoder.py", "pydoc_data/topics/assert", "cdoc/_json", ...). The split is by
id: sha256(id) mod 100 < 3 is `test` (held out, reported), < 5 is `valid` (monitoring during training), the rest is
`train`. Chat documents take the split of the document they were made from, so no held-out file leaks into
training through a conversation.

Output (deterministic for a given Python build: sorted walks, no randomness, no timestamps):

    OUT/train.jsonl, OUT/valid.jsonl, OUT/test.jsonl   one {"id", "kind", "text"} object a line, sorted by id
    OUT/manifest.json                                   interpreter version, counts and bytes per split and kind,
                                                        sha256 of every output file

Usage: python export/default_model_provenance/build_corpus.py [--out .data/default_model/corpus]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import sysconfig
import textwrap
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_SOURCE_BYTES = 1 << 20
MAX_ANSWER_CHARS = 1500
MAX_FUNCTION_LINES = 30
TEST_PARTS = {"test", "tests", "idle_test"}
BOILERPLATE = ("Initialize self.", "Create and return a new object.")  # inherited slot docstrings


def split_of(doc_id: str) -> str:
    bucket = int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < 3 else "valid" if bucket < 5 else "train"


def pick(key: str, options: list[str]) -> str:
    """A phrasing chosen by hash, so the choice is fixed for a given name."""
    return options[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(options)]


def clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    for token in SPECIAL_TOKENS:  # keep the control tokens out of raw text
        text = text.replace(token, token.replace("|", "| "))
    return text


def chat(question: str, answer: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def truncate(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """Cut at a paragraph (else line) boundary before `limit` characters."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 3:
        cut = text.rfind("\n", 0, limit)
    if cut < limit // 3:
        cut = limit
    return text[:cut].rstrip()


# ----------------------------------------------------------------------------------------------------------------
# source files
# ----------------------------------------------------------------------------------------------------------------


def source_files(stdlib: Path) -> list[tuple[str, str]]:
    """(id, text) of every usable .py file under the stdlib folder, sorted by id."""
    out = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = Path(root) / name
            rel = path.relative_to(stdlib).as_posix()
            if rel == "pydoc_data/topics.py" or path.stat().st_size > MAX_SOURCE_BYTES:
                continue
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            text = clean(text)
            if text.strip():
                out.append(("Lib/" + rel, text))
    return sorted(out)


def module_name(doc_id: str) -> str:
    parts = doc_id[len("Lib/"):-len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_test_file(doc_id: str) -> bool:
    parts = doc_id.split("/")
    return any(p in TEST_PARTS or p.startswith("test_") for p in parts)


def signature_text(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        return f"{node.name}({ast.unparse(node.args)})"
    except Exception:  # noqa: BLE001 - unparse of odd defaults
        return f"{node.name}(...)"


def source_chats(doc_id: str, text: str) -> list[tuple[str, str]]:
    """Conversations about the public, documented module, classes and functions of one source file."""
    if is_test_file(doc_id):
        return []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    module = module_name(doc_id)
    lines = text.split("\n")
    out: list[tuple[str, str]] = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) > 40:
        question = pick(module, [f"What is the `{module}` module for?",
                                 f"Describe the Python module `{module}`.",
                                 f"What does the standard library module {module} do?"])
        out.append((f"{doc_id}#module", chat(question, truncate(doc))))

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                if node.name.startswith("_"):
                    continue
                qual = prefix + node.name
                doc = ast.get_docstring(node)
                if doc and len(doc) > 20:
                    question = pick(qual, [f"What is `{module}.{qual}`?",
                                           f"Explain the class {qual} from the {module} module.",
                                           f"What is the {qual} class in {module} used for?"])
                    out.append((f"{doc_id}#{qual}", chat(question, truncate(doc))))
                if not prefix:  # methods of top-level classes
                    visit(node.body, qual + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name.startswith("_"):
                    continue
                qual = prefix + node.name
                doc = ast.get_docstring(node)
                if not doc or len(doc) <= 20:
                    continue
                question = pick(qual, [f"What does `{module}.{qual}` do?",
                                       f"Explain {qual} in the {module} module.",
                                       f"How does `{qual}` from `{module}` behave?"])
                out.append((f"{doc_id}#{qual}", chat(question, truncate(doc))))
                start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
                end = node.end_lineno or node.lineno
                if 3 <= end - start <= MAX_FUNCTION_LINES:
                    code = textwrap.dedent("\n".join(lines[start:end]))
                    summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
                    where = f"method of `{prefix[:-1]}`" if prefix else "function"
                    question = pick(qual + "#code", [
                        f"Write the {where} `{signature_text(node)}` for the `{module}` module. {summary}",
                        f"Implement `{signature_text(node)}` ({module}): {summary}",
                        f"In Python, write `{node.name}` as in {module}. Its docstring says: {summary}",
                    ])
                    out.append((f"{doc_id}#{qual}#code", chat(question, f"```python\n{code}\n```")))

    visit(tree.body, "")
    return out


# ----------------------------------------------------------------------------------------------------------------
# reference topics and compiled modules' docstrings
# ----------------------------------------------------------------------------------------------------------------


def topic_documents() -> list[tuple[str, str, str]]:
    """(id, kind, text) for the reference topics and one conversation each."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = clean(topics[key]).strip("\n") + "\n"
        doc_id = f"pydoc_data/topics/{key}"
        out.append((doc_id, "topic", text))
        label = key.replace("-", " ")
        question = pick(key, [f"Explain the Python topic \"{label}\".",
                              f"What does the Python language reference say about {label}?",
                              f"Tell me about {label} in Python."])
        out.append((doc_id + "#chat", "chat", chat(question, truncate(text.strip()))))
    return out


def compiled_module_names(stdlib: Path) -> list[str]:
    names = set(sys.builtin_module_names)
    dynload = stdlib / "lib-dynload"
    if dynload.is_dir():
        for path in dynload.iterdir():
            if path.suffix in (".so", ".pyd"):
                names.add(path.name.split(".")[0])
    return sorted(n for n in names if not n.startswith(("_test", "xx", "_xx", "_ctypes_test")))


def cdoc_text(name: str) -> str | None:
    """Plain-text stub of a compiled module's docstrings (names and docstrings only)."""
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module this build cannot import is skipped
        return None
    if getattr(module, "__file__", "") and str(module.__file__).endswith(".py"):
        return None  # has a Python source, which the corpus already holds
    parts = [f"Module {name}\n"]
    if module.__doc__:
        parts.append(inspect.cleandoc(module.__doc__) + "\n")
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = getattr(module, attr)
        if inspect.isclass(obj) and getattr(obj, "__module__", None) == name:
            block = [f"class {attr}"]
            if obj.__doc__:
                block.append(textwrap.indent(inspect.cleandoc(obj.__doc__), "    "))
            for meth in sorted(vars(obj)):
                if meth.startswith("_") and meth not in ("__init__", "__new__", "__call__"):
                    continue
                member = vars(obj)[meth]
                doc = getattr(member, "__doc__", None)
                if callable(member) and isinstance(doc, str) and doc.strip() and not doc.startswith(BOILERPLATE):
                    block.append(f"    {meth}")
                    block.append(textwrap.indent(inspect.cleandoc(doc), "        "))
            parts.append("\n".join(block) + "\n")
        elif (inspect.isbuiltin(obj) or inspect.isroutine(obj)) and isinstance(obj.__doc__, str) and obj.__doc__.strip():
            parts.append(f"{attr}\n" + textwrap.indent(inspect.cleandoc(obj.__doc__), "    ") + "\n")
    text = clean("\n".join(parts))
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return text if len(parts) > 1 else None


# ----------------------------------------------------------------------------------------------------------------


def build(out_dir: Path) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents: list[tuple[str, str, str]] = []  # (id, kind, text)
    for doc_id, text in source_files(stdlib):
        documents.append((doc_id, "source", text))
        documents.extend((cid, "chat", ctext) for cid, ctext in source_chats(doc_id, text))
    documents.extend(topic_documents())
    for name in compiled_module_names(stdlib):
        text = cdoc_text(name)
        if text:
            documents.append((f"cdoc/{name}", "cdoc", text))
    documents.sort()

    out_dir.mkdir(parents=True, exist_ok=True)
    splits = ("train", "valid", "test")
    stats: dict[str, dict[str, dict[str, int]]] = {s: {} for s in splits}
    with contextlib.ExitStack() as stack:
        handles = {s: stack.enter_context(open(out_dir / f"{s}.jsonl", "w", encoding="utf-8")) for s in splits}
        for doc_id, kind, text in documents:
            split = split_of(doc_id.split("#")[0])
            handles[split].write(json.dumps({"id": doc_id, "kind": kind, "text": text}, ensure_ascii=False) + "\n")
            entry = stats[split].setdefault(kind, {"documents": 0, "bytes": 0})
            entry["documents"] += 1
            entry["bytes"] += len(text.encode("utf-8"))
    manifest = {
        "python": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "splits": stats,
        "sha256": {f"{s}.jsonl": hashlib.sha256((out_dir / f"{s}.jsonl").read_bytes()).hexdigest() for s in splits},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".data/default_model/corpus", type=Path)
    args = parser.parse_args()
    manifest = build(args.out)
    print(json.dumps(manifest, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
