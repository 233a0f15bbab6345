"""A refactor's proof: every run of the test suite's batches trains to the same bits before and after.

    python bench/identical.py --out /tmp/after.json                  # this checkout's runs
    python bench/identical.py --compare /tmp/before.json /tmp/after.json

It launches every launch of tests/batches/ (every strategy, layout and lever the suite runs: about 70
runs at 1-4 ranks, 6-8 minutes on 2 cores) and writes, for each run, a SHA-256 of its losses, gradient
norms, final weights and the logits of a fixed batch, read from the results the test worker saves. Run
it at the commit before a refactor (a `git worktree` of it, with PYTHONPATH pointing there) and after;
`--compare` lists every run whose bits differ. Issue 44's note gives the result for the lever registry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

DIGESTED = ("losses", "grad_norms", "final", "logits")


def _digest(value: object, h: hashlib._Hash) -> None:
    if torch.is_tensor(value):
        h.update(str(value.dtype).encode())
        h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _digest(value[k], h)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _digest(v, h)
    else:
        h.update(repr(value).encode())  # floats: repr is exact


def run_all(root: Path) -> dict[str, dict[str, str]]:
    """Every batch run's digests, by run name (the launches run here, under ``root``)."""
    sys.path.insert(0, str(Path.cwd()))
    from tests import conftest
    from tests.batches import LAUNCHES, RUNS, Batches

    modules = {stem for r in RUNS for stem in r.readers}
    conftest._COLLECTED.update(modules | {"test_ds_import", "test_pretrained"})
    batches = Batches(root, modules)
    for key in LAUNCHES:
        batches._launch(key)
    out = {}
    for run in RUNS:
        path = root / f"{run.name}.pt"
        if not path.exists():
            continue
        result = torch.load(path, weights_only=True)
        if "losses" not in result:  # a run expected to fail at set-up
            continue
        row = {}
        for key in DIGESTED:
            h = hashlib.sha256()
            _digest(result.get(key), h)
            row[key] = h.hexdigest()[:16]
        out[run.name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write this checkout's digests here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        differ = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
        only = sorted(before.keys() ^ after.keys())
        print(
            f"{len(before.keys() & after.keys())} runs in both; bit-identical: "
            f"{len(before.keys() & after.keys()) - len(differ)}; differ: {differ or 'none'}"
        )
        if only:
            print(f"in one only: {only}")
        raise SystemExit(1 if differ else 0)
    with tempfile.TemporaryDirectory() as tmp:
        digests = run_all(Path(tmp))
    args.out.write_text(json.dumps(digests, indent=1, sort_keys=True))
    print(f"{len(digests)} runs digested into {args.out}")


if __name__ == "__main__":
    main()
