"""Bridges to other continual-learning frameworks.

``continual_blr.integrations.avalanche`` runs every registered method as a plugin of Avalanche's
strategies. It is not imported here: importing Avalanche is slow (≈ 5 s) and has side effects
(``~/.avalanche/config.json``), so only code that asks for it pays for it.
"""

__all__: list[str] = []
