"""The Page: one document image, the prompt it is parsed with, and its ground truth if known."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

# A real document parser's instruction; the chat template adds the system prompt around it.
DEFAULT_PROMPT = "Convert this page to markdown."


@dataclass
class Page:
    image: Image.Image
    source: Path
    reference: str | None = None
    prompt: str = DEFAULT_PROMPT
    # Unique, stable name used for splits, file outputs and fingerprints
    # (file stem, or "file.pdf#p3" for a PDF page).
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not self.name:
            self.name = Path(self.source).name

    @property
    def has_reference(self) -> bool:
        return self.reference is not None
