"""One Jinja environment for every template; errors name the template, the line and the spec uri."""

from __future__ import annotations

import functools
from pathlib import Path

# jinja2 is imported where a template is rendered: loading a cached kernel never needs it


class TemplateError(RuntimeError):
    """A template failed to render: the message names the template, the line and the spec uri."""


@functools.lru_cache(maxsize=1)
def templates_dir() -> Path:
    """The templates folder: ``flashgen/templates`` in a wheel, the checkout's ``templates/`` otherwise."""
    package = Path(__file__).resolve().parent.parent  # flashgen/
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / "include" / "flashgen").is_dir():
            return candidate
    raise FileNotFoundError(f"flashgen templates not found beside {package}")


def include_dir() -> Path:
    """The folder passed to nvcc as ``-I``; it holds ``flashgen/<role>/*.cuh``."""
    return templates_dir() / "include"


@functools.lru_cache(maxsize=1)
def environment() -> "jinja2.Environment":  # noqa: F821
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render_template(name: str, context: dict, uri: str) -> str:
    """Render ``templates/<name>`` with ``context``; any failure becomes a ``TemplateError``."""
    import jinja2

    try:
        return environment().get_template(name).render(**context)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"{exc.filename or name}:{exc.lineno}: {exc.message} (spec {uri})") from exc
    except jinja2.TemplateError as exc:
        line = _template_line(exc, name)
        raise TemplateError(f"{name}:{line}: {exc} (spec {uri})") from exc


def _template_line(exc: BaseException, name: str) -> str:
    """The template line being rendered when ``exc`` was raised, read off the traceback."""
    tb = exc.__traceback__
    line = "?"
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(name):
            line = str(tb.tb_lineno)
        tb = tb.tb_next
    return line
