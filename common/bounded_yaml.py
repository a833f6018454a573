"""YAML from untrusted hands (an EndpointPickerConfig, a pool's annotations), with bounded time and memory.

`yaml.safe_load` constructs only plain data, but it still trusts the document's shape:
- nesting: the composer recurses once per level, so `[[[[...` a thousand deep escapes as RecursionError (and
  libyaml's C composer, CSafeLoader, overflows the C stack: a segfault at 100000 levels);
- aliases: `&a [x, x, ...]`, `&b [*a, *a, ...]`, ... ("billion laughs") loads in microseconds as a shared
  graph, but anything that walks it as a tree (repr in an error message, a merge key `<<: *b` that copies its
  pairs, json.dumps) expands it: 10 levels of 10 aliases are 10^10 nodes. A recursive alias (`&a [*a]`) is
  a cycle;
- size: the pure-Python parser takes ~12 s for a 1 MiB flow list on a shared core.

`load` refuses, with a yaml.YAMLError naming the limit, a text over `max_chars` characters, nesting deeper than
`max_depth`, and a document of more than `max_nodes` nodes counting every alias as the whole node it names
(so a bomb is refused before anything is expanded, and parse time stops at `max_nodes` nodes: ~0.25 s).
`load_all` does the same for a stream of documents (`---`), the nodes counted over all of them. A file is read
with common/bounded_file.py (at most MAX_CHARS bytes) before either.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.nodes import MappingNode, Node, SequenceNode
from yaml.scanner import ScannerError

MAX_CHARS = 1 << 20  # a ConfigMap's whole data is at most 1 MiB
MAX_DEPTH = 64
MAX_NODES = 10_000  # a real EndpointPickerConfig has a few hundred


class _BoundedSafeLoader(yaml.SafeLoader):
    max_depth = MAX_DEPTH
    max_nodes = MAX_NODES

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    # Nesting is refused as the scanner meets it: past a `[` the scanner reads up to 1024 characters ahead
    # for a possible simple key, at a cost per token that grows with the open levels, so refusing deep input at
    # the composer would come only after that work.
    def fetch_flow_collection_start(self, token_class: Any) -> None:
        if self.flow_level >= self.max_depth:
            raise ScannerError(None, None, f"nested deeper than {self.max_depth} levels", self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def add_indent(self, column: int) -> bool:
        if len(self.indents) >= self.max_depth:
            raise ScannerError(None, None, f"nested deeper than {self.max_depth} levels", self.get_mark())
        return super().add_indent(column)

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._nodes += 1  # aliases too: each costs parsing (what they expand to is check_expansion's)
        if self._nodes > self.max_nodes:
            raise ComposerError(None, None, f"more than {self.max_nodes} nodes", self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise ComposerError(None, None, f"nested deeper than {self.max_depth} levels",
                                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        check_expansion(node, self.max_nodes)
        return self.construct_document(node)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_expansion(root: Node, max_nodes: int) -> None:
    """ComposerError when `root`, with every alias expanded, has more than `max_nodes` nodes or is a cycle.
    Iterative (no recursion limit) and linear in the composed nodes: each node's expanded size is memoized."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the current path: reaching one again is a recursive alias
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > max_nodes:
                raise ComposerError(None, None, f"more than {max_nodes} nodes once its aliases are expanded",
                                    node.start_mark)
        elif key in open_nodes:
            raise ComposerError(None, None, "a recursive alias (a node that contains itself)", node.start_mark)
        elif key not in sizes:
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))


def load(text: str, max_chars: int = MAX_CHARS) -> Any:
    """The one YAML document in `text`, as yaml.safe_load gives it, within the limits above (else YAMLError)."""
    if len(text) > max_chars:
        raise yaml.YAMLError(f"longer than {max_chars} characters")
    loader = _BoundedSafeLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_all(text: str, max_chars: int = MAX_CHARS) -> list[Any]:
    """Every YAML document in `text`, as yaml.safe_load_all gives them, within the limits above (else YAMLError);
    `max_nodes` bounds the stream, not each document."""
    if len(text) > max_chars:
        raise yaml.YAMLError(f"longer than {max_chars} characters")
    loader = _BoundedSafeLoader(text)
    try:
        docs = []
        while loader.check_node():
            node = loader.get_node()
            check_expansion(node, loader.max_nodes)
            docs.append(loader.construct_document(node))
        return docs
    finally:
        loader.dispose()
