"""A module whose import fails, as an operator's half-finished code does."""

raise RuntimeError("boom")
