"""Update: from preconditioned directions to the parameters: damping rules, the step length
(trust region, KL clip), grafting, Adam for parameters outside K-FAC, and SGD's update with
momentum and weight decay. Knows no hooks or factor statistics. See docs/architecture.md.
"""
