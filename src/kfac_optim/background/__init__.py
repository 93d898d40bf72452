"""Background: the work K-FAC moves off the step's path: statistics folded on a worker thread and
side stream, decompositions computed on a background thread and installed at a later step.
Knows what a job is, not which blocks or steps submit it. See docs/architecture.md.
"""
