"""Reading what a user wrote: a text file with its errors in words (config, data and prompt
files all come through `read_user_text`), JSON (with comments, for the fine-tune config) and YAML
mappings that refuse duplicate keys, and `--set field=value` overrides."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

from steadytrain.config.explain import type_name
from steadytrain.errors import BadInputError


def read_user_text(path: Path, what: str, encoding: str = "utf-8", hint: str = "") -> str:
    """The text of a file the user named; a missing, unreadable or non-text file is
    BadInputError naming `what` it is ("config file", "data file", "--prompts-file:") and the
    fix. `hint` ends the not-UTF-8 message (what to do about it)."""
    try:
        return path.read_text(encoding=encoding)
    except FileNotFoundError:
        raise BadInputError(f"{what} {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise BadInputError(
            f"{what} {path} cannot be read: it is a directory; give the file inside it"
        ) from None
    except UnicodeDecodeError:
        if _utf16(path):  # saved as "Unicode" / "UTF-16" by an editor
            raise BadInputError(
                f"{what} {path} is UTF-16 text, not UTF-8: save it again as UTF-8"
            ) from None
        raise BadInputError(f"{what} {path} is not UTF-8 text{hint}") from None
    except OSError as exc:
        raise BadInputError(f"{what} {path} cannot be read: {exc.strerror}") from None


def _utf16(path: Path) -> bool:
    """Whether the file starts with a UTF-16 byte order mark."""
    try:
        with open(path, "rb") as file:
            return file.read(2) in (b"\xff\xfe", b"\xfe\xff")
    except OSError:
        return False


def read_config_text(path: Path, encoding: str = "utf-8") -> str:
    """A config file's text; a missing, unreadable or non-text file is BadInputError."""
    return read_user_text(path, "config file", encoding, "; is it a config?")


def load_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON or YAML file as a dict; a missing, unreadable or malformed file is BadInputError."""
    import yaml

    path = Path(path)
    text = read_config_text(path)
    try:
        if path.suffix.lower() == ".json":  # comments allowed, as in the fine-tune's config
            data = json.loads(strip_json_comments(text), object_pairs_hook=_unique_keys)
        else:
            data = yaml.load(text, Loader=_unique_key_loader())
    except _DuplicateKeyError as exc:
        raise BadInputError(f"config file {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadInputError(
            f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}"
        ) from None
    except yaml.YAMLError as exc:
        raise BadInputError(
            f"config file {path} is not valid YAML: {_yaml_problem(exc)}{_json_inside(path, text)}"
        ) from None
    except (RecursionError, ValueError) as exc:
        raise BadInputError(f"config file {path}: {unreadable_problem(exc)}") from None
    if data is None:
        raise BadInputError(f"config file {path} is empty; it must hold a mapping of field: value")
    if not isinstance(data, dict):
        raise BadInputError(
            f"config file {path} must hold a mapping of field: value, found {type_name(data)}"
        )
    return data


def unreadable_problem(exc: BaseException) -> str:
    """Plain words for what JSON or YAML text Python cannot read beyond a syntax error: nesting
    deeper than its recursion limit, an integer longer than it converts (4300 digits)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply to read (thousands of levels); nothing steadytrain reads is"
    if "digits" in str(exc):
        return "holds a number of more than 4300 digits, which no setting takes"
    return str(exc)


def _json_inside(path: Path, text: str) -> str:
    """For a file YAML cannot read that is JSON with comments (an annotated config pasted from
    a guide): the hint to name it .json; else ''."""
    if not text.lstrip().startswith("{"):
        return ""
    try:
        json.loads(strip_json_comments(text))
    except (RecursionError, ValueError):
        return ""
    return (
        f"; it is JSON with comments, which YAML does not read: name it "
        f"{path.with_suffix('.json').name} (a .json config may hold // and /* */ comments)"
    )


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`field=value` strings (the CLI's `--set`) as a dict; each value is read as a YAML scalar,
    so `4` and `2e-4` are numbers, `null` is None, `true` a bool and `12GiB` text."""
    import yaml

    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise BadInputError(f"--set {pair!r}: write it as field=value, e.g. max_steps=10")
        try:
            overrides[key.strip()] = yaml.load(text, Loader=_unique_key_loader())
        except yaml.YAMLError as exc:
            raise BadInputError(
                f"--set {pair!r}: the value is not valid YAML: {_yaml_problem(exc)}; to pass it as "
                f"text, quote the value for YAML"
            ) from None
    return overrides


# -- files ----------------------------------------------------------------------------------------


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKeyError(f"key {key!r} appears twice; keep one")
        data[key] = value
    return data


_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""A number with an exponent and no dot (1e-4, 2E5), which YAML 1.1 reads as text."""


@functools.cache
def _unique_key_loader() -> type:
    """yaml.SafeLoader that refuses a key given twice (plain PyYAML keeps the last silently) and
    reads numbers as YAML 1.2 and JSON do: PyYAML's YAML 1.1 takes `2e-4` (no dot) for text, so
    the `learning_rate: 2e-4` of every Hugging Face recipe would be refused."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    UniqueKeyLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789")
    )

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: construct_mapping reports it
                continue
            if duplicate:
                line = key_node.start_mark.line + 1
                raise _DuplicateKeyError(
                    f"key {key!r} appears twice (again at line {line}); keep one"
                )
        return loader.construct_mapping(node)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return UniqueKeyLoader


def _yaml_problem(exc: Exception) -> str:
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None or mark is None:
        return str(exc).replace("\n", " ")
    context = getattr(exc, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}"
    return problem + where + (f" ({context})" if context else "")


# -- JSON with comments (the fine-tune config), or YAML ----------------------------------------


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A config file as a dict. `.json` / `.jsonc` may hold `//` and `/* */` comments (people
    paste annotated JSON from guides, as in the seed's config); they are blanked outside strings
    with line and column positions kept, so a JSON error still points at the right place.
    Anything else goes to `load_mapping`."""
    path = Path(path)
    if path.suffix.lower() not in (".json", ".jsonc"):
        return load_mapping(path)
    text = read_config_text(path, encoding="utf-8-sig")
    try:
        text = strip_json_comments(text)
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError as exc:
        raise BadInputError(f"config file {path}: {unreadable_problem(exc)}") from None
    except ValueError as exc:
        problem = unreadable_problem(exc) if "digits" in str(exc) else _json_problem(exc, text)
        raise BadInputError(f"config file {path}: {problem}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"config file {path} must hold a mapping of field: value")
    return data


def strip_json_comments(text: str) -> str:
    """`text` with `//` line comments and `/* */` block comments replaced by spaces (newlines
    kept). Slashes inside strings, escaped quotes included, are left alone."""
    out: list[str] = []
    i, n = 0, len(text)
    in_string = False
    while i < n:
        char = text[i]
        if in_string:
            out.append(char)
            if char == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 2
                continue
            if char == '"':
                in_string = False
            i += 1
        elif char == '"':
            in_string = True
            out.append(char)
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end == -1 else end
            out.append(" " * (end - i))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end == -1:
                line = text.count("\n", 0, i) + 1
                raise ValueError(f"a /* comment opened at line {line} is never closed with */")
            out.append("".join(c if c == "\n" else " " for c in text[i : end + 2]))
            i = end + 2
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _json_problem(exc: ValueError, text: str) -> str:
    if not isinstance(exc, json.JSONDecodeError):
        return str(exc)
    where = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    before = text[: exc.pos].rstrip()
    if before.endswith(",") and text[exc.pos : exc.pos + 1] in ("}", "]"):
        return f"not valid JSON: {where}: a trailing comma before it; remove the comma"
    return f"not valid JSON: {where}"
