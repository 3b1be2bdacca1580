"""Pages: loading (image folders, PDFs, `datasets` imagefolders), splits, synthetic pages."""

from pathlib import Path

from .load import LoadReport, load_pages
from .page import DEFAULT_PROMPT, Page
from .split import is_heldout, select_split, split_pages

BUNDLED_PAGES = Path(__file__).resolve().parent.parent.parent / "calib_data"

__all__ = ["BUNDLED_PAGES", "DEFAULT_PROMPT", "LoadReport", "Page", "is_heldout", "load_pages", "select_split",
           "split_pages"]
