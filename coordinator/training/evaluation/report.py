"""The one-line formats every part of psctl prints: evaluation results and values."""

from __future__ import annotations


def format_values(values: dict[str, float]) -> str:
    """``loss: 0.1234 | accuracy: 0.9650``"""
    return " | ".join(f"{name}: {value:.4f}" for name, value in values.items())


def eval_line(
    step: int, values: dict[str, float], *, examples: int, seconds: float, where: str = ""
) -> str:
    """``eval | step:    600 | loss: 0.1234 | accuracy: 0.9650 | 10000 examples in 0.41s``,
    plus `` (where)`` when given."""
    line = (
        f"eval | step: {step:6d} | {format_values(values)} | {examples} examples in {seconds:.2f}s"
    )
    return f"{line} ({where})" if where else line
