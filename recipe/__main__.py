"""`python -m recipe …`: the `recipe` command where its console script is not installed."""

from .cli import app

app(prog_name="recipe")
