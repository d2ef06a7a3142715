"""The one reader of the YAML files kveval takes (gate configs, sweep configs): strict where PyYAML is lenient.

PyYAML keeps the last of two equal keys in a mapping without a word, so ``margin: 0.05`` followed later by
``margin: 0.5`` gates at 0.5. Here a repeated key is a :class:`~kveval.errors.ConfigError` naming the key and both
lines. A merge (``<<: *defaults``) and a key set again beside it stay YAML's override, not a repeat.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kveval.errors import ConfigError

_MERGE = "tag:yaml.org,2002:merge"


class _RepeatedKey(Exception):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: PyYAML's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise _RepeatedKey(key, first, line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path, what: str) -> Any:
    """The YAML document of ``path`` (a ``what``, e.g. ``"gate config"``, for messages).

    Raises :class:`~kveval.errors.ConfigError` for text that is not UTF-8, not YAML, or repeats a key in a mapping;
    ``FileNotFoundError`` where there is no file (callers check first, to name their own example)."""
    path = Path(path)
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506 - a safe loader
    except _RepeatedKey as exc:
        raise ConfigError(f"{path}: key {exc.key!r} is given twice (lines {exc.first} and {exc.again}); YAML would "
                          f"keep only the last: remove one") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; a {what} is a YAML file") from None


__all__ = ["load_yaml"]
