"""Fine-tuning records: a JSON or JSONL file read and checked, every problem collected with its
line, the format (text, prompt + completion, messages) detected from the first record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steadytrain.config.files import read_user_text, unreadable_problem
from steadytrain.errors import BadInputError

MAX_PROBLEMS = 10
"""Problems listed in one error; the rest are counted. Enough to see a pattern (a whole file in
the wrong format) without burying the first one."""

ROLES = ("system", "user", "assistant")
FORMATS = ("text", "prompt_completion", "messages")
FORMAT_NAMES = {
    "text": '"text"',
    "prompt_completion": '"prompt" + "completion"',
    "messages": '"messages"',
}


# -- reading and checking records ------------------------------------------------------------


class _Problems:
    """Problems of one file, collected so that all of them are reported in one error."""

    def __init__(self, path: Path):
        self.path = path
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{where}: {message}")

    def raise_if_any(self) -> None:
        if not self.items:
            return
        shown = "\n".join(f"  - {p}" for p in self.items[:MAX_PROBLEMS])
        more = len(self.items) - MAX_PROBLEMS
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise BadInputError(
            f"data file {self.path}: {len(self.items)} problem(s):\n{shown}{tail}\n"
            "  See docs/finetune-data.md for the formats."
        )


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _whole_json(text: str) -> str | None:
    """What `text` is when the whole of it is one JSON list of records (or {"data": [...]}), as
    a .json file holds; None otherwise (one object per line, or not JSON at all)."""
    if not text.lstrip().startswith(("[", "{")):
        return None
    try:
        value = json.loads(text)
    except (RecursionError, ValueError):
        return None
    if isinstance(value, dict) and list(value) == ["data"]:
        value, shape = value["data"], 'one JSON object {"data": [...]}'
    else:
        shape = "one JSON list"
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        return None  # a line that is a list of other things is said as that line's problem
    return f"{shape} of {len(value)} records"


def _jsonl_records(path: Path, text: str, problems: _Problems) -> list[tuple[str, dict]]:
    """The records of a ``.jsonl`` file's `text`, one object per line (blank lines skipped),
    as ``(where, record)``: "line 7" (1-based)."""
    whole = _whole_json(text)
    if whole is not None:  # the .json shape saved as .jsonl: every line would be a problem
        raise BadInputError(
            f"data file {path} holds {whole}, where a .jsonl file holds one JSON object per "
            f"line: rename it to {path.with_suffix('.json').name} (a .json file is read "
            "whole), or write one record per line"
        )
    records: list[tuple[str, dict]] = []
    # Not str.splitlines: it also splits at U+2028 and friends, which JSON allows in strings.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.add(
                where,
                f"invalid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                "complete JSON object",
            )
            continue
        except (RecursionError, ValueError) as exc:
            problems.add(where, unreadable_problem(exc))
            continue
        if not isinstance(value, dict):
            problems.add(where, f"expected a JSON object {{...}}, found {_type_name(value)}")
            continue
        records.append((where, value))
    return records


def _read_records(path: Path, problems: _Problems) -> list[tuple[str, dict]]:
    """The records of a ``.jsonl`` (one object per line; blank lines skipped) or ``.json`` file
    (a list of objects, or ``{"data": [...]}``) as ``(where, record)``; `where` names the record
    in errors: "line 7" (1-based) for JSONL, "item [3]" (0-based index) for JSON."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json"):
        raise BadInputError(
            f"data file {path}: expected a .jsonl file (one JSON object per line) or a .json "
            "file (a list of objects); rename it if it is one of these"
        )
    text = read_user_text(path, "data file", "utf-8-sig", "; re-save it as UTF-8")
    if suffix == ".jsonl":
        return _jsonl_records(path, text, problems)
    records: list[tuple[str, dict]] = []
    try:
        value = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as exc:
        raise BadInputError(
            f"data file {path}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except (RecursionError, ValueError) as exc:
        raise BadInputError(f"data file {path}: {unreadable_problem(exc)}") from None
    if isinstance(value, dict) and isinstance(value.get("data"), list) and len(value) == 1:
        value = value["data"]
    if not isinstance(value, list):
        raise BadInputError(
            f"data file {path}: expected a list of records [{{...}}, ...] or "
            f'{{"data": [...]}}, found {_type_name(value)}'
        )
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            problems.add(f"item [{index}]", f"expected an object {{...}}, found {_type_name(item)}")
            continue
        records.append((f"item [{index}]", item))
    return records


def _record_format(record: dict) -> tuple[str | None, str | None]:
    """(format, None), or (None, the problem) for a record with no format or more than one."""
    found = []
    if "messages" in record:
        found.append("messages")
    if "prompt" in record or "completion" in record:
        found.append("prompt_completion")
    if "text" in record:
        found.append("text")
    if len(found) == 1:
        return found[0], None
    if not found and "instruction" in record and "output" in record:
        return None, (
            'has the Alpaca fields "instruction", "input", "output", none of "text", "prompt" + '
            '"completion" or "messages"; write "prompt" (the instruction, then the input) and '
            '"completion" (the output): {"prompt": "...", "completion": "..."}'
        )
    if not found and "conversations" in record:
        return None, (
            'has "conversations" (ShareGPT\'s), not "messages"; write it as "messages": '
            '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'
        )
    if not found:
        keys = ", ".join(f'"{k}"' for k in list(record)[:8]) or "none"
        return None, (
            'has none of "text", "prompt" + "completion" or "messages" '
            f"(its keys: {keys}); rename the field that holds the training text"
        )
    names = " and ".join(FORMAT_NAMES[f] for f in found)
    return None, f"has both {names}; keep the fields of one format"


def _string_problem(record: dict, key: str, *, allow_empty: bool) -> str | None:
    if key not in record:
        return None
    value = record[key]
    if not isinstance(value, str):
        return f'"{key}" must be a string, found {_type_name(value)}'
    if not allow_empty and not value.strip():
        return f'"{key}" is empty; there is nothing to learn from this record, remove it'
    return _surrogate_problem(f'"{key}"', value)


def _surrogate_problem(what: str, value: str) -> str | None:
    """A lone surrogate (JSON's "\\ud800" without its pair) is not text a tokenizer can read."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"{what} holds a lone surrogate {value[exc.start]!r} at character {exc.start}, "
            "which is not text; fix the escape in the file (a \\uD800-\\uDFFF needs its pair)"
        )
    return None


def _check_record(record: dict, fmt: str) -> list[str]:
    """Problems of one record in a file of format `fmt`."""
    if fmt == "text":
        problem = _string_problem(record, "text", allow_empty=False)
        return [problem] if problem else []
    if fmt == "prompt_completion":
        problems = [
            f'missing "{key}"; a prompt + completion record needs both (an empty prompt is "")'
            for key in ("prompt", "completion")
            if key not in record
        ]
        for key, allow_empty in (("prompt", True), ("completion", False)):
            problem = _string_problem(record, key, allow_empty=allow_empty)
            if problem:
                problems.append(problem)
        return problems
    messages = record["messages"]
    if not isinstance(messages, list):
        return [
            f'"messages" must be a list of {{"role", "content"}} objects, found {_type_name(messages)}'
        ]
    if not messages:
        return ['"messages" is empty; a conversation needs a user and an assistant message']
    problems = []
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, dict):
            problems.append(
                f'{at} must be an object {{"role", "content"}}, found {_type_name(message)}'
            )
            continue
        role = message.get("role")
        if "role" not in message:
            problems.append(f'{at} has no "role"; use one of {", ".join(ROLES)}')
        elif role not in ROLES:
            shown = json.dumps(role) if isinstance(role, str) else _type_name(role)
            problems.append(f"{at}: role {shown} is not one of {', '.join(ROLES)}")
        if "content" not in message:
            problems.append(f'{at} has no "content"')
        elif not isinstance(message["content"], str):
            problems.append(
                f'{at}: "content" must be a string, found {_type_name(message["content"])}'
            )
        elif role == "assistant" and not message["content"].strip():
            problems.append(f"{at}: the assistant's content is empty; nothing to learn from it")
        elif surrogate := _surrogate_problem(f'{at}: "content"', message["content"]):
            problems.append(surrogate)
    roles = [m.get("role") for m in messages if isinstance(m, dict)]
    if "assistant" not in roles:
        problems.append("no assistant message; the loss is on the assistant's replies")
    elif roles and roles[0] == "assistant":
        problems.append(
            "the conversation starts with the assistant; start with a system or user message"
        )
    return problems


def _check_records(records: list[tuple[str, dict]], problems: _Problems) -> str | None:
    """The format of a file's records (from the first that has one); adds every problem."""
    fmt: str | None = None
    first = ""
    for where, record in records:
        found, problem = _record_format(record)
        if problem:
            problems.add(where, problem)
            continue
        if fmt is None:
            fmt, first = found, where
        elif found != fmt:
            problems.add(
                where,
                f"is a {FORMAT_NAMES[found]} record but the file's first record ({first}) is "
                f"{FORMAT_NAMES[fmt]}; use one format per file",
            )
            continue
        for problem in _check_record(record, fmt):
            problems.add(where, problem)
    return fmt


def read_file(path: str | Path) -> tuple[list[tuple[str, dict]], str]:
    """The checked records of a data file and its format, or one BadInputError listing every
    problem in it (unreadable lines and bad fields alike)."""
    path = Path(path)
    problems = _Problems(path)
    records = _read_records(path, problems)
    if not records and not problems.items:
        raise BadInputError(
            f"data file {path} is empty: it holds no records; add records such as "
            '{"text": "..."} or {"prompt": "...", "completion": "..."}'
        )
    fmt = _check_records(records, problems)
    problems.raise_if_any()
    return records, fmt or ""
