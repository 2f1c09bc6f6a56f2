"""`python -m strata.config > docs/CONFIG.md`: print the config reference page."""

from strata.config.reference import reference_markdown

print(reference_markdown(), end="")
