"""The command-line surface, frozen: every command of `recipe` with its arguments and options, and every option of
`python -m launch.train`. Scripts, docs and plans name these; a change here is one users see, made on purpose with
its docs (this list changes with them)."""

from __future__ import annotations

import argparse

import typer.main

RECIPE = {
    "": ["--install-completion", "--show-completion"],
    "check": ["--fix", "--format", "-f", "paths"],
    "compare": ["--format", "--gpus", "--hw", "--layers", "--micro-batch-tokens", "--model", "--plot", "--seq", "-f",
                "-g", "-m", "-s"],
    "hw": ["--format", "-f", "show"],
    "launch": ["--aggregation", "--checkpoint-every", "--clip-high", "--clip-low", "--data", "--device", "--dry-run",
               "--dtype", "--emit", "--entropy-coef", "--export", "--hf-checkpoint", "--keep-last", "--kl-coef",
               "--kl-estimator", "--lr", "--max-grad-norm", "--max-restarts", "--nnodes", "--no-checkpoint",
               "--node-rank", "--objective", "--on-nonfinite", "--out", "--rdzv-endpoint", "--resume",
               "--rollouts-per-step", "--seed", "--steps", "--temperature", "--tis-cap", "--weight-decay", "plan"],
    "models": ["--format", "-f", "model"],
    "solve": ["--cp", "--ep", "--ep-chunks", "--explain", "--format", "--gpus", "--hw", "--layers", "--lm-head",
              "--micro-batch-tokens", "--micro-batches", "--model", "--output", "--pp", "--recompute", "--seq", "--tp",
              "-f", "-g", "-m", "-o", "-s"],
    "sweep": ["--format", "--gpus", "--hw", "--layers", "--lm-head", "--micro-batch-tokens", "--micro-batches",
              "--model", "--recompute", "--seq", "--top", "-f", "-g", "-m", "-s"],
    "version": [],
}

TRAIN = ["--aggregation", "--checkpoint-every", "--clip-high", "--clip-low", "--data", "--device", "--dtype",
         "--entropy-coef", "--export", "--help", "--hf-checkpoint", "--keep-last", "--kl-coef", "--kl-estimator",
         "--lr", "--max-grad-norm", "--no-checkpoint", "--objective", "--on-nonfinite", "--out", "--resume",
         "--rollouts-per-step", "--seed", "--steps", "--temperature", "--tis-cap", "--weight-decay", "-h", "plan"]


def test_recipe_commands_and_options():
    from recipe.cli import app

    group = typer.main.get_command(app)
    surface = {"": sorted(o for p in group.params for o in p.opts + p.secondary_opts)}
    for name, cmd in group.commands.items():
        surface[name] = sorted([p.name for p in cmd.params if p.param_type_name == "argument"]
                               + [o for p in cmd.params for o in p.opts + p.secondary_opts if o.startswith("-")])
    assert surface == RECIPE


def test_launch_train_options(monkeypatch):
    import launch.train

    seen = []

    def capture(parser, args=None, namespace=None):
        seen.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    try:
        launch.train._parse([])
    except SystemExit:
        pass
    (parser,) = seen
    surface = sorted([a.dest for a in parser._actions if not a.option_strings]
                     + [s for a in parser._actions for s in a.option_strings])
    assert surface == TRAIN
