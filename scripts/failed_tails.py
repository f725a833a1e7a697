#!/usr/bin/env python3
"""Prints the last lines of each failed test's output from a build's last ctest run.

Usage: scripts/failed_tails.py BUILD_DIR [LINES]

scripts/test.sh prints this just before its summary, so that a record which keeps only the end of
the whole suite's output (a CI log's tail) still says which test failed and how. Reads
BUILD_DIR/Testing/Temporary/LastTest.log, where ctest keeps every test's output; prints nothing
when no test failed.
"""
import re
import sys


def failed_outputs(log):
    """Yields (name, output lines) for each test the log records as failed."""
    name, output, in_output = None, [], False
    for line in log.splitlines():
        started = re.match(r"^\d+/\d+ Test: (.+)$", line)
        if started:
            name, output, in_output = started.group(1), [], False
        elif line == "Output:":
            in_output = True
        elif line == "<end of output>":
            in_output = False
        elif in_output:
            if not line.startswith("-" * 20) or output:
                output.append(line)
        elif name and line.startswith("Test Failed"):
            # (a timeout and a crash say so too; a skipped test says "Test Pass Reason:")
            yield name, output
            name = None
        elif name and line.startswith("Test Passed"):
            name = None


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    lines = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    try:
        with open(f"{sys.argv[1]}/Testing/Temporary/LastTest.log", errors="replace") as f:
            log = f.read()
    except OSError as e:
        print(f"failed_tails: no ctest log: {e}")
        return
    for name, output in failed_outputs(log):
        print(f"-- {name} failed; the last {min(lines, len(output))} lines of its output:")
        print("\n".join(output[-lines:]))


if __name__ == "__main__":
    main()
