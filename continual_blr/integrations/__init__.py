"""Bridges to other continual-learning frameworks.

``continual_blr.integrations.avalanche`` runs every registered method as a plugin of Avalanche's
strategies. It is not imported here: importing Avalanche is slow (≈ 5 s) and has side effects
(``~/.avalanche/config.json``), so only code that asks for it pays for it.

Avalanche is an optional dependency (the ``avalanche`` extra): the library and the CLI import and run
without it, and importing the plugins without it raises an ``ImportError`` whose message says how to
install it (:func:`require_avalanche`).
"""

from __future__ import annotations

import importlib.util

__all__ = ["AVALANCHE_INSTALL_HINT", "require_avalanche"]

AVALANCHE_INSTALL_HINT = 'pip install "continual_blr[avalanche]"'


def require_avalanche() -> None:
    """Check that Avalanche can be imported.

    Raises:
        ImportError: Avalanche is not installed; the message names the extra to install.
    """
    try:
        found = importlib.util.find_spec("avalanche") is not None
    except (ImportError, ValueError):  # a finder that refuses the name, or a broken partial install
        found = False
    if not found:
        raise ImportError("continual_blr.integrations.avalanche needs Avalanche (avalanche-lib), which is not "
                          f"installed: {AVALANCHE_INSTALL_HINT}")
