#!/usr/bin/env python3
"""Prints the slowest tests of a cargo-nextest run from its JUnit report.

usage: scripts/slowest-tests.py target/nextest/ci/junit.xml [N]

scripts/test.sh runs it after the Rust tests; docs/testing.md keeps the
list of a whole-suite run.
"""
import sys
import xml.etree.ElementTree as ElementTree


def main():
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    root = ElementTree.parse(path).getroot()
    cases = []
    for suite in root.iter("testsuite"):
        for case in suite.iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            cases.append((float(case.get("time", "0")), suite.get("name"), case.get("name"), failed))
    total = float(root.get("time", "0"))
    cases.sort(reverse=True)
    print(f"{len(cases)} tests in {total:.0f} s; the slowest {min(count, len(cases))}:")
    for seconds, binary, name, failed in cases[:count]:
        print(f"  {seconds:7.1f} s  {binary} {name}{'  (FAILED)' if failed else ''}")


if __name__ == "__main__":
    main()
