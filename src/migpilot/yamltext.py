"""YAML config text read strictly: one loader for every config file migpilot takes.

Why it exists: mig-parted configs and NVIDIA's device-plugin configs are both YAML written by
hand, where a key typed twice silently overwrites the first (PyYAML's default) and a syntax
error comes out as a multi-line traceback. :func:`load` reads with PyYAML's safe loader, refuses
a duplicate key (keys written beside a ``<<`` merge still override the merged ones, as YAML
says), and turns any YAML error into one line naming the source and, where PyYAML knows it, the
line and column. PyYAML's Python loader recurses once per level of nesting, so a document
nested a thousand levels deep (``[[[[...``, a few KB) raises ``RecursionError``, and a
value PyYAML cannot build (an integer of over 4,300 digits, the 13th month) ``ValueError``;
those too are the one-line error, not a traceback. Pure: text in, data out, no file I/O.
"""

from __future__ import annotations

from typing import Any

import yaml

from migpilot import errors


class _Loader(yaml.SafeLoader):
    """A safe loader that rejects duplicate keys, which would otherwise silently overwrite."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # keys written beside a '<<' merge override the merged ones, as YAML says
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # an unhashable key: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(text: str, *, source: str, error: type[errors.MigpilotError]) -> Any:
    """The data of YAML ``text``; raise ``error`` with one line naming ``source`` when it is
    not YAML or repeats a key."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = e.problem or e.context or "invalid YAML"
        raise error(f"{source}: malformed YAML{where}: {problem}") from None
    except yaml.YAMLError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise error(f"{source}: malformed YAML: {first}") from None
    except RecursionError:
        raise error(f"{source}: malformed YAML: {TOO_DEEP}") from None
    except ValueError as e:
        raise error(f"{source}: malformed YAML: {value_problem(e)}") from None


def value_problem(err: ValueError) -> str:
    """What a ``ValueError`` from building a value says, in words for the file's author."""
    if "integer string conversion" in str(err):
        return "a number of more than 4300 digits"
    return (str(err).strip().splitlines() or ["a value that cannot be read"])[0]


TOO_DEEP = "nested too deeply to read (a config is a few levels deep)"
"""Why a document nested past the parser's recursion limit is refused, for every reader."""
