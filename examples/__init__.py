"""Runnable examples: training loops that checkpoint through tierckpt, and the demo.

A package so that `python -m examples.demo` runs from the repository root
(the demo uses the development helpers in `devsupport`); the training loops
themselves are plain scripts that need only the installed `tierckpt`.
"""
