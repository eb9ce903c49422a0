"""Rewriting series.yaml in place: the new values, the user's comments and layout kept.

``e2 export`` and ``e2 rebase`` write the series through ``render_series``, so
hand edits the header invites (comments, quoting) survive a rewrite; the
canonical form (``dump_series``) is the fallback and the layout both share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from e2.series import dump_series

if TYPE_CHECKING:
    from ruamel.yaml import YAML


def _round_trip_yaml() -> YAML:
    from ruamel.yaml import YAML

    # the same layout dump_series writes, so an untouched file comes back byte for byte
    handler = YAML()
    handler.preserve_quotes = True
    handler.width = 88
    handler.indent(mapping=2, sequence=2, offset=0)
    handler.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    return handler


def _fresh(value: Any) -> Any:
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import LiteralScalarString

    if isinstance(value, dict):
        return CommentedMap((k, _fresh(v)) for k, v in value.items())
    if isinstance(value, list):
        return CommentedSeq(_fresh(v) for v in value)
    if isinstance(value, str) and "\n" in value:
        return LiteralScalarString(value)
    return value


def _merge(old: Any, new: Any) -> Any:
    """``new`` written into the node ``old`` came from, keeping its comments and quoting."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(old, CommentedMap) and isinstance(new, dict):
        for key in [k for k in old if k not in new]:
            del old[key]
        for position, (key, value) in enumerate(new.items()):
            if key in old:
                old[key] = _merge(old[key], value)
            else:
                old.insert(position, key, _fresh(value))
        return old
    if isinstance(old, CommentedSeq) and isinstance(new, list):
        if all(isinstance(v, dict) for v in new) and all(isinstance(v, dict) for v in old):
            return _merge_entries(old, new)
        if list(old) == new:
            return old
        return _fresh(new)
    if type(new) in (str, int, float, bool, type(None)) and old == new \
            and (old is None) == (new is None):
        return old  # the same value: keep its quoting and folding
    return _fresh(new)


def _merge_entries(old: Any, new: list[dict]) -> Any:
    """Patch entries follow their old node (and its comments) by title, else by position."""
    from ruamel.yaml.comments import CommentedSeq

    remaining = list(old)
    result = CommentedSeq()
    for position, entry in enumerate(new):
        match = next((node for node in remaining if node.get("title") == entry.get("title")),
                     None)
        if match is None and position < len(old) and old[position] in remaining:
            match = old[position]
        if match is not None:
            remaining.remove(match)
            result.append(_merge(match, entry))
        else:
            result.append(_fresh(entry))
    if len(result) == len(old):
        result.ca.items.update(old.ca.items)  # comments between entries keep their place
    return result


def render_series(data: dict, previous: str | None) -> str:
    """series.yaml holding ``data``; the comments and layout of ``previous`` are kept.

    The header invites hand edits, so a rewrite by export or rebase changes
    only the values that changed; a file that cannot be read back as YAML is
    written canonically instead.
    """
    import io

    if previous is None:
        return dump_series(data)
    handler = _round_trip_yaml()
    try:
        document = handler.load(previous)
    except Exception:  # noqa: BLE001 - any parse failure: fall back to the canonical form
        return dump_series(data)
    if not isinstance(document, dict):
        return dump_series(data)
    buffer = io.StringIO()
    handler.dump(_merge(document, data), buffer)
    return buffer.getvalue()
