"""`python -m steadytrain.cli`: the `steadytrain` command."""

from steadytrain.cli import main

main()
