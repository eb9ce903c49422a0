"""The Markdown reports' layout: one jinja2 template per report under templates/.

The modules that write a report compute its facts (counts, rows, groups) and
hand them to ``render``; the template only lays them out. Templates ship inside
the package, so an installed e2 finds them beside its modules.
"""

from __future__ import annotations

import functools

import jinja2


@functools.cache
def environment() -> jinja2.Environment:
    # Block tags on lines of their own leave no trace in the output, so a template
    # reads like the Markdown it writes; an undefined name is an error, not "".
    return jinja2.Environment(loader=jinja2.PackageLoader("e2", "templates"),
                              keep_trailing_newline=True, undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True)


def render(name: str, **context: object) -> str:
    """The report ``templates/<name>`` filled in with ``context``."""
    return environment().get_template(name).render(**context)
