#!/usr/bin/env python3
"""Fail when two source files of one crate import from each other.

A file's imports are the `crate::…`, `super::…` and `self::…` paths in its
non-test code (comments stripped), resolved to the longest module path that
is a file, and through `pub use child::Name` re-exports to the child that
defines the name. A module and its own submodules may use each other
(that is how Rust modules are built); any other pair that imports both
ways is a circle: move the shared names into a lower file.

Usage: scripts/check-import-circles.py [REPO]   (exit status 1 on a circle)
"""

import itertools
import os
import re
import sys

COMMENT = re.compile(r"//[^\n]*")
GROUP = re.compile(
    r"((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^{}]*)\}"
)
PATH = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
REEXPORT = re.compile(
    r"pub(?:\([^)]*\))?\s+use\s+(?:self::)?([a-z_][a-z0-9_]*)::"
    r"(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)\s*;"
)


def module_files(src):
    """Module path (tuple) -> file, for one crate's src/."""
    out = {}
    for d, _, names in os.walk(src):
        for name in names:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(d, name)
            parts = os.path.relpath(path, src)[:-3].split(os.sep)
            if parts[0] == "bin":
                continue
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            out[tuple(parts)] = path
    return out


def code(path):
    """The file's text before its tests, without comments."""
    text = open(path, encoding="utf-8").read()
    cut = text.find("#[cfg(test)]")
    if cut >= 0:
        text = text[:cut]
    return COMMENT.sub("", text)


def paths_in(text):
    """Every crate/super/self path, grouped imports expanded one level."""
    found = [m.group(1) for m in PATH.finditer(text)]
    for m in GROUP.finditer(text):
        for part in m.group(2).split(","):
            head = part.strip().split(" as ")[0].strip().split("::")[0]
            if head and head not in ("self", "*"):
                found.append(f"{m.group(1)}::{head}")
    return found


def circles(src):
    files = module_files(src)
    reexports = {}
    for module, path in files.items():
        for m in REEXPORT.finditer(code(path)):
            child = module + (m.group(1),)
            if child in files:
                for name in m.group(2).strip("{}").split(","):
                    name = name.strip().split(" as ")[-1].strip()
                    if name:
                        reexports[module + (name,)] = child
    deps = {module: set() for module in files}
    for module, path in files.items():
        here = list(module)
        for p in paths_in(code(path)):
            segs = p.split("::")
            if segs[0] == "crate":
                base, segs = [], segs[1:]
            elif segs[0] == "self":
                base, segs = here[:], segs[1:]
            else:
                base = here[:]
                while segs and segs[0] == "super":
                    base, segs = base[:-1], segs[1:]
            target = tuple(base)
            used = 0
            for s in segs:
                if target + (s,) not in files:
                    break
                target, used = target + (s,), used + 1
            if used < len(segs) and target + (segs[used],) in reexports:
                target = reexports[target + (segs[used],)]
            if target != module and target in files:
                deps[module].add(target)

    def nested(a, b):
        n = min(len(a), len(b))
        return a[:n] == b[:n]

    for a, b in itertools.combinations(sorted(files), 2):
        if not nested(a, b) and b in deps[a] and a in deps[b]:
            yield "/".join(a) or "lib", "/".join(b) or "lib"


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    crates = os.path.join(repo, "crates")
    found = 0
    for crate in sorted(os.listdir(crates)):
        src = os.path.join(crates, crate, "src")
        if os.path.isdir(src):
            for a, b in circles(src):
                print(f"import circle in crates/{crate}: {a} <-> {b}")
                found += 1
    if found:
        print(f"{found} import circle(s): move the names both use into a lower file")
        return 1
    print("no import circles between files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
