"""Figures for a chapter's prose, computed by a cell from the shipped data.

A chapter computes a figure in a code cell and hands it to the text with
``glue("fa2_speedup", ratio)``; the prose then reads
``{glue:text}`fa2_speedup:.2f```, so the sentence cannot drift from the
recording. In the book build this is MyST-NB's ``glue``; elsewhere (Colab,
plain Jupyter, nbval) it only returns the value, and the cell that computed it
is where a reader sees it.
"""

from __future__ import annotations


def glue(name: str, value: object) -> object:
    """Store ``value`` under ``name`` for ``{glue:text}`` in the prose; returns ``value``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"glue: name must be an identifier-like str, got {name!r}")
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()  # a numpy or torch scalar: its text would not format
    try:
        from myst_nb import glue as myst_glue
    except ImportError:  # not building the book
        return value
    myst_glue(name, value, display=False)
    return value
