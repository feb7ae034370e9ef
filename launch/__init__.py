"""The trainer and its launcher.

The launcher starts the trainer's processes and is torch-free, so that it answers before any worker exists:
    launcher.py          `recipe launch` (its command: recipe/launch_cli.py): the torchrun command line and
                         environment from the plan's `launch:` block (the trainer never reads that block), an sbatch
                         script, the pre-flight checks, running it
    checkpoint_index.py  which checkpoints under a run's folder are complete (read by both sides)
    progress.py          what a run reports on rank 0: live view, metrics.jsonl, the summary against the prediction

The trainer runs on every rank (`python -m launch.train PLAN`, alone or under torchrun):
    train.py             the Trainer (one optimizer step) and the CLI;  job.py  one job: groups, resume, steps, export
    model.py, moe.py, gated_delta.py, rl.py          the model, its experts and token mixer, the loss through the head
    parallel.py, tensor_parallel.py, expert_parallel.py, context_parallel.py, pipeline.py, recompute.py
                         the plan's layout on real ranks
    optim.py, checkpoint.py, data.py, hf_io.py       AdamW with fp32 masters, DCP checkpoints, rollouts, HF weights
"""
