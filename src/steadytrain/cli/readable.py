"""A console for tables that stay whole when the output is piped or redirected.

On a terminal rich uses the terminal's width. Elsewhere (`steadytrain plan ... > plan.txt`, a
pipe into `less` or `grep`) it assumes 80 columns and cuts or wraps every table to fit them, so
a file holds a table nobody can read. Off a terminal this console is as wide as the lines need;
a COLUMNS the user set still wins.
"""

from __future__ import annotations

import os
from typing import TextIO

from rich.console import Console

WIDE = 1000  # columns off a terminal: tables take their natural width, up to this


def readable_console(file: TextIO | None = None) -> Console:
    console = Console(file=file)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(file=file, width=WIDE)
