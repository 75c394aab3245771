"""The base of every section of the ``"xirang"`` block (`xirang_ds.config.schema`)."""
from __future__ import annotations

from dataclasses import dataclass

Issues = list[tuple[str, str]]


@dataclass(frozen=True)
class Section:
    """Base of every section: a section does nothing unless ``enabled``."""

    enabled: bool = False
    """Turn this section's plugin on."""

    def check(self) -> Issues:
        """Cross-field rules; ``[(field, message)]``, empty when the section is consistent."""
        return []


__all__ = ["Issues", "Section"]
