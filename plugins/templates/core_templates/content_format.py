"""Whether a Jinja chat template reads a message's `content` as a string or as a list of parts.

vLLM calls this the template's content format ("string" or "openai") and detects it from the template's
syntax tree: a template that loops over a message's content (``{% for part in message['content'] %}``,
directly or through variables assigned from `messages` or a message) reads parts; any other reads
strings. Following assignments catches ``{% set loop_messages = messages[1:] %}`` and the like; scopes
are not tracked (a name assigned anywhere counts), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

import jinja2
import jinja2.nodes as nodes

STRING, OPENAI = "string", "openai"


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _is_key(node: nodes.Node, names: set[str], key: str) -> bool:
    """``name[key]`` or ``name.key`` for one of `names`."""
    if isinstance(node, nodes.Getitem):
        return _is_name(node.node, names) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, names) and node.attr == key
    return False


def _reads(node: nodes.Node | None, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (or its `key`), seen through filters, tests, slices, ``or`` and
    ``if ... else`` (``message.content | reverse``, ``messages[1:]``, ``message.content or []``)."""
    if node is None:
        return False
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return _reads(node.node, names, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, names, key)
    if isinstance(node, nodes.Or):
        return _reads(node.left, names, key) or _reads(node.right, names, key)
    if isinstance(node, nodes.CondExpr):
        return _reads(node.expr1, names, key) or _reads(node.expr2, names, key)
    return _is_key(node, names, key) if key is not None else _is_name(node, names)


def _aliases(root: nodes.Template, name: str) -> set[str]:
    """`name` and every variable assigned from it (or its elements), transitively."""
    found, pending = {name}, [name]
    assigns = list(root.find_all(nodes.Assign))
    while pending:
        current = {pending.pop()}
        for assign in assigns:
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in found and _reads(assign.node, current):
                found.add(target.name)
                pending.append(target.name)
    return found


def _loop_targets(root: nodes.Template, names: set[str], key: str | None = None) -> Iterator[str]:
    """Names bound by ``{% for x in ... %}`` loops over one of `names` (or its `key`)."""
    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and _reads(loop.iter, names, key):
            yield loop.target.name


def detect_content_format(source: str, environment: jinja2.Environment) -> str:
    """"openai" if the template loops over some message's content, else "string" (also when the
    source does not parse: the renderer reports that error itself)."""
    try:
        root = environment.parse(source)
    except jinja2.TemplateError:
        return STRING
    messages = _aliases(root, "messages")
    message_names = {alias for target in _loop_targets(root, messages) for alias in _aliases(root, target)}
    loops_over_content = any(True for _ in _loop_targets(root, message_names, "content"))
    return OPENAI if loops_over_content or _loops_over_indexed_content(root, messages) else STRING


def _loops_over_indexed_content(root: nodes.Template, messages: set[str]) -> bool:
    """``{% for part in messages[0]['content'] %}``: a loop over the content of an indexed message."""
    for loop in root.find_all(nodes.For):
        node = loop.iter
        while isinstance(node, (nodes.Filter, nodes.Test)):
            node = node.node
        if isinstance(node, (nodes.Getitem, nodes.Getattr)):
            key = node.arg.value if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) \
                else getattr(node, "attr", None)
            inner = node.node
            if key == "content" and isinstance(inner, nodes.Getitem) and _is_name(inner.node, messages):
                return True
    return False
