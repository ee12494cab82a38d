"""Targets and harnesses for frameworks users already run (MaxText).

Nothing is re-exported: each module imports its framework only inside its functions, so
importing `shardlint.integrations.<module>` costs nothing where the framework is absent.
"""
