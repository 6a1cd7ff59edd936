"""`python -m steadytrain.config > docs/config.md`: the config reference, from the fields."""

from steadytrain.config import reference_markdown

print(reference_markdown(), end="")
