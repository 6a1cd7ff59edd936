"""A console for tables that stay whole and readable when the output is piped or redirected.

On a terminal rich uses the terminal's width. Elsewhere (`steadytrain plan ... > plan.txt`, a
pipe into `less` or `grep`) rich would assume 80 columns; tables at their natural width run to
~190 columns, wider than most terminals and editors show. Off a terminal this console is
COLUMNS wide where the user set it, else 100: a table wraps the text inside its cells to fit,
and nothing is cut.
"""

from __future__ import annotations

import os
from typing import TextIO

from rich.console import Console

PIPED_WIDTH = 100  # columns off a terminal without COLUMNS: cells wrap, nothing is cut


def readable_console(file: TextIO | None = None) -> Console:
    console = Console(file=file)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(file=file, width=PIPED_WIDTH)
