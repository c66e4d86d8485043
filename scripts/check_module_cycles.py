#!/usr/bin/env python3
"""Module cycles inside each crate, which `cargo` allows and the crate
graph check (scripts/check-deps.sh) cannot see.

Every path a module names (`use crate::a::b`, `super::x`, `crate::a::f()`
in code) is an edge from its file's module to the module it reaches.
An edge between two modules is counted between the children of their
nearest common ancestor that hold them (`run` -> `env::slot` is `run` ->
`env`), and an edge between a module and one inside it is not counted: a
parent that declares and re-exports its children, and children that use
their parent's types, is how Rust modules are made. A cycle among
siblings (`config` -> `spear` -> `config`) means neither can be read,
changed or tested without the other; this prints each such cycle and
exits 1 when there is one.

    python3 scripts/check_module_cycles.py [CRATE_SRC_DIR...]
    python3 scripts/check_module_cycles.py --self-test   # it finds one it should
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from typing import Dict, List, Set, Tuple

CRATES = ["proto/src", "tasks/src", "policy/src", "buffer-service/src", "actor/src",
          "learner/src", "src"]

# `crate::a::b`, `super::a`, `self::a` paths, and `use` groups after them.
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)?(::\{)?")
# Comments, strings and char literals, left to right, blanked before paths
# are read (a `/*` in a string, a quote in a comment).
NOISE = re.compile(
    r"//[^\n]*|/\*.*?\*/|r(#*)\".*?\"\1|b?\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])'",
    re.S,
)


def module_of(root: str, path: str) -> Tuple[str, ...]:
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)


def modules(root: str) -> Dict[Tuple[str, ...], str]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rs"):
                p = os.path.join(d, f)
                out[module_of(root, p)] = p
    return out


def in_tests(text: str) -> List[Tuple[int, int]]:
    """Spans of `#[cfg(test)] mod ... { }` blocks (test code may use anything)."""
    spans = []
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub\s+)?mod\s+\w+\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        spans.append((m.start(), i))
    return spans


def group_paths(code: str, start: int) -> List[List[str]]:
    """The paths of a `use` group whose `{` is just before `start`:
    `{a::b, c::{d, e}}` gives [a, b], [c, d], [c, e]."""
    depth, i = 1, start
    while i < len(code) and depth:
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        i += 1
    body, items, cur, depth = code[start:i - 1], [], "", 0
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    items.append(cur)
    out = []
    for item in (x.strip() for x in items):
        if not item:
            continue
        head, brace, _ = item.partition("{")
        prefix = [p for p in head.replace(" ", "").split("::") if p]
        if brace:
            at = start + body.index(item) + len(head) + 1
            out += [prefix + sub for sub in group_paths(code, at)]
        else:
            out.append([p.split(" as ")[0].strip() for p in prefix])
    return out


def targets(module: Tuple[str, ...], text: str, known) -> Set[Tuple[str, ...]]:
    """The known modules `module`'s code names."""
    code = NOISE.sub(" ", text)
    tests = in_tests(code)
    found = set()
    for m in PATH.finditer(code):
        if any(a <= m.start() < b for a, b in tests):
            continue
        head, rest = m.group(1), (m.group(2) or "").split("::")[1:]
        if head == "crate":
            base: Tuple[str, ...] = ()
        elif head == "super":
            base = module[:-1]
            while rest and rest[0] == "super":
                base, rest = base[:-1], rest[1:]
        else:
            base = module
        tails = group_paths(code, m.end()) if m.group(3) else [[]]
        for tail in tails:
            parts = list(base) + rest + tail
            # The deepest known module the path reaches.
            for n in range(len(parts), -1, -1):
                if tuple(parts[:n]) in known:
                    found.add(tuple(parts[:n]))
                    break
    return found


def sibling_edges(root: str):
    known = modules(root)
    edges = defaultdict(set)  # (parent) -> {(a, b)} between its children
    for mod, path in known.items():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for t in targets(mod, text, known):
            n = 0
            while n < min(len(mod), len(t)) and mod[n] == t[n]:
                n += 1
            if n == len(mod) or n == len(t):
                continue  # one inside the other
            edges[mod[:n]].add((mod[n], t[n]))
    return edges


def cycles(pairs: Set[Tuple[str, str]]) -> List[List[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    graph = defaultdict(set)
    for a, b in pairs:
        graph[a].add(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def self_test() -> int:
    """A crate with a cycle through a `use` group and one through a path in
    code, a parent-child pair and test-only uses, which are not cycles."""
    import tempfile
    files = {
        "lib.rs": "pub mod a;\npub mod b;\npub mod c;\npub mod d;\n",
        "a.rs": "use crate::{b::X, c};\npub struct Y;\n",
        "b.rs": "pub struct X;\nfn f() -> super::a::Y { todo!() }\n",
        "c/mod.rs": "pub mod inner;\npub use inner::Z;\n",
        "c/inner.rs": "pub struct Z;\nuse super::super::c;\n",
        "d.rs": "// crate::a::Y in a comment\n#[cfg(test)]\nmod tests { use crate::a::Y; }\n"
                "const S: &str = \"crate::a\";\n",
    }
    with tempfile.TemporaryDirectory() as root:
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            with open(os.path.join(root, name), "w") as f:
                f.write(text)
        found = [c for pairs in sibling_edges(root).values() for c in cycles(pairs)]
    ok = found == [["a", "b"]]
    print(f"check_module_cycles self-test: {'ok' if ok else 'FAILED'} (found {found})")
    return 0 if ok else 1


def main(argv: List[str]) -> int:
    if argv == ["--self-test"]:
        return self_test()
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = argv or [os.path.join(top, c) for c in CRATES]
    found = 0
    for root in roots:
        for parent, pairs in sorted(sibling_edges(root).items()):
            for comp in cycles(pairs):
                found += 1
                where = "::".join(parent) or "(crate root)"
                edges = sorted((a, b) for a, b in pairs if a in comp and b in comp)
                print(f"{os.path.relpath(root, top)}: in {where}: cycle {{{', '.join(comp)}}}: "
                      + ", ".join(f"{a} -> {b}" for a, b in edges))
    print(f"check_module_cycles: {found} cycle(s)" if found else "check_module_cycles: no cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
