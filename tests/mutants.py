"""Does the suite catch a wrong lever? Injects each wrong behaviour in turn and runs the tests.

    python tests/mutants.py                 # every mutant against the test files that should catch it
    python tests/mutants.py --full          # every mutant against the whole suite (make test's)
    python tests/mutants.py always-reshard  # one (or several) by name
    make mutants [ARGS="--full"]

Each mutant is injected into every process of a pytest run by tests/mutant_site/sitecustomize.py
(on PYTHONPATH, chosen by FSDP_ZERO_MUTANT): the test process and every run a test launches; a public
API wrapped, or (where no API carries the lever) one expression of our own source replaced. The
tests run first without a mutant (they must pass), then once per mutant (they must fail). A mutant
that no process applied is reported as such: the suite cannot be credited with catching a wrong
behaviour that never happened. A mutant counts as caught only when a test named for that behaviour
fails (and nothing errors: a crashed launch would fail tests for the wrong reason). Exit code 0 when
the clean run passes and every mutant is caught.

The mutants, what each breaks and which tests must catch it: tests/mutant_table.py.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutant_table import MUTANTS  # tests/ is sys.path[0]: this file runs as a script

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "tests" / "mutant_site"


def run_tests(files: list[str], mutant: str | None) -> dict:
    """One pytest run; returns its exit code, failed test ids, counts, seconds, and the processes
    that applied the mutant."""
    env = dict(os.environ)
    log = Path(tempfile.mkstemp(prefix="mutant-")[1])
    if mutant:
        env.update(
            FSDP_ZERO_MUTANT=mutant,
            FSDP_ZERO_MUTANT_LOG=str(log),
            PYTHONPATH=os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])]),
        )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *files],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - start
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    errors = re.findall(r"^ERROR (\S+)", proc.stdout, re.M)
    summary = (
        re.findall(r"^=* ?(\d+ (?:passed|failed).*?) in [\d.]+s", proc.stdout, re.M)
        or [proc.stdout[-300:]]
    )[-1]
    applied = len(log.read_text().split()) if log.exists() else 0
    log.unlink(missing_ok=True)
    return {
        "code": proc.returncode,
        "failed": failed,
        "errors": errors,
        "summary": summary,
        "seconds": seconds,
        "applied": applied,
        "output": proc.stdout[-3000:] + proc.stderr[-2000:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "names", nargs="*", help=f"mutants to run (default all): {', '.join(MUTANTS)}"
    )
    parser.add_argument("--full", action="store_true", help="run the whole suite under each mutant")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(MUTANTS))
    if unknown:
        print(
            f"error: unknown mutant {unknown[0]!r}; valid choices: {', '.join(MUTANTS)}",
            file=sys.stderr,
        )
        return 2
    names = args.names or list(MUTANTS)
    files = (lambda name: []) if args.full else (lambda name: MUTANTS[name][1])
    name_of = lambda test: test.split("::")[-1].split("[")[0]  # noqa: E731 - a test id's function name
    everything = sorted({f for name in names for f in files(name)})

    ok = True
    clean = run_tests(everything, None)
    print(
        f"{'(no mutant)':24} {clean['summary']} in {clean['seconds']:.0f} s "
        f"({' '.join(everything) or 'the whole suite'})"
    )
    if clean["code"] != 0:
        print(clean["output"])
        print("error: the tests fail without a mutant; fix that first", file=sys.stderr)
        return 1
    for name in names:
        what, _, catchers = MUTANTS[name]
        result = run_tests(files(name), name)
        named = any(name_of(test) in catchers for test in result["failed"])
        caught = named and not result["errors"] and result["applied"] > 0
        ok &= caught
        verdict = (
            "CAUGHT"
            if caught
            else "NOT APPLIED (no process changed anything)"
            if not result["applied"]
            else f"ERRORS ({len(result['errors'])} tests could not run)"
            if result["errors"]
            else "SURVIVED"
            if result["code"] == 0
            else f"FAILED, BUT NOT BY {', '.join(catchers)}"
        )
        print(
            f"{name:24} {verdict}: {result['summary']} in {result['seconds']:.0f} s; applied in "
            f"{result['applied']} processes ({what})"
        )
        for test in result["failed"] + [f"{t} (error)" for t in result["errors"]]:
            print(f"{'':24}   failed: {test}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
