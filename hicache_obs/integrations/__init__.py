"""Adapters that attach hicache-obs to real engines' cache controllers."""
