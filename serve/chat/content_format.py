"""How a message's content reaches the chat template (vLLM's `chat_template_content_format`):
"string", its text (text parts joined by newlines), or "openai", OpenAI's list of parts
(`[{"type": "text", "text": ...}]`), for templates that loop over the parts. "auto" reads
the template: a `for` loop over a message's content, or over a variable named `content`,
or over a macro parameter a message's content is passed to, makes it "openai"; anything
else, and a template that does not parse, "string". The same rule as vLLM's, so the two
servers hand a template the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTENT_FORMATS = ("auto", "string", "openai")


class _GenerationTag(jinja2.ext.Extension):
    """HF templates' `{% generation %}` block (it marks the assistant's tokens), parsed as
    its body so that such templates can be read."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


_PARSER = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])


def resolve_content_format(content_format: str, template: str) -> str:
    """ "string" or "openai": the one asked for, or for "auto" the one `template` reads."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format is one of {', '.join(CONTENT_FORMATS)}; "
            f"got {content_format!r}."
        )
    return detect_content_format(template) if content_format == "auto" else content_format


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    try:
        tree = _PARSER.parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if any(_content_loops(tree)) else "string"


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (or its `key` item: `m.content`, `m['content']`),
    seen through filters, tests and slices."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, nodes.Name) and node.name in names
    if isinstance(node, nodes.Getitem):
        is_key = isinstance(node.arg, nodes.Const) and node.arg.value == key
    elif isinstance(node, nodes.Getattr):
        is_key = node.attr == key
    else:
        return False
    return is_key and _reads(node.node, names)


def _message_names(tree: nodes.Template) -> set[str]:
    """The loop variables that walk the messages (or a variable set from them)."""
    lists = {"messages"}
    grew = True
    while grew:  # `{% set loop_messages = messages[1:] %}`, and so on
        grew = False
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in lists:
                if _reads(assign.node, lists):
                    lists.add(target.name)
                    grew = True
    return {
        loop.target.name
        for loop in tree.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and _reads(loop.iter, lists)
    }


def _content_parameters(tree: nodes.Template, messages: set[str]) -> dict[int, set[str]]:
    """Per macro (by id): its parameters that some call passes a message's content."""
    found: dict[int, set[str]] = {}
    for macro in tree.find_all(nodes.Macro):
        parameters = [arg.name for arg in macro.args]
        names: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for parameter, arg in zip(parameters, call.args):
                if _reads(arg, messages, "content"):
                    names.add(parameter)
            for kwarg in call.kwargs:
                if kwarg.key in parameters and _reads(kwarg.value, messages, "content"):
                    names.add(kwarg.key)
        found[id(macro)] = names
    return found


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    messages = _message_names(tree)
    parameters_of = _content_parameters(tree, messages)
    in_macros: dict[int, set[str]] = {}  # loop id -> the content parameters of its macro
    for macro in tree.find_all(nodes.Macro):
        for loop in macro.find_all(nodes.For):
            in_macros[id(loop)] = parameters_of[id(macro)]
    for loop in tree.find_all(nodes.For):
        if _reads(loop.iter, messages, "content"):
            yield loop
        elif isinstance(loop.iter, nodes.Name):
            parameters = in_macros.get(id(loop))
            if parameters is None and loop.iter.name == "content":
                yield loop  # `{% set content = message.content %}...{% for part in content %}`
            elif parameters and loop.iter.name in parameters:
                yield loop
