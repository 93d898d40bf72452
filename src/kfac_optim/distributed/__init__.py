"""Distributed K-FAC: who computes which decomposition (plan) and the collectives that share them."""
