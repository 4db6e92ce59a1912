"""`continual-blr --help` and `methods` answer without importing torch; the catalogue read from the source equals the
imported registry's; each FROMP variant is described by what it changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_static_catalogue_equals_the_imported_registry():
    from continual_blr import cli_catalog
    from continual_blr.data import STREAMS
    from continual_blr.methods import DESCRIPTIONS, METHODS

    static = cli_catalog.static_methods()
    assert static == cli_catalog.imported(dict(METHODS), DESCRIPTIONS)  # names, descriptions, every field
    assert cli_catalog.static_streams() == tuple(STREAMS)


@pytest.mark.parametrize("argv", [["--help"], ["methods"], ["methods", "fromp"], ["run", "--help"]])
def test_help_and_methods_do_not_import_torch(argv):
    code = ("import sys\nfrom continual_blr.__main__ import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')" % argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "no torch", done.stdout[-500:]


def test_each_fromp_variant_is_described_by_what_it_changes(capsys):
    from continual_blr.cli import main

    assert main(["methods"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    variants = ["fromp", "frorp", "fromp-l2", "fromp-full", "fromp-kron", "fromp-replay"]
    assert len({lines[v] for v in variants}) == len(variants), lines  # no two share a description
    assert "random" in lines["frorp"] and "identity" in lines["fromp-l2"]
    assert "full" in lines["fromp-full"] and "Kronecker" in lines["fromp-kron"]
    assert not any("``" in text or "module docstring" in text for text in lines.values())  # no reST in the help
