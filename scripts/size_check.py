#!/usr/bin/env python3
"""Size limits of the source tree (issue 28): no file over 800 lines, no function over 120.

A file or function may stay longer when a one-line comment says why: `// long-file: WHY` in the
file's first 20 lines, `// long-function: WHY` among the comment lines right above the function
(a dispatch switch, a hot path kept in one piece). Functions are found as clang-format lays
them out at namespace scope: a definition starts at column 0 and ends at the next `}` in column
0; member functions defined inside a class body are not measured (they are short by habit).
Findings in files a change may not touch yet go in an --allow file, one `PATH` or
`PATH:FUNCTION` a line, each with its reason after it (`#` lines are comments).
Usage: size_check.py [--max-file N] [--max-function N] [--allow FILE] DIR...   (exit 1 on a
finding)
"""
import argparse
import os
import re
import sys

SOURCES = (".cc", ".h", ".cpp", ".hpp")
# Column-0 lines that open something other than a function body.
NOT_FUNCTION = re.compile(
    r"^(namespace|struct|class|enum|union|using|typedef|extern|static_assert|template|#|//|/\*|\}|\{)")


def functions(lines):
    """Yields (first line, line count, name) of each column-0 function definition."""
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line or line[0].isspace() or NOT_FUNCTION.match(line) or "(" not in line:
            i += 1
            continue
        # The signature runs until a line that ends in `{` (the body) or `;` (a declaration).
        j = i
        while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")):
            j += 1
        if j >= len(lines) or lines[j].rstrip().endswith(";") or lines[j].rstrip().endswith("};"):
            i = j + 1
            continue
        if lines[j].rstrip().endswith("= {") or "=" in line.split("(")[0]:
            i = j + 1  # a variable's initialiser, not a body
            continue
        k = j + 1
        while k < len(lines) and not lines[k].startswith("}"):
            k += 1
        name = line.split("(")[0].split()[-1] if line.split("(")[0].split() else line
        yield i, k - i + 1, name
        i = k + 1


def exempt(lines, start, marker):
    """A `// MARKER: why` comment among the comment lines right above `start`."""
    i = start - 1
    while i >= 0 and lines[i].lstrip().startswith("//"):
        if marker in lines[i]:
            return True
        i -= 1
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-file", type=int, default=800)
    ap.add_argument("--max-function", type=int, default=120)
    ap.add_argument("--allow", help="known findings: PATH or PATH:FUNCTION, then why")
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    allowed = set()
    if args.allow:
        with open(args.allow, encoding="utf-8") as fh:
            allowed = {l.split()[0] for l in fh if l.strip() and not l.startswith("#")}
    found = 0
    for top in args.dirs:
        for root, _, files in os.walk(top):
            for f in sorted(files):
                if not f.endswith(SOURCES):
                    continue
                path = os.path.join(root, f)
                with open(path, encoding="utf-8") as fh:
                    lines = fh.read().split("\n")
                if lines and lines[-1] == "":
                    lines.pop()
                rel = os.path.relpath(path, os.path.dirname(os.path.abspath(top)))
                if len(lines) > args.max_file and rel not in allowed and not any(
                        "// long-file:" in l for l in lines[:20]):
                    print(f"{path}: {len(lines)} lines (limit {args.max_file}; or say why: "
                          "// long-file: ...)")
                    found += 1
                for start, n, name in functions(lines):
                    if n > args.max_function and f"{rel}:{name}" not in allowed and not exempt(
                            lines, start, "long-function:"):
                        print(f"{path}:{start + 1}: {name} is {n} lines (limit "
                              f"{args.max_function}; or say why above it: // long-function: ...)")
                        found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
